"""The backends a run shares: its transcriber, tool bank, router and retriever, built once from the settings by
:func:`build_transcriber` and :func:`build_backends` (the one place ``cspan serve`` and ``cspan infer`` build them),
and :class:`Backends`, which holds them and gives each session its own view (its user's memory and tools)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cspan.backends.urls import redact_url
from cspan.core.errors import CspanError
from cspan.server.auth import ServeConfigError

if TYPE_CHECKING:
    from cspan.server.settings_common import BackendSettings, ToolSettings

    class _Settings(BackendSettings, ToolSettings):
        """``cspan serve``'s and ``cspan infer``'s settings: both hold the backend and the tool settings."""


logger = logging.getLogger(__name__)


@dataclass
class Backends:
    """What ``cspan serve`` builds once and shares, and the per-session view of it.

    Attributes:
        transcriber: the shared transcriber (None: ``--asr none``).
        retriever: the shared :class:`~cspan.backends.retriever.Retriever` (None: ``--router none``); its router
            sees :attr:`bank` and no user's memory.
        bank: the shared :class:`~cspan.backends.tools.ToolBank` (``--tools``, ``--mcp``); None when the retriever
            was given from outside.
        sets: the built-in tool sets chosen (``memory`` is made per session).
    """

    transcriber: Any = None
    retriever: Any = None
    bank: Any = None
    sets: tuple[str, ...] = ()

    def for_session(self, memory: Any, tools: Iterable[Any] = (), *, extra_timeout_s: float = 0.0) -> Any:
        """One session's retriever: ``memory`` (the principal's
        :class:`~cspan.backends.context_db.UserMemory`) for its records and context, and its own router over the
        shared bank plus that principal's memory tools (with the ``memory`` set) and ``tools`` (a client's
        functions); an LLM router's time limit grows by ``extra_timeout_s``. Cheap: nothing is opened."""
        from cspan.backends.router import LocalRouter
        from cspan.backends.tools.catalog import session_bank

        base = self.retriever
        if base is None or not hasattr(base, "scoped"):
            return base
        router = base.router
        remembers = "memory" in self.sets or self.bank is None
        if isinstance(router, LocalRouter):
            bank = session_bank(self.bank, memory=memory, sets=self.sets, extra=tools) if self.bank else None
            return base.scoped(memory, router=router.with_bank(bank, memory=memory if remembers else None))
        tools = list(tools)
        if hasattr(router, "with_bank") and (self.bank is not None or tools):
            shared = self.bank if self.bank is not None else router.tools
            own = router.with_bank(session_bank(shared, memory=memory, sets=self.sets, extra=tools))
            if extra_timeout_s and isinstance(getattr(own, "timeout_s", None), float):
                own.timeout_s += extra_timeout_s
            return base.scoped(memory, router=own)
        return base.scoped(memory)

    def tool_names(self) -> set[str]:
        """The names of the server's own tools a session's router sees (the shared bank's and, with the ``memory``
        set, the memory tools): a client's function may not take one."""
        from cspan.backends.tools.catalog import memory_tools

        router = getattr(self.retriever, "router", None)
        bank = self.bank if self.bank is not None else getattr(router, "tools", None)
        names = set(bank.names()) if bank is not None else set()
        if "memory" in self.sets:
            names |= {tool.name for tool in memory_tools(None)}  # type: ignore[arg-type]
        return names

    async def aclose(self) -> None:
        """Close the router's HTTP client, the tool bank (MCP sessions and subprocesses) and the transcriber."""
        router = getattr(self.retriever, "router", None)
        for obj in (router, self.bank if self.bank is not None else getattr(router, "tools", None), self.transcriber):
            aclose = getattr(obj, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def build_transcriber(settings: BackendSettings) -> Any:
    """The transcriber of ``--asr`` (None for ``none``).

    Raises:
        ServeConfigError: the transcriber cannot be made (the message names ``--asr``).
    """
    from cspan.backends.asr import transcriber_from_url

    if settings.asr == "none":
        return None
    try:
        return transcriber_from_url(settings.asr, model=settings.asr_model)
    except (ValueError, CspanError) as exc:
        raise ServeConfigError(f"--asr {redact_url(settings.asr)}: {exc}") from exc


async def build_backends(settings: _Settings, transcriber: Any) -> Backends:
    """The shared backends of ``settings``: the one place ``cspan serve`` (and ``cspan infer``) builds its tool bank
    (built-in sets of ``--tools``, MCP servers of ``--mcp``) and its router (``--router``). Runs on the event loop
    that will use them (MCP sessions belong to it). The retriever waits for the Context DB at most ``db_wait_s``
    seconds where the settings have it (``cspan serve``'s ``--db-wait-s``), without limit otherwise.

    Raises:
        ServeConfigError: an MCP server did not start or list its tools, or two tools share a name (the message
            names the ``--mcp`` value).
    """
    from cspan.backends.errors import BackendError
    from cspan.backends.knowledge import KnowledgeBase
    from cspan.backends.retriever import Retriever
    from cspan.backends.router import LLMRouter, LocalRouter
    from cspan.backends.tools.catalog import build_bank

    warm = getattr(transcriber, "warm", None)
    if warm is not None:  # the embedded transcriber's decoding processes start now, not at a session's first clip
        await asyncio.to_thread(warm)
    if settings.router == "none":
        if settings.mcp or settings.tools is not None:
            logger.warning("--router none: no router calls tools; --tools and --mcp are not used")
        return Backends(transcriber=transcriber)
    knowledge = KnowledgeBase(settings.knowledge)
    spec = settings.tools_spec(knowledge=settings.knowledge)
    try:
        bank = await build_bank(spec, knowledge=knowledge)
    except BackendError as exc:
        raise ServeConfigError(f"tools (--tools, --mcp): {exc}") from exc
    # cspan serve's bound on what waits for the Context DB (--db-wait-s) bounds the retriever's reads and span row
    # writes, and the local router's reads of the user's facts: a database that does not answer costs a retrieval
    # the conversation's context, not its deadline (cspan infer: no bound)
    db_wait_s = getattr(settings, "db_wait_s", None)
    if settings.router == "local":
        router: Any = LocalRouter(bank, None, knowledge=knowledge, db_timeout_s=db_wait_s)
        idle = [n for n in bank.names() if n not in LocalRouter.TOOLS_CALLED and n != "search_notes"]
        if idle and (settings.mcp or settings.tools is not None):  # what the operator chose, not the default
            logger.warning(
                "--router local calls only %s (and searches the notes and the user's memory itself): %s will not "
                "be called; give an LLM router (--router URL) to use them",
                " and ".join(LocalRouter.TOOLS_CALLED),
                ", ".join(idle),
            )
    else:
        router = LLMRouter(settings.router, settings.router_model, bank)
    retriever = Retriever(transcriber, router, None, deadline_s=settings.span_deadline_s, db_timeout_s=db_wait_s)
    names = ", ".join(bank.names()) or "none"
    logger.info("tools: %s (sets %s; %d MCP server(s))", names, ",".join(spec.sets) or "none", len(spec.mcp))
    return Backends(transcriber=transcriber, retriever=retriever, bank=bank, sets=tuple(spec.sets))


__all__ = ["Backends", "build_backends", "build_transcriber"]
