"""Each rank loads its share of the target, reading only its slices of the safetensors
(`safe_open(...).get_slice`): a 65 GB checkpoint over two ranks reads about half of it on each
(the replicated norms and routers whole). The draft is replicated: every rank loads all of it
(loader.load_draft), since it is small."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from blockspec.distributed.group import TPGroup
from blockspec.distributed.shard import Slice, local_expert, rank_slice, shard_config, shard_modules
from blockspec.loader import (LoadedModel, LoadError, architecture_of, build_empty, checkpoint_files, gguf_path,
                              load_weights, read_json, resolve_device, resolve_dtype, resolve_model_path)
from blockspec.models.registry import ARCHITECTURES


@dataclass
class ReadLog:
    """What a rank read: checkpoint name → (the tensor's shape, the elements read)."""
    reads: dict[str, tuple[tuple[int, ...], int]] = field(default_factory=dict)


def load_sharded_model(model: str, tp: TPGroup, device: str = "auto", dtype: str = "auto",
                       log: ReadLog | None = None, expert_parallel: bool = False) -> LoadedModel:
    """This rank's share of a target checkpoint (directory or hub id; GGUF files are refused)."""
    if gguf_path(model) is not None:
        raise LoadError("--tensor-parallel-size > 1 needs a safetensors checkpoint (GGUF files load on one device)")
    path = resolve_model_path(model)
    config = read_json(path / "config.json")
    if (config.get("text_config") or config).get("quantization_config") or config.get("quantization_config"):
        raise LoadError(f"{path}: a quantized checkpoint loads on one device only (--tensor-parallel-size 1)")
    arch = architecture_of(config, path)
    spec = ARCHITECTURES[arch]()
    torch_device = resolve_device(device)
    try:
        with torch.device("meta"):                      # the full model's parsed config, no weights
            full = spec.build(config, arch).config
        expert_parallel = expert_parallel and full.moe is not None          # a dense target has no experts
        local = shard_config(config, full, tp.size, expert_parallel)

        def build():
            module = spec.build(local, arch)
            shard_modules(module, tp, expert_parallel)
            return module
        module = build_empty(build, torch_device, resolve_dtype(dtype, torch_device))
    except (KeyError, ValueError) as exc:
        raise LoadError(f"{path / 'config.json'}: cannot build {arch}: {exc}") from None
    files = checkpoint_files(path)
    load_weights(module, files, spec.rename, tensors=rank_tensors(files, spec.rename, full, tp, log, expert_parallel))
    return LoadedModel(module, path, local, arch)


def rank_tensors(files: list[Path], rename, full, tp: TPGroup, log: ReadLog | None, expert_parallel: bool = False
                 ) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """(name, file, this rank's slice) of every checkpoint tensor the model takes; expert
    parallel: this rank's experts only, under their local numbers."""
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                ours = local_expert(name, full.moe.num_experts, tp.size, tp.rank) if expert_parallel else name
                if ours is None or rename(name) is None:     # another rank's expert, a vision tower, MTP
                    continue
                part = handle.get_slice(name)
                shape = tuple(part.get_shape())
                where = rank_slice(name, shape, full, tp.size, tp.rank, expert_parallel)
                tensor = part[:] if where is None else read_slice(part, shape, where)
                if log is not None:
                    log.reads[name] = (shape, tensor.numel())
                yield ours, f, tensor


def read_slice(part, shape: tuple[int, ...], where: Slice) -> torch.Tensor:
    """Only the ranges of `where` from the file, concatenated along its dim."""
    pieces = []
    for start, stop in where.ranges:
        index = [slice(None)] * len(shape)
        index[where.dim] = slice(start, stop)
        pieces.append(part[tuple(index)])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=where.dim)
