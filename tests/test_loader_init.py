"""Building a model on the meta device skips the random fills of its constructors (loader.py
`_NoMetaInit`): meta tensors are left as they are, a real tensor filled meanwhile is filled, and
nothing of it outlives the build or reaches another thread."""
from __future__ import annotations

import threading

import torch
from torch import nn

from blockspec.loader import _NoMetaInit, build_empty


def test_meta_fills_are_skipped_and_real_ones_are_not():
    real_normal = torch.Tensor.normal_

    with torch.device("meta"), _NoMetaInit():
        emb = nn.Embedding(8, 4)
        lin = nn.Linear(4, 4)
        cpu = torch.zeros(64, device="cpu").normal_()          # a real tensor: filled
    assert emb.weight.is_meta and lin.weight.is_meta
    assert cpu.std() > 0.5
    assert torch.Tensor.normal_ is real_normal                 # nothing patched, nothing left behind
    after = nn.Embedding(8, 4)                                 # outside the build: random again
    assert after.weight.std() > 0.5
    model = build_empty(lambda: nn.Embedding(8, 4), torch.device("cpu"), torch.float32)
    assert model.weight.shape == (8, 4) and not model.weight.is_meta


def test_another_threads_modules_are_initialised_during_a_build():
    built = {}

    def other() -> None:
        built["weight"] = nn.Embedding(16, 16).weight.detach().clone()
    with torch.device("meta"), _NoMetaInit():
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        nn.Embedding(8, 4)
    assert not built["weight"].is_meta and built["weight"].std() > 0.5


def test_the_weights_are_allocated_in_their_dtype_only():
    """build_empty allocates each weight once, in the dtype asked: allocating the meta model's
    float32 and casting after held twice the weights at once (a 35B bf16 model asked an 80 GB
    card for 140 GB)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    empties = {torch.ops.aten.empty_like, torch.ops.aten.empty, torch.ops.aten.empty_strided,
               torch.ops.aten.empty_permuted}

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[tuple[torch.dtype, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in empties and isinstance(out, torch.Tensor) and not out.is_meta:
                self.made.append((out.dtype, out.numel()))
            return out
    with Allocations() as allocations:
        model = build_empty(lambda: nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 48)), torch.device("cpu"),
                            torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert sorted(allocations.made) == sorted((torch.bfloat16, p.numel()) for p in model.parameters())
