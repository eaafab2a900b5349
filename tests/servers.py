"""Real `blockspec serve` subprocesses for the end-to-end tests (test_server, test_reliability,
test_soak): loopback only, the log in a file."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from blockspec.server.app import ServerSettings, create_app

MAX_BODY_BYTES = 64 * 1024
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m blockspec.cli serve …` in a subprocess, its log in a file."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "blockspec.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), "--max-body-bytes", str(MAX_BODY_BYTES), *args]
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.startup_answers: list[tuple[int, dict]] = []  # /health answers before ready

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited early:\n{self.log()}"
            try:
                response = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if response.status_code == 200:
                return
            self.startup_answers.append((response.status_code, response.json()))
            time.sleep(0.05)
        raise AssertionError(f"server not ready in {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def wait_until(condition, timeout: float = 20.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()


class InProcessServer:
    """uvicorn on a thread of this process, over an app built from `llm_factory` (a loaded or
    scripted LLM)."""

    def __init__(self, llm_factory, settings: ServerSettings, send_buffer: int | None = None) -> None:
        """send_buffer: SO_SNDBUF of the listening socket (its connections inherit it), so a
        client that stops reading blocks the server's writes after a few KiB."""
        import uvicorn
        self.socket = socket.socket()
        if send_buffer is not None:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(llm_factory, settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        assert wait_until(lambda: self.server.started, timeout=20)
        return self

    def __exit__(self, *_) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.socket.close()
