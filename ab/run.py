"""A/B (not part of the repository): adaptive with this tree's policy vs round 55's, same process."""
import importlib.util, json, os, sys, torch
from unittest import mock
from blockspec.bench.common import SHAPES, build_models
from blockspec.bench.speculation import speculation_sweep, LatentProfile
from blockspec.engine import model_runner
spec = importlib.util.spec_from_file_location("old_policy", os.path.join(os.path.dirname(__file__), "old_policy.py"))
old = importlib.util.module_from_spec(spec); sys.modules["old_policy"] = old; spec.loader.exec_module(old)
import blockspec.bench.common as common
common.ENGINE_OPTIONS.update(json.loads(os.environ.get("ENGINE_OPTS", "{}")))
conc = [int(c) for c in sys.argv[1].split(",")]
torch.manual_seed(0)
_, _, target, draft = build_models(SHAPES[os.environ.get("SHAPE", "qwen3-8b")], torch.device("cuda"), torch.bfloat16, 16)
profile = LatentProfile(6.5, 16)
out = {}
def run(name, patch_old):
    ctx = mock.patch.object(model_runner, "Speculation", old.Speculation) if patch_old else mock.patch.object(model_runner, "Speculation", model_runner.Speculation)
    with ctx:
        mode = "fixed" if name == "fixed" else "adaptive"
        r = speculation_sweep(target, draft, 16, conc, 128, 256, mode, None, profile)
    out[name] = {c: {k: r[c][k] for k in ("tok_s", "ms_per_cycle", "mean_width")} for c in conc}
    print(name, json.dumps(out[name]), flush=True)
for name, patch_old in (("fixed", False), ("new", False), ("old", True), ("new2", False), ("old2", True))[: int(os.environ.get("RUNS", "5"))]:
    run(name, patch_old)
for c in conc:
    f = out["fixed"][c]["tok_s"]
    print(c, " ".join(f"{n} {out[n][c]['tok_s'] / f:.3f}" for n in ("new", "old", "new2", "old2")))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ab.json"), "w"), indent=1)
