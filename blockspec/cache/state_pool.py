"""Recurrent state of the hybrid targets' Gated DeltaNet layers: one slot per sequence.

Per layer: conv [slots, conv_dim, K−1] (the last K−1 conv inputs) and ssm [slots, Hv, Dk, Dv]
(fp32, fp64 for an fp64 model). A prefill chunk or a plain decode step writes its final state
back into the sequence's slot. A verify forward instead stashes the state after every position
and the conv inputs of the block; `select` then gives each sequence the state after its own
last committed position and the K−1 conv inputs ending there. No replay, no recompute
(invariant 5).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.sampling import device_longs


@dataclass(frozen=True)
class RecurrentShape:
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    k_dim: int
    v_dim: int


class StatePool:
    def __init__(self, num_slots: int, shapes: list[RecurrentShape], dtype: torch.dtype, device: torch.device) -> None:
        state_dtype = torch.promote_types(dtype, torch.float32)
        # Layers of one shape (every Qwen3.5) share one tensor per kind, [L, slots, …], and each
        # layer's is a view of it: a verify's select, a snapshot's copy and a clear are then a few
        # ops over all layers, not a few per layer (24 GDN layers: ~150 launches a cycle).
        self.stacked = len(set(shapes)) == 1
        if self.stacked:
            s = shapes[0]
            self.conv_all = torch.zeros(len(shapes), num_slots, s.conv_dim, s.conv_kernel - 1, dtype=dtype,
                                        device=device)
            self.ssm_all = torch.zeros(len(shapes), num_slots, s.num_v_heads, s.k_dim, s.v_dim, dtype=state_dtype,
                                       device=device)
            # Views by index, not unbind: in-place writes to one of unbind's views are refused
            # outside the mode it was made in (a pool made under no_grad, written in a test).
            self.conv = [self.conv_all[i] for i in range(len(shapes))]
            self.ssm = [self.ssm_all[i] for i in range(len(shapes))]
        else:
            self.conv = [torch.zeros(num_slots, s.conv_dim, s.conv_kernel - 1, dtype=dtype, device=device)
                         for s in shapes]
            self.ssm = [torch.zeros(num_slots, s.num_v_heads, s.k_dim, s.v_dim, dtype=state_dtype, device=device)
                        for s in shapes]
        # After a verify: per layer (states after each position [B, T, Hv, Dk, Dv], conv inputs [B, C, K−1+T]).
        self.stashed: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(shapes)
        self._in_space: list | None = None      # in_space(): the stash entries last found in the space
        # Per layer, preallocated (steps [S, T, Hv, Dk, Dv], conv inputs [S, C, K−1+T]) that every
        # CUDA graph's verify stashes into (engine/graphs.py): a graph's own would stay allocated
        # for as long as the graph, one per graph.
        self.space: list[tuple[torch.Tensor, torch.Tensor]] = []

    def reserve_space(self, num_seqs: int, num_rows: int) -> None:
        """Stash space for verifies of up to num_seqs sequences of num_rows rows (before any capture)."""
        if self.stacked:
            layers, _, conv_dim, window = self.conv_all.shape
            self.space_steps = torch.empty(layers, num_seqs, num_rows, *self.ssm_all.shape[2:], dtype=self.ssm_all.dtype,
                                           device=self.ssm_all.device)
            self.space_conv = torch.empty(layers, num_seqs, conv_dim, window + num_rows, dtype=self.conv_all.dtype,
                                          device=self.conv_all.device)
            self.space = [(self.space_steps[i], self.space_conv[i]) for i in range(layers)]
            return
        self.space = [(torch.empty(num_seqs, num_rows, *ssm.shape[1:], dtype=ssm.dtype, device=ssm.device),
                       torch.empty(num_seqs, conv.shape[1], conv.shape[2] + num_rows, dtype=conv.dtype,
                                   device=conv.device))
                      for conv, ssm in zip(self.conv, self.ssm)]

    def space_for(self, layer: int, num_seqs: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Views of the layer's stash space for num_seqs × num_rows, if it is reserved and that large."""
        if not self.space:
            return None
        steps, conv_inputs = self.space[layer]
        if num_seqs > steps.shape[0] or num_rows != steps.shape[1]:
            return None
        return steps[:num_seqs], conv_inputs[:num_seqs]

    @staticmethod
    def space_bytes(shapes: list[RecurrentShape], num_seqs: int, num_rows: int, dtype: torch.dtype) -> int:
        """Bytes reserve_space(num_seqs, num_rows) takes."""
        state_size = torch.promote_types(dtype, torch.float32).itemsize
        return sum(num_seqs * (num_rows * s.num_v_heads * s.k_dim * s.v_dim * state_size
                               + s.conv_dim * (s.conv_kernel - 1 + num_rows) * dtype.itemsize) for s in shapes)

    def copy(self, src: int, dst: int) -> None:
        """Slot dst := slot src (every layer's conv window and SSM state): a prefix snapshot
        taken or restored."""
        if self.stacked:
            self.conv_all[:, dst].copy_(self.conv_all[:, src])
            self.ssm_all[:, dst].copy_(self.ssm_all[:, src])
            return
        for conv, ssm in zip(self.conv, self.ssm):
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

    @property
    def slot_bytes(self) -> int:
        return sum(c[0].numel() * c.element_size() + m[0].numel() * m.element_size() for c, m in zip(self.conv, self.ssm))

    def clear(self, slots: list[int]) -> None:
        """Zero these slots' state (a sequence starting from its first token). Slot ids are
        handed out by cache/manager.py (slot 0: padding rows of a batch)."""
        for slot in slots:
            if self.stacked:
                self.conv_all[:, slot].zero_()
                self.ssm_all[:, slot].zero_()
                continue
            for conv, ssm in zip(self.conv, self.ssm):
                conv[slot].zero_()
                ssm[slot].zero_()

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer][slots], self.ssm[layer][slots]

    def write(self, layer: int, slots: torch.Tensor, conv_inputs: torch.Tensor, state: torch.Tensor,
              lengths: list[int] | torch.Tensor | None = None) -> None:
        """After a forward that needs no rollback: the K−1 conv inputs ending at each sequence's
        last row (lengths: its rows, on the host or the device, when the group was padded past
        them) and the final state."""
        window = self.conv[layer].shape[-1]
        if lengths is None:
            self.conv[layer][slots] = conv_inputs[..., conv_inputs.shape[-1] - window:]
        else:
            lengths = torch.as_tensor(lengths, device=slots.device)
            columns = lengths[:, None] + torch.arange(window, device=slots.device)
            self.conv[layer][slots] = conv_inputs.gather(2, columns[:, None, :].expand(-1, conv_inputs.shape[1], -1))
        self.ssm[layer][slots] = state.to(self.ssm[layer].dtype)

    def stash(self, layer: int, step_states: torch.Tensor, conv_inputs: torch.Tensor) -> None:
        self.stashed[layer] = (step_states, conv_inputs)

    def select(self, slots: list[int], num_kept: list[int], keep_stash: bool = False,
               rows: list[int] | None = None) -> None:
        """After a verify: the sequence in slot slots[b] keeps num_kept[b] (1..T) positions of its block.
        keep_stash: the stash stays for another select; rows: the batch rows the slots take
        their state from (default 0 … len(slots) − 1); both for prefix snapshots at page
        boundaries (cache/prefix.py).

        conv_inputs[b, :, j] is block position j − (K−1), so the window ending at the last kept
        position is columns num_kept … num_kept + K − 2."""
        width = next((s[0].shape[1] for s in self.stashed if s is not None), None)
        if width is None:
            raise RuntimeError("select() without a verify forward that kept its steps")
        if any(not 1 <= kept <= width for kept in num_kept):
            raise ValueError(f"each sequence keeps 1..{width} positions of its block, got {num_kept}")
        # One host→device copy (this runs every hybrid cycle, its host time on the step's path):
        # the slots, the batch rows, the last kept row and the K−1 conv columns of each sequence.
        num_seqs, window = len(slots), self.conv[0].shape[-1]
        rows = list(range(num_seqs)) if rows is None else list(rows)
        index = device_longs(list(slots) + rows + [kept - 1 for kept in num_kept]
                             + [kept + j for kept in num_kept for j in range(window)], self.conv[0].device)
        slots, rows_t, last = index[:num_seqs], index[num_seqs: 2 * num_seqs], index[2 * num_seqs: 3 * num_seqs]
        columns = index[3 * num_seqs:].view(num_seqs, window)
        if self.in_space():
            self.select_stacked(slots, rows_t, last, columns)
            if not keep_stash:
                self.stashed = [None] * len(self.stashed)
            return
        for layer, stashed in enumerate(self.stashed):
            if stashed is None:
                raise RuntimeError("select() without a verify forward that kept its steps")
            step_states, conv_inputs = stashed
            self.ssm[layer][slots] = step_states[rows_t, last].to(self.ssm[layer].dtype)
            picked = conv_inputs[rows_t].gather(2, columns[:, None, :].expand(-1, conv_inputs.shape[1], -1))
            self.conv[layer][slots] = picked
            if not keep_stash:
                self.stashed[layer] = None

    def in_space(self) -> bool:
        """Whether every layer's stash is the first rows of its view of the stacked space (a
        graphed verify's), the same rows for all."""
        # Asked every hybrid cycle of the same entries (a graph's replay hands over a copy of its
        # own list, the same tuples each time): a yes is remembered by their identity. Only a yes:
        # those are views of the space, while remembering an eager verify's own stash would keep
        # its tensors alive after select() has let them go.
        known = self._in_space
        if known is not None and len(known) == len(self.stashed) and all(a is b for a, b in zip(known, self.stashed)):
            return True
        if not self.stacked or not self.space or any(s is None for s in self.stashed):
            return False
        count = self.stashed[0][0].shape[0]
        if not all(steps.shape[0] == count and steps.data_ptr() == space[0].data_ptr()
                   and conv.shape[0] == count and conv.data_ptr() == space[1].data_ptr()
                   for (steps, conv), space in zip(self.stashed, self.space)):
            return False
        self._in_space = list(self.stashed)
        return True

    def select_stacked(self, slots: torch.Tensor, rows: torch.Tensor, last: torch.Tensor, columns: torch.Tensor) -> None:
        """`select` over all layers at once from the stacked space: the same copies (last: each
        sequence's last kept row; columns [B, K−1]: its conv window's columns)."""
        count = self.stashed[0][0].shape[0]
        steps, conv_inputs = self.space_steps[:, :count], self.space_conv[:, :count]   # [L, n, T, …], [L, n, C, K−1+T]
        self.ssm_all[:, slots] = steps[:, rows, last].to(self.ssm_all.dtype)
        layers, _, conv_dim, window = self.conv_all.shape
        index = columns[None, :, None, :].expand(layers, -1, conv_dim, -1)
        self.conv_all[:, slots] = conv_inputs[:, rows].gather(3, index)
