"""Reliability (issue 14): SIGTERM drains a real server, faults cost only their own request, a
reader that stops never stalls the engine, templates run sandboxed, request sizes are bounded."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from servers import ServerProcess, wait_until

HELLO = [{"role": "user", "content": "Hello, who are you?"}]
LONG = 3000                  # tokens: far longer than any drain here


# ---------------------------------------------------------------------------------------------
# SIGTERM: stop admitting, drain, end the rest with an error event and [DONE], exit 0
# ---------------------------------------------------------------------------------------------


class StreamReader(threading.Thread):
    """Reads one streamed request to its end, noting each SSE line and when it came."""

    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.lines: list[tuple[float, str]] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self.first_line = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json={**self.body, "stream": True},
                              timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.lines.append((time.monotonic(), line))
                        self.first_line.set()
        except BaseException as exc:  # noqa: BLE001 - the test asserts there was none
            self.error = exc
        finally:
            self.first_line.set()

    @property
    def payloads(self) -> list:
        return [line[len("data: "):] if line == "data: [DONE]" else json.loads(line[len("data: "):])
                for _, line in self.lines]


def finish_reasons(payloads: list) -> list:
    return [c["choices"][0]["finish_reason"] for c in payloads
            if isinstance(c, dict) and c.get("choices") and c["choices"][0].get("finish_reason")]


DRAIN_S = 3.0


@pytest.fixture()
def draining_server(qwen3_dir, tmp_path):
    server = ServerProcess(tmp_path / "drain.log", "--model", str(qwen3_dir), "--max-num-seqs", "2",
                           "--shutdown-timeout", str(DRAIN_S))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_sigterm_drains_then_ends_every_open_request_with_done(draining_server):
    """Running: a long stream (outlives the drain) and a short one (finishes inside it); queued
    behind them: a long non-stream and a long stream. After SIGTERM a new request is a 503;
    the short stream ends normally; the rest end at the drain's end: streams with an abort
    chunk, an error event and [DONE], the non-stream with a 503 error object; exit 0, no traceback."""
    server = draining_server
    url = server.url

    def body(max_tokens: int) -> dict:
        return {"model": "qwen3", "messages": HELLO, "temperature": 0, "max_tokens": max_tokens}

    long_stream, short_stream = StreamReader(url, body(LONG)), StreamReader(url, body(150))
    long_stream.start()
    assert long_stream.first_line.wait(60)
    short_stream.start()
    assert short_stream.first_line.wait(60)
    assert wait_until(lambda: httpx.get(url + "/health").json()["running"] == 2)
    queued_stream = StreamReader(url, body(LONG))
    queued_stream.start()
    queued_answer: dict = {}
    queued = threading.Thread(target=lambda: queued_answer.update(response=httpx.post(
        url + "/v1/chat/completions", json=body(LONG), timeout=120)), daemon=True)
    queued.start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 2)

    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, timeout=5)
    refused = httpx.post(url + "/v1/chat/completions", json=body(4), timeout=10)
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"] == "1"

    for reader in (long_stream, short_stream, queued_stream):
        reader.join(60)
        assert not reader.is_alive() and reader.error is None and reader.status == 200
    queued.join(60)
    assert server.process.wait(30) == 0
    ended = time.monotonic()

    # the short stream finished inside the drain, with output written after the signal
    short = short_stream.payloads
    assert short[-1] == "[DONE]" and finish_reasons(short) == ["length"]
    assert any(t > signalled for t, _ in short_stream.lines)
    # the others ran into the drain's end: abort, then an error event, then [DONE]
    for reader in (long_stream, queued_stream):
        payloads = reader.payloads
        assert payloads[-1] == "[DONE]"
        assert finish_reasons(payloads) == ["abort"]
        assert payloads[-2]["error"]["code"] == 503 and "shut down" in payloads[-2]["error"]["message"]
        assert reader.lines[-1][0] - signalled >= DRAIN_S - 0.5     # not before the drain was over
    response = queued_answer["response"]
    assert response.status_code == 503 and "shut down" in response.json()["error"]["message"]
    assert ended - signalled < DRAIN_S + 15
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and "CancelledError" not in log and "Exception" not in log, log[-4000:]
