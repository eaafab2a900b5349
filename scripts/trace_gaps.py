"""Where the device waits: a torch.profiler Chrome trace (scripts/host_split.py --torch-profile
--trace T) → the device's busy fraction over the profiled cycles, and each idle stretch's time
attributed to what the host was doing then (the innermost `phase:` range open on the engine
thread at each instant of the gap; "-" where none was).

    python scripts/trace_gaps.py T [--min-gap-us 5]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events if e.get("cat") in DEVICE_CATS)
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def innermost(phases: list[tuple[float, float, str]], t: float) -> str:
    """The shortest phase range containing t (ranges nest on one thread)."""
    best, width = "-", float("inf")
    for start, end, name in phases:
        if start <= t < end and end - start < width:
            best, width = name, end - start
    return best


def gaps(trace: dict, min_gap_us: float = 5.0, step_us: float = 2.0) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    busy = busy_intervals(events)
    phases = [(e["ts"], e["ts"] + e.get("dur", 0.0), e["name"][len("phase:"):]) for e in events
              if str(e.get("name", "")).startswith("phase:")]
    if not busy:
        return {"busy_us": 0.0, "span_us": 0.0, "idle_by_phase_us": {}}
    start = min(p[0] for p in phases) if phases else busy[0][0]
    end = max(p[1] for p in phases) if phases else busy[-1][1]
    idle: dict[str, float] = defaultdict(float)
    edges = [(start, start)] + busy + [(end, end)]
    for (_, a), (b, _) in zip(edges, edges[1:]):
        if b - a < min_gap_us:
            continue
        t = a
        while t < b:
            dt = min(step_us, b - t)
            idle[innermost(phases, t + dt / 2)] += dt
            t += dt
    busy_us = sum(min(b, end) - max(a, start) for a, b in busy if b > start and a < end)
    return {"busy_us": round(busy_us, 1), "span_us": round(end - start, 1),
            "idle_by_phase_us": {k: round(v, 1) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--cycles", type=int, default=12, help="decode cycles the trace covers (per-cycle figures)")
    args = ap.parse_args()
    with open(args.trace) as f:
        result = gaps(json.load(f), args.min_gap_us)
    n = args.cycles
    print(f"device busy {result['busy_us'] / n / 1e3:.3f} ms of {result['span_us'] / n / 1e3:.3f} ms a cycle "
          f"({result['busy_us'] / max(result['span_us'], 1e-9):.0%}); idle by host phase, ms a cycle:")
    for name, us in result["idle_by_phase_us"].items():
        print(f"  {name:24s} {us / n / 1e3:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
