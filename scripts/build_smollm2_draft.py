"""Train the DFlash draft shipped for `--model smollm2` (one GPU, a few minutes), then measure it.

    python scripts/build_smollm2_draft.py --target PATH/SmolLM2-135M-Instruct.Q4_1.gguf --work WORK

1. prompts    scripts/smollm2_prompts.py (stdlib documentation questions, code tasks, chat templates)
2. responses  the target answers each prompt through our engine, batched: once greedy and
              --samples times at temperature 0.7 (more distinct continuations of the same prompts)
3. draft      `blockspec train-draft` on those token ids (resumable: --resume when WORK/draft has
              checkpoints), one layer, block 8, reading target layers 1, 10, 19, 27
4. measure    greedy DFlash (block 8) vs plain on the held-out prompts (HELD_OUT): mean acceptance
              length, equality of the outputs, tok/s at one sequence; results.json in WORK
Each stage is skipped when its output exists, so a run cut short resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from smollm2_prompts import HELD_OUT, train_prompts  # noqa: E402

BLOCK = 8
LAYER_IDS = "1,10,19,27"
MASK_TOKEN = "<empty_output>"          # a special SmolLM2 never writes in chat: the draft's mask
SEQ_LEN = 384


def log(message: str) -> None:
    print(f"[smollm2 {time.strftime('%H:%M:%S')}] {message}", flush=True)


def generate_responses(target: str, work: Path, samples: int, budget_s: float, max_num_seqs: int,
                       seq_len: int, limit: int | None) -> Path:
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    out = work / "responses.jsonl"
    if out.exists():
        return out
    llm = LLM(target, max_model_len=seq_len, max_num_seqs=max_num_seqs, max_queue=100_000, show_progress=False)
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in train_prompts()[:limit]]
    started, rows = time.perf_counter(), []
    rounds = [SamplingParams(max_tokens=seq_len, temperature=0.0)] + [
        SamplingParams(max_tokens=seq_len, temperature=0.7, seed=1000 * r + 1) for r in range(samples)]
    for number, base in enumerate(rounds):
        for start in range(0, len(prompts), 1024):
            chunk = prompts[start:start + 1024]
            params = [SamplingParams(max_tokens=seq_len - len(p), temperature=base.temperature,
                                     seed=None if base.seed is None else base.seed + start + i)
                      for i, p in enumerate(chunk)]
            for prompt, result in zip(chunk, llm.generate(chunk, params)):
                rows.append({"token_ids": prompt + result.token_ids, "prompt_len": len(prompt)})
            elapsed = time.perf_counter() - started
            log(f"responses: round {number} {start + len(chunk)}/{len(prompts)}, {len(rows)} rows, {elapsed:.0f} s, "
                f"{sum(len(r['token_ids']) - r['prompt_len'] for r in rows) / elapsed:,.0f} tok/s")
            if elapsed > budget_s:
                break
        if time.perf_counter() - started > budget_s:
            break
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    del llm
    return out


def train(target: str, work: Path, data: Path, steps: int, batch: int, lr: float, mask_id: int, seq_len: int,
          budget_s: float) -> int:
    """`blockspec train-draft` in a child process, stopped after budget_s (a device call is
    bounded): then the last checkpoint's draft is the draft. Returns the steps trained."""
    import shutil
    import subprocess
    from blockspec.train.checkpoint import latest_checkpoint
    out = work / "draft"
    command = [sys.executable, "-m", "blockspec", "train-draft", "--target", target, "--out", str(out),
               "--data", str(data), "--num-layers", "1", "--block-size", str(BLOCK), "--target-layer-ids", LAYER_IDS,
               "--mask-token-id", str(mask_id), "--steps", str(steps), "--batch-size", str(batch), "--lr", str(lr),
               "--seq-len", str(seq_len), "--eval-every", "0", "--eval-prompts", "0",
               "--save-every", str(max(1, steps // 8)), "--quiet"]
    if latest_checkpoint(out) is not None:
        command.append("--resume")
    try:
        subprocess.run(command, check=True, timeout=budget_s)
        return steps
    except subprocess.TimeoutExpired:
        found = latest_checkpoint(out)
        if found is None:
            raise SystemExit("train-draft saved no checkpoint within the time budget")
        for name in ("config.json", "model.safetensors"):
            shutil.copy(found / name, out / name)
        log(f"train-draft stopped by the time budget; the draft is {found.name}")
        return int(found.name.split("-")[-1])


def measure(target: str, draft: Path, device: str, dtype: str, max_tokens: int, limit: int | None = None) -> dict:
    """Held-out prompts, greedy: acceptance at block 8, DFlash == plain, tok/s at one sequence."""
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    plain = LLM(target, device=device, dtype=dtype, max_model_len=1024, max_num_seqs=1, show_progress=False)
    spec = LLM(target, draft=str(draft), block_size=BLOCK, device=device, dtype=dtype, max_model_len=1024,
               max_num_seqs=1, show_progress=False, speculation="fixed")
    prompts = [plain.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in HELD_OUT[:limit]]
    for llm in (plain, spec):                                  # warm-up (graphs, allocator)
        llm.generate_ids(prompts[0], params)
    results = {"plain": [], "dflash": []}
    for name, llm in (("plain", plain), ("dflash", spec)):
        for prompt in prompts:
            results[name].append(llm.generate_ids(prompt, params))
    lengths = [a for r in results["dflash"] for a in r.stats.acceptance_lengths]

    def tok_s(rs):
        return sum(r.stats.output_tokens for r in rs) / sum(r.stats.decode_s for r in rs)
    equal = sum(p.token_ids == d.token_ids for p, d in zip(results["plain"], results["dflash"]))
    return {"device": device, "dtype": dtype, "prompts": len(prompts), "max_tokens": max_tokens,
            "mean_acceptance_length": sum(lengths) / len(lengths), "equal_outputs": equal,
            "plain_tok_s": tok_s(results["plain"]), "dflash_tok_s": tok_s(results["dflash"]),
            "speedup": tok_s(results["dflash"]) / tok_s(results["plain"]),
            "answer_capital_of_france": results["plain"][0].text}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--gen-budget-s", type=float, default=100)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--train-budget-s", type=float, default=1e9)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--measure-tokens", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=SEQ_LEN)
    parser.add_argument("--limit-prompts", type=int, default=None, help="smoke test: this many prompts of each set")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    from blockspec.loader import load_tokenizer
    mask_id = load_tokenizer(Path(args.target)).token_to_id(MASK_TOKEN)
    started = time.perf_counter()
    data = generate_responses(args.target, work, args.samples, args.gen_budget_s, args.max_num_seqs,
                              args.seq_len, args.limit_prompts)
    log(f"responses ready ({time.perf_counter() - started:.0f} s)")
    trained = train(args.target, work, data, args.steps, args.batch_size, args.lr, mask_id, args.seq_len,
                    args.train_budget_s)
    log(f"draft trained ({time.perf_counter() - started:.0f} s)")
    result = measure(args.target, work / "draft", args.device, "auto", args.measure_tokens, args.limit_prompts)
    result["train"] = {"steps": args.steps, "steps_trained": trained, "batch_size": args.batch_size, "lr": args.lr, "seq_len": args.seq_len,
                       "block_size": BLOCK, "target_layer_ids": LAYER_IDS, "mask_token": MASK_TOKEN,
                       "responses": sum(1 for _ in data.open())}
    (work / "results.json").write_text(json.dumps(result, indent=1))
    log(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
