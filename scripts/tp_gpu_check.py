"""Tensor parallelism on two CUDA devices (issue 34): TP2 greedy == TP1 greedy, fp32, CUDA graphs
on (their decode graphs hold the all-reduces and the logits' all-gather), for a dense, a hybrid and
a MoE target, plain, DFlash and DFlash 2. Prints one JSON line; exits 1 on any difference.

    python scripts/tp_gpu_check.py            # needs 2 GPUs; 5 cases × (TP1, TP2), each capturing its graphs
    python scripts/tp_gpu_check.py cpu        # the same over gloo on CPU (no graphs)
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> int:
    import torch
    import fixtures
    import test_tensor_parallel as tp_tests
    from blockspec import LLM, SamplingParams
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if device == "cuda" and torch.cuda.device_count() < 2:
        print("tp_gpu_check: needs 2 CUDA devices", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="tp-gpu-"))
    fixtures.write_hybrid_checkpoint(root / "hybrid")
    for kind in ("dense", "qwen3_next"):
        tp_tests.write_target(root / kind, kind, root / "hybrid")
    cases = [("dense", None), ("dense", "dflash"), ("dense", "dflash2"), ("hybrid", "dflash"), ("qwen3_next", "dflash")]
    for kind, draft in cases:
        if draft == "dflash" and not (root / f"{kind}-dflash").exists():
            fixtures.write_dflash_draft(root / f"{kind}-dflash", root / kind, block_size=4, mask_token_id=255)
        if draft == "dflash2" and not (root / f"{kind}-dflash2").exists():
            fixtures.write_dflash2_draft(root / f"{kind}-dflash2", root / kind, block_size=4, mask_token_id=255)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    results, ok = {}, True
    for kind, draft in cases:
        outputs = []
        for size in (1, 2):
            llm = LLM(str(root / kind), draft=str(root / f"{kind}-{draft}") if draft else None, device=device,
                      dtype="float32", tensor_parallel_size=size, max_model_len=256, max_num_seqs=4,
                      show_progress=False)
            outputs.append([r.token_ids for r in llm.generate(tp_tests.PROMPTS, params)])
            graphs = llm.graphs_summary
            llm.close()
        same = outputs[0] == outputs[1]
        ok &= same
        results[f"{kind}-{draft or 'plain'}"] = {"tp2_equals_tp1": same, "graphs": graphs}
    print(json.dumps({"ok": ok, **results}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
