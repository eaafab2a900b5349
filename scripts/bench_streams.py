"""N streamed requests over HTTP, one after another and then all at once, side by side.

A real `blockspec serve` subprocess (the shipped demo pair unless --model is given); this
process is the client: streamed /v1/completions with held-out code prompts (token ids),
greedy, `--rounds` alternated rounds, the best time of each way kept. The two ways' texts
must be equal (a batch changes nothing). Prints seconds for each and the ratio. With --bursts:
each burst's first tokens as the client saw them, the server's own time to first token split into
its stages (build, queue, prefill, delivery: /metrics) and the server's CPU (its event loop's thread,
the rest).

    python scripts/bench_streams.py                        # demo pair, DFlash (block 8)
    python scripts/bench_streams.py --serve-args "--speculation off"
    python scripts/bench_streams.py --fixture              # the suite's tiny Qwen3 (152k vocabulary), random draft
    python scripts/bench_streams.py --serve-args "--device cuda" --requests 64 --overlap off   # and --overlap on
    python scripts/bench_streams.py --serve-args "--device cuda" --requests 64 --max-tokens 256 --bursts 3
        [--burst-client processes --client-processes 8]   # the streams dealt among 8 client processes
    py-spy record --subprocesses -o streams.svg -- python scripts/bench_streams.py   # where the time goes
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, serve_args: list[str], overlap: bool, switch_interval: float | None = None
                 ) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "BLOCKSPEC_OVERLAP": "1" if overlap else "0"}
    if switch_interval is not None:
        env["BLOCKSPEC_SWITCH_INTERVAL"] = str(switch_interval)
    command = [sys.executable, "-m", "blockspec.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--no-access-log", *serve_args]
    process = subprocess.Popen(command, env=env)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the server was not ready in 180 s")


def stream(url: str, prompt: list[int], max_tokens: int) -> str:
    """One streamed completion → its text (SSE chunks joined)."""
    return timed_stream(url, prompt, max_tokens)[0]


def new_client() -> httpx.Client:
    return httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


# One client for every request but the bursts': a new one per request costs an SSL context (~10 ms
# of this process's CPU, which the server's cores share).
CLIENT = new_client()


def timed_stream(url: str, prompt: list[int], max_tokens: int, client: httpx.Client | None = None) -> tuple[str, float]:
    """One streamed completion → its text and the seconds from sending to its first token's chunk."""
    text = StreamText()
    with (client or CLIENT).stream("POST", url + "/v1/completions", json=stream_body(prompt, max_tokens)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            text.feed(line)
    return text.result()


def stream_body(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}


class StreamText:
    """A streamed completion's SSE lines → its text and the seconds from this object's making (the
    request's sending) to the first chunk with text."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.started, self.first = time.perf_counter(), None

    def feed(self, line: str) -> None:
        if line.startswith("data: ") and line != "data: [DONE]":
            choices = json.loads(line[len("data: "):]).get("choices") or []
            self.parts += [c.get("text", "") for c in choices]
            if self.first is None and any(c.get("text") for c in choices):
                self.first = time.perf_counter() - self.started

    def result(self) -> tuple[str, float]:
        return "".join(self.parts), self.first if self.first is not None else float("nan")


def cpu_seconds(path: str) -> float:
    """User + system CPU time so far of the process or thread whose /proc stat file this is."""
    fields = open(path).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu(pid: int) -> tuple[float, float]:
    """The server's CPU seconds: its main thread (the event loop: HTTP, streaming, detokenizing)
    and all the others (the engine thread, mostly)."""
    loop = cpu_seconds(f"/proc/{pid}/task/{pid}/stat")
    return loop, cpu_seconds(f"/proc/{pid}/stat") - loop


def sequential(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[str]]:
    started = time.perf_counter()
    texts = [stream(url, p, max_tokens) for p in prompts]
    return time.perf_counter() - started, texts


def at_once(url: str, prompts: list[list[int]], max_tokens: int, client: httpx.Client | None = None
            ) -> tuple[float, list[tuple[str, float]]]:
    """Every prompt streamed at the same moment, one thread each → the wall seconds and each
    stream's (text, seconds to its first token); a failed stream raises here."""
    return at_once_with(lambda prompt: timed_stream(url, prompt, max_tokens, client), prompts)


def concurrent(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[str]]:
    seconds, results = at_once(url, prompts, max_tokens)
    return seconds, [text for text, _ in results]


async def async_stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
                       ) -> tuple[str, float]:
    """timed_stream on an event loop: one stream's text and seconds to its first token's chunk."""
    text = StreamText()
    async with client.stream("POST", url + "/v1/completions", json=stream_body(prompt, max_tokens)) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            text.feed(line)
    return text.result()


def at_once_async(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[tuple[str, float]]]:
    """at_once with one event loop and fresh connections (as vLLM's and SGLang's serving benchmarks
    send: asyncio, not a thread per stream, whose GIL hand-offs this process's clock would count)."""
    import asyncio

    async def run() -> list[tuple[str, float]]:
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return list(await asyncio.gather(*(async_stream(client, url, p, max_tokens) for p in prompts)))
    started = time.perf_counter()
    results = asyncio.run(run())
    return time.perf_counter() - started, results


def client_worker(url: str, conn) -> None:
    """A burst client process (--burst-client processes): for each job, its share of a burst's
    streams, a thread each on fresh connections, started together at the job's moment; replies
    with each stream's (text, seconds from that moment to its first token). time.monotonic is one
    clock for every process on the machine. Its code paths are warmed once, on /health (as a load
    balancer's probe does before traffic), so the first burst does not time this client's own
    first use."""
    httpx.get(url + "/health", timeout=30).raise_for_status()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        prompts, max_tokens, start_at = job
        time.sleep(max(0.0, start_at - time.monotonic()))
        with new_client() as client, collector_quiet():
            def timed(prompt: list[int]) -> tuple[str, float]:
                sent = time.monotonic()
                text, first = timed_stream(url, prompt, max_tokens, client)
                return text, sent - start_at + first
            _, results = at_once_with(timed, prompts)
        conn.send(results)


@contextlib.contextmanager
def collector_quiet(quiet: bool = True):
    """The client's garbage collector held off for a burst (collected before it, on again after):
    64 threads parsing 256 chunks each make enough objects for a collection mid-burst, which stops
    every client thread at once and is counted as the server's latency (--client-gc on: as before)."""
    if not quiet:
        yield
        return
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def at_once_with(run, prompts: list[list[int]]) -> tuple[float, list[tuple[str, float]]]:
    """run(prompt) for every prompt at the same moment, one thread each."""
    results: list[tuple[str, float]] = [("", float("nan"))] * len(prompts)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = run(prompts[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started, results


class ClientProcesses:
    """--burst-client processes: `count` client processes started (and warmed) before the first
    burst; each burst's streams dealt round-robin among them, so no process runs more than
    requests / count client threads (a thread per stream in one process fights itself for its GIL:
    round 54 on the H100, the client's first-token p50 was 20-38 ms above the server's own)."""

    def __init__(self, url: str, count: int) -> None:
        import multiprocessing
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for _ in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(target=client_worker, args=(url, theirs), daemon=True)
            process.start()
            self.pipes.append(mine)
            self.processes.append(process)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise SystemExit("a client process did not start")

    def burst(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[tuple[str, float]]]:
        count = len(self.pipes)
        start_at = time.monotonic() + 0.05
        for k, pipe in enumerate(self.pipes):
            pipe.send((prompts[k::count], max_tokens, start_at))
        shares = [pipe.recv() for pipe in self.pipes]
        results: list[tuple[str, float]] = [("", float("nan"))] * len(prompts)
        for k, share in enumerate(shares):
            results[k::count] = share
        return time.monotonic() - start_at, results

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for process in self.processes:
            process.join(30)


# The server's first-token stages (server/state.py FIRST_TOKEN_STAGES), which add up to its TTFT.
STAGES = ("build", "queue", "prefill", "delivery")


def server_histograms(url: str) -> dict[str, tuple[float, float]]:
    """The server's time-to-first-token histogram ("ttft") and its stages' so far (/metrics): each
    one's sum (s) and count."""
    names = {"blockspec_time_to_first_token_seconds": "ttft",
             **{f"blockspec_first_token_{stage}_seconds": stage for stage in STAGES}}
    values: dict[str, list[float]] = {key: [0.0, 0.0] for key in names.values()}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        for suffix, i in (("_sum", 0), ("_count", 1)):
            if name.endswith(suffix) and name[: -len(suffix)] in names:
                values[names[name[: -len(suffix)]]][i] = float(value)
    return {key: (total, count) for key, (total, count) in values.items()}


def server_ttft(url: str) -> tuple[float, float]:
    """The server's time-to-first-token histogram so far (/metrics): its sum (s) and count. What it
    measures starts in the request's handler, after the connection, the HTTP parse and the client;
    the difference to a client's figure is theirs."""
    return server_histograms(url)["ttft"]


def mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    return round((after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3, 2)


def bursts(url: str, prompt_sets: list[list[list[int]]], max_tokens: int, client_kind: str = "threads",
           server_pid: int | None = None, processes: ClientProcesses | None = None, quiet_gc: bool = True
           ) -> list[dict]:
    """A burst per prompt set, its streams sent at once, the first straight after startup (no
    warm-up request): each burst's first-token p50 / p99 (ms) and its wall time. A server that
    compiled and captured everything before its port opened serves the first burst as fast as
    the later ones; so that the comparison is of that alone, each burst has prompts of its own by
    default (`burst_prompt_sets`: with the same prompts, the later bursts' prefills were prefix-cache
    hits and the first burst's were not). Each burst opens its own connections (a new client): with
    one client the first burst alone would pay for opening them, the later ones reusing them kept
    alive. client_kind: "async" (one event loop) or "threads" (a thread per stream, rounds 40-47's
    client)."""
    from blockspec.bench.common import percentile
    out = []
    for prompts in prompt_sets:
        before = server_histograms(url)
        cpu_before = server_cpu(server_pid) if server_pid is not None else None
        with collector_quiet(quiet_gc):
            if client_kind == "async":
                seconds, results = at_once_async(url, prompts, max_tokens)
            elif processes is not None:
                seconds, results = processes.burst(prompts, max_tokens)
            else:
                with new_client() as client:
                    seconds, results = at_once(url, prompts, max_tokens, client)
        after = server_histograms(url)
        ttfts = sorted(first for _, first in results)
        out.append({"ttft_p50_ms": round(percentile(ttfts, 50) * 1e3, 1),
                    "ttft_p99_ms": round(percentile(ttfts, 99) * 1e3, 1),
                    "ttft_mean_ms": round(sum(ttfts) / len(ttfts) * 1e3, 1),
                    "server_ttft_mean_ms": round(mean_ms(before["ttft"], after["ttft"]), 1), "wall_s": round(seconds, 3),
                    "server_stages_mean_ms": {stage: mean_ms(before[stage], after[stage]) for stage in STAGES}})
        if cpu_before is not None:
            # The server's CPU over the burst (its streams included): the event loop's thread, the rest.
            (loop0, rest0), (loop1, rest1) = cpu_before, server_cpu(server_pid)
            out[-1]["server_cpu_ms"] = {"loop": round((loop1 - loop0) * 1e3), "others": round((rest1 - rest0) * 1e3)}
        stages = ", ".join(f"{stage} {ms}" for stage, ms in out[-1]["server_stages_mean_ms"].items())
        cpu = out[-1].get("server_cpu_ms")
        print(f"burst {len(out)}: {len(prompts)} streams, first token p50 {out[-1]['ttft_p50_ms']} ms, "
              f"p99 {out[-1]['ttft_p99_ms']} ms, mean {out[-1]['ttft_mean_ms']} ms (the server's own, from "
              f"its handler to the token: mean {out[-1]['server_ttft_mean_ms']} ms = {stages} ms), all done in "
              f"{out[-1]['wall_s']} s" + (f"; server CPU: loop {cpu['loop']} ms, others {cpu['others']} ms" if cpu else ""),
              flush=True)
    return out


def burst_prompt_sets(count: int, size: int, model: str | None, fresh: bool) -> list[list[list[int]]]:
    """`count` sets of `size` prompts: distinct across sets (fresh: no burst's prompt shares a
    cached prefix with an earlier burst's), or the same set each time (rounds 40-49's bursts)."""
    if not fresh:
        return [demo_prompts(size, model)] * count
    prompts = demo_prompts(size * count, model)
    return [prompts[i * size:(i + 1) * size] for i in range(count)]


def demo_prompts(num: int, model: str | None) -> list[list[int]]:
    from blockspec.demo import TARGET_DIR
    from blockspec.demo.measure import held_out_prompts
    from blockspec.loader import load_tokenizer
    tokenizer = load_tokenizer(TARGET_DIR if model is None else Path(model))
    prompts = held_out_prompts(tokenizer, num)
    # The held-out code gives 42 windows; more are the same windows rotated (a different first page,
    # so no two share a cached prefix).
    base, shift = list(prompts), 1
    while prompts and len(prompts) < num:
        prompts += [p[shift * 37 % len(p):] + p[: shift * 37 % len(p)] for p in base][: num - len(prompts)]
        shift += 1
    return prompts


def write_fixture() -> tuple[str, str]:
    """tests/fixtures.py's tiny Qwen3 and its DFlash draft (block 16), in a temporary directory."""
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import fixtures
    root = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    target = fixtures.write_dense_checkpoint(root / "qwen3", "qwen3")
    return str(target), str(fixtures.write_dflash_draft(root / "draft", target))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="checkpoint (none: the demo pair)")
    parser.add_argument("--fixture", action="store_true",
                        help="the test suite's tiny random Qwen3 (152k vocabulary) with a random DFlash draft")
    parser.add_argument("--serve-args", default="", help="more `blockspec serve` arguments, one string")
    parser.add_argument("--overlap", choices=("on", "off"), default="on",
                        help="the engine's overlap on CUDA (off: BLOCKSPEC_OVERLAP=0 for the server)")
    parser.add_argument("--switch-interval", type=float, default=None, metavar="S",
                        help="the server's sys.setswitchinterval (BLOCKSPEC_SWITCH_INTERVAL; the server's default "
                             "0.0005, Python's 0.005): how long its event loop may wait for the GIL behind the engine thread")
    parser.add_argument("--json", action="store_true", help="print one JSON line too")
    parser.add_argument("--bursts", type=int, default=0, metavar="K",
                        help="instead: K bursts of --requests streams at once, first tokens' p50 / p99 per burst")
    parser.add_argument("--burst-prompts", choices=("fresh", "same"), default="fresh",
                        help="each burst's prompts its own (default: every burst prefills as the first did), or the "
                             "same prompts each burst (rounds 40-49: the later bursts hit the prefix cache)")
    parser.add_argument("--client-gc", choices=("quiet", "on"), default="quiet",
                        help="the client's garbage collector during a burst: held off (collected before it; "
                             "the default since round 59) or on (rounds 40-58)")
    parser.add_argument("--burst-client", choices=("async", "threads", "processes"), default="threads",
                        help="the bursts' client: a thread per stream (default; round 48 measured httpx's asyncio "
                             "client slower on the H200 machine: 298 / 95 / 282 ms against 157 / 80 / 92), one event "
                             "loop, or --client-processes processes started before the first burst, the streams "
                             "dealt among them")
    parser.add_argument("--client-processes", type=int, default=8, metavar="N")
    args = parser.parse_args()
    port = free_port()
    if args.fixture:
        args.model, draft = write_fixture()
        args.serve_args += f" --draft {draft}"
    serve_args = shlex.split(args.serve_args) + (["--model", args.model] if args.model else [])
    server = start_server(port, serve_args, args.overlap == "on", args.switch_interval)
    url = f"http://127.0.0.1:{port}"
    try:
        if args.bursts:
            sets = burst_prompt_sets(args.bursts, args.requests, args.model, args.burst_prompts == "fresh")
            processes = ClientProcesses(url, args.client_processes) if args.burst_client == "processes" else None
            try:
                result = bursts(url, sets, args.max_tokens, args.burst_client, server.pid, processes,
                                args.client_gc == "quiet")
            finally:
                if processes is not None:
                    processes.close()
            print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens, "client": args.burst_client,
                              "burst_prompts": args.burst_prompts, "bursts": result,
                              "first_over_last_p50": round(result[0]["ttft_p50_ms"] / result[-1]["ttft_p50_ms"], 3)}))
            return 0
        prompts = demo_prompts(args.requests + 1, args.model)
        stream(url, prompts[0], args.max_tokens)                                  # warm-up
        prompts = prompts[1:]
        best_seq, best_conc, reference = float("inf"), float("inf"), None
        for r in range(args.rounds):
            cpu = [server_cpu(server.pid)]
            seq_s, seq_texts = sequential(url, prompts, args.max_tokens)
            cpu.append(server_cpu(server.pid))
            conc_s, conc_texts = concurrent(url, prompts, args.max_tokens)
            cpu.append(server_cpu(server.pid))
            if seq_texts != conc_texts or (reference is not None and seq_texts != reference):
                raise SystemExit("the concurrent texts differ from the sequential ones")
            reference = seq_texts
            best_seq, best_conc = min(best_seq, seq_s), min(best_conc, conc_s)
            (l0, e0), (l1, e1), (l2, e2) = cpu
            print(f"round {r + 1}: sequential {seq_s:.2f} s (server CPU: loop {l1 - l0:.2f} s, engine {e1 - e0:.2f} s), "
                  f"concurrent {conc_s:.2f} s (loop {l2 - l1:.2f} s, engine {e2 - e1:.2f} s): {seq_s / conc_s:.2f}x",
                  flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    print(f"{args.requests} requests x {args.max_tokens} tokens: sequential {best_seq:.2f} s, "
          f"concurrent {best_conc:.2f} s, concurrent {best_seq / best_conc:.2f}x sooner (best of {args.rounds})")
    if args.json:
        print(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens, "sequential_s": round(best_seq, 3),
                          "concurrent_s": round(best_conc, 3), "ratio": round(best_seq / best_conc, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
