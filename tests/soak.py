"""The soak (issue 14): many clients at once against a real server, every answer checked.

`run_soak(url, model, num_requests)` sends a seeded mix through `clients` concurrent threads:
chat and completions, streamed and not; 20 % of the streams hung up after 1–3 chunks; 10 % of
all requests malformed bodies of BAD_BODIES' kinds (each must be a 4xx OpenAI error object
within BAD_BODY_DEADLINE_S); every other answer is greedy or seeded, so it must equal its
reference, taken first one request at a time. After the mix: the running gauge back to 0,
/health 200, one more request answered within FINAL_DEADLINE_S, and the server's RSS growth
(warm, after the references, to after the mix) reported for the caller to bound.
Loopback only; used by tests/test_soak.py (a short run in CI, 500 requests behind -m soak).
"""
from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

CLIENTS = 8
HANGUP_SHARE = 0.2                # of the streams
BAD_SHARE = 0.1                   # of all requests
BAD_BODY_DEADLINE_S = 5.0
FINAL_DEADLINE_S = 5.0
MAX_BODY_BYTES = 64 * 1024         # the server under test runs with --max-body-bytes of this

HELLO = [{"role": "user", "content": "Hello"}]
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"

# (path, body: dict | list | bytes, expected status): 36 kinds of malformed request.
BAD_BODIES: dict[str, tuple[str, object, int]] = {
    "malformed json": (CHAT, b'{"messages": [', 400),
    "empty body": (CHAT, b"", 400),
    "binary garbage": (CHAT, b"\xff\xfe\x00\x01garbage", 400),
    "not an object": (CHAT, [1, 2], 400),
    "json null": (CHAT, b"null", 400),
    "NaN": (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400),
    "deep nesting": (CHAT, b"[" * 50_000, 400),
    "no messages": (CHAT, {"max_tokens": 4}, 400),
    "empty messages": (CHAT, {"messages": []}, 400),
    "messages a string": (CHAT, {"messages": "hello"}, 400),
    "message null": (CHAT, {"messages": [None]}, 400),
    "bad role": (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    "content an int": (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400),
    "max_tokens 0": (CHAT, {"messages": HELLO, "max_tokens": 0}, 400),
    "max_tokens text": (CHAT, {"messages": HELLO, "max_tokens": "many"}, 400),
    "max_tokens 10**9": (CHAT, {"messages": HELLO, "max_tokens": 10**9}, 400),
    "max_tokens 2**40": (CHAT, {"messages": HELLO, "max_tokens": 2**40}, 400),
    "temperature 3": (CHAT, {"messages": HELLO, "temperature": 3}, 400),
    "top_p 0": (CHAT, {"messages": HELLO, "top_p": 0}, 400),
    "top_k 10**23": (CHAT, {"messages": HELLO, "top_k": 10**23}, 400),
    "stop an int": (CHAT, {"messages": HELLO, "stop": 5}, 400),
    "n 0": (CHAT, {"messages": HELLO, "n": 0}, 400),
    "seed 2**70": (CHAT, {"messages": HELLO, "seed": 2**70}, 400),
    "stop_token_ids 10**23": (CHAT, {"messages": HELLO, "stop_token_ids": [10**23]}, 400),
    "tools not a list": (CHAT, {"messages": HELLO, "tools": "get_weather"}, 400),
    "template kwargs a list": (CHAT, {"messages": HELLO, "chat_template_kwargs": [1]}, 400),
    "bad tool arguments": (CHAT, {"messages": [*HELLO, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400),
    "prompt too long": (CHAT, {"messages": [{"role": "user", "content": "hello " * 5000}]}, 400),
    "unknown model": (CHAT, {"model": "gpt-17", "messages": HELLO}, 404),
    "body too large": (CHAT, {"messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}, 413),
    "completion: no prompt": (COMPLETION, {"max_tokens": 2}, 400),
    "completion: empty prompt": (COMPLETION, {"prompt": ""}, 400),
    "completion: token outside vocabulary": (COMPLETION, {"prompt": [1, 10**9]}, 400),
    "completion: mixed prompt list": (COMPLETION, {"prompt": ["a", [1, 2]]}, 400),
    "completion: echo with logprobs": (COMPLETION, {"prompt": "a", "echo": True, "logprobs": 2}, 400),
    "completion: max_tokens beyond the context": (COMPLETION, {"prompt": "a", "max_tokens": 10**9}, 400),
}

CHAT_PROMPTS = ["What is 2 + 2?", "Name three colours.", "Why is the sky blue?"]
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
MAX_TOKENS = (4, 14)
WARMUP = 2 * CLIENTS             # requests of the mix run before the RSS baseline (buffers of a full batch)
SEEDS = (None, None, None, 7)     # a quarter of the answers are seeded samples (temperature 0.8)


@dataclass(frozen=True)
class Good:
    """A request with one right answer: greedy, or seeded."""
    path: str
    prompt: str
    max_tokens: int
    seed: int | None

    def body(self, model: str) -> dict:
        body: dict = {"model": model, "max_tokens": self.max_tokens, "temperature": 0.0 if self.seed is None else 0.8}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.path == CHAT:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


@dataclass(frozen=True)
class Job:
    kind: str                       # "plain" | "stream" | "hangup" | "bad"
    good: Good | None = None
    bad: str | None = None
    hangup_after: int = 0


@dataclass
class SoakReport:
    num_requests: int = 0
    answered: int = 0               # complete answers compared with their reference
    mismatches: list = field(default_factory=list)
    hangups: int = 0
    bad_bodies: int = 0
    bad_kinds: set = field(default_factory=set)
    wrong_bad_answers: list = field(default_factory=list)
    max_bad_latency_s: float = 0.0
    server_errors: list = field(default_factory=list)       # any 5xx, or a transport failure
    duration_s: float = 0.0
    running_after: float | None = None
    health_after: int | None = None
    final_latency_s: float | None = None
    final_ok: bool = False
    rss_before: int = 0
    rss_after: int = 0
    rss_samples: list = field(default_factory=list)         # MiB after each quarter of the mix

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_after - self.rss_before) / 2**20

    def failures(self, max_rss_growth_mib: float) -> list[str]:
        """Every pass condition that does not hold, in words (empty: the soak passed)."""
        problems = []
        if self.server_errors:
            problems.append(f"5xx or transport failures: {self.server_errors[:5]}")
        if self.mismatches:
            problems.append(f"answers unlike their reference: {self.mismatches[:3]}")
        if self.wrong_bad_answers:
            problems.append(f"malformed bodies not answered with their 4xx error: {self.wrong_bad_answers[:5]}")
        if self.max_bad_latency_s > BAD_BODY_DEADLINE_S:
            problems.append(f"a malformed body took {self.max_bad_latency_s:.1f} s")
        if self.running_after != 0:
            problems.append(f"running gauge after the soak: {self.running_after}")
        if self.health_after != 200:
            problems.append(f"/health after the soak: {self.health_after}")
        if not self.final_ok or (self.final_latency_s or 1e9) > FINAL_DEADLINE_S:
            problems.append(f"the request after the soak: ok={self.final_ok}, {self.final_latency_s} s")
        if self.rss_growth_mib > max_rss_growth_mib:
            problems.append(f"RSS grew {self.rss_growth_mib:.1f} MiB (bound {max_rss_growth_mib})")
        return problems

    def summary(self) -> str:
        return (f"{self.num_requests} requests in {self.duration_s:.1f} s ({CLIENTS} clients): "
                f"{self.answered} answers equal to their reference, {len(self.mismatches)} mismatches; "
                f"{self.hangups} streams hung up; {self.bad_bodies} malformed bodies of {len(self.bad_kinds)} "
                f"kinds, all 4xx: {not self.wrong_bad_answers}, slowest {self.max_bad_latency_s * 1000:.0f} ms; "
                f"5xx/transport failures: {len(self.server_errors)}; running after: {self.running_after}; "
                f"next request: {self.final_latency_s:.2f} s; RSS {self.rss_before / 2**20:.0f} → "
                f"{self.rss_after / 2**20:.0f} MiB ({self.rss_growth_mib:+.1f} MiB; by quarter {self.rss_samples})")


def make_jobs(num_requests: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    bad_kinds = list(BAD_BODIES)
    rng.shuffle(bad_kinds)
    jobs = []
    for i in range(num_requests):
        if rng.random() < BAD_SHARE:
            jobs.append(Job("bad", bad=bad_kinds[len([j for j in jobs if j.kind == "bad"]) % len(bad_kinds)]))
            continue
        path = rng.choice((CHAT, COMPLETION))
        prompt = rng.choice(CHAT_PROMPTS if path == CHAT else COMPLETION_PROMPTS)
        good = Good(path, prompt, rng.choice(MAX_TOKENS), rng.choice(SEEDS))
        if rng.random() < 0.5:
            jobs.append(Job("plain", good))
        elif rng.random() < HANGUP_SHARE:
            jobs.append(Job("hangup", good, hangup_after=rng.randint(1, 3)))
        else:
            jobs.append(Job("stream", good))
    return jobs


def text_of(path: str, answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if path == CHAT else choice["text"]


class Soak:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.report = SoakReport()
        self.references: dict[Good, str] = {}
        self._lock = threading.Lock()

    def post(self, client: httpx.Client, path: str, body) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return client.post(self.url + path, content=content, headers={"Content-Type": "application/json"})

    def reference(self, client: httpx.Client, good: Good) -> str:
        response = self.post(client, good.path, good.body(self.model))
        if response.status_code != 200:
            raise AssertionError(f"reference request failed: {response.status_code} {response.text}")
        return text_of(good.path, response.json())

    def run_job(self, job: Job) -> None:
        with httpx.Client(timeout=120) as client:
            try:
                if job.kind == "bad":
                    self.send_bad(client, job.bad)
                elif job.kind == "plain":
                    response = self.post(client, job.good.path, job.good.body(self.model))
                    self.check_status(response, job)
                    if response.status_code == 200:
                        self.compare(job.good, text_of(job.good.path, response.json()))
                else:
                    self.stream(client, job)
            except (httpx.TransportError, AssertionError, ValueError, KeyError) as exc:
                with self._lock:
                    self.report.server_errors.append(f"{job.kind}: {type(exc).__name__}: {exc}")

    def check_status(self, response: httpx.Response, job: Job) -> None:
        if response.status_code != 200:
            with self._lock:
                self.report.server_errors.append(f"{job.kind} {job.good}: {response.status_code} {response.text[:200]}")

    def compare(self, good: Good, text: str) -> None:
        with self._lock:
            self.report.answered += 1
            if text != self.references[good]:
                self.report.mismatches.append((good, text, self.references[good]))

    def send_bad(self, client: httpx.Client, kind: str) -> None:
        path, body, status = BAD_BODIES[kind]
        start = time.perf_counter()
        response = self.post(client, path, body)
        seconds = time.perf_counter() - start
        error = response.json().get("error") if response.headers.get("content-type", "").startswith(
            "application/json") else None
        good = (response.status_code == status and isinstance(error, dict) and error.get("message")
                and {"type", "param", "code"} <= set(error))
        with self._lock:
            self.report.bad_bodies += 1
            self.report.bad_kinds.add(kind)
            self.report.max_bad_latency_s = max(self.report.max_bad_latency_s, seconds)
            if not good:
                self.report.wrong_bad_answers.append((kind, response.status_code, response.text[:200]))
            if response.status_code >= 500:
                self.report.server_errors.append(f"bad body {kind}: {response.status_code}")

    def stream(self, client: httpx.Client, job: Job) -> None:
        body = {**job.good.body(self.model), "stream": True}
        with client.stream("POST", self.url + job.good.path, json=body) as response:
            self.check_status(response, job)
            if response.status_code != 200:
                return
            pieces, chunks = [], 0
            for line in response.iter_lines():
                if not line:
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise AssertionError(f"error event: {event}")
                chunks += 1
                if job.kind == "hangup" and chunks >= job.hangup_after:
                    with self._lock:
                        self.report.hangups += 1
                    return                                   # leaving the block closes the connection
                for choice in event["choices"]:
                    pieces.append(choice["delta"].get("content") or "" if job.good.path == CHAT else choice["text"])
            else:
                raise AssertionError("the stream ended without [DONE]")
        self.compare(job.good, "".join(pieces))

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()


def run_soak(url: str, model: str, num_requests: int, seed: int = 0) -> SoakReport:
    soak = Soak(url, model)
    jobs = make_jobs(num_requests, seed)
    report = soak.report
    report.num_requests = num_requests
    final = Good(CHAT, CHAT_PROMPTS[0], MAX_TOKENS[0], None)           # the request after the mix
    with httpx.Client(timeout=120) as client:
        for good in sorted({final} | {job.good for job in jobs if job.good is not None}, key=repr):
            soak.references[good] = soak.reference(client, good)
    start = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(soak.run_job, jobs[:WARMUP]))
        report.rss_before = soak.health()["memory"]["rss_bytes"]
        rest = jobs[WARMUP:]
        for quarter in range(4):
            list(pool.map(soak.run_job, rest[quarter * len(rest) // 4: (quarter + 1) * len(rest) // 4]))
            report.rss_samples.append(round(soak.health()["memory"]["rss_bytes"] / 2**20))
    report.duration_s = time.perf_counter() - start
    deadline = time.monotonic() + 20
    while (running := soak.health()["running"]) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)                 # hung-up streams end within a cycle of their abort
    report.running_after = running
    report.health_after = httpx.get(url + "/health", timeout=10).status_code
    with httpx.Client(timeout=30) as client:
        started = time.perf_counter()
        response = soak.post(client, CHAT, final.body(model))
        report.final_latency_s = time.perf_counter() - started
        report.final_ok = response.status_code == 200 and text_of(CHAT, response.json()) == soak.references[final]
    report.rss_after = soak.health()["memory"]["rss_bytes"]
    return report
