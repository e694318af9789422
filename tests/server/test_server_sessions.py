"""Several conversations on one batched engine: concurrent streams, ``busy`` for one too many, a disconnect that
frees its slot and keeps what was recorded, ``/health`` and ``/metrics``."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client, load_frames
from websockets.exceptions import ConnectionClosed


async def wait_for(predicate, timeout: float = 60.0) -> None:
    """Poll ``predicate()`` until true (a safety timeout, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


@pytest.mark.timeout(300)
async def test_two_sessions_stream_concurrently_and_a_third_is_busy(serve, fixture_file) -> None:
    server = serve(max_sessions=2)
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))
    quiet = [0.5 * f for f in frames]  # the second speaker is quieter: the two streams differ
    assert server.hub.engine.batch_size == 2

    async with (
        websockets.connect(server.ws_url, max_size=None) as ws1,
        websockets.connect(server.ws_url, max_size=None) as ws2,
    ):
        c1, c2 = Client(ws1), Client(ws2)
        r1 = await c1.start(profile={"name": "Ann"})
        r2 = await c2.start(profile={"name": "Bob"})
        assert (r1["type"], r2["type"]) == ("ready", "ready")
        assert {r1["slot"], r2["slot"]} == {0, 1}
        assert r1["conversation_id"] != r2["conversation_id"]
        assert r1["profile"]["user_id"] == r2["profile"]["user_id"] == "local"  # no credentials: one local user
        assert httpx.get(server.url + "/health").json()["free_slots"] == 0

        async with websockets.connect(server.ws_url) as ws3:
            c3 = Client(ws3)
            busy = await c3.start()
            assert busy == {"type": "busy", "max_sessions": 2, "message": busy["message"]}
            with pytest.raises(ConnectionClosed) as info:
                await c3.recv()
            assert info.value.rcvd.code == 1013

        async def talk(client: Client, audio: list[np.ndarray]) -> dict:
            await client.stream(audio)
            return await client.stop()

        bye1, bye2 = await asyncio.gather(talk(c1, frames), talk(c2, quiet))

    for client, bye in ((c1, bye1), (c2, bye2)):
        stats = bye["stats"]
        assert stats["user_frames"] == stats["consumed_frames"] == len(frames)
        assert stats["dropped_frames"] == 0
        assert stats["frames"] == len(client.received.audio()) >= len(frames)
    await wait_for(lambda: httpx.get(server.url + "/health").json()["free_slots"] == 2)
    local = server.hub.db.user("local")
    assert {r1["conversation_id"], r2["conversation_id"]} <= {c.id for c in local.conversations()}
    assert local.get_profile().name in ("Ann", "Bob")  # the profile each session stored, the later one kept

    metrics = httpx.get(server.url + "/metrics").text
    assert 'cspan_sessions_started_total{protocol="cspan"} 2.0' in metrics
    assert 'cspan_sessions_busy_total{protocol="cspan"} 1.0' in metrics
    assert 'cspan_sessions_ended_total{protocol="cspan",reason="stop"} 2.0' in metrics
    assert f'cspan_user_frames_total{{protocol="cspan"}} {2.0 * len(frames)}' in metrics
    assert "cspan_step_seconds_count" in metrics


@pytest.mark.timeout(300)
async def test_disconnect_mid_conversation_frees_the_slot_and_keeps_the_record(
    serve, fixture_file, tmp_path: Path
) -> None:
    knowledge = tmp_path / "knowledge"
    knowledge.mkdir()
    (knowledge / "weather.md").write_text("The weather in London today is sunny and warm.\n")
    db_path = tmp_path / "context.sqlite"
    server = serve(asr="sphinx", router="local", knowledge=knowledge, db=str(db_path), span_deadline_s=60.0)
    frames = load_frames(fixture_file("audio", "question_weather_24k.wav"))

    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        ready = await client.start(profile={"name": "Ada"}, test={"force_ret_at": [4.0]})
        await client.stream(frames)
        seen: set[str] = set()

        def final_and_ret(kind: str, msg: dict) -> bool:  # in either order: the final transcript may follow the ret
            if kind == "json" and (msg["type"] == "ret" or (msg["type"] == "user_text" and msg["final"])):
                seen.add(msg["type"])
            return seen == {"ret", "user_text"}

        await client.recv_until(final_and_ret)
        # leave while the retrieval is in flight (or just landed): no stop, no goodbye
    await wait_for(lambda: server.hub.free_slots() == 1)

    from cspan.backends.context_db import ContextDB

    with ContextDB(db_path) as store:  # a second connection to the SQLite file: what was written is on disk
        db = store.user("local")
        # the session is finished off after its slot is freed (outstanding transcripts, then the end time)
        await wait_for(lambda: db.get_conversation(ready["conversation_id"]).ended_at is not None)
        turns = db.turns(ready["conversation_id"])
        assert any(t.role == "user" and "london" in t.text for t in turns)
        assert db.get_profile().name == "Ada"
    await wait_for(
        lambda: (
            'cspan_sessions_ended_total{protocol="cspan",reason="disconnect"} 1.0'
            in httpx.get(server.url + "/metrics").text
        )
    )

    # the freed slot serves the next conversation from a clean state
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        again = await client.start()
        assert again["type"] == "ready" and again["slot"] == ready["slot"]
        await client.stream(frames[:5])
        bye = await client.stop()
    assert bye["stats"]["consumed_frames"] == 5


@pytest.mark.timeout(120)
async def test_a_client_that_stops_reading_is_ended_as_slow_client(serve) -> None:
    """A client that stops reading its socket, with buffers large enough for everything sent meanwhile (the outbox
    stays short of its limit), is closed by the WebSocket keepalive (here a ping every 0.5 s, 0.5 s to answer):
    counted as ``slow_client``, not ``disconnect``. A client that reads, on the same keepalive, goes on."""
    server = serve(max_sessions=2, uvicorn={"ws_ping_interval": 0.5, "ws_ping_timeout": 0.5})
    silence = [np.zeros(1920, dtype=np.float32)] * 40  # 3.2 s
    async with (
        websockets.connect(server.ws_url, max_size=None) as reader,
        websockets.connect(server.ws_url, max_size=None, max_queue=1) as stuck,
    ):
        good = Client(reader)
        assert (await good.start())["type"] == "ready"
        assert (await Client(stuck).start())["type"] == "ready"

        async def not_reading() -> None:  # audio at the real-time pace; its library stops reading the socket
            with contextlib.suppress(ConnectionClosed):  # once the server closed it
                for frame in silence:
                    await stuck.send(frame.tobytes())
                    await asyncio.sleep(0.08)

        feeding = asyncio.ensure_future(not_reading())
        await good.stream(silence)  # sends and reads
        await feeding
        await wait_for(lambda: server.hub.free_slots() == 1, timeout=10)  # its outbox limit: 40 s at least
        bye = await good.stop()
    assert bye["reason"] == "stop" and bye["stats"]["dropped_frames"] == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'cspan_sessions_ended_total{protocol="cspan",reason="slow_client"} 1.0' in metrics
    assert 'cspan_sessions_ended_total{protocol="cspan",reason="stop"} 1.0' in metrics
    assert 'reason="disconnect"' not in metrics


def _sum(metrics: str, name: str) -> float:
    """The sum of ``name``'s samples over all its label sets in a Prometheus exposition (0 when it has none)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{"))


async def test_connections_that_never_reach_ready_are_not_counted_as_ended(serve) -> None:
    """``cspan_sessions_ended_total`` counts the sessions of ``cspan_sessions_started_total`` (those that reached
    ``ready``), so started minus ended is never negative: a refused token, a bad first message, a refused start are
    counted in ``cspan_auth_failures_total`` and ``cspan_sessions_unstarted_total`` (was: 3 ended for 1 started)."""
    token = "s3cret-token_0123"
    server = serve(token=token)
    auth = {"Authorization": f"Bearer {token}"}
    async with websockets.connect(server.ws_url + "?token=wrong-token-000") as ws:
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd.code == 4401
    async with websockets.connect(server.ws_url, additional_headers=auth) as ws:  # a bad first message, then gone
        await ws.send("not json")
        assert (await Client(ws).recv_until(lambda k, m: k == "json"))[1]["code"] == "bad_json"
    async with websockets.connect(server.ws_url, additional_headers=auth) as ws:  # a refused start, then stop
        client = Client(ws)
        assert (await client.start(seed=-1))["code"] == "invalid_message"
        assert (await client.stop())["reason"] == "stop"
    async with websockets.connect(server.ws_url, additional_headers=auth, max_size=None) as ws:
        client = Client(ws)
        assert (await client.start())["type"] == "ready"
        assert (await client.stop())["reason"] == "stop"

    def scraped() -> str:
        return httpx.get(server.url + "/metrics", headers=auth).text

    await wait_for(lambda: _sum(scraped(), "cspan_sessions_unstarted_total") == 2)  # the disconnect ends off-loop
    metrics = scraped()
    assert 'cspan_auth_failures_total{protocol="cspan",reason="token"} 1.0' in metrics
    assert 'cspan_sessions_unstarted_total{protocol="cspan",reason="disconnect"} 1.0' in metrics
    assert 'cspan_sessions_unstarted_total{protocol="cspan",reason="stop"} 1.0' in metrics
    assert 'cspan_sessions_started_total{protocol="cspan"} 1.0' in metrics
    assert 'cspan_sessions_ended_total{protocol="cspan",reason="stop"} 1.0' in metrics
    assert _sum(metrics, "cspan_sessions_ended_total") == _sum(metrics, "cspan_sessions_started_total") == 1


class _Transcriber:
    """Hears the same question in any audio."""

    async def transcribe(self, pcm: np.ndarray, sample_rate: int) -> str:
        return "what is the weather in leeds"


class _BlockingRouter:
    """A router that never answers: ``entered`` is set once a request reaches it, ``cancelled`` once it is cut."""

    def __init__(self) -> None:
        self.entered, self.cancelled = threading.Event(), threading.Event()

    async def route(self, request: object) -> object:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


def _serve_with_a_blocking_router(serve, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A server whose retriever hears one question and whose router never answers, recording in a SQLite Context
    DB: (server, router, the database's path)."""
    from cspan.backends.retriever import Retriever

    router = _BlockingRouter()
    db_path = tmp_path / "context.sqlite"
    server = serve(
        transcriber=_Transcriber(),
        retriever=Retriever(_Transcriber(), router, None),
        db=str(db_path),
        span_deadline_s=60.0,
    )
    return server, router, db_path


async def _spans_once_ended(db_path: Path, conversation_id: str) -> tuple[list, float]:
    """The conversation's span rows once its end time is written, and that time."""
    from cspan.backends.context_db import ContextDB

    with ContextDB(db_path) as store:
        db = store.user("local")
        await wait_for(lambda: db.get_conversation(conversation_id).ended_at is not None)
        return db.spans(conversation_id), db.get_conversation(conversation_id).ended_at


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["stop", "disconnect"])
async def test_a_retrieval_cut_by_the_end_of_its_session_is_recorded_as_cancelled(
    serve, tmp_path: Path, ending: str
) -> None:
    """A retrieval still waiting for its router when the session ends (the client stops, or leaves) is cancelled
    and leaves its span row, dropped ``cancelled`` with the step and the reason, before the conversation's end time
    (was: no row at all); the client that stopped gets its ``no_span``, and no backend failure is counted."""
    server, router, db_path = _serve_with_a_blocking_router(serve, tmp_path)
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        ready = await client.start(test={"force_ret_at": [0.4]})
        await client.stream([np.zeros(1920, dtype=np.float32)] * 10)
        await wait_for(router.entered.is_set)
        if ending == "stop":
            bye = await client.stop()
            assert bye["reason"] == "stop"
            cut = client.received.json("no_span")
            assert [(m["question"], m["error"]) for m in cut] == [(None, "conversation ended")]
    await wait_for(lambda: server.hub.free_slots() == 1)
    await wait_for(router.cancelled.is_set)  # the slot is released first, then the conversation finishes

    spans, _ = await _spans_once_ended(db_path, ready["conversation_id"])
    assert [(s.question, s.text, s.dropped, s.error) for s in spans] == [
        ("what is the weather in leeds", None, "cancelled", "cancelled in the router step: conversation ended")
    ]
    assert spans[0].latency_s > 0 and spans[0].injected_at is None
    metrics = httpx.get(server.url + "/metrics").text
    assert 'cspan_spans_total{outcome="cancelled"} 1.0' in metrics  # the metric says what the span row says
    assert 'cspan_spans_total{outcome="no_span"} 0.0' in metrics
    assert "cspan_backend_errors_total{" not in metrics


@pytest.mark.timeout(120)
async def test_a_ret_waiting_for_the_users_utterance_when_the_session_ends_is_recorded_as_cancelled(
    serve, fixture_file, tmp_path: Path
) -> None:
    """A ``<ret>`` that came while the user spoke waits for the utterance to end (plan ``wait``): the retriever is
    not asked yet. A ``stop`` then gives its ``no_span`` and leaves its span row, dropped ``cancelled`` in the asr
    step, the question not known (was: no row, though the metric counted it cancelled)."""
    server, router, db_path = _serve_with_a_blocking_router(serve, tmp_path)
    speech = load_frames(fixture_file("audio", "question_weather_24k.wav"))[:15]  # 1.2 s, the user still speaks
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        ready = await client.start(test={"force_ret_at": [0.8]})
        await client.stream(speech)
        bye = await client.stop()
        assert bye["reason"] == "stop"
        assert [m["plan"] for m in client.received.json("ret")] == ["wait"]
        cut = client.received.json("no_span")
        assert [(m["question"], m["error"]) for m in cut] == [(None, "conversation ended")]
    assert not router.entered.is_set()

    spans, ended_at = await _spans_once_ended(db_path, ready["conversation_id"])
    assert [(s.question, s.text, s.dropped, s.error) for s in spans] == [
        ("", None, "cancelled", "cancelled in the asr step: conversation ended")
    ]
    assert spans[0].latency_s > 0 and spans[0].asked_at <= ended_at
    metrics = httpx.get(server.url + "/metrics").text
    assert 'cspan_spans_total{outcome="cancelled"} 1.0' in metrics


def test_a_reference_ready_but_not_read_at_the_end_is_recorded_as_cancelled(tmp_path: Path) -> None:
    """The end's ``no_span`` of a retrieval whose reference had come but was not read yet carries its id: the row,
    written by the retriever as if about to be injected, is marked dropped ``cancelled``; a ``no_span`` of a retrieval
    that found nothing leaves its row as the retriever wrote it."""
    from cspan.backends.context_db import ContextDB
    from cspan.core.events import CONVERSATION_ENDED, NoSpanEvent
    from cspan.server.records import db_recorder

    with ContextDB(tmp_path / "context.sqlite") as store:
        db = store.user("local")
        cid = db.start_conversation()
        ready = db.add_span(cid, question="q1", text="The answer is 42.")
        empty = db.add_span(cid, question="q2", text=None, dropped="no_span")
        record = db_recorder(db, cid)
        record(NoSpanEvent(frame=9, t=0.72, question="q2", retrieval_id=empty))
        record(NoSpanEvent(frame=9, t=0.72, question="q1", error=CONVERSATION_ENDED, retrieval_id=ready))
        spans = db.spans(cid)
        assert [(s.text, s.dropped, s.error) for s in spans] == [
            ("The answer is 42.", "cancelled", CONVERSATION_ENDED),
            (None, "no_span", None),
        ]


async def test_health_info_page_and_static_files(serve) -> None:
    server = serve(max_sessions=1)
    async with httpx.AsyncClient(base_url=server.url) as http:
        health = (await http.get("/health")).json()
        assert health == {
            "status": "ok",
            "model": health["model"],
            "sample_rate": 24000,
            "frame_size": 1920,
            "max_sessions": 1,
            "free_slots": 1,
            "protocol_version": 1,
        }
        for path in ("/health", "/"):  # HEAD, as some balancers check: the status and headers, no body
            head = await http.head(path)
            assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
        info = (await http.get("/info")).json()
        assert info["voices"] == ["tiny0", "tiny1"] and info["default_voice"] == "tiny0"
        assert info["token_required"] is False
        page = await http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="start"' in page.text and 'src="static/app.js"' in page.text  # relative: works under a prefix
        assert "content-security-policy" in page.headers
        for name in ("app.js", "ogg-opus.js", "mic-worklet.js", "player-worklet.js", "style.css"):
            r = await http.get(f"/static/{name}")
            assert r.status_code == 200 and len(r.content) > 100, name
        assert (await http.get("/static/serve.py")).status_code == 404
        assert (await http.get("/static/..%2Fserve.py")).status_code == 404
        for path in ("/openapi.json", "/docs", "/redoc"):  # only the routes of docs/PROTOCOL.md, no schema pages
            assert (await http.get(path)).status_code == 404, path
        for path in ("/info/", "/health/"):  # no redirect to an absolute URL (behind a proxy: out of its prefix)
            answer = await http.get(path)
            assert answer.status_code == 404 and "location" not in answer.headers, path
        metrics = await http.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        assert "cspan_session_slots 1.0" in metrics.text


@pytest.mark.timeout(300)
async def test_start_sampling_is_the_sessions_own(serve) -> None:
    """``start.sampling`` gives the session its own temperatures and top-k (``ready.sampling`` says what is in
    effect, the server's defaults for what was not given); the engine row samples with them; bad values get
    ``invalid_message`` naming the field."""
    server = serve()
    engine = server.hub.engine
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        bad = await client.start(sampling={"audio_topk": 501})
        assert bad["type"] == "error" and bad["code"] == "invalid_message" and "audio_topk" in bad["message"]
        ready = await client.start(sampling={"text_temperature": 0, "audio_topk": 7})
        assert ready["type"] == "ready"
        assert ready["sampling"] == {
            "text_temperature": 0.0,
            "text_topk": engine.text_params.top_k,
            "audio_temperature": engine.audio_params.temperature,
            "audio_topk": 7,
        }
        own = engine.sampling[ready["slot"]]
        assert (own.text.temperature, own.audio.top_k) == (0.0, 7)
        await client.stop()


def test_clients_see_a_local_checkpoint_by_its_name_only(tmp_path: Path) -> None:
    """``/health`` needs no token and a Realtime session reports its ``model``: a local checkpoint is named without
    the folders above it (the server's file system is nobody's business); a Hub repo id stays as it is."""
    from cspan.server.session import public_model_name

    folder = tmp_path / "models" / "ft-2026-12"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"")
    assert public_model_name(str(folder)) == "ft-2026-12"
    assert public_model_name(str(folder / "model.safetensors")) == "model.safetensors"
    assert public_model_name("nvidia/personaplex-7b-v1") == "nvidia/personaplex-7b-v1"
    assert public_model_name("default") == "default"


async def test_a_prompt_too_long_in_tokens_is_told_to_the_client_without_a_server_error(serve, caplog) -> None:
    """A text prompt within ``--max-text-prompt-chars`` whose characters take several tokens each (emoji) can fill
    the model's window: the client gets ``persona_failed`` saying so and what to shorten, the server logs it at INFO
    without a traceback (was: the engine's ValueError quoted, policy advice for the operator, an ERROR with its
    traceback), and a shorter prompt starts."""
    import logging

    server = serve(max_text_prompt_chars=4000)
    caplog.set_level(logging.INFO, logger="cspan.server.session")
    async with websockets.connect(server.ws_url, max_size=None) as ws:
        client = Client(ws)
        refused = await client.start(text_prompt="\U0001f600" * 1000)
        assert refused["type"] == "error" and refused["code"] == "persona_failed", refused
        assert re.fullmatch(
            r"the persona takes \d+ of the model's \d+ positions and leaves no room to talk: shorten the text prompt "
            r"\(an emoji or a rare character takes several tokens\) or the voice",
            refused["message"],
        ), refused["message"]
        assert (await client.start(text_prompt="Be brief."))["type"] == "ready"
        assert (await client.stop())["reason"] == "stop"
    records = [r for r in caplog.records if r.name == "cspan.server.session" and "persona" in r.getMessage()]
    assert [r.levelname for r in records] == ["INFO"] and records[0].exc_info is None
