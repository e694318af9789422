"""``/metrics`` counts what happened: the hub's event counters on a real ``Conversation`` and ``ServerMetrics``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from prometheus_client import generate_latest

from cspan.core.constants import RET
from cspan.core.events import CONVERSATION_ENDED, NoSpanEvent
from cspan.core.runtime import Conversation, ConversationConfig
from cspan.server.metrics import ServerMetrics
from cspan.server.session import SessionHub


class _Engine:
    def inject_span(self, session: int, text: str) -> None:
        raise AssertionError("no span is injected here")


class _SilentVAD:
    def is_voiced(self, frame: np.ndarray) -> bool:
        return False

    def reset(self) -> None:
        pass


class _Retriever:
    """A router that answers after ``delay_s``, or fails at once."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.delay_s, self.fail = delay_s, fail

    async def retrieve(self, **kw):
        if self.fail:
            raise ConnectionError("router down")
        await asyncio.sleep(self.delay_s)
        return SimpleNamespace(question="q", reference="r", error=None, late=False)


def _counted(retriever: _Retriever, frames: int) -> tuple[list[NoSpanEvent], str]:
    """Run a conversation that says ``<ret>`` at frame 2 for ``frames`` frames, then ends; the hub counts each event
    as ``cspan serve`` does. Returns the ``no_span`` events and the metrics' exposition."""
    metrics = ServerMetrics(1)
    hub = SimpleNamespace(metrics=metrics)
    events = []
    conv = Conversation(
        _Engine(),
        0,
        retriever=retriever,
        config=ConversationConfig(span_deadline_s=None),
        vad=_SilentVAD(),
        on_event=events.append,
    )

    async def go() -> None:
        for i in range(frames):
            await conv.before_step(np.zeros(1920, dtype=np.float32))
            await conv.after_step(RET if i == 2 else 3, i == 2)
            await asyncio.sleep(0.01)
        await conv.finish()

    asyncio.run(go())
    for event in events:
        SessionHub.observe_event(hub, SimpleNamespace(stats=None), event)  # type: ignore[arg-type]
    return [e for e in events if isinstance(e, NoSpanEvent)], generate_latest(metrics.registry).decode()


def test_a_retrieval_cut_by_the_end_of_its_conversation_is_no_backend_error():
    """A client that stops or leaves while a retrieval runs (the soak's injected disconnects did) ends it as
    ``no_span`` with :data:`CONVERSATION_ENDED`: counted as a ``cancelled`` outcome, as its span row is dropped, and
    not as a backend failure (was: ``cspan_backend_errors_total{stage="retrieval"}`` rose with every such
    disconnect); a router that fails still counts."""
    cut, text = _counted(_Retriever(delay_s=60.0), frames=6)
    assert [e.error for e in cut] == [CONVERSATION_ENDED]
    assert 'cspan_spans_total{outcome="cancelled"} 1.0' in text  # as its span row is dropped
    assert 'cspan_spans_total{outcome="no_span"} 0.0' in text
    assert "cspan_backend_errors_total{" not in text

    failed, text = _counted(_Retriever(fail=True), frames=6)
    assert [e.error for e in failed] == ["ConnectionError: router down"]
    assert 'cspan_backend_errors_total{stage="retrieval"} 1.0' in text
