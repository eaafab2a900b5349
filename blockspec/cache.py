"""Per-sequence caches. Every cache has a leading slot (batch) dimension and `trim(length)`.

Attention layers keep K/V preallocated up to max_len; rollback after a verify is `trim` to the
committed length (nothing is copied: positions past the length are simply overwritten later).
"""
from __future__ import annotations

import torch


class KVCache:
    """Static K/V buffers of one attention layer: [slots, kv_heads, max_len, head_dim]."""

    def __init__(self, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [slots, kv_heads, T, D] at [start, start+T); return views of [0, start+T)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} > max_len {self.max_len}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def write_at(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Graph-safe write: positions [T] on the device; returns the whole buffers.

        No host integer decides a shape, so a CUDA graph captured once serves every length;
        the attention mask hides positions past the sequence."""
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        return self.k, self.v

    def trim(self, length: int, verify_start: int | None) -> None:
        """Nothing to do: the model cache's length is the truth for attention layers."""


class ModelCache:
    """All layer caches of one model for its slots, plus the committed length.

    `length` is the number of positions whose K/V (or recurrent state) the cache holds.
    A forward over T new tokens advances it by T; `trim(n)` rolls it back to n after a verify.
    Layers that cannot roll back by truncation (recurrent ones) are told where the last
    forward started, so they can pick the state they saved after position n - 1.
    """

    def __init__(self, layers: list, max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        self.length = 0
        self.last_forward_start: int | None = None

    def advance(self, num_tokens: int) -> int:
        """Reserve num_tokens positions; return the start position. Called once per forward."""
        start = self.length
        if start + num_tokens > self.max_len:
            raise ValueError(f"sequence of {start + num_tokens} tokens exceeds the cache's {self.max_len}")
        self.last_forward_start = start
        self.length = start + num_tokens
        return start

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot trim a cache of length {self.length} to {length}")
        if length == self.length:
            return
        for layer in self.layers:
            layer.trim(length, self.last_forward_start)
        self.length = length
        self.last_forward_start = None


class RecurrentCache:
    """Conv window and delta-rule state of one Gated DeltaNet layer, with replay-free rollback.

    conv: the last K−1 conv inputs [slots, conv_dim, K−1]; ssm: S [slots, Hv, Dk, Dv] in fp32
    (fp64 for an fp64 model).
    A forward with keep_steps=True over T positions keeps the state after every one of them and
    the conv inputs of the block behind the previous window; `trim(n)` then selects the state
    after position n − 1 and the K−1 inputs ending there. Nothing is recomputed.
    """

    def __init__(self, num_slots: int, conv_dim: int, conv_kernel: int, num_v_heads: int,
                 k_dim: int, v_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.conv = torch.zeros(num_slots, conv_dim, conv_kernel - 1, dtype=dtype, device=device)
        state_dtype = torch.promote_types(dtype, torch.float32)      # fp32, or fp64 for fp64 models
        self.ssm = torch.zeros(num_slots, num_v_heads, k_dim, v_dim, dtype=state_dtype, device=device)
        self.step_states: torch.Tensor | None = None   # [slots, T, Hv, Dk, Dv] after each position
        self.block_inputs: torch.Tensor | None = None  # [slots, conv_dim, K−1+T] window + block

    @property
    def window(self) -> int:
        return self.conv.shape[-1]

    def update(self, conv_inputs: torch.Tensor, state: torch.Tensor,
               step_states: torch.Tensor | None) -> None:
        """After a forward: conv_inputs [slots, conv_dim, K−1+T] (old window + new inputs), the
        final state, and the per-step states when the forward kept them."""
        self.conv.copy_(conv_inputs[..., conv_inputs.shape[-1] - self.window:])
        self.ssm.copy_(state)
        self.step_states = step_states
        self.block_inputs = conv_inputs if step_states is not None else None

    def trim(self, length: int, verify_start: int | None) -> None:
        """Become the cache after position length − 1 of the last forward (which began at
        verify_start): its saved state and the conv window ending there."""
        if self.step_states is None or verify_start is None:
            raise ValueError(f"cannot roll a recurrent layer back to {length}: the last forward kept "
                             "no per-step states (run the verify forward with keep_steps=True)")
        num_steps = self.step_states.shape[1]
        kept = length - verify_start                    # positions of the block that stay, 1..T
        if not 1 <= kept <= num_steps:
            raise ValueError(f"cannot roll a recurrent layer back to {length}: the saved states cover "
                             f"lengths {verify_start + 1}..{verify_start + num_steps}")
        self.ssm.copy_(self.step_states[:, kept - 1])
        # block_inputs[j] is position verify_start − (K−1) + j: the window ending at length − 1.
        self.conv.copy_(self.block_inputs[..., kept:kept + self.window])
        self.step_states = self.block_inputs = None
