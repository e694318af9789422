"""``cspan bench serve``: load a running ``cspan serve`` with N real-time clients and report how it holds up.

Each client plays recordings (or silence) into one protocol of the server at the real-time pace of the audio (one
80 ms frame every 80 ms of the monotonic clock, whatever the server answers), for ``--seconds``, while it receives
everything the server sends. It can inject malformed messages and abrupt disconnects (the TCP connection dropped
without a close frame; the client then opens a new session) at set rates, drawn per frame from a seeded generator.

Protocols (``--protocol``): ``ws`` (``/ws``, float32 PCM frames), ``ws-opus`` (``/ws`` with Ogg/Opus both ways),
``moshi`` (``/api/chat``, Ogg/Opus) and ``realtime`` (``/v1/realtime``, base64 pcm16, with the ``cspan`` event
extension on).

What is measured, per session (one WebSocket connection that started a conversation):

- **frame lateness**: the arrival time of each agent frame (1920 samples of agent audio, counted after decoding)
  against the 80 ms clock, ``arrival_k - k * 80 ms - min_j(arrival_j - j * 80 ms)`` over a run of consecutive
  frames: 0 for the most punctual frame of the run, growing when the server or the network falls behind. On
  ``/ws`` and ``/api/chat`` the whole session is one run; on ``/v1/realtime`` agent audio is sent only inside
  responses, so each response is a run. Reported as p50, p99 and max in ms;
- **dropped frames**: user frames the server dropped because its queue was full (the session's final ``stats`` on
  ``/ws``; ``/api/chat`` and ``/v1/realtime`` only report them in ``/metrics``, summed in ``server``);
- **agent gaps**: agent frames that never came on ``/ws`` and ``/api/chat`` (the server's clock skipped ahead);
- spans, errors (answers to injected malformed messages counted apart), refusals (busy, 4401, a 1013 close: the slots, the Context DB or the user's connection limit) and how it ended.

A client whose session was refused, or failed (``ended`` ``error (...)``: the connection refused or reset, no
``ready``), waits :data:`RETRY_S` before the next; after failures in a row twice as long each time, up to
:data:`RETRY_MAX_S`. Identical failed attempts in a row are one record (``repeats``), so that a dead server does not
fill the report. The summary counts failed attempts (``session_errors``) beside the server's error answers
(``errors``); the command exits with status 1 when no session completed, or when the server stopped answering
(``/health`` after the run), saying why in one line (the report of what ran is written then).

Server side, every ``--sample-s``: the process's resident memory (``process_resident_memory_bytes`` of
``/metrics``, or ``/proc/PID/status`` with ``--server-pid``) and the live sessions (``cspan_sessions_active``);
and the difference of every ``cspan_*`` counter between the start and the end of the run.

Output: ``OUT/serve-load.json`` (:class:`LoadReport`) and ``OUT/serve-load.png`` (lateness per session, memory and
live sessions over time). The numbers are for comparing set-ups on the same machine: lateness depends on the
client's machine as much as on the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from cspan.core.constants import FRAME_S, FRAME_SIZE, SAMPLE_RATE

FRAMES_PER_MINUTE = 60.0 / FRAME_S
PROTOCOLS = ("ws", "ws-opus", "moshi", "realtime")
RETRY_S, RETRY_MAX_S = 1.0, 8.0
"""A refused or failed client's wait before its next session; failures in a row double it, up to the second."""

MALFORMED: dict[str, list[bytes | str]] = {
    "ws": ['{"type": "hello"}', "not json", b"\x00\x01\x02", '{"type": "context", "profile": {"lat": 500}}'],
    "ws-opus": ['{"type": "hello"}', "not json", b"OggS-not-a-page", '{"type": "stop", "now": true}'],
    "moshi": [b"\x07junk", "text is not allowed", b"\x01not ogg at all", b""],
    "realtime": ['{"type": "nope"}', "not json", '{"type": "input_audio_buffer.append", "audio": "@@@"}', b"\x00"],
}
"""What each protocol's client sends as a malformed message (one drawn at random each time)."""


class Lateness(BaseModel):
    """Agent frame lateness against the 80 ms clock, in ms (None without frames)."""

    p50: float | None = None
    p99: float | None = None
    max: float | None = None


class SessionRecord(BaseModel):
    """One session of one client."""

    client: int
    protocol: str
    started_s: float = Field(description="when the connection opened, seconds after the run began")
    duration_s: float = 0.0
    conversation_id: str | None = None
    frames_sent: int = 0
    agent_frames: int = 0
    lateness_ms: Lateness = Field(default_factory=Lateness)
    dropped_frames: int | None = Field(None, description="user frames the server dropped (None: not reported)")
    agent_gaps: int | None = Field(None, description="agent frames that never came (None: not measurable)")
    spans: int = 0
    errors: int = 0
    malformed_sent: int = 0
    ended: str = Field("", description="stop, disconnect (injected), closed (code reason), refused (why), error")
    repeats: int = Field(1, description="attempts this record stands for: identical failed ones in a row are folded")

    @property
    def failed(self) -> bool:
        """The session never got going or broke: the connection was refused or reset, or no ``ready`` came."""
        return self.ended.startswith("error")

    @property
    def refused(self) -> bool:
        return self.ended.startswith("refused")


class ServerSample(BaseModel):
    """The server at one moment."""

    t: float
    rss_bytes: float | None = None
    sessions_active: float | None = None


class LoadReport(BaseModel):
    """What ``cspan bench serve`` writes (``serve-load.json``)."""

    settings: dict[str, Any]
    sessions: list[SessionRecord]
    summary: dict[str, Any]
    server: dict[str, Any]


@dataclass
class LoadSettings:
    """The run (see ``cspan bench serve --help``)."""

    url: str
    protocol: str = "ws"
    clients: int = 4
    seconds: float = 30.0
    audio: list[Path] = field(default_factory=list)
    token: str | None = None
    malformed_per_min: float = 0.0
    disconnects_per_min: float = 0.0
    stagger_s: float = 0.25
    sample_s: float = 1.0
    server_pid: int | None = None
    cafile: Path | None = None
    seed: int = 0

    def ws_url(self, path: str) -> str:
        base = re.sub(r"^http", "ws", self.url.rstrip("/"))
        return base + path

    def ssl(self) -> Any:
        if not self.url.startswith("https"):
            return None
        import ssl

        return ssl.create_default_context(cafile=str(self.cafile) if self.cafile else None)


# --------------------------------------------------------------------------------------------- measurements


def lateness(arrivals: list[list[float]]) -> tuple[Lateness, list[float]]:
    """Per-frame lateness (ms) of runs of consecutive frames (arrival times in s), and its summary."""
    values: list[float] = []
    for run in arrivals:
        if not run:
            continue
        t = np.asarray(run, dtype=np.float64) - FRAME_S * np.arange(len(run))
        values.extend(((t - t.min()) * 1000.0).tolist())
    return Lateness(**_summary(values)), values


def parse_metrics(text: str) -> dict[str, float]:
    """``{"name{labels}": value}`` of a Prometheus text exposition (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def process_rss(pid: int) -> float | None:
    """Resident memory of process ``pid`` in bytes (Linux ``/proc``), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024.0
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------------------------- one client


class _Injected(Exception):
    """The client dropped its own connection (an injected disconnect)."""


@dataclass
class _Run:
    record: SessionRecord
    t0: float
    runs: list[list[float]] = field(default_factory=lambda: [[]])
    pending: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def frames(self, samples: int, now: float) -> None:
        """Count ``samples`` of agent audio that arrived at ``now``: every completed frame gets that time."""
        self.pending += samples
        while self.pending >= FRAME_SIZE:
            self.pending -= FRAME_SIZE
            self.runs[-1].append(now)
            self.record.agent_frames += 1

    def new_run(self) -> None:
        if self.runs[-1]:
            self.runs.append([])
        self.pending = 0


class Client:
    """One load client: sessions one after another until its time is up (see the module docstring)."""

    def __init__(self, index: int, settings: LoadSettings, frames: list[np.ndarray], epoch: float) -> None:
        self.index = index
        self.s = settings
        self.frames = frames
        self.epoch = epoch
        self.rng = random.Random(settings.seed * 1000003 + index)
        self.records: list[SessionRecord] = []
        self.lateness_values: list[float] = []
        self.cursor = self.rng.randrange(len(frames))  # clients do not all say the same thing at the same time

    async def run(self, deadline: float) -> None:
        failures = 0  # failed sessions in a row
        while time.monotonic() < deadline - 1.0:
            record = SessionRecord(
                client=self.index, protocol=self.s.protocol, started_s=round(time.monotonic() - self.epoch, 3)
            )
            self.records.append(record)
            run = _Run(record, time.monotonic())
            try:
                await self._session(run, deadline)
            except _Injected:
                record.ended = "disconnect"
            except Exception as exc:  # a refused handshake, a reset connection: recorded, the client goes on
                record.ended = record.ended or _describe_close(exc)
            record.duration_s = round(time.monotonic() - run.t0, 3)
            record.lateness_ms, values = lateness(run.runs)
            self.lateness_values.extend(values)
            if self.s.protocol in ("ws", "ws-opus", "moshi") and run.runs[0]:
                expected = round((run.runs[0][-1] - run.runs[0][0]) / FRAME_S) + 1
                record.agent_gaps = max(0, expected - len(run.runs[0]))
            failures = failures + 1 if record.failed else 0
            previous = self.records[-2] if len(self.records) > 1 else None
            if (
                previous is not None
                and (previous.failed or previous.refused)
                and previous.ended == record.ended
                and not (previous.frames_sent or record.frames_sent)
            ):
                previous.repeats += 1  # the same failure again: one record
                self.records.pop()
            if record.failed or record.refused:
                wait = min(RETRY_S * 2 ** max(0, failures - 1), RETRY_MAX_S)
                await asyncio.sleep(max(0.0, min(wait, deadline - 1.0 - time.monotonic())))

    async def _session(self, run: _Run, deadline: float) -> None:
        import websockets

        p = self.s.protocol
        path = {"ws": "/ws", "ws-opus": "/ws", "moshi": "/api/chat", "realtime": "/v1/realtime?model=cspan"}[p]
        url = self.s.ws_url(path)
        headers = {}
        if self.s.token:
            if p in ("realtime", "moshi"):
                headers["Authorization"] = f"Bearer {self.s.token}"
            else:
                url += f"?token={self.s.token}"
        async with websockets.connect(
            url, additional_headers=headers, max_size=None, ssl=self.s.ssl(), open_timeout=30
        ) as ws:
            codec = _Codec(p)
            receiver = asyncio.ensure_future(self._receive(ws, run, codec))
            try:
                await self._open(ws, run)
                if not run.ready.is_set():
                    return
                await self._play(ws, run, codec, deadline)
                await self._close(ws, run)
            finally:
                receiver.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await receiver

    async def _open(self, ws: Any, run: _Run) -> None:
        p = self.s.protocol
        if p in ("ws", "ws-opus"):
            start: dict[str, Any] = {"type": "start"}
            if p == "ws-opus":
                start["codecs"] = ["opus"]
            await ws.send(json.dumps(start))
        elif p == "realtime":
            update = {"type": "session.update", "session": {"type": "realtime", "cspan": {"events": True}}}
            await ws.send(json.dumps(update))
        # moshi starts at once (its persona comes from the query); realtime at the first audio
        if p == "realtime":
            run.ready.set()
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_first(run.ready, run.done), 120)
        if not run.ready.is_set() and not run.record.ended:
            run.record.ended = "error (not ready within 120 s)"

    async def _play(self, ws: Any, run: _Run, codec: _Codec, deadline: float) -> None:
        malformed = self.s.malformed_per_min / FRAMES_PER_MINUTE
        disconnect = self.s.disconnects_per_min / FRAMES_PER_MINUTE
        t0 = time.monotonic()
        k = 0
        while time.monotonic() < deadline and not run.done.is_set():
            delay = t0 + k * FRAME_S - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            frame = self.frames[self.cursor]
            self.cursor = (self.cursor + 1) % len(self.frames)
            await ws.send(codec.encode(frame))
            run.record.frames_sent += 1
            k += 1
            if malformed and self.rng.random() < malformed:
                await ws.send(self.rng.choice(MALFORMED[self.s.protocol]))
                run.record.malformed_sent += 1
            if disconnect and self.rng.random() < disconnect:
                ws.transport.abort()
                raise _Injected

    async def _close(self, ws: Any, run: _Run) -> None:
        if run.done.is_set():
            return
        if self.s.protocol in ("ws", "ws-opus"):
            await ws.send(json.dumps({"type": "stop"}))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(run.done.wait(), 30)
        else:  # these protocols end when the client leaves
            run.record.ended = run.record.ended or "stop"
            await ws.close()

    async def _receive(self, ws: Any, run: _Run, codec: _Codec) -> None:
        rec = run.record
        try:
            async for message in ws:
                now = time.monotonic()
                for kind, data in codec.decode(message):
                    if kind == "audio":
                        run.frames(data, now)
                    elif kind == "run":
                        run.new_run()
                    else:
                        self._event(run, data)
        except Exception as exc:
            rec.ended = rec.ended or _describe_close(exc)
        if not rec.ended:
            code = getattr(ws, "close_code", None)
            rec.ended = f"closed ({code} {getattr(ws, 'close_reason', '') or ''})".replace(" )", ")")
        run.done.set()

    def _event(self, run: _Run, event: dict[str, Any]) -> None:
        rec = run.record
        kind = event.get("type")
        if kind in ("ready", "session", "cspan.ready"):
            rec.conversation_id = event.get("conversation_id")
            run.ready.set()
        elif kind in ("span", "cspan.span"):
            rec.spans += 1
        elif kind == "busy" or (kind == "error" and _code(event) == "busy"):
            rec.ended = "refused (busy)"
            run.done.set()
        elif kind == "error":
            rec.errors += 1
        elif kind == "bye":
            stats = event.get("stats") or {}
            if "dropped_frames" in stats:
                rec.dropped_frames = int(stats["dropped_frames"])
            rec.ended = rec.ended or str(event.get("reason", "stop"))
            run.done.set()


async def _first(*events: asyncio.Event) -> None:
    """Wait until any of ``events`` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _code(event: dict[str, Any]) -> str | None:
    error = event.get("error")
    return error.get("code") if isinstance(error, dict) else event.get("code")


def _describe_close(exc: BaseException) -> str:
    import websockets

    if isinstance(exc, websockets.ConnectionClosed):
        frame = exc.rcvd
        if frame is None:
            return "closed (no close frame)"
        if frame.code == 4401:
            return "refused (4401 unauthorized)"
        if frame.code == 1013:  # try again later: the server's slots, the Context DB, or this user's connections
            return f"refused (1013 {frame.reason})".replace(" )", ")")
        return f"closed ({frame.code} {frame.reason})".replace(" )", ")")
    if isinstance(exc, websockets.InvalidStatus):
        return f"refused (HTTP {exc.response.status_code})"
    return f"error ({type(exc).__name__}: {exc})"[:200]


class _Codec:
    """A protocol's audio and event framing, client side."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.writer: Any = None
        self.reader: Any = None
        if protocol in ("ws-opus", "moshi"):
            import sphn

            self.writer = sphn.OpusStreamWriter(SAMPLE_RATE)
            self.reader = sphn.OpusStreamReader(SAMPLE_RATE)

    def encode(self, frame: np.ndarray) -> bytes | str:
        if self.protocol == "ws":
            return np.ascontiguousarray(frame, dtype="<f4").tobytes()
        if self.protocol == "ws-opus":
            return bytes(self.writer.append_pcm(frame))
        if self.protocol == "moshi":
            return b"\x01" + bytes(self.writer.append_pcm(frame))
        pcm16 = (np.clip(frame, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode("ascii")})

    def decode(self, message: bytes | str) -> list[tuple[str, Any]]:
        """``("audio", samples)``, ``("run", None)`` (a new run of frames) and ``("event", dict)`` items."""
        p = self.protocol
        if p in ("ws", "ws-opus"):
            if isinstance(message, str):
                return [("event", json.loads(message))]
            if p == "ws":
                return [("audio", len(message) // 4)]
            return [("audio", int(np.asarray(self.reader.append_bytes(message)).size))]
        if p == "moshi":
            if isinstance(message, str) or not message:
                return []
            kind, body = message[0], message[1:]
            if kind == 1:
                return [("audio", int(np.asarray(self.reader.append_bytes(body)).size))]
            if kind == 4:
                return [("event", json.loads(body))]
            if kind == 5:
                text = body.decode("utf-8", "replace")
                return [("event", {"type": "error", "code": text.partition(":")[0]})]
            return []
        event = json.loads(message)
        kind = event.get("type", "")
        if kind in ("response.output_audio.delta", "response.audio.delta"):
            return [("audio", len(base64.b64decode(event.get("delta", ""))) // 2)]
        if kind == "response.created":
            return [("run", None)]
        return [("event", event)]


# --------------------------------------------------------------------------------------------- the run


async def _sample(settings: LoadSettings, http: Any, samples: list[ServerSample], epoch: float) -> dict[str, float]:
    try:
        reply = await http.get("/metrics")
        metrics = parse_metrics(reply.text) if reply.status_code == 200 else {}
    except Exception:
        metrics = {}
    rss = process_rss(settings.server_pid) if settings.server_pid else metrics.get("process_resident_memory_bytes")
    samples.append(
        ServerSample(
            t=round(time.monotonic() - epoch, 3), rss_bytes=rss, sessions_active=metrics.get("cspan_sessions_active")
        )
    )
    return metrics


async def run_load(settings: LoadSettings) -> LoadReport:
    """Run the clients against ``settings.url`` and return the report (see the module docstring).

    Raises:
        BenchError: an unknown protocol, nothing listening at the URL, or unreadable audio.
    """
    import httpx

    from cspan.bench.errors import BenchError

    if settings.protocol not in PROTOCOLS:
        raise BenchError(f"--protocol {settings.protocol!r}: use one of {', '.join(PROTOCOLS)}")
    frames = load_frames(settings.audio)
    headers = {"Authorization": f"Bearer {settings.token}"} if settings.token else {}
    verify: Any = settings.ssl() or True
    async with httpx.AsyncClient(base_url=settings.url, headers=headers, timeout=10.0, verify=verify) as http:
        try:
            health = await http.get("/health")
        except httpx.HTTPError as exc:
            raise BenchError(f"--url {settings.url}: no cspan serve answers there ({exc})") from None
        if health.status_code not in (200, 503) or "free_slots" not in health.text:
            raise BenchError(f"--url {settings.url}: /health answered {health.status_code}; is it cspan serve?")
        epoch = time.monotonic()
        samples: list[ServerSample] = []
        before = await _sample(settings, http, samples, epoch)
        metrics_unread = None if before else await _metrics_problem(http)
        deadline = epoch + settings.seconds
        clients = [Client(i, settings, frames, epoch) for i in range(settings.clients)]

        async def start(client: Client) -> None:
            await asyncio.sleep(client.index * settings.stagger_s)
            await client.run(deadline)

        tasks = [asyncio.ensure_future(start(c)) for c in clients]
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=settings.sample_s)
            await _sample(settings, http, samples, epoch)
        for task in tasks:
            task.result()
        await asyncio.sleep(0.5)  # the server records the ends
        after = await _sample(settings, http, samples, epoch)
        try:
            answering = (await http.get("/health")).status_code in (200, 503)
        except httpx.HTTPError:
            answering = False
    sessions = [r for c in clients for r in c.records]
    values = [v for c in clients for v in c.lateness_values]
    deltas = {
        k: after[k] - before.get(k, 0.0)
        for k in after
        if k.startswith("cspan_")
        and k.partition("{")[0].endswith(("_total", "_count"))
        and after[k] != before.get(k, 0.0)
    }
    live = [s for s in sessions if s.agent_frames]
    attempts = sum(s.repeats for s in sessions)
    refused = sum(s.repeats for s in sessions if s.refused)
    failed = sum(s.repeats for s in sessions if s.failed)
    disconnected = sum(s.ended == "disconnect" for s in sessions)
    summary = {
        "sessions": attempts,
        "sessions_with_audio": len(live),
        "completed": attempts - refused - failed - disconnected,  # ran to the end: not the client's own cuts
        "refused": refused,
        "session_errors": failed,
        "first_session_error": next((s.ended for s in sessions if s.failed), None),
        "server_answering": answering,
        "disconnects_injected": disconnected,
        "frames_sent": sum(s.frames_sent for s in sessions),
        "agent_frames": sum(s.agent_frames for s in sessions),
        "lateness_ms": _summary(values),
        "dropped_frames": sum(s.dropped_frames or 0 for s in sessions),
        "dropped_frames_server": sum(v for k, v in deltas.items() if k.startswith("cspan_user_frames_dropped_total")),
        "agent_gaps": sum(s.agent_gaps or 0 for s in sessions),
        "spans": sum(s.spans for s in sessions),
        "errors": sum(s.errors for s in sessions),
        "malformed_sent": sum(s.malformed_sent for s in sessions),
        "rss_bytes_max": max((x.rss_bytes for x in samples if x.rss_bytes is not None), default=None),
        "metrics_unread": metrics_unread,
    }
    return LoadReport(
        settings={
            **{k: v for k, v in vars(settings).items() if k not in ("token", "audio", "cafile")},
            "audio": [str(p) for p in settings.audio],
        },
        sessions=sessions,
        summary=summary,
        server={"samples": [s.model_dump() for s in samples], "counters": deltas},
    )


async def _metrics_problem(http: Any) -> str:
    """Why ``/metrics`` gave nothing: the server's memory, live sessions and counters are then not recorded."""
    try:
        status = (await http.get("/metrics")).status_code
    except Exception as exc:
        return f"/metrics could not be read ({type(exc).__name__}: {exc})"
    if status in (401, 403):
        return f"/metrics answered {status}: pass a token with the admin scope (--token) to read it"
    return f"/metrics answered {status} with no metrics"


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    v = np.asarray(values)
    return {
        "p50": round(float(np.percentile(v, 50)), 2),
        "p99": round(float(np.percentile(v, 99)), 2),
        "max": round(float(v.max()), 2),
    }


def load_frames(paths: list[Path]) -> list[np.ndarray]:
    """The recordings as 1920-sample float32 frames at 24 kHz, one after another (10 s of silence without any).

    Raises:
        BenchError: a file that cannot be read as audio (names it).
    """
    from cspan.bench.errors import BenchError
    from cspan.core.audio import iter_frames
    from cspan.core.errors import CspanError

    if not paths:
        return [np.zeros(FRAME_SIZE, dtype=np.float32)] * round(10.0 / FRAME_S)
    frames: list[np.ndarray] = []
    for path in paths:
        try:
            frames.extend(iter_frames(path))
        except (CspanError, OSError, RuntimeError) as exc:
            raise BenchError(f"--audio {path}: cannot be read as audio ({exc})") from None
    return frames


def plot(report: LoadReport, out: Path) -> None:
    """``out``: per-session lateness p50/p99 against when the session began, and the server's memory and live
    sessions over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), constrained_layout=True)
    measured = [s for s in report.sessions if s.lateness_ms.p50 is not None]
    x = [s.started_s for s in measured]
    top.scatter(x, [s.lateness_ms.p50 for s in measured], label="p50", marker="o")
    top.scatter(x, [s.lateness_ms.p99 for s in measured], label="p99", marker="^")
    top.set_xlabel("session start (s)")
    top.set_ylabel("agent frame lateness (ms)")
    s = report.settings
    top.set_title(f"cspan bench serve: {s['clients']} x {s['protocol']} for {s['seconds']:g} s")
    top.legend()
    top.grid(alpha=0.3)
    t = [x["t"] for x in report.server["samples"]]
    rss = [(x["rss_bytes"] or float("nan")) / 2**20 for x in report.server["samples"]]
    live = [
        x["sessions_active"] if x["sessions_active"] is not None else float("nan") for x in report.server["samples"]
    ]
    bottom.plot(t, rss, color="tab:blue", label="server RSS (MiB)")
    bottom.set_xlabel("time (s)")
    bottom.set_ylabel("RSS (MiB)", color="tab:blue")
    twin = bottom.twinx()
    twin.step(t, live, where="post", color="tab:orange", label="live sessions")
    twin.set_ylabel("live sessions", color="tab:orange")
    twin.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.grid(alpha=0.3)
    fig.savefig(out, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- the command


MAX_CLIENTS = 1024
"""``--clients``: at most this many concurrent clients."""
MIN_SECONDS, MAX_SECONDS = 0.1, 86_400.0
"""``--seconds``: the run's length, a tenth of a second to 24 h."""


def server_url(value: str) -> str:
    """argparse type of ``--url``: an ``http://`` or ``https://`` URL with a host (out of it: exit status 2, before
    anything runs; it was tried and reported as "no cspan serve answers there", exit 1)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(value)
        host = parts.hostname
        parts.port  # noqa: B018 (raises on a port that is no number)
    except ValueError:
        host = None
    if parts.scheme not in ("http", "https") or not host:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an http(s) URL: give the server's address, e.g. http://127.0.0.1:8080 (https:// for "
            "TLS; the clients use its ws:// paths themselves)"
        )
    return value


def register_serve(sub: Any) -> None:
    """``cspan bench serve``."""
    from cspan.bench.run_commands import in_range, non_negative, positive

    p = sub.add_parser(
        "serve",
        help="load a running cspan serve with N real-time clients (lateness, drops, spans, errors, memory)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument(
        "--url",
        type=server_url,
        default="http://127.0.0.1:8080",
        help="the server (default %(default)s; https for TLS)",
    )
    p.add_argument("--protocol", choices=PROTOCOLS, default="ws", help="wire protocol (default %(default)s)")
    p.add_argument(
        "--clients",
        type=in_range(1, MAX_CLIENTS, integer=True),
        default=4,
        help=f"concurrent clients, 1 to {MAX_CLIENTS} (default %(default)s)",
    )
    p.add_argument(
        "--seconds",
        type=in_range(MIN_SECONDS, MAX_SECONDS),
        default=30.0,
        help=f"length of the run, {MIN_SECONDS:g} s to {MAX_SECONDS:g} s (24 h; default %(default)s)",
    )
    p.add_argument(
        "--audio", type=Path, action="append", default=[], help="a recording to play (repeatable; default: silence)"
    )
    p.add_argument("--token", default=None, help="credential (a session token; an admin one also reads /metrics)")
    p.add_argument(
        "--malformed-per-min", type=non_negative, default=0.0, help="malformed messages per client per minute"
    )
    p.add_argument(
        "--disconnects-per-min", type=non_negative, default=0.0, help="abrupt disconnects per client per minute"
    )
    p.add_argument(
        "--stagger-s", type=non_negative, default=0.25, help="delay between client starts (default %(default)s)"
    )
    p.add_argument("--sample-s", type=positive, default=1.0, help="server sampling period (default %(default)s)")
    p.add_argument("--server-pid", type=int, default=None, help="read the server's memory from /proc/PID")
    p.add_argument("--cafile", type=Path, default=None, help="CA certificate to verify an https/wss server with")
    p.add_argument("--seed", type=int, default=0, help="seed of the injections and recording offsets")
    p.add_argument("--out", type=Path, required=True, help="folder for serve-load.json and serve-load.png")
    p.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from cspan.bench.errors import BenchError
    from cspan.bench.session import check_out

    check_out(args.out, folder=True, first_file="serve-load.json")
    settings = LoadSettings(
        url=args.url,
        protocol=args.protocol,
        clients=args.clients,
        seconds=args.seconds,
        audio=list(args.audio),
        token=args.token,
        malformed_per_min=args.malformed_per_min,
        disconnects_per_min=args.disconnects_per_min,
        stagger_s=args.stagger_s,
        sample_s=args.sample_s,
        server_pid=args.server_pid,
        cafile=args.cafile,
        seed=args.seed,
    )
    report = asyncio.run(run_load(settings))
    s = report.summary
    failure = f", {s['session_errors']} failed: {s['first_session_error']}" if s["session_errors"] else ""
    if s["completed"] + s["disconnects_injected"] <= 0:  # nothing was measured: no report that reads as a result
        raise BenchError(
            f"no session ran against {args.url} in {args.seconds:g} s ({s['sessions']} attempt(s), {s['refused']} "
            f"refused{failure}): is cspan serve running there, and is --token a session token? nothing written"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve-load.json").write_text(report.model_dump_json(indent=2) + "\n", encoding="utf-8")
    plot(report, args.out / "serve-load.png")
    print(
        f"{settings.clients} client(s): {s['sessions']} session attempt(s), {s['refused']} refused, "
        f"{s['session_errors']} failed (such a client tries again {RETRY_S:g} s later, up to {RETRY_MAX_S:g} s "
        f"after failures in a row), {s['disconnects_injected']} disconnects injected; "
        f"lateness p50 {s['lateness_ms']['p50']} ms, p99 {s['lateness_ms']['p99']} ms; dropped {s['dropped_frames']}; "
        f"spans {s['spans']}; errors {s['errors']} ({s['malformed_sent']} malformed sent); "
        f"-> {args.out / 'serve-load.json'}"
    )
    if s["metrics_unread"]:
        unread = "live sessions and counters" if settings.server_pid else "memory, live sessions and counters"
        print(f"warning: {s['metrics_unread']}; the server's {unread} were not recorded", file=sys.stderr)
    if not s["server_answering"]:
        raise BenchError(
            f"--url {args.url}: the server stopped answering during the run ({s['completed']} session(s) completed"
            f"{failure}); {args.out / 'serve-load.json'} covers what ran"
        )
    return 0


__all__ = ["LoadReport", "LoadSettings", "SessionRecord", "lateness", "register_serve", "run_load"]
