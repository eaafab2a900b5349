"""Checkpoint loading: a local directory or a hub id → config, weights in our modules, tokenizer.

Weights are matched by their Hugging Face names. Anything we cannot place, or a parameter the
checkpoint does not provide, is an error naming the key: a partial load never passes silently.
"""
from __future__ import annotations


import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from blockspec.layers.common import parts_of
from blockspec.models.registry import ARCHITECTURES, ParamSlice, Rename


class LoadError(RuntimeError):
    """A checkpoint that cannot be loaded; the message says which file/key and what to do."""


def resolve_model_path(model: str) -> Path:
    """A local directory, or a hub id resolved through huggingface_hub's cache (offline-safe); a
    GGUF file (a .gguf, a directory holding one, a named model) resolves to the file."""
    found = gguf_path(model)
    if found is not None:
        return found
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise LoadError(f"model path {model!r} is not a directory (give a checkpoint directory or a hub id like Qwen/Qwen3-8B)")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"]))
    except Exception as exc:  # offline, unknown repo, no network: all the same to the user
        raise LoadError(f"cannot fetch {model!r} from the Hugging Face hub ({type(exc).__name__}); "
                        f"download it first (hf download {model}) or pass a local directory") from None


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise LoadError(f"missing file: {path}") from None
    except json.JSONDecodeError as exc:
        raise LoadError(f"invalid JSON in {path}: {exc}") from None


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        files = [path / s for s in shards]
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for f in files:
        if not f.exists():
            raise LoadError(f"missing weight shard: {f}")
    return files


def iter_tensors(files: list[Path], show_progress: bool) -> Iterator[tuple[str, Path, torch.Tensor]]:
    from blockspec.progress import track       # a bar on a terminal only
    for f in track(files, "loading shards", len(files), "shard", enabled=show_progress and len(files) > 1):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                yield name, f, handle.get_tensor(name)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise LoadError(f"unknown dtype {dtype!r} (auto, float32, bfloat16, float16)")
    return table[dtype]


DEVICE_TYPES = ("cpu", "cuda")        # what the engine runs on: a meta or mps model would load, then fail mid-step


def supported_device(device: str) -> torch.device | None:
    """A --device other than auto as torch names it, or None where torch cannot parse it or the
    engine does not run on its type (cli.check_device asks before anything loads)."""
    try:
        resolved = torch.device(device)
    except RuntimeError:
        return None
    return resolved if resolved.type in DEVICE_TYPES else None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = supported_device(device)
    if resolved is None:
        raise LoadError(f"--device {device!r} is not supported: use auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise LoadError("--device cuda was asked for but no CUDA device is available")
    return resolved


def load_weights(model: nn.Module, files: list[Path], rename: Rename, show_progress: bool = False,
                 tensors: Iterator[tuple[str, Path, torch.Tensor]] | None = None) -> None:
    """Copy every checkpoint tensor into the parameter of the same (renamed) name, or into its
    slice of a stacked parameter (per-expert tensors): one tensor in memory at a time, never a
    second copy of the model. A parameter counts as loaded when every element was written.
    `tensors` replaces reading `files` (a GGUF file's dequantized tensors, already renamed)."""
    params = dict(model.named_parameters())
    fused = {name: ParamSlice(param, None, rows=(start, stop)) for name, (param, start, stop) in parts_of(model).items()}
    filled: dict[str, int] = {}                            # parameter → elements written
    placed: set[str | ParamSlice] = set()
    for raw_name, file, tensor in tensors if tensors is not None else iter_tensors(files, show_progress):
        where = rename(raw_name)
        if where is None:
            continue
        if isinstance(where, str) and where not in params:
            where = fused.get(where, where)               # one part of a fused projection
        name, target = destination(params, where, raw_name, file, model)
        if where in placed or filled.get(name, 0) + target.numel() > params[name].numel():
            raise LoadError(f"{file.name}: {raw_name!r} is given twice (per expert and fused, or in two shards)")
        if tuple(target.shape) != tuple(tensor.shape):
            raise LoadError(f"{file.name}: {raw_name!r} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor.to(target.dtype))
        placed.add(where)
        filled[name] = filled.get(name, 0) + target.numel()
    loaded = {name for name, count in filled.items() if count == params[name].numel()}
    tie_embeddings(model, params, loaded)
    # Name what the checkpoint should have held: the parts of a fused parameter by their own names.
    unplaced_parts = sorted(name for name, piece in fused.items() if piece not in placed)
    missing = sorted(({p for p in params if p not in loaded} - {fused[n].param for n in unplaced_parts})
                     | set(unplaced_parts))
    if missing:
        raise LoadError(f"checkpoint lacks {len(missing)} tensors, first: {missing[0]!r}"
                        + (" (some of its experts are missing)" if missing[0] in filled else ""))


def destination(params: dict[str, nn.Parameter], where: str | ParamSlice, raw_name: str, file: Path,
                model: nn.Module) -> tuple[str, torch.Tensor]:
    """The parameter a checkpoint tensor fills and the view of it that it fills."""
    name = where.param if isinstance(where, ParamSlice) else where
    if name not in params:
        raise LoadError(f"{file.name}: tensor {raw_name!r} has no place in {type(model).__name__}")
    param = params[name]
    if not isinstance(where, ParamSlice):
        return name, param
    if where.index is None:
        return name, param[where.rows[0]:where.rows[1]]
    if not 0 <= where.index < param.shape[0]:
        raise LoadError(f"{file.name}: {raw_name!r} names expert {where.index}, "
                        f"but the config has {param.shape[0]} experts")
    return name, param[where.index].chunk(where.num_parts)[where.part]


def tie_embeddings(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    config = getattr(model, "config", None)
    if "lm_head.weight" in params and "lm_head.weight" not in loaded and getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")


# The in-place random fills module constructors call (through torch.nn.init).
_INITIALISERS = frozenset({"normal_", "uniform_", "trunc_normal_", "fill_", "zero_", "random_", "exponential_",
                           "log_normal_", "cauchy_", "geometric_", "bernoulli_"})


class _NoMetaInit(TorchFunctionMode):
    """Module constructors skip filling meta tensors (every weight is loaded afterwards): such a
    fill computes nothing, but normal_ on the meta device goes through torch's reference ops, whose
    first call imports torch._dynamo — 2-3 s of every CPU start-up (`blockspec generate`'s first
    command). A function mode, so only this thread's build sees it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INITIALISERS:
            target = args[0] if args else kwargs.get("tensor")         # torch.nn.init passes it by name
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def build_empty(build: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build on the meta device (no random init of billions of weights), then allocate, in
    `dtype` from the start: allocating the meta model's float32 and casting after held twice the
    weights at once (a 35B bf16 model asked an 80 GB card for 140 GB)."""
    with torch.device("meta"), _NoMetaInit():
        model = build()
    model = model.to(dtype).to_empty(device=device)
    for module in model.modules():  # buffers computed at init (RoPE tables) are lost by to_empty
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    return model.eval()


@dataclass
class LoadedModel:
    model: nn.Module
    path: Path
    config: dict[str, Any]
    architecture: str


def architecture_of(config: dict[str, Any], path: Path) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise LoadError(f"{path / 'config.json'} names no architectures")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise LoadError(f"{path / 'config.json'}: architecture {arch!r} is not supported (supported: {supported})")
    return arch


def load_model(model: str, device: str = "auto", dtype: str = "auto",
               show_progress: bool = False, quantization: str | None = None) -> LoadedModel:
    """Load a target model from a checkpoint directory, hub id, GGUF file or named model;
    FP8 checkpoints as they are, `quantization="fp8"` quantizes a bf16 one on load."""
    gguf_file = gguf_path(model)
    if gguf_file is not None:
        if quantization is not None:
            raise LoadError("--quantization fp8 takes a safetensors checkpoint, not a GGUF file")
        return load_gguf_model(gguf_file, device, dtype)
    path = resolve_model_path(model)
    config = read_json(path / "config.json")
    arch = architecture_of(config, path)
    torch_device = resolve_device(device)
    spec = ARCHITECTURES[arch]()
    files = checkpoint_files(path)
    plan = fp8_plan(config, path, files, spec.rename, quantization, torch_device)
    from blockspec.layers import fp8

    def build() -> nn.Module:
        return spec.build(config, arch) if plan is None else fp8.convert(spec.build(config, arch), plan)
    try:
        module = build_empty(build, torch_device, resolve_dtype(dtype, torch_device))
    except (KeyError, ValueError) as exc:
        raise LoadError(f"{path / 'config.json'}: cannot build {arch}: {exc}") from None
    if plan is None:
        load_weights(module, files, spec.rename, show_progress)
    else:
        load_weights(module, files, fp8.fp8_rename(spec.rename, plan),
                     tensors=fp8.fp8_stream(iter_tensors(files, show_progress), spec.rename, plan))
    return LoadedModel(module, path, config, arch)


def fp8_plan(config: dict[str, Any], path: Path, files: list[Path], rename: Rename, quantization: str | None,
             device: torch.device):
    """Which weights of this load are FP8 (layers/fp8.py): those the checkpoint stores so, or
    (quantization "fp8" over a bf16 checkpoint) every quantizable one; None: none. Refused,
    in one line, on a device without FP8."""
    from blockspec.kernels.fp8 import MIN_CAPABILITY, has_fp8
    from blockspec.layers import fp8
    if quantization not in (None, "fp8"):
        raise LoadError(f"--quantization {quantization!r} is not supported (fp8 is)")
    try:
        stored = fp8.check_quantization_config(config)
    except fp8.Fp8Error as exc:
        raise LoadError(f"{path / 'config.json'}: {exc}") from None
    if not stored and quantization is None:
        return None
    if not has_fp8(device):
        need = ".".join(map(str, MIN_CAPABILITY))
        raise LoadError(f"FP8 weights need a GPU of compute capability {need} or later (Ada, Hopper); {device} "
                        f"has none: serve a bf16 checkpoint without --quantization")
    if not stored:
        return fp8.Fp8Plan(set(), on_load=True, device=device)
    names = []
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    try:
        return fp8.plan_from_names(names, rename)
    except fp8.Fp8Error as exc:
        raise LoadError(f"{path}: {exc}") from None


def gguf_path(model: str) -> Path | None:
    """The GGUF file `model` stands for (a .gguf, a directory holding one, a named model), or None."""
    from blockspec import gguf, named
    try:
        local = Path(model).expanduser()
        return gguf.find_gguf(model) if local.exists() else named.resolve(model)   # a local path wins over a name
    except gguf.GGUFError as exc:
        raise LoadError(str(exc)) from None


def load_gguf_model(path: Path, device: str, dtype: str) -> LoadedModel:
    """Build the model from the file's metadata and fill it with its tensors: on CPU with dtype
    auto its Q4_0 / Q4_1 / Q8_0 blocks stay quantized (gguf.keep_quantized, layers/quant.py),
    otherwise every tensor is dequantized into the dtype (float32: what transformers computes)."""
    from blockspec import gguf
    from blockspec.kernels import native
    try:
        file = gguf.open_gguf(path)
        config = gguf.hf_config(file)
        arch = config["architectures"][0]
        torch_device = resolve_device(device)
        spec = ARCHITECTURES[arch]()
        # Allocated but never written where a quantized module replaces it: untouched pages cost no memory.
        module = build_empty(lambda: spec.build(config, arch), torch_device, resolve_dtype(dtype, torch_device))
        kept = (gguf.keep_quantized(module, file, config) if torch_device.type == "cpu" and dtype == "auto"
                else frozenset())
        if kept:
            native.enable(module)             # its norms, RoPE, attention and SiLU on our CPU kernels too
        load_weights(module, [path], spec.rename, tensors=gguf.iter_tensors(file, config, kept))
    except gguf.GGUFError as exc:
        raise LoadError(str(exc)) from None
    return LoadedModel(module, path, config, arch)


def load_tokenizer(path: Path):
    """The tokenizer of a loaded model: its directory's tokenizer files, or a GGUF file's metadata."""
    from blockspec import gguf
    from blockspec.tokenizer import Tokenizer
    if path.is_file() and path.suffix == ".gguf":
        try:
            return gguf.load_tokenizer(path)
        except gguf.GGUFError as exc:
            raise LoadError(str(exc)) from None
    return Tokenizer.from_dir(path)


def load_draft(draft: str, target: nn.Module, show_progress: bool = False) -> nn.Module:
    """Load a z-lab DFlash draft (DFlash 1 or 2) onto the target's device and dtype, checked
    against the target."""
    from blockspec.config import ConfigError
    from blockspec.models.dflash import DFlashDraftModel, DraftConfig, draft_rename
    from blockspec.models.dflash2 import DFlash2DraftModel, dflash2_rename
    kinds = {"DFlashDraftModel": (DFlashDraftModel, draft_rename), "DFlash2DraftModel": (DFlash2DraftModel, dflash2_rename)}
    path = resolve_model_path(draft)
    config = read_json(path / "config.json")
    arch = (config.get("architectures") or ["DFlashDraftModel"])[0]
    if arch not in kinds:
        raise LoadError(f"{path / 'config.json'}: {arch!r} is not a DFlash draft ({', '.join(kinds)})")
    build, rename = kinds[arch]
    try:
        draft_config = DraftConfig.from_hf(config, num_target_layers=target.num_layers)
        check_draft_fits(draft_config, target, path)
        weight = target.lm_head.weight
        module = build_empty(lambda: build(draft_config), weight.device, weight.dtype)
    except (ConfigError, KeyError) as exc:
        raise LoadError(f"{path / 'config.json'}: {exc}") from None
    load_weights(module, checkpoint_files(path), rename, show_progress)
    return module


def check_draft_fits(config, target: nn.Module, path: Path) -> None:
    if config.hidden_size != target.hidden_size:
        raise LoadError(f"{path}: draft hidden_size {config.hidden_size} != target's {target.hidden_size}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise LoadError(f"{path}: target_layer_ids {bad} outside the target's {target.num_layers} layers")
    vocab = target.lm_head.out_features
    if not 0 <= config.mask_token_id < vocab:
        raise LoadError(f"{path}: mask_token_id {config.mask_token_id} outside the target's vocabulary of {vocab}")
    if config.selector_rank is not None and config.vocab_size != vocab:
        raise LoadError(f"{path}: draft vocab_size {config.vocab_size} != the target's {vocab} "
                        "(DFlash 2's codebooks index the target's vocabulary)")
