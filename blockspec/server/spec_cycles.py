"""The opt-in stream extension `stream_options.include_spec_cycles`: per-chunk verify-cycle data.

With it, each streamed chunk that carries output tokens also carries `spec_cycles`, one entry
per cycle whose tokens the chunk carries (ARCHITECTURE.md §5):

    {"cycle": k, "tokens": n, "accepted": a, "drafts": d, "bonus": b, "text": [t_0 … t_{n-1}]}

`cycle` 0 is the token the prefill produced (no verify pass: accepted 0, drafts 0, bonus null);
k ≥ 1 is the k-th verify pass, whose n tokens are its a accepted drafts and then the bonus
(b = n − 1), as the engine's stats count them (acceptance length n = a + 1, cut at a stop id or
max_tokens); d is the drafts it verified. `text` is the output text each token released.

Why it is exact even for a slow reader: a Generation keeps one pending event and merges the
engine's later events into it, so one chunk may hold several cycles. The cycle boundaries
therefore cannot be read off the events; they are recorded on the engine thread, in the
callback of each event (the engine emits a sequence's tokens once per step, right after that
step's `record_cycle`, so the stats then describe exactly the tokens just emitted), as token
ranges. The reader side only counts the tokens it has processed and hands out the records
those tokens complete.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from blockspec.engine.request import GenerationStats, TokenEvent
from blockspec.server.output import OutputDelta, OutputProcessor


@dataclass(frozen=True)
class CycleRecord:
    cycle: int          # 0: the prefill's token; k ≥ 1: the k-th verify pass
    start: int          # index of its first token in the request's output
    tokens: int
    accepted: int
    drafts: int

    @property
    def end(self) -> int:
        return self.start + self.tokens


class SpecCycles:
    """One choice's cycle records (engine thread) and the texts its tokens released (loop)."""

    def __init__(self) -> None:
        self._records: list[CycleRecord] = []
        self._lock = threading.Lock()
        # engine thread only: what the stats of the events recorded so far had counted
        self._num_recorded_tokens = self._num_cycles = self._num_drafts = 0
        # event loop only: tokens processed, their texts (from _texts_start on), records handed out
        self._num_processed = self._texts_start = self._num_sent = 0
        self._texts: list[str] = []

    def record(self, event: TokenEvent, stats: GenerationStats) -> None:
        """Engine thread, before the event is published: the cycles of event's tokens."""
        if not event.token_ids:
            return
        new_lengths = stats.acceptance_lengths[self._num_cycles:]
        new_drafts = stats.draft_tokens - self._num_drafts
        records, start = [], self._num_recorded_tokens
        # Tokens beyond the new verify passes came from a prefill: the first token, or the next
        # one after a preempted sequence recomputed. They come first in the event.
        for _ in range(max(0, len(event.token_ids) - sum(new_lengths))):
            records.append(CycleRecord(0, start, 1, 0, 0))
            start += 1
        for i, length in enumerate(new_lengths):
            # One pass per event (see the module's docstring); were there several, the drafts
            # could only be split evenly, the last taking the rest.
            drafts = new_drafts // len(new_lengths) + (new_drafts % len(new_lengths) if i == len(new_lengths) - 1 else 0)
            records.append(CycleRecord(self._num_cycles + i + 1, start, length, length - 1, drafts))
            start += length
        self._num_recorded_tokens, self._num_cycles = start, len(stats.acceptance_lengths)
        self._num_drafts = stats.draft_tokens
        with self._lock:
            self._records.extend(records)

    def process(self, processor: OutputProcessor, event: TokenEvent) -> OutputDelta:
        """processor.process(event), one token at a time so each token's text is known; the
        delta is the one the whole event gives (the processor goes one id at a time anyway)."""
        total, first_text = OutputDelta(), len(self._texts)
        logprobs = event.logprobs
        for i, token_id in enumerate(event.token_ids):
            if processor.is_finished:       # a stop string ended the output: the rest has no text
                self._texts.append("")
                continue
            piece = processor.process([token_id], None, [logprobs[i]] if logprobs is not None else None)
            self._texts.append(piece.content + piece.reasoning)
            add(total, piece)
        if event.finish_reason is not None and not processor.is_finished:
            tail = processor.process([], event.finish_reason)
            if len(self._texts) > first_text:   # held text released at the end: the last token's
                self._texts[-1] += tail.content + tail.reasoning
            add(total, tail)
        self._num_processed += len(event.token_ids)
        return total

    def take(self) -> list[dict[str, Any]] | None:
        """The records whose tokens are all processed and not yet sent, as the wire dicts."""
        with self._lock:
            ready = [r for r in self._records[self._num_sent:] if r.end <= self._num_processed]
        if not ready:
            return None
        self._num_sent += len(ready)
        entries = [self._entry(record) for record in ready]
        done = ready[-1].end
        del self._texts[: done - self._texts_start]
        self._texts_start = done
        return entries

    def _entry(self, record: CycleRecord) -> dict[str, Any]:
        texts = self._texts[record.start - self._texts_start: record.end - self._texts_start]
        return {"cycle": record.cycle, "tokens": record.tokens, "accepted": record.accepted,
                "drafts": record.drafts, "bonus": record.tokens - 1 if record.cycle else None, "text": texts}


def add(total: OutputDelta, piece: OutputDelta) -> None:
    total.content += piece.content
    total.reasoning += piece.reasoning
    total.tool_calls.extend(piece.tool_calls)
    total.logprobs.extend(piece.logprobs)
    total.stop_hit = total.stop_hit or piece.stop_hit
    total.finish_reason = piece.finish_reason or total.finish_reason


def wants_spec_cycles(body: Any) -> bool:
    options = getattr(body, "stream_options", None)
    return bool(body.stream and options is not None and options.include_spec_cycles)
