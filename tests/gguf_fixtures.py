"""GGUF files written by the tests with the `gguf` package's writer, from a Hugging Face checkpoint
directory (the fixtures' tiny targets): what llama.cpp's converter would write, names, metadata
and tokenizer included, so loading the file must reproduce its safetensors twin."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in HF_TO_GGUF_GLOBAL:
        return f"{HF_TO_GGUF_GLOBAL[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)              # model.layers.N.<rest>
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[rest]}.{kind}"


def tokenizer_arrays(directory: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """tokens (by id, padded to the embedding), token types, merges: from tokenizer.json and the
    added tokens tokenizer_config.json declares."""
    spec = json.loads((directory / "tokenizer.json").read_text())
    declared = json.loads((directory / "tokenizer_config.json").read_text()).get("added_tokens_decoder", {})
    spec["added_tokens"] = list(spec.get("added_tokens") or []) + [
        {"id": int(i), "content": t["content"], "special": t.get("special", True)} for i, t in declared.items()]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size                             # UNUSED, as llama.cpp marks padding rows
    for token, index in spec["model"]["vocab"].items():
        tokens[index], types[index] = token, 1           # NORMAL
    for added in spec["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


def write_gguf(directory: Path, out: Path, arch: str = "qwen3", quantize: dict[str, str] | None = None,
               with_tokenizer: bool = True) -> Path:
    """The checkpoint in `directory` as one GGUF file; `quantize` maps a tensor name (ours) to a
    GGML type name (Q8_0, ...) for tensors stored quantized instead of F32. Without the tokenizer
    (151k tokens and merges) the file is written and read in a fraction of the time."""
    import gguf
    config = json.loads((directory / "config.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if with_tokenizer:
        add_tokenizer(writer, directory, config["vocab_size"])
    for name, array in load_file(str(directory / "model.safetensors")).items():
        array = array.astype(np.float32)
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(gguf_name(name), array)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def add_tokenizer(writer, directory: Path, vocab_size: int) -> None:
    """Byte-level BPE as llama.cpp writes it: tokens by id, their types, merges, eos, template."""
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokens, types, merges = tokenizer_arrays(directory, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index(tokenizer_config["eos_token"]))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer_config.get("chat_template")
                             or (directory / "chat_template.jinja").read_text())


# ---- a Llama-3-style file: end of turn and end of sequence are two ids -------------------------

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] }}<|eot_id|>{% endfor %}"
                   "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, by byte: a byte-level BPE vocabulary without merges."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def write_llama3_style_gguf(out: Path, chains: list[list[int]],
                            quantize: dict[str, str] | None = None) -> tuple[Path, dict[str, int]]:
    """A one-layer Llama GGUF laid out as Meta's Llama 3 files are: byte-level vocabulary
    (pre-split llama-bpe), <|end_of_text|> the end-of-sequence id and <|eot_id|> the
    end-of-turn id, a Llama-3 chat template. Its greedy output is scripted (as
    fixtures.write_chain_checkpoint's): after chains[c][k] it says chains[c][k + 1]; attention and
    MLP outputs are zero, so a position's hidden state is its token's embedding. `quantize` maps a
    GGUF tensor name to a GGML type name for tensors stored quantized. Returns the path and the
    special tokens' ids."""
    import gguf
    # Quantized rows come in blocks of 32: a quantized file's vocabulary is padded to them.
    padding = -(256 + len(LLAMA3_SPECIALS)) % 32 if quantize else 0
    tokens = byte_tokens() + list(LLAMA3_SPECIALS) + [f"[PAD{i}]" for i in range(padding)]
    special = {name: 256 + i for i, name in enumerate(LLAMA3_SPECIALS)}
    shape, vocab = LLAMA3_SHAPE, len(tokens)
    hidden, q_rows = shape["hidden_size"], shape["num_attention_heads"] * shape["head_dim"]
    kv_rows = shape["num_key_value_heads"] * shape["head_dim"]
    weights = {"token_embd.weight": np.zeros((vocab, hidden), np.float32),
               "output.weight": np.zeros((vocab, hidden), np.float32),
               "output_norm.weight": np.ones(hidden, np.float32)}
    sizes = {"attn_norm": (hidden,), "ffn_norm": (hidden,), "attn_q": (q_rows, hidden), "attn_k": (kv_rows, hidden),
             "attn_v": (kv_rows, hidden), "attn_output": (hidden, q_rows),
             "ffn_gate": (shape["intermediate_size"], hidden), "ffn_up": (shape["intermediate_size"], hidden),
             "ffn_down": (hidden, shape["intermediate_size"])}
    for name, size in sizes.items():
        weights[f"blk.0.{name}.weight"] = (np.ones if name.endswith("norm") else np.zeros)(size, np.float32)
    links = [(token, successor) for chain in chains for token, successor in zip(chain, chain[1:])]
    if len({token for token, _ in links}) != len(links) or len(links) > hidden:
        raise ValueError("each chain token needs one successor, at most hidden_size links")
    for k, (token, successor) in enumerate(links):
        weights["token_embd.weight"][token, k] = 1.0
        weights["output.weight"][successor, k] = 4.0
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(shape["num_attention_heads"])
    writer.add_head_count_kv(shape["num_key_value_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3] * len(LLAMA3_SPECIALS) + [5] * padding)   # NORMAL, CONTROL, UNUSED
    writer.add_token_merges([])
    writer.add_bos_token_id(special["<|begin_of_text|>"])
    writer.add_eos_token_id(special["<|end_of_text|>"])
    writer.add_eot_token_id(special["<|eot_id|>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(LLAMA3_TEMPLATE)
    for name, array in weights.items():
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(name, array)
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, special
