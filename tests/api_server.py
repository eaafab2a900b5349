"""An in-process server (uvicorn on a thread) over a real tiny LLM, for the API tests: it starts
in about a second and leaves nothing behind, unlike the `blockspec serve` subprocesses of
test_server.py."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from blockspec.llm import LLM
from blockspec.server.app import ServerSettings, create_app
from servers import free_port, wait_until


class LiveServer:
    """`create_app` over a loaded LLM, served by uvicorn on a daemon thread."""

    def __init__(self, llm: Any, name: str, **settings: Any) -> None:
        import uvicorn
        self.name, self.llm = name, llm
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(llm, ServerSettings(model=f"/models/{name}", served_model_name=name, **settings))
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        assert wait_until(lambda: self.server.started)
        assert wait_until(lambda: httpx.get(self.url + "/health").status_code == 200)
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def post(self, path: str, body: dict, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120, **kwargs)

    def chat(self, messages: list[dict], **fields: Any) -> dict:
        body = {"model": self.name, "messages": messages, "temperature": 0, "max_tokens": 8, **fields}
        response = self.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        return response.json()

    def complete(self, prompt: Any, **fields: Any) -> dict:
        body = {"model": self.name, "prompt": prompt, "temperature": 0, "max_tokens": 8, **fields}
        response = self.post("/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()

    def stream(self, path: str, body: dict) -> list:
        """Every SSE payload (dicts; "[DONE]" last for the chat/completions routes)."""
        events = []
        with httpx.stream("POST", self.url + path, json={"model": self.name, **body, "stream": True},
                          timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
        return events


def load_llm(target: Path, draft: Path | None = None, **kwargs: Any) -> LLM:
    return LLM(str(target), draft=str(draft) if draft else None, device="cpu", show_progress=False,
               max_model_len=kwargs.pop("max_model_len", 512), **kwargs)


def assert_error(response: httpx.Response, status: int, param_or_word: str | None = None) -> dict:
    """An OpenAI error object; its message names `param_or_word` when given."""
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    if param_or_word is not None:
        assert param_or_word in error["message"], error
    return error
