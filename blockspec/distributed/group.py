"""The tensor-parallel group of this process: who we are, and the collectives the layers use.

torch.distributed carries everything (no transport of our own): the data group is NCCL on CUDA
(all-reduces of the row-parallel layers, the logits' all-gather, the drafts' broadcast; they
capture into CUDA graphs) and gloo on CPU; the control group is always gloo, for the one pickled
step message per step, because an idle server waits in it for minutes and a CPU wait costs
nothing (an NCCL wait would spin on the GPU and trip its watchdog).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# An idle server waits for its next step in the control group's broadcast for as long as no
# request comes: the control group's timeout is "never" in practice. NCCL keeps a finite one, so
# that a collective whose peer is gone (another host, under torchrun) fails rather than hangs.
IDLE_TIMEOUT = datetime.timedelta(days=365)
NCCL_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TPGroup:
    """Rank `rank` of `size` tensor-parallel ranks; rank 0 schedules, every rank computes."""
    rank: int
    size: int
    data: dist.ProcessGroup | None
    control: dist.ProcessGroup | None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (the partial sums of a row-parallel layer)."""
        dist.all_reduce(x, group=self.data)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank → [..., size · n], rank r's piece at r · n (the vocab shards)."""
        x = x.contiguous()
        pieces = torch.empty((self.size * x.numel(),), dtype=x.dtype, device=x.device)
        dist.all_gather_single(pieces, x.view(-1), group=self.data)
        return pieces.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (in place)."""
        dist.broadcast(x, src=0, group=self.data)
        return x

    def broadcast_message(self, message: object = None) -> object:
        """Rank 0's message (any picklable object) on every rank."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


def init_group(rank: int, size: int, init_method: str, device_type: str) -> TPGroup:
    """Join the process group (every rank calls this) and make the control group."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=NCCL_TIMEOUT if backend == "nccl" else IDLE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, control)
