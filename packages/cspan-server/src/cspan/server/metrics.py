"""Prometheus metrics of ``cspan serve`` (``GET /metrics``, text exposition format via ``prometheus-client``).

Each app owns its own :class:`prometheus_client.CollectorRegistry`, so several apps in one process (tests) never
share counters. Names follow the Prometheus conventions: ``_total`` counters, ``_seconds`` histograms. Per-session
counters carry the wire protocol as the label ``protocol`` (``cspan`` for ``/ws``, ``moshi`` for ``/api/chat``, ...:
each adapter's ``name``).

| metric | type | what |
|---|---|---|
| ``cspan_sessions_active`` | gauge | sessions holding an engine slot |
| ``cspan_session_slots`` | gauge | engine batch size (``--max-sessions``) |
| ``cspan_sessions_started_total{protocol}`` | counter | sessions that reached ``ready`` |
| ``cspan_sessions_ended_total{protocol,reason}`` | counter | sessions that reached ``ready``, ended: stop, idle, disconnect, shutdown, slow_client, over_budget, revoked, forgotten, error (started minus ended: the sessions running now) |
| ``cspan_sessions_unstarted_total{protocol,reason}`` | counter | connections past the handshake that ended before ``ready`` (in neither started nor ended): the reasons above, and refused (`/api/chat`: its start was refused) |
| ``cspan_sessions_busy_total{protocol}`` | counter | ``start`` refused with ``busy`` |
| ``cspan_auth_failures_total{protocol,reason}`` | counter | handshakes refused: ``token`` (4401), ``origin`` (4403) |
| ``cspan_user_limit_refusals_total{protocol,limit}`` | counter | refused for a per-user limit: ``connections`` (a connection past ``--max-connections-per-user``, closed 1013), ``sessions`` (a start past ``--max-sessions-per-user``, ``busy``; also in ``cspan_sessions_busy_total``) |
| ``cspan_host_refused_total`` | counter | requests refused for their ``Host`` header (403, DNS rebinding) |
| ``cspan_frames_total`` | counter | batched engine steps (one per 80 ms tick with a live session) |
| ``cspan_session_frames_total{protocol}`` | counter | agent frames sent (summed over sessions) |
| ``cspan_user_frames_total{protocol}`` | counter | user frames received |
| ``cspan_user_frames_dropped_total{protocol}`` | counter | user frames dropped (queue full: audio faster than real time) |
| ``cspan_wire_bytes_total{protocol,direction}`` | counter | WebSocket payload bytes, ``in`` (from clients) and ``out`` |
| ``cspan_client_throttled_seconds_total{protocol}`` | counter | time clients' messages were held back for sending faster than ``--max-messages-per-s`` (or its byte budget) |
| ``cspan_silence_frames_total`` | counter | session frames with no user frame queued (silence fed) |
| ``cspan_clock_resyncs_total`` | counter | ticks more than one frame late: the clock skipped ahead instead of bursting |
| ``cspan_step_seconds`` | histogram | wall time of one batched engine step |
| ``cspan_prefill_seconds`` | histogram | host time of injecting one Context Span (its read is part of the next step) |
| ``cspan_persona_prefill_seconds`` | histogram | wall time of one persona prefix read |
| ``cspan_spans_total{outcome}`` | counter | retrieval outcomes: injected, late, no_span (nothing to say, or a backend failed), cancelled (cut by the end of its session) |
| ``cspan_backend_errors_total{stage}`` | counter | backend failures (asr, retrieval, span, ...) |
| ``cspan_protocol_errors_total{protocol,code}`` | counter | client mistakes reported, ``error`` messages sent or not (over a client's 50 at once and 10 a second: counted, not sent) |
| ``cspan_voice_recordings_total{protocol}`` | counter | recordings clients sent that became a session's voice |
| ``cspan_db_writes_pending`` | gauge | Context DB writes of sessions queued or running (a session runs one at a time; docs/OPERATORS.md, "When PostgreSQL is away") |
| ``cspan_db_write_failures_total{reason}`` | counter | session writes not written: ``failed`` (the database refused or was away: logged), ``dropped`` (over a session's queue while the database did not answer, or left at shutdown) |
| ``cspan_db_write_seconds`` | histogram | time from a session's write queued to committed (its wait behind the session's earlier writes included): what a message held behind it waited |
| ``cspan_mcp_servers{state}`` | gauge | ``--mcp`` servers ``up``, ``reconnecting`` (lost: the next call reconnects) and ``down`` (given up after 3 failed reconnects) |
| ``process_resident_memory_bytes``, ``process_cpu_seconds_total``, ... | gauge, counter | the server process (Linux; prometheus-client's process collector) |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from cspan.backends.tools.bank import MCP_STATES

_STEP_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.12, 0.2, 0.5, 1.0, 2.5)
_PREFILL_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_DB_WRITE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0)


class ServerMetrics:
    """The metric objects of one app, registered in their own registry (see the module table).

    Args:
        max_sessions: the engine's batch size (``cspan_session_slots``).
        protocols: the adapters' names, whose per-protocol series are created at 0.
    """

    def __init__(self, max_sessions: int, protocols: Iterable[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # memory and CPU of this process, read from /proc (nothing elsewhere)
        self.sessions_active = Gauge("cspan_sessions_active", "Sessions holding an engine slot", registry=r)
        self.session_slots = Gauge("cspan_session_slots", "Engine batch size (--max-sessions)", registry=r)
        self.session_slots.set(max_sessions)
        p = ["protocol"]
        self.sessions_started = Counter("cspan_sessions_started", "Sessions that reached ready", p, registry=r)
        self.sessions_ended = Counter(
            "cspan_sessions_ended", "Sessions that reached ready, ended, by reason", [*p, "reason"], registry=r
        )
        self.sessions_unstarted = Counter(
            "cspan_sessions_unstarted", "Connections that ended before ready, by reason", [*p, "reason"], registry=r
        )
        self.sessions_busy = Counter("cspan_sessions_busy", "start refused with busy", p, registry=r)
        self.auth_failures = Counter("cspan_auth_failures", "Handshakes refused", [*p, "reason"], registry=r)
        self.user_limit_refusals = Counter(
            "cspan_user_limit_refusals", "Refused for a per-user limit, by limit", [*p, "limit"], registry=r
        )
        self.host_refused = Counter("cspan_host_refused", "Requests refused for their Host header", registry=r)
        self.frames = Counter("cspan_frames", "Batched engine steps", registry=r)
        self.session_frames = Counter("cspan_session_frames", "Agent frames sent, summed over sessions", p, registry=r)
        self.user_frames = Counter("cspan_user_frames", "User frames received", p, registry=r)
        self.user_frames_dropped = Counter(
            "cspan_user_frames_dropped", "User frames dropped because the session queue was full", p, registry=r
        )
        self.wire_bytes = Counter(
            "cspan_wire_bytes", "WebSocket payload bytes, by direction", [*p, "direction"], registry=r
        )
        self.throttled_seconds = Counter(
            "cspan_client_throttled_seconds", "Time client messages were held back (over their budget)", p, registry=r
        )
        self.silence_frames = Counter(
            "cspan_silence_frames", "Session frames with no queued user frame (silence fed)", registry=r
        )
        self.clock_resyncs = Counter(
            "cspan_clock_resyncs", "Ticks more than one frame late (clock skipped ahead)", registry=r
        )
        self.step_seconds = Histogram(
            "cspan_step_seconds", "Wall time of one batched engine step", buckets=_STEP_BUCKETS, registry=r
        )
        self.prefill_seconds = Histogram(
            "cspan_prefill_seconds",
            "Host time of injecting one Context Span (its read is part of the next step)",
            buckets=_PREFILL_BUCKETS,
            registry=r,
        )
        self.persona_prefill_seconds = Histogram(
            "cspan_persona_prefill_seconds",
            "Wall time of one persona prefix read",
            buckets=_PREFILL_BUCKETS,
            registry=r,
        )
        self.spans = Counter("cspan_spans", "Retrieval outcomes", ["outcome"], registry=r)
        self.backend_errors = Counter("cspan_backend_errors", "Backend failures, by stage", ["stage"], registry=r)
        self.protocol_errors = Counter(
            "cspan_protocol_errors",
            "client mistakes reported (error messages, sent or over the client's error budget)",
            [*p, "code"],
            registry=r,
        )
        self.voice_recordings = Counter(
            "cspan_voice_recordings", "Recordings clients sent that became a session's voice", p, registry=r
        )
        self.db_writes_pending = Gauge(
            "cspan_db_writes_pending", "Context DB writes of sessions queued or running", registry=r
        )
        self.db_write_failures = Counter(
            "cspan_db_write_failures", "Session writes not written: failed, dropped", ["reason"], registry=r
        )
        self.db_write_seconds = Histogram(
            "cspan_db_write_seconds",
            "Time from a session's Context DB write queued to committed",
            buckets=_DB_WRITE_BUCKETS,
            registry=r,
        )
        self.mcp_servers = Gauge(
            "cspan_mcp_servers", "--mcp servers by state: up, reconnecting, down (given up)", ["state"], registry=r
        )
        for state in MCP_STATES:
            self.mcp_servers.labels(state)
        for outcome in ("injected", "late", "no_span", "cancelled"):
            self.spans.labels(outcome)
        for reason in ("failed", "dropped"):
            self.db_write_failures.labels(reason)
        for name in protocols:  # every protocol's series exist from the start (0 rather than absent)
            for metric in (
                self.sessions_started,
                self.sessions_busy,
                self.session_frames,
                self.user_frames,
                self.throttled_seconds,
            ):
                metric.labels(name)
            for direction in ("in", "out"):
                self.wire_bytes.labels(name, direction)
            for limit in ("connections", "sessions"):
                self.user_limit_refusals.labels(name, limit)

    def render(self, mcp_states: Mapping[str, int] | None = None) -> tuple[bytes, str]:
        """``(body, content_type)`` of the Prometheus text exposition, with ``cspan_mcp_servers`` set from
        ``mcp_states`` (``{state: count}``, read at the scrape) first."""
        for state, count in (mcp_states or {}).items():
            self.mcp_servers.labels(state).set(count)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServerMetrics"]
