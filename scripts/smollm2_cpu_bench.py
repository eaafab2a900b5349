"""SmolLM2 on CPU at one thread: plain vs DFlash (the shipped draft; --speculation fixed, adaptive
or both), quantized (dtype auto) vs dequantized float32, in one process; each figure repeated,
best and spread reported (the box is shared: the best is the machine's speed, the spread says how
loaded it was).

    OMP_NUM_THREADS=1 python scripts/smollm2_cpu_bench.py [--target GGUF] [--repeats 3] [--prompts 4] \
        [--draft DIR] [--speculation fixed,adaptive]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from smollm2_prompts import HELD_OUT  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--draft", default=None, help="(default: the shipped one)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--dtypes", default="auto,float32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculation", default="fixed", help="DFlash modes, comma-separated: fixed, adaptive")
    args = parser.parse_args()
    modes = [m for m in args.speculation.split(",") if m]
    from blockspec import named
    from blockspec.llm import LLM
    from blockspec.sampling import SamplingParams
    draft = args.draft or str(named.default_draft("smollm2"))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    report = {}
    for dtype in args.dtypes.split(","):
        options = dict(device="cpu", dtype=dtype, threads=1, max_model_len=512, max_num_seqs=1, show_progress=False)
        engines = {"plain": LLM(args.target, **options)}
        for mode in modes:
            name = "dflash" if mode == "fixed" else f"dflash_{mode}"
            engines[name] = LLM(args.target, draft=draft, block_size=args.block_size, speculation=mode, **options)
        prompts = [engines["plain"].tokenizer.encode_chat([{"role": "user", "content": p}])
                   for p in HELD_OUT[: args.prompts]]
        for llm in engines.values():
            llm.generate_ids(prompts[0], params)                              # warm-up
        runs: dict[str, list[float]] = {name: [] for name in engines}
        lengths: dict[str, list[int]] = {}
        equal = True
        for _ in range(args.repeats):
            outputs = {}
            for name, llm in engines.items():                                 # alternate: noise hits both
                results = [llm.generate_ids(p, params) for p in prompts]
                tokens = sum(len(r.token_ids) - 1 for r in results)          # the first token is the prefill's
                runs[name].append(tokens / sum(r.stats.decode_s for r in results))
                outputs[name] = [r.token_ids for r in results]
                if name != "plain":
                    lengths[name] = [a for r in results for a in r.stats.acceptance_lengths]
            equal = equal and all(outputs[name] == outputs["plain"] for name in outputs)
        row = {name: {"best": round(max(v), 1), "worst": round(min(v), 1)} for name, v in runs.items()}
        for name in lengths:
            row[name]["speedup_best"] = round(row[name]["best"] / row["plain"]["best"], 2)
            row[name]["mean_acceptance_length"] = round(sum(lengths[name]) / max(1, len(lengths[name])), 3)
        row["dflash_equals_plain"] = equal
        report[dtype] = row
        print(json.dumps({dtype: row}), flush=True)
        del engines
    print(json.dumps({"prompts": args.prompts, "max_tokens": args.max_tokens, "repeats": args.repeats, **report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
