"""Prometheus histograms of speculation per cycle (issue 21), from the engine's exact counts
(EngineCounters: value → cycles): drafts verified and drafts accepted by the whole batch in one
cycle (as the verify judged them, before a stop id or max_tokens cuts a block: the requests'
stats count after the cut), the width k (drafts verified) chosen for each sequence in each cycle
and the drafts it accepted of them (the realised acceptance). With --speculation fixed the
width is always the block's; with adaptive its spread is the policy's."""
from __future__ import annotations

from prometheus_client.core import HistogramMetricFamily

PER_CYCLE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
WIDTH_BUCKETS = tuple(range(16))


def histogram(name: str, doc: str, counts: dict[int, int], bounds: tuple[int, ...]) -> HistogramMetricFamily:
    counts = dict.copy(counts)         # one atomic copy: the engine thread may add a value meanwhile
    buckets = [(str(bound), sum(n for value, n in counts.items() if value <= bound)) for bound in bounds]
    buckets.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(v * n for v, n in counts.items()))


def speculation_histograms(counters):
    """The four families (empty when the engine is not up yet)."""
    empty: dict[int, int] = {}
    yield histogram("blockspec_spec_verified_tokens_per_cycle", "Draft tokens verified by one decode cycle (all "
                    "sequences)", counters.spec_verified_per_cycle if counters else empty, PER_CYCLE_BUCKETS)
    yield histogram("blockspec_spec_accepted_tokens_per_cycle", "Draft tokens accepted in one decode cycle (all "
                    "sequences)", counters.spec_accepted_per_cycle if counters else empty, PER_CYCLE_BUCKETS)
    yield histogram("blockspec_spec_verify_width", "Drafts one sequence verified in one cycle (the chosen width k)",
                    counters.spec_widths if counters else empty, WIDTH_BUCKETS)
    yield histogram("blockspec_spec_accepted_per_sequence", "Drafts one sequence accepted in one cycle (of the k "
                    "it verified)", counters.spec_accepted if counters else empty, WIDTH_BUCKETS)
