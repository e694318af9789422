"""Fixtures of the benchmark tests: a tiny checkpoint built once per session, one torch thread, a fake LLM server."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the models are tiny and the CI machine has two shared cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def v1_dir(fixtures_dir: Path) -> Path:
    """The Full-Duplex-Bench v1 fixture (read-only input: copy it before writing next to it)."""
    path = fixtures_dir / "fdb-v1"
    if not path.is_dir():
        pytest.skip(f"fixture not found: {path}")
    return path


def run_cli(*argv: str) -> int:
    """``cspan ARGV...`` in this process (the real entry point); returns its exit status."""
    from cspan.core.cli import main

    return main(list(argv))


@pytest.fixture
def cli() -> Callable[..., int]:
    return run_cli


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class FakeChatServer:
    """An OpenAI-compatible ``/v1/chat/completions`` server on 127.0.0.1 (uvicorn in a thread) that answers the
    scripted replies in order (the last one repeats), or what ``replies(request_body)`` returns, and keeps every
    request body."""

    replies: list[dict[str, Any]] | Callable[[dict[str, Any]], dict[str, Any]]
    requests: list[dict[str, Any]] = field(default_factory=list)
    port: int = 0

    def reply_to(self, body: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(body)
        if callable(self.replies):
            return self.replies(body)
        return self.replies[min(len(self.requests), len(self.replies)) - 1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture
def tool_call_message() -> Callable[[str, dict[str, Any]], dict[str, Any]]:
    """``tool_call_message(name, arguments)`` -> an assistant message calling one tool (OpenAI format)."""
    return _tool_call


def _tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        ],
    }


@pytest.fixture
def fake_chat_server() -> Iterator[Callable[..., FakeChatServer]]:
    """``fake_chat_server([message, ...])`` starts a server replying those assistant messages in order;
    ``fake_chat_server(fn)`` one replying ``fn(request_body)``."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(replies: list[dict[str, Any]] | Callable[[dict[str, Any]], dict[str, Any]]) -> FakeChatServer:
        fake = FakeChatServer(replies=replies if callable(replies) else list(replies), port=free_port())
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> dict[str, Any]:
            body = await request.json()
            message = fake.reply_to(body)
            return {
                "id": f"chatcmpl-{len(fake.requests)}",
                "object": "chat.completion",
                "model": body.get("model", ""),
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }

        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=fake.port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("fake chat server did not start")
            time.sleep(0.05)
        servers.append((server, thread))
        return fake

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
