"""What `serve` logs: one startup summary of what it serves, and a stats line every
--log-stats-interval seconds while there is work (vLLM's: throughput, running / waiting, KV
usage, speculative acceptance). Everything goes through `logging` (--log-level)."""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from typing import TypeVar

from blockspec.server.settings import ServerSettings
from blockspec.server.state import EngineHandle

logger = logging.getLogger("blockspec.server")
T = TypeVar("T")
FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """One handler on stderr for blockspec's and uvicorn's loggers, at --log-level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
    for name in ("blockspec", "uvicorn", "uvicorn.error", "uvicorn.access"):
        named = logging.getLogger(name)
        named.handlers[:] = [handler] if name in ("blockspec", "uvicorn") else []
        named.setLevel(level.upper())
        named.propagate = name not in ("blockspec", "uvicorn")


def read_property(handle: object, name: str, kind: type[T]) -> T | None:
    """A property of the loaded model if it has it, of the type expected, else None: the summary
    names what this build knows (a branch may add properties, a test stand-in may lack them)."""
    value = getattr(handle, name, None)
    if isinstance(value, bool) and kind is not bool:        # bool is an int subclass
        return None
    return value if isinstance(value, kind) else None


def startup_summary(llm: EngineHandle, settings: ServerSettings) -> str:
    """One line: model, draft, dtype, device, the target's weight format and bytes per step,
    context, block size, speculation policy, KV pool in tokens and maximum concurrency, CUDA graphs."""
    policy = read_property(llm, "speculation_policy", str)
    if policy is None:
        policy = f"fixed block size {llm.block_size}" if llm.speculative else "none (plain decoding)"
    pool, concurrency = read_property(llm, "kv_cache_tokens", int), read_property(llm, "max_concurrency", int)
    weights, step_bytes = read_property(llm, "weight_format", str), read_property(llm, "weight_bytes_per_step", int)
    fields = [("model", settings.model), ("draft", settings.draft if llm.speculative else None),
              ("dtype", read_property(llm, "dtype", str)), ("device", read_property(llm, "device", str)),
              ("weights", f"{weights}, {step_bytes / 1e9:.3g} GB read per step"
               if weights is not None and step_bytes is not None else None),
              ("context", f"{llm.max_model_len} tokens"),
              ("block size", llm.block_size if llm.speculative else None), ("speculation", policy),
              ("KV pool", f"{pool} tokens" if pool is not None else None),
              ("max concurrency", f"{concurrency} requests of {llm.max_model_len} tokens"
               if concurrency is not None else None),
              ("CUDA graphs", read_property(llm, "graphs_summary", str)), ("threads", torch_threads(llm))]
    return "serving " + settings.model_name + ": " + ", ".join(f"{k} {v}" for k, v in fields if v is not None)


def torch_threads(llm: EngineHandle) -> int | None:
    device = read_property(llm, "device", str)
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None and device == "cpu" else None


@dataclass
class Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_verify: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class StatsLogger:
    """Every `interval` seconds while the engine has or had work since the last line: one line
    of throughput over the interval, queue, KV usage and the interval's acceptance."""

    def __init__(self, llm: EngineHandle, interval: float) -> None:
        self.llm, self.interval = llm, interval
        self.last, self.last_time = self.totals(), time.monotonic()

    def totals(self) -> Totals:
        counters = self.llm.engine.counters
        return Totals(counters.prompt_tokens, counters.generation_tokens, counters.spec_verify,
                      counters.spec_draft_tokens, counters.spec_accepted_tokens)

    def line(self) -> str | None:
        """The interval's line, or None when it was idle (nothing ran, nothing waits)."""
        engine, now, totals = self.llm.engine, time.monotonic(), self.totals()
        seconds = max(now - self.last_time, 1e-9)
        prompt, generated = totals.prompt_tokens - self.last.prompt_tokens, totals.generation_tokens - self.last.generation_tokens
        verify = totals.spec_verify - self.last.spec_verify
        drafted = totals.spec_draft_tokens - self.last.spec_draft_tokens
        accepted = totals.spec_accepted_tokens - self.last.spec_accepted_tokens
        self.last, self.last_time = totals, now
        if not (prompt or generated or engine.num_running or engine.num_waiting):
            return None
        text = (f"prompt throughput {prompt / seconds:.1f} tokens/s, generation throughput {generated / seconds:.1f} "
                f"tokens/s, running {engine.num_running}, waiting {engine.num_waiting}, "
                f"KV cache usage {100 * engine.kv_cache_usage:.1f}%")
        if self.llm.speculative:
            rate = f"{100 * accepted / drafted:.1f}%" if drafted else "n/a"
            length = f"{(accepted + verify) / verify:.2f}" if verify else "n/a"
            text += f", spec acceptance rate {rate}, mean acceptance length {length} ({verify} verify passes)"
        return text

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            line = self.line()
            if line is not None:
                logger.info(line)
