"""Test helpers over the Engine v2 API: one sequence driven directly through a model (its own
KV pool, state pool and block table, metadata built here), and engines run to completion,
alone or as a batch."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from unittest import mock

import torch

from blockspec.cache import KVPool, StatePool
from blockspec.config import EngineConfig
from blockspec.engine.engine import Engine
from blockspec.engine.request import Request, TokenEvent
from blockspec.engine.sequence import Sequence
from blockspec.layers import AttentionMetadata
from blockspec.sampling import SamplingParams


class OneSequence:
    """One sequence through a target (or, with `draft_of`, nothing else): pools sized for
    `capacity` positions, pages 1… in order (page 0 stays the padding page), state slot 1.

    forward(ids) feeds ids at the next positions and returns (logits [T, V], features or None);
    rollback(length) after a keep_steps forward keeps the positions before `length`."""

    def __init__(self, model: torch.nn.Module, capacity: int, page_size: int = 16,
                 capture_layers: tuple[int, ...] = ()) -> None:
        self.model, self.page_size, self.capture_layers = model, page_size, tuple(capture_layers)
        weight = model.lm_head.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_pages = -(-capacity // page_size) + 1                       # + the padding page
        self.capacity = (self.num_pages - 1) * page_size
        config = model.config
        self.kv = KVPool(model.num_attention_layers, self.num_pages * page_size, config.num_key_value_heads,
                         config.head_dim, self.dtype, self.device)
        shapes = model.recurrent_shapes
        self.states = StatePool(2, shapes, self.dtype, self.device) if shapes else None
        self.state_slot = 1 if self.states is not None else None            # slot 0: padding rows
        if self.states is not None:
            self.states.clear([self.state_slot])
        self.block_table = list(range(1, self.num_pages))
        self.length = 0
        self._last_start: int | None = None

    def metadata(self, ids: torch.Tensor, keep_steps: bool = False) -> AttentionMetadata:
        start, page, num_tokens = self.length, self.page_size, ids.numel()
        positions = torch.arange(start, start + num_tokens, device=self.device)
        table = torch.tensor([self.block_table], dtype=torch.long, device=self.device)
        slots = table[0, positions // page] * page + positions % page
        return AttentionMetadata(
            num_seqs=1, width=num_tokens, input_ids=ids, positions=positions, slot_mapping=slots, block_tables=table,
            context_lens=torch.tensor([start + num_tokens], device=self.device), max_context_len=start + num_tokens,
            page_size=page, kv=self.kv.layers, states=self.states,
            state_slots=None if self.states is None else torch.tensor([self.state_slot], device=self.device),
            keep_steps=keep_steps)

    @torch.no_grad()
    def forward(self, ids, keep_steps: bool = False,
                shape: Callable[[AttentionMetadata], AttentionMetadata] | None = None):
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).reshape(-1)
        assert self.length + ids.numel() <= self.capacity
        meta = self.metadata(ids, keep_steps)
        if shape is None:
            out = self.model(ids, meta.positions, meta, self.capture_layers)
            hidden, features = out.hidden, out.features
        else:                         # a reshaped (e.g. graph-shaped, padded) batch: keep row 0
            padded = shape(meta)
            out = self.model(padded.input_ids, padded.positions, padded, self.capture_layers)
            hidden = out.hidden[: ids.numel()]
            features = None if out.features is None else out.features[: ids.numel()]
        self._last_start = self.length
        self.length += ids.numel()
        return self.model.compute_logits(hidden), features

    def rollback(self, length: int) -> None:
        """After a forward of positions [s, s + T): keep [0, length), s ≤ length ≤ s + T (a hybrid
        keeps at least one position of a keep_steps forward: StatePool.select's 1 … T)."""
        start = self._last_start
        assert start is not None and start <= length <= self.length
        if self.states is not None:
            assert length > start
            self.states.select([self.state_slot], [length - start])
        self.length = length

    def recurrent_state(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per recurrent layer: (ssm state, conv window) of this sequence's slot."""
        return [(ssm[self.state_slot], conv[self.state_slot]) for conv, ssm in zip(self.states.conv, self.states.ssm)]


def graph_shaped(num_rows: int) -> Callable[[AttentionMetadata], AttentionMetadata]:
    """What a CUDA-graph replay sees: a batch padded to num_rows rows (padding rows write at page 0
    and read state slot 0) and keys gathered over the pool's whole per-sequence capacity."""
    def shape(meta: AttentionMetadata) -> AttentionMetadata:
        device, width, pad = meta.positions.device, meta.width, num_rows - meta.num_seqs
        capacity = meta.block_tables.shape[1] * meta.page_size
        pad_positions = torch.arange(width, device=device).repeat(pad)
        tables = torch.cat((meta.block_tables, torch.zeros(pad, meta.block_tables.shape[1], dtype=torch.long,
                                                           device=device)))
        state_slots = None
        if meta.state_slots is not None:
            state_slots = torch.cat((meta.state_slots, torch.zeros(pad, dtype=torch.long, device=device)))
        return AttentionMetadata(
            num_seqs=num_rows, width=width,
            input_ids=torch.cat((meta.input_ids, torch.zeros(pad * width, dtype=torch.long, device=device))),
            positions=torch.cat((meta.positions, pad_positions)),
            slot_mapping=torch.cat((meta.slot_mapping, pad_positions % meta.page_size)),   # page 0
            block_tables=tables,
            context_lens=torch.cat((meta.context_lens, torch.full((pad,), width, device=device))),
            max_context_len=capacity, page_size=meta.page_size, kv=meta.kv, states=meta.states,
            state_slots=state_slots, keep_steps=meta.keep_steps)
    return shape


# -- engines ---------------------------------------------------------------------------------

def engine_config(**overrides) -> EngineConfig:
    """Small pools for CPU tests (the default sizing is for 32 sequences of 4096 tokens). The
    whole block is verified every cycle (speculation "fixed"), so acceptance lengths are exact;
    tests of adaptive speculation ask for it (tests/test_adaptive.py)."""
    settings = dict(max_model_len=1024, max_num_seqs=8, max_queue=256, speculation="fixed")
    settings.update(overrides)
    return EngineConfig(**settings)


def padded(engine: Engine) -> Engine:
    """The engine's decode cycle through the CUDA-graph path's fixed shapes (batch padded to a
    captured size with page-0 / slot-0 rows, keys gathered to a fixed bucket), run eagerly."""
    engine.runner.graphs = engine.runner.make_graphs(capture=False)
    return engine


def make_engine(target, draft=None, **config) -> Engine:
    """An engine over already-loaded models (several engines may share them)."""
    return Engine(target, draft, engine_config(**config))


@dataclass
class Run:
    """A request run by an engine: its events, in order, as the callback received them."""
    request: Request
    events: list[TokenEvent] = field(default_factory=list)
    seq: Sequence | None = None          # the engine's Sequence (run_alone / run_batch fill it in)

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]

    @property
    def output_ids(self) -> list[int]:
        return self.request.output_ids

    @property
    def finish_reason(self) -> str | None:
        return self.request.finish_reason

    @property
    def stats(self):
        return self.request.stats

    def check_events(self) -> None:
        """Events carry exactly the committed tokens; exactly the last one finishes."""
        assert self.tokens == self.request.output_ids
        reasons = [e.finish_reason for e in self.events]
        assert reasons[-1] is not None and reasons.count(None) == len(reasons) - 1, reasons


def make_request(request_id: str, prompt: list[int], stops=frozenset(), max_model_len: int = 1024,
                 **params) -> Request:
    params.setdefault("max_tokens", 40)
    return Request(request_id, prompt, SamplingParams(**params), frozenset(stops), max_model_len)


def submit(engine: Engine, request: Request) -> Run:
    run = Run(request)
    engine.submit(request, run.events.append)
    return run


def note_sequences(engine: Engine, runs: list[Run]) -> None:
    """Remember each run's Sequence while the scheduler still holds it."""
    by_id = {seq.request_id: seq for seq in [*engine.scheduler.waiting, *engine.scheduler.running]}
    for run in runs:
        if run.seq is None and run.request.request_id in by_id:
            run.seq = by_id[run.request.request_id]


def run_until_done(engine: Engine, runs: list[Run], max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if all(r.request.is_finished for r in runs) and not engine.has_work:
            return
        engine.step()
        note_sequences(engine, runs)
    raise AssertionError(f"not finished after {max_steps} steps")


def run_alone(engine_factory: Callable[[], Engine], request: Request) -> Run:
    """The request on a fresh engine with nothing else in it."""
    engine = engine_factory()
    run = submit(engine, request)
    run_until_done(engine, [run])
    run.check_events()
    return run


def run_batch(engine_factory: Callable[[], Engine], requests: list[Request],
              arrivals: dict[int, list[Request]] | None = None,
              aborts: dict[int, list[Request]] | None = None) -> tuple[Engine, list[Run]]:
    """`requests` submitted together; arrivals[n]: more submitted before step n; aborts[n]:
    abort() called before step n. Returns the engine (for its counters) and every run, in the
    order requests, then arrivals by step."""
    engine = engine_factory()
    runs = [submit(engine, r) for r in requests]
    arrivals, aborts = dict(arrivals or {}), dict(aborts or {})
    step = 0
    while arrivals or aborts or not all(r.request.is_finished for r in runs) or engine.has_work:
        for request in arrivals.pop(step, []):
            runs.append(submit(engine, request))
        for request in aborts.pop(step, []):
            assert not request.is_finished, f"{request.request_id} finished before its abort at step {step}"
            request.abort()
        engine.step()
        note_sequences(engine, runs)
        step += 1
        assert step < 10_000
    for run in runs:
        run.check_events()
    return engine, runs


class OracleDraft(torch.nn.Module):
    """A stand-in draft that proposes a known continuation (the target's own greedy output, or
    a corrupted copy), so the bookkeeping can be checked against exact acceptance lengths.

    It speaks the runner's draft protocol and runs the real draft's forward (so forwards are
    counted and shapes are real), then reads out one-hot logits: block slot i of a sequence whose
    anchor sits at position p proposes sequence[p + 1 + i]. `sequences` is one token list (every
    row), or a dict request_id → token list resolved through `bind(engine)` (rows are told apart
    by their first page, which no two live sequences share; page 0 marks a padding row)."""

    def __init__(self, real_draft, sequences, sharpness: float = 50.0):
        super().__init__()
        self.real = real_draft
        self.sequences = sequences
        self.sharpness = sharpness
        self.calls = 0
        self.engine: Engine | None = None
        self._rows: list[tuple[list[int], int]] = []

    block_size = property(lambda self: self.real.block_size)
    mask_token_id = property(lambda self: self.real.mask_token_id)
    target_layer_ids = property(lambda self: self.real.target_layer_ids)
    config = property(lambda self: self.real.config)

    def bind(self, engine: Engine) -> "OracleDraft":
        self.engine = engine
        return self

    def append_context(self, features, positions, slot_mapping, kv) -> None:
        self.real.append_context(features, positions, slot_mapping, kv)

    def _sequence_of(self, meta, row: int) -> list[int]:
        if isinstance(self.sequences, list):
            return self.sequences
        first_page = int(meta.block_tables[row, 0])
        if first_page == 0:                      # a padding row of the graph path: nobody's
            return []
        for seq in self.engine.scheduler.running:
            if seq.block_table and seq.block_table[0] == first_page:
                return self.sequences[seq.request_id]
        raise AssertionError(f"no running sequence owns page {first_page}")

    def forward(self, block_embeds, positions, meta):
        hidden = self.real(block_embeds, positions, meta)
        self.calls += 1
        anchors = meta.query_positions[:, 0].tolist()
        self._rows = [(self._sequence_of(meta, b), anchors[b]) for b in range(meta.num_seqs)]
        return hidden

    def propose(self, hidden, anchors, lm_head):
        """hidden [B, T, H] → logits [B, T − 1, V] of the draft slots (DFlash 1's protocol)."""
        return self.read_logits(hidden[:, 1:], lm_head)

    def read_logits(self, hidden, lm_head):
        num_rows, num_slots = hidden.shape[:2]
        assert num_rows == len(self._rows)
        logits = torch.zeros(num_rows, num_slots, lm_head.weight.shape[0], device=hidden.device, dtype=hidden.dtype)
        for b, (sequence, anchor) in enumerate(self._rows):
            for i in range(num_slots):
                position = anchor + 1 + i
                token = sequence[position] if position < len(sequence) else 0
                logits[b, i, token] = self.sharpness
        return logits


class ForwardCounter:
    """Counts a module's forward calls (to prove compute stopped, by a bound, not a timeout)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_) -> None:
        self.count += 1


def run_interpreted(code: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """code in a fresh process under Triton's CPU interpreter (chosen when the kernels are defined,
    so never in this process), with the repository and tests/ importable, the interpreter less its
    redundant re-patching (tests/fast_interpreter.py: the same operations, about a third faster)."""
    tests = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]))
    code = "import fast_interpreter; fast_interpreter.install()\n" + code
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def modelled_costs(runner):
    """Adaptive's cost table in the shape the runner measures it (its token buckets, sequence
    buckets and draft widths), the times a line through what the tiny Qwen3 pair measures on the
    2-core CPU (verify 13 ms at 1 token to 105 at 64; a draft block of width w for n sequences
    about 8 + 2.6·n·w ms): the policy allocates as it would on measured times, without the ~2.5 s
    of probes an engine's measurement takes here."""
    from blockspec.engine.graphs import sparse
    from blockspec.engine.spec.costs import cost_table
    graphs = runner.graphs
    tokens, seqs = sparse(graphs.full_tokens), sparse(graphs.draft_sizes)
    draft = {w: {n: 8.0 + 2.6 * n * w for n in seqs} for w in graphs.draft_widths}
    return cost_table({"verify": {n: 12.0 + 1.4 * n for n in tokens}, "draft": draft[graphs.width],
                       "narrow": {w: ms for w, ms in draft.items() if w != graphs.width}}, padded=False)


@contextmanager
def modelled_cost_tables(on: bool = True) -> Iterator[None]:
    """Engines built within take `modelled_costs` for adaptive's table instead of measuring it
    (on=False: they measure, as serving does, also inside an outer modelled block: conftest's
    _modelled_costs models every test's tables but those marked `measured_costs`)."""
    from blockspec.engine.model_runner import ModelRunner
    measured = ModelRunner.__dict__["measure_costs"]
    measured = getattr(measured, "measured", measured)          # the runner's own, under any patch of ours

    def measure_costs(runner):
        return modelled_costs(runner) if on else measured(runner)
    measure_costs.measured = measured
    with mock.patch.object(ModelRunner, "measure_costs", measure_costs):
        yield
