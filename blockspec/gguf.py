"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer from one file.

A GGUF file holds what a Hugging Face directory spreads over config.json, model.safetensors and
tokenizer.json, under llama.cpp's names. This module reads it with the `gguf` package (its
key/value section, vocabulary included, with read_value: the package takes seconds there) and turns
each part into what the rest of blockspec already takes: a config.json-style dict (so the model is
built by the same ArchSpec as a safetensors checkpoint), (name, tensor) pairs under Hugging Face
names (so loader.load_weights places them and checks nothing is missing), and a Tokenizer.
Quantized tensors are dequantized on load into the requested dtype: blockspec has no quantized
kernels, the file is only a way to carry the weights.
"""
from __future__ import annotations

import functools
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

# llama.cpp's general.architecture → what we build it as (the dense ArchSpec of registry.py).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Per-layer tensor names, llama.cpp → Hugging Face (the suffix .weight / .bias is kept).
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<name>[a-z_]+)\.(?P<kind>weight|bias)")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4

# How each `tokenizer.ggml.pre` splits text before BPE (the merges were learned on these pieces).
# None: GPT-2's own split, done by the ByteLevel pre-tokenizer.
DIGITS_THEN_GPT2 = "digits"              # StarCoder/SmolLM: every digit alone, then GPT-2's split
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt2": None, "gpt-2": None,
    "smollm": DIGITS_THEN_GPT2, "starcoder": DIGITS_THEN_GPT2, "refact": DIGITS_THEN_GPT2,
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT,
}


class GGUFError(RuntimeError):
    """A GGUF file we cannot serve; loader.py re-raises it as a LoadError (one line)."""


def find_gguf(model: str) -> Path | None:
    """The .gguf file `model` names: the file itself, or the only .gguf in a directory that has no
    config.json (a directory with config.json is a Hugging Face checkpoint). None otherwise."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise GGUFError(f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:3])}…): "
                            "pass --model the one to load")
        return files[0] if files else None
    return None


@dataclass
class GGUFFile:
    """An opened GGUF file: its metadata as plain Python values, and its tensors (memory-mapped)."""
    path: Path
    meta: dict[str, Any]
    reader: Any

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", "?"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.architecture}.{key}", default)


def open_gguf(path: Path) -> GGUFFile:
    """The file, parsed once per process (the model and its tokenizer both need it); a file
    changed on disk is parsed again."""
    stat = Path(path).stat()
    return _open_gguf(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf(name: str, mtime_ns: int, size: int) -> GGUFFile:
    path = Path(name)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise GGUFError("loading a .gguf file needs the `gguf` package: pip install gguf") from None
    try:
        reader = metadata_reader(GGUFReader)(str(path))
    except (ValueError, OSError, KeyError, struct.error, UnicodeDecodeError) as exc:
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None
    meta = reader.metadata
    if meta is None:                  # a byte order read_value does not take: the package's fields
        meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    file = GGUFFile(path, meta, reader)
    if file.architecture not in ARCHITECTURES:
        raise GGUFError(f"{path.name}: GGUF architecture {file.architecture!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return file


# The GGUF format's value types: scalars by their struct code, 8 a string (u64 length + UTF-8), 9 an
# array (u32 item type, u64 count, the items).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")


def read_value(buf: memoryview, offs: int, vtype: int) -> tuple[Any, int]:
    """The little-endian value of type vtype at offs, and the offset after it: what the `gguf`
    package's ReaderField.contents() gives (str, int, float, bool, or a list of them), except that
    an array of arrays stays nested (the package flattens it; no key we read is one)."""
    code = _SCALARS.get(vtype)
    if code is not None:
        return struct.unpack_from("<" + code, buf, offs)[0], offs + struct.calcsize(code)
    if vtype == _STRING:
        (length,) = _LENGTH.unpack_from(buf, offs)
        offs += 8
        return str(buf[offs:offs + length], "utf-8"), offs + length
    if vtype == _ARRAY:
        item_type, count = struct.unpack_from("<IQ", buf, offs)
        offs += 12
        code = _SCALARS.get(item_type)
        if code is not None:                       # numbers: the whole array in one call
            return list(struct.unpack_from(f"<{count}{code}", buf, offs)), offs + count * struct.calcsize(code)
        if item_type == _STRING:                   # a vocabulary: the loop kept tight
            values, unpack = [], _LENGTH.unpack_from
            for _ in range(count):
                (length,) = unpack(buf, offs)
                offs += 8
                values.append(str(buf[offs:offs + length], "utf-8"))
                offs += length
            return values, offs
        values = []
        for _ in range(count):
            value, offs = read_value(buf, offs, item_type)
            values.append(value)
        return values, offs
    raise ValueError(f"unknown GGUF value type {vtype}")


@functools.lru_cache(maxsize=None)
def metadata_reader(base: type) -> type:
    """The `gguf` package's GGUFReader with its key/value section read by `read_value` into
    `.metadata` (key → value). The package builds numpy views and a field object for every
    string of a vocabulary and its merges: 17 s for a Qwen3 file's 152k tokens and 151k merges on
    this project's CPU, where this reads them in 0.4 s. Its tensors and their
    views are the package's own. A file of the other byte order keeps the package's fields
    (`.metadata` None). `general.alignment` is still made the package's way: it reads it itself."""

    class MetadataReader(base):
        metadata: dict[str, Any] | None = None

        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order != "I" or sys.byteorder != "little":
                return super()._build_fields(offs, count)
            buf, metadata = memoryview(self.data), {}
            for _ in range(int(count)):
                start = offs
                key, offs = read_value(buf, offs, _STRING)
                (vtype,) = struct.unpack_from("<I", buf, offs)
                value, end = read_value(buf, offs + 4, vtype)
                if key in metadata:
                    raise KeyError(f"duplicate key {key}")
                metadata[key] = value
                if key == "general.alignment":
                    super()._build_fields(start, 1)
                offs = end
            self.metadata = metadata
            return offs

    return MetadataReader


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this model would have."""
    arch, model_type = ARCHITECTURES[file.architecture]
    names = {t.name for t in file.reader.tensors}
    if "rope_freqs.weight" in names:
        raise GGUFError(f"{file.path.name}: per-frequency RoPE factors (rope_freqs, Llama 3.1 scaling) are not supported")
    scaling = file.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFError(f"{file.path.name}: RoPE scaling {scaling!r} is not supported in GGUF files")
    heads = int(file.arch_value("attention.head_count"))
    hidden = int(file.arch_value("embedding_length"))
    tokens = file.meta.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": int(file.arch_value("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(file.arch_value("feed_forward_length")),
        "num_hidden_layers": int(file.arch_value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(file.arch_value("attention.head_count_kv", heads)),
        "head_dim": int(file.arch_value("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(file.arch_value("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        # llama.cpp writes no output.weight when the head is the embedding
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": stop_ids(file.meta),
    }
    if model_type == "llama":
        config["attention_bias"] = "blk.0.attn_output.bias" in names   # Llama's flag covers o_proj too
    if file.meta.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(file.meta["tokenizer.ggml.bos_token_id"])
    return config


def stop_ids(meta: dict[str, Any]) -> list[int]:
    """The ids that end generation: the file's eos, end-of-turn and end-of-message tokens."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [int(meta[k]) for k in keys if meta.get(k) is not None]
    return list(dict.fromkeys(ids))


def hf_name(name: str) -> str | None:
    """llama.cpp tensor name → Hugging Face name; None for a name we do not know."""
    base, _, kind = name.rpartition(".")
    if base in GLOBAL_TENSORS and kind in ("weight", "bias"):
        return f"{GLOBAL_TENSORS[base]}.{kind}"
    match = LAYER_NAME.fullmatch(name)
    if match is None or match["name"] not in LAYER_TENSORS:
        return None
    return f"model.layers.{match['layer']}.{LAYER_TENSORS[match['name']]}.{match['kind']}"


def dequantize(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as float32 in PyTorch's (row-major, Hugging Face) shape."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize as gguf_dequantize
    shape = tuple(int(d) for d in reversed(tensor.shape))    # GGML lists the fastest dimension first
    qtype = tensor.tensor_type
    if qtype in (Q.F32, Q.F16):
        array = np.array(tensor.data, dtype=np.float32)     # a copy: the file is mapped read-only
    else:
        try:
            array = gguf_dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise GGUFError(f"tensor {tensor.name!r} is stored as {qtype.name}, which the gguf package "
                            "cannot dequantize") from None
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32).reshape(shape))


# Bytes per block of 32 weights: fp16 scale, [fp16 minimum,] codes.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def blocks_of(tensor: Any):
    """A Q4_0 / Q4_1 / Q8_0 tensor as layers.quant.Blocks (its own numbers, undequantized), rows
    in PyTorch order; None for other types."""
    from blockspec.layers import quant
    kind = tensor.tensor_type.name
    if kind not in BLOCK_BYTES:
        return None
    rows = np.asarray(tensor.data)
    blocks = rows.reshape(rows.shape[0], -1, BLOCK_BYTES[kind])                 # [N, K / 32, bytes]
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        values = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows.shape[0], -1))
        return quant.q8_blocks(values, d)
    m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)) if kind == "Q4_1" else None
    packed = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]                # [N, K / 32, 16]
    # Byte j of a block holds weight j (low nibble) and weight j + 16 (high nibble).
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=-1).reshape(rows.shape[0], -1)
    return quant.q4_blocks(torch.from_numpy(codes.astype(np.uint8)), d, m)


def q8_table(tensor: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A Q8_0 tensor's int8 values [N, K] and fp32 scales [N, K / 32]; None for other types."""
    if tensor.tensor_type.name != "Q8_0":
        return None
    rows = np.asarray(tensor.data)
    blocks = rows.reshape(rows.shape[0], -1, BLOCK_BYTES["Q8_0"])
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    return torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows.shape[0], -1)), d


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's reordering of Llama's q/k rows. Its converter interleaves each head's two
    rotary halves (row r of half h goes to 2r + h) so that its kernel can rotate adjacent pairs;
    our RoPE (and Hugging Face's) rotates the first half against the second."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def rope_rows(tensor_name: str, config: dict[str, Any]) -> int | None:
    """The head count whose rows llama.cpp interleaved in this tensor (Llama's q/k), else None."""
    match = LAYER_NAME.fullmatch(tensor_name)
    if config["model_type"] != "llama" or match is None:
        return None
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(match["name"])


def iter_tensors(file: GGUFFile, config: dict[str, Any], skip: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, Path, torch.Tensor]]:
    """Every tensor (but those named in `skip`) as (Hugging Face name, file, float32 tensor), one at a time."""
    for tensor in file.reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise GGUFError(f"{file.path.name}: tensor {tensor.name!r} has no place in {config['architectures'][0]}")
        if name in skip:
            continue
        value = dequantize(tensor)
        heads = rope_rows(tensor.name, config)
        if heads is not None:
            value = unpermute_rope_rows(value, heads)
        yield name, file.path, value


def keep_quantized(model: torch.nn.Module, file: GGUFFile, config: dict[str, Any]) -> frozenset[str]:
    """Swap the model's projections, head and embedding for modules that keep the file's Q4_0 /
    Q4_1 / Q8_0 blocks (layers/quant.py; CPU). A fused projection (q/k/v, gate/up) is swapped
    when all its parts are such blocks; anything else stays a dequantized parameter. Returns the
    Hugging Face names of the tensors the new modules hold (iter_tensors skips them)."""
    from blockspec.layers.common import FusedLinear
    from blockspec.layers.quant import Blocks, QuantEmbedding, QuantLinear
    by_name = {hf_name(t.name): t for t in file.reader.tensors}
    taken: set[str] = set()

    def blocks(name: str) -> Blocks | None:
        tensor = by_name.get(name)
        found = blocks_of(tensor) if tensor is not None else None
        heads = rope_rows(tensor.name, config) if tensor is not None else None
        if found is not None and heads is not None:
            found = found.rows(unpermute_rope_rows(torch.arange(found.shape[0])[:, None], heads)[:, 0])
        return found

    def bias(name: str) -> torch.Tensor | None:
        tensor = by_name.get(name)
        return None if tensor is None else dequantize(tensor)

    for module_name, module in list(model.named_modules()):
        parent_name, _, child = module_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        prefix = parent_name + "." if parent_name else ""
        if isinstance(module, FusedLinear):
            names = [f"{prefix}{part}" for part in module.part_rows]
            parts = [blocks(f"{n}.weight") for n in names]
            if any(p is None for p in parts) or len({p.bits for p in parts}) > 1:
                continue
            biases = [bias(f"{n}.bias") for n in names] if module.bias is not None else None
            setattr(parent, child, QuantLinear(Blocks.cat(parts), None if biases is None else torch.cat(biases),
                                               module.part_sizes))
            taken |= {f"{n}.{kind}" for n in names for kind in ("weight", "bias")}
        elif isinstance(module, torch.nn.Linear):
            found = blocks(f"{module_name}.weight")
            if found is None and module_name == "lm_head" and config.get("tie_word_embeddings"):
                found = blocks("model.embed_tokens.weight")            # the head is the embedding
            if found is not None:
                setattr(parent, child, QuantLinear(found, bias(f"{module_name}.bias") if module.bias is not None else None))
                taken |= {f"{module_name}.weight", f"{module_name}.bias"}
        elif isinstance(module, torch.nn.Embedding) and f"{module_name}.weight" in by_name:
            table = q8_table(by_name[f"{module_name}.weight"])
            if table is not None:
                setattr(parent, child, QuantEmbedding(*table))
                taken.add(f"{module_name}.weight")
    return frozenset(taken)


# ---- tokenizer ----

def byte_level_backend(meta: dict[str, Any], path: Path):
    """The tokenizers.Tokenizer of a byte-level BPE vocabulary (`tokenizer.ggml.model` gpt2)."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as BackendTokenizer
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    backend = BackendTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                          fuse_unk=False, byte_fallback=False))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path.name}: tokenizer pre-split {pre!r} is not known "
                        f"(known: {', '.join(sorted(PRE_TOKENIZERS))})")
    split = PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None)
    if split == DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    # Control tokens (<|im_start|>) match whole and are special; user-defined ones (<think>) match
    # whole but are ordinary text when decoding with skip_special_tokens.
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, kind in zip(tokens, types) if kind == CONTROL])
    backend.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], int(bos))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    return backend


def load_tokenizer(path: Path):
    """The Tokenizer (vocabulary, merges, special tokens, chat template, stop ids) of a GGUF file."""
    from blockspec.tokenizer import Tokenizer
    file = open_gguf(path)
    meta = file.meta
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"{path.name}: tokenizer.ggml.model {model!r} is not supported "
                        "(byte-level BPE, 'gpt2', is)")
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None
    return Tokenizer(byte_level_backend(meta, path), chat_template=meta.get("tokenizer.chat_template"),
                     bos_token=token("bos"), eos_token=token("eos"), pad_token=token("padding"),
                     unk_token=token("unknown"), generation_eos_ids=stop_ids(meta))
