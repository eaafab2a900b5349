"""The cost table adaptive speculation allocates with (policy.py): target-forward milliseconds
by rows and draft-forward milliseconds by batch, measured on the device the engine runs on.

Measured once per runner, at the first decode step that needs it, by the graph dispatcher
(GraphDispatcher.measure_costs): one verify forward per token bucket and one draft propose per
sequence bucket, each through the path a step of that shape takes (its graph's replay on CUDA).
The rows are padding rows (page 0, state slot 0: nobody's memory) with a short context, so the
table prices the weights and the per-row work; attention over long contexts is not in it (at a
few thousand tokens of context the per-row GEMMs still dominate a dense 8B forward), nor the
host's work per step, which the policy learns online (Speculation.record_cycle). A few seconds on
an H200; on CPU, where the test models take milliseconds per forward, a fraction of a second.
"""
from __future__ import annotations

import logging
import time

from blockspec.engine.spec.policy import CostTable

logger = logging.getLogger("blockspec.engine")


def measure_costs(runner, log: bool = True) -> CostTable:
    """The runner's dispatcher's measured costs as a CostTable."""
    started = time.perf_counter()
    costs = runner.graphs.measure_costs()
    verify, draft = costs["verify"], costs["draft"] or {1: 0.0}
    table = CostTable(tuple(verify), tuple(verify.values()), tuple(draft), tuple(draft.values()))
    if log:
        logger.info(f"blockspec: speculation cost table ({runner.device}, {time.perf_counter() - started:.1f} s): "
                    f"{table.describe()}")            # the startup lines' logger (never stdout: generate --json)
    return table
