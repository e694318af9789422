"""Fixtures of the server tests: the tiny checkpoint, a real uvicorn server on 127.0.0.1, a protocol client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_client import ServerThread


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoint_dir: Path) -> Any:
    """The tiny checkpoint loaded once on the CPU in float32 (shared by the servers of all tests)."""
    import torch

    from cspan.core.checkpoint import load_checkpoint

    return load_checkpoint(tiny_checkpoint_dir, device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture
def serve(tiny_checkpoint: Any) -> Iterator[Callable[..., ServerThread]]:
    """``serve(**settings)`` -> a started :class:`ServerThread` on the tiny checkpoint (stopped after the test).

    Keyword arguments are :class:`~cspan.server.serve_settings.ServeSettings` fields, plus ``transcriber`` / ``retriever``
    to pass to ``create_app`` and ``uvicorn`` (a dict of uvicorn settings, :class:`ServerThread`). Defaults: no ASR, no router, test hooks on, one session, a short persona, a Context DB
    in memory, and a queue bound of 20 s (a test asserting that no frame is dropped must not depend on how fast this
    machine is; the bound itself is tested with a small one).
    """
    from cspan.server.serve import ServeSettings, create_app

    started: list[ServerThread] = []

    def make(**kwargs: Any) -> ServerThread:
        app_kwargs = {k: kwargs.pop(k) for k in ("transcriber", "retriever") if k in kwargs}
        uvicorn = kwargs.pop("uvicorn", {})
        defaults: dict[str, Any] = {
            "asr": "none",
            "router": "none",
            "test_hooks": True,
            "max_sessions": 1,
            "text_prompt": "You are a helpful assistant.",
            "max_queued_frames": 250,
            "db": ":memory:",
        }
        settings = ServeSettings(**{**defaults, **kwargs})
        app = create_app(settings, checkpoint=tiny_checkpoint, **app_kwargs)
        server = ServerThread(app, settings, **uvicorn).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def stub_llm() -> Iterator[Any]:
    """The scripted chat-completions server of the router tests (``tests/backends/router_stub.py``), one per test
    module."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "backends" / "router_stub.py"
    spec = importlib.util.spec_from_file_location("router_stub", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    stub = module.StubLLM().start()
    yield stub
    stub.stop()
