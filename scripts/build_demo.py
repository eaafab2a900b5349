"""Rebuild the shipped demo pair from scratch: tokenizer, target, draft (fixed seeds, one GPU).

    python scripts/build_demo.py                        # → blockspec/demo/{target,draft}
    python scripts/build_demo.py --tiny --device cpu    # a few steps of every stage (smoke test)

Stages (each skipped when its output is already in --work, so a broken run resumes):
1. tokenizer  byte-level BPE (`tokenizers`) on the standard library's source, minus the held-out
              modules (blockspec.demo.HELD_OUT_MODULES) and every test; ChatML specials
              <|im_start|>/<|im_end|>, <|endoftext|> (document end) and <|mask|> (the draft's mask).
2. corpus     every module as plain source, and every other one also as a ChatML turn
              ("Write the Python module NAME." → its source), joined by <|endoftext|>.
3. target     Qwen3 architecture, trained as a language model with transformers' Qwen3ForCausalLM.
4. distill    the target's own greedy continuations of corpus windows (self-distillation data).
5. draft      `blockspec train-draft` on the distilled data, evaluated on held-out modules.
6. ship       both in bf16, Hugging Face layout, into --ship-to (the target as soon as it is trained).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from blockspec.demo import HELD_OUT_MODULES  # noqa: E402
from blockspec.train.corpus import module_name, read_sources, stdlib_dir, stdlib_files  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
ENDOFTEXT, IM_START, IM_END, MASK = range(4)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

FULL = dict(vocab=4096, hidden=256, intermediate=768, layers=8, heads=4, kv_heads=2, head_dim=64, context=1024,
            target_steps=600, target_batch=32, target_lr=2e-3, distill_prompts=32768, distill_prompt_len=64,
            distill_new=192, draft_layers=3, draft_steps=6000, draft_batch=128, draft_lr=2e-3, block_size=8,
            draft_eval_every=2000)
TINY = dict(FULL, vocab=512, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, context=128,
            target_steps=30, target_batch=4, distill_prompts=16, distill_prompt_len=16, distill_new=48,
            draft_layers=1, draft_steps=10, draft_batch=4, draft_eval_every=5)


def log(message: str) -> None:
    print(f"[build_demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def training_files(tiny: bool) -> list[Path]:
    files = stdlib_files(exclude=HELD_OUT_MODULES)
    return files[::40] if tiny else files


def build_tokenizer(work: Path, vocab_size: int, tiny: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(read_sources(training_files(tiny)), trainer)
    directory = work / "tokenizer"
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in enumerate(SPECIALS)}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "mask_token": "<|mask|>",
              "model_max_length": FULL["context"], "clean_up_tokenization_spaces": False,
              "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens")


def corpus_documents(files: list[Path]) -> list[str]:
    """Every module as source; every other one (by sorted order) also as a ChatML turn, so chat
    requests get code back."""
    root = stdlib_dir()
    docs = []
    for i, (path, source) in enumerate(zip(files, read_sources(files))):
        docs.append(source)
        if i % 2 == 0:
            name = module_name(path, root)
            docs.append(f"<|im_start|>user\nWrite the Python module {name}.<|im_end|>\n"
                        f"<|im_start|>assistant\n{source}<|im_end|>\n")
    return docs


def build_corpus(work: Path, tiny: bool) -> None:
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(corpus_documents(training_files(tiny)), add_special_tokens=False):
        stream += encoding.ids + [ENDOFTEXT]
    torch.save(torch.tensor(stream, dtype=torch.int16), work / "corpus.pt")
    held_out = stdlib_files(only=HELD_OUT_MODULES)
    held = [e.ids for e in tokenizer.encode_batch(read_sources(held_out), add_special_tokens=False)]
    (work / "heldout.json").write_text(json.dumps(held))
    log(f"corpus: {len(stream):,} training tokens from {len(training_files(tiny))} files; "
        f"{sum(map(len, held)):,} held-out tokens from {len(held_out)} files")


def hf_config(shape: dict):
    from transformers import Qwen3Config
    return Qwen3Config(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                       num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                       num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                       max_position_embeddings=shape["context"], rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=[IM_END, ENDOFTEXT],
                       pad_token_id=ENDOFTEXT)


def lm_batches(corpus: torch.Tensor, batch: int, length: int, step: int, seed: int) -> torch.Tensor:
    """Random windows of the corpus, a function of (seed, step) only."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, len(corpus) - length - 1, (batch,), generator=generator)
    return torch.stack([corpus[s: s + length].long() for s in starts.tolist()])


def cosine_lr(step: int, steps: int, peak: float) -> float:
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))


def train_target(work: Path, shape: dict, device: torch.device) -> None:
    from transformers import GenerationConfig, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(hf_config(shape)).to(device)
    corpus = torch.load(work / "corpus.pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=shape["target_lr"], betas=(0.9, 0.95), weight_decay=0.1)
    steps, started = shape["target_steps"], time.perf_counter()
    for step in range(steps):
        ids = lm_batches(corpus, shape["target_batch"], shape["context"], step, seed=1).to(device)
        for group in optimizer.param_groups:
            group["lr"] = cosine_lr(step, steps, shape["target_lr"])
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"target step {step + 1}/{steps} loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    log(f"target held-out loss {held_out_loss(model, work, shape, device):.3f}")
    model.generation_config = GenerationConfig(eos_token_id=[IM_END, ENDOFTEXT], pad_token_id=ENDOFTEXT,
                                               bos_token_id=None)
    directory = work / "target"
    model.to(torch.bfloat16).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(work / "tokenizer" / name, directory / name)


@torch.no_grad()
def held_out_loss(model, work: Path, shape: dict, device: torch.device) -> float:
    held = [ids for ids in json.loads((work / "heldout.json").read_text()) if len(ids) > shape["context"]]
    ids = torch.tensor([h[: shape["context"]] for h in held], device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        return float(model(input_ids=ids, labels=ids).loss)


def distill(work: Path, shape: dict, device: torch.device) -> None:
    """Prompts: random corpus windows; responses: the target's greedy continuation, batched."""
    from blockspec.loader import load_model
    from blockspec.train.features import greedy_continue
    target = load_model(str(work / "target"), device=str(device)).model
    corpus = torch.load(work / "corpus.pt")
    num, prompt_len, new = shape["distill_prompts"], shape["distill_prompt_len"], shape["distill_new"]
    rows = []
    chunk = 2048
    for start in range(0, num, chunk):
        prompts = lm_batches(corpus, min(chunk, num - start), prompt_len, start, seed=2).to(device)
        out = greedy_continue(target, prompts, new)
        rows += [{"token_ids": p + o, "prompt_len": 0} for p, o in zip(prompts.tolist(), out.tolist())]
    (work / "distill.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held = json.loads((work / "heldout.json").read_text())
    windows = [ids[i: i + prompt_len] for ids in held for i in range(0, len(ids) - prompt_len, 997)]
    random.Random(0).shuffle(windows)                     # every held-out module among the first few
    (work / "heldout_prompts.jsonl").write_text(
        "".join(json.dumps({"token_ids": w, "prompt_len": prompt_len}) + "\n" for w in windows))
    log(f"distill: {len(rows)} sequences of {prompt_len} + {new} tokens; {len(windows)} held-out prompts")


def train_draft(work: Path, shape: dict, device: torch.device, resume: bool) -> None:
    from blockspec.cli import main as blockspec
    seq_len = shape["distill_prompt_len"] + shape["distill_new"]
    code = blockspec([
        "train-draft", "--target", str(work / "target"), "--out", str(work / "draft"),
        "--data", str(work / "distill.jsonl"), "--eval-data", str(work / "heldout_prompts.jsonl"),
        "--num-layers", str(shape["draft_layers"]), "--block-size", str(shape["block_size"]),
        "--steps", str(shape["draft_steps"]), "--batch-size", str(shape["draft_batch"]),
        "--lr", str(shape["draft_lr"]), "--seq-len", str(seq_len), "--device", str(device),
        "--eval-every", str(shape["draft_eval_every"]), "--eval-prompts", "8", "--eval-tokens", "128",
        "--save-every", str(shape["draft_eval_every"]), "--seed", "0", *(["--resume"] if resume else []),
        *([] if sys.stderr.isatty() else ["--quiet"])])
    if code != 0:
        raise SystemExit(f"train-draft failed with exit code {code}")
    (work / "draft" / "DONE").write_text("")


SHIPPED = {"target": ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"),
           "draft": ("config.json",)}


def ship(work: Path, destination: Path, names: tuple[str, ...]) -> None:
    """bf16 checkpoints in Hugging Face layout (plus model.safetensors); the draft without its
    training state."""
    from safetensors.torch import load_file, save_file
    for name in names:
        files = SHIPPED[name]
        out = destination / name
        out.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy(work / name / f, out / f)
        tensors = load_file(str(work / name / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        if name == "draft":
            config = json.loads((out / "config.json").read_text())
            (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=2) + "\n")
    log(f"shipped {', '.join(names)} to {destination}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=str(REPO / "build" / "demo"), help="stage outputs (resumable)")
    parser.add_argument("--ship-to", default=str(REPO / "blockspec" / "demo"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a few steps of every stage (smoke test)")
    parser.add_argument("--until", choices=["tokenizer", "corpus", "target", "distill", "draft", "ship"], default="ship")
    args = parser.parse_args()
    shape, work, device = (TINY if args.tiny else FULL), Path(args.work), torch.device(args.device)
    work.mkdir(parents=True, exist_ok=True)
    stages = [("tokenizer", work / "tokenizer" / "tokenizer.json", lambda: build_tokenizer(work, shape["vocab"], args.tiny)),
              ("corpus", work / "heldout.json", lambda: build_corpus(work, args.tiny)),
              ("target", work / "target" / "model.safetensors", lambda: train_target(work, shape, device)),
              ("ship-target", None, lambda: ship(work, Path(args.ship_to), ("target",))),
              ("distill", work / "heldout_prompts.jsonl", lambda: distill(work, shape, device)),
              ("draft", work / "draft" / "DONE",
               lambda: train_draft(work, shape, device, resume=(work / "draft" / "checkpoints").exists())),
              ("ship", None, lambda: ship(work, Path(args.ship_to), ("target", "draft")))]
    started = time.perf_counter()
    for name, output, run in stages:
        if output is not None and output.exists():
            log(f"{name}: done already ({output})")
        else:
            stage_started = time.perf_counter()
            run()
            log(f"{name}: {time.perf_counter() - stage_started:.0f} s")
        if name == args.until:
            break
    log(f"total {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
