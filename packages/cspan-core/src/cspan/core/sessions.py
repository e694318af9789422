"""The duplex engine's sessions: their device state in one object, their host mirrors in one record, and the
host-built layout of one step.

- :class:`EngineState` holds every device tensor of all B sessions: the temporal KV cache, the token grid, the
  sampling seeds and parameters and the Mimi codec states (row B of the cache, grid, seeds and parameters is a
  scratch row that the padding rows of a CUDA-graph bucket compute on).
- :class:`Sessions` holds what the host knows of each session (pending position, whether it started, its prefix
  end, seed, sampling parameters, whether it is live, its persona policy: :mod:`cspan.core.window`) and what is
  queued for its next step (a restart with an optional persona prefix, Context Span blocks, new sampling
  parameters, a copy of the prefix). Queueing is host-only, so a server may call it between steps from any
  thread.
- :class:`StepBatch` is one step's host-built inputs: the live rows, their queued block columns and the ragged
  layout of those columns, packed into one integer tensor that the step (graphed or eager) unpacks on the device
  (:func:`unpack`).
"""

from __future__ import annotations

import collections
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .constants import MAX_TOP_K
from .modules import fused
from .modules.transformer import StepLayout
from .plan import ExecutionPlan
from .prefix import PrefixBlock
from .sampling import TOP_K_BOUNDS, RowSampling, SessionSampling
from .span import Block
from .streams import TokenGrid
from .window import PinnedSinks, WindowEvent

WINDOW_EVENTS_KEPT = 64
"""Window events kept per session until :meth:`Sessions.take_window_events` (older ones are dropped)."""
SPAN_READS_KEPT = 256
"""The reads of Context Spans kept per session for :meth:`Sessions.take_span_reads` (the oldest are dropped past
this: a caller that never takes them, such as a benchmark stepping the engine alone, holds no growing list)."""


def fresh_seed() -> int:
    """A non-deterministic 63-bit seed."""
    return random.SystemRandom().getrandbits(63)


@dataclass
class Restart:
    """A queued restart of one session: its new seed, and the persona prefix its next step reads (or None)."""

    seed: int
    prefix: PrefixBlock | None = None


@dataclass
class Persona:
    """How a session keeps its persona prefix in the window (:mod:`cspan.core.window`).

    Attributes:
        policy: ``pinned``, ``reprefix`` or ``none``.
        sinks: S = P + 1, the prefix's positions ``0 .. P`` (its last column included).
        copy: the block that reads the prefix again (``reprefix``), else None.
        first, last: the positions of the latest copy of the prefix (``0, P`` until a re-prefix).
        pinned: the sinks have been placed (from then on, every step places them).
    """

    policy: str
    sinks: int
    copy: Block | None = None
    first: int = 0
    last: int = 0
    pinned: bool = False


@dataclass(frozen=True)
class SpanRead:
    """A Context Span a step read (:meth:`Sessions.take_span_reads`).

    Attributes:
        seq: its number (:attr:`cspan.core.span.SpanReport.seq`).
        first_position: the KV position of its first column, as read (one more per step the column budget held
            it back since its report).
        n: its columns.
    """

    seq: int
    first_position: int
    n: int


@dataclass
class StepHead:
    """What the sessions record hands a step (:meth:`Sessions.take`), all read under one lock.

    Attributes:
        rows: the live rows.
        restarts: their queued restarts.
        blocks: their queued Context Span blocks.
        sampling: new sampling parameters of any row (to write into the device state).
        pins: rows whose pinned prefix is placed in this step: row -> (the first position of the window its last
            query sees, the sink positions S).
        text_top_k: each live row's text top-k (the step's static top-k size covers them).
        positions: each session's position in this step (the pending one, less the columns of the blocks left
            queued for a later step by the step's column budget).
        version: :attr:`Sessions.version` when the head was read (a head read by :meth:`Sessions.peek` is the one
            :meth:`Sessions.take` would hand while the version stays the same).
    """

    rows: list[int]
    restarts: dict[int, Restart]
    blocks: dict[int, list[Block]]
    sampling: dict[int, SessionSampling]
    pins: dict[int, tuple[int, int]]
    text_top_k: list[int]
    positions: list[int]
    version: int = 0


class Sessions:
    """Host mirrors of all B sessions and what is queued for their next step (one lock guards the queue).

    Attributes:
        position: each session's pending position: the position its next step feeds (its queued blocks included).
        started: a persona or a step since its reset (a Context Span needs a running stream).
        prefix_end: the last position of its persona prefix, or None.
        persona: row -> its :class:`Persona` (rows with a prefix).
        context: the attention window W in positions (None: unbounded; no policy acts).
        seeds: its sampling seed.
        sampling: its sampling parameters (:class:`cspan.core.sampling.SessionSampling`).
        live: stepped by the engine (idle rows cost nothing and keep their queue; see ``DuplexEngine.set_live``).
        restarts: row -> :class:`Restart` applied at the head of its next step.
        blocks: row -> queued Context Span blocks, read by its next step in order.
        after_prefix: row -> blocks queued behind a persona prefix not read yet: they are read by the step after
            the prefix's, so that they follow the whole prefix (as they would once it has been read).
        sampling_changed: rows whose sampling parameters the device state does not have yet.
        window_events: row -> what its persona policy did since the last :meth:`take_window_events`.
        span_reads: row -> the Context Spans its steps read since the last :meth:`take_span_reads`.
        stepping: the rows of the step under way (taken its head, not advanced yet): each feeds its pending position
            in that step, so a block queued for one of them meanwhile starts a position later.
        version: counts the changes of what the next step reads (every reset, sampling change, queued block, live
            flag, taken head and step): a head :meth:`peek` read stays the next step's while it is unchanged.
        max_block_columns: the step's budget of block columns (None: no limit). A step takes the queued Context
            Spans of as many rows as fit, oldest waiting first (a row that read some goes behind those that read
            none); the rest wait for a later step, in order (a step that reads no persona prefix always reads at
            least one span; a persona prefix, and a row whose queue holds a re-prefix copy, are never held back, so
            the prefix stays in the window). Chunked prefill's token budget (Sarathi-Serve, Agrawal et al. 2024):
            two long spans in one frame no longer double it.
    """

    def __init__(
        self,
        seeds: Sequence[int],
        sampling: SessionSampling,
        context: int | None = None,
        max_block_columns: int | None = None,
    ) -> None:
        B = len(seeds)
        self.batch_size = B
        self.position = [0] * B
        self.started = [False] * B
        self.prefix_end: list[int | None] = [None] * B
        self.seeds = [int(s) for s in seeds]
        self.sampling = [sampling] * B
        self.sampling_changed = set(range(B))
        self.live = [True] * B
        self.restarts: dict[int, Restart] = {i: Restart(self.seeds[i]) for i in range(B)}
        self.blocks: dict[int, list[Block]] = {}
        self.after_prefix: dict[int, list[Block]] = {}
        self.persona: dict[int, Persona] = {}
        self.context = context
        self.window_events: dict[int, collections.deque[WindowEvent]] = {}
        self.span_reads: dict[int, collections.deque[SpanRead]] = {}
        self.max_block_columns = max_block_columns
        self.waiting: list[int] = []  # rows whose spans the budget held back, oldest first
        self.stepping: set[int] = set()
        self.version = 0
        self.lock = threading.Lock()

    def reset(
        self,
        rows: Sequence[int],
        seeds: Sequence[int | None],
        prefix: PrefixBlock | None = None,
        persona: Persona | None = None,
        sampling: SessionSampling | None = None,
    ) -> int:
        """Restart ``rows`` (fresh seeds where None), optionally with a persona prefix and its :class:`Persona`
        and new sampling parameters (the same for all rows; None keeps each row's), all under one lock: a step
        taking its head from another thread sees the whole restart or none of it. Returns the Context Spans
        dropped: queued for the rows' old streams and not read yet."""
        dropped = 0
        with self.lock:
            self.version += 1
            for row, seed in zip(rows, seeds, strict=True):
                queued = [*self.blocks.get(row, ()), *self.after_prefix.get(row, ())]
                dropped += sum(blk.span_seq is not None for blk in queued)
                self.span_reads.pop(row, None)
                if sampling is not None:
                    self.sampling[row] = sampling
                    self.sampling_changed.add(row)
                self.seeds[row] = fresh_seed() if seed is None else int(seed)
                self.restarts[row] = Restart(self.seeds[row], prefix)
                self.stepping.discard(row)  # the step under way no longer moves it (advance)
                self.blocks.pop(row, None)
                self.after_prefix.pop(row, None)
                self.window_events.pop(row, None)
                self.persona.pop(row, None)
                if prefix is not None and persona is not None:
                    self.persona[row] = Persona(persona.policy, persona.sinks, persona.copy, 0, prefix.pending)
                self.position[row] = 0 if prefix is None else prefix.pending
                self.prefix_end[row] = None if prefix is None else prefix.pending
                self.started[row] = prefix is not None
        return dropped

    def set_sampling(self, row: int, sampling: SessionSampling) -> None:
        """Sample ``row`` with ``sampling`` from its next step on."""
        with self.lock:
            self.version += 1
            self.sampling[row] = sampling
            self.sampling_changed.add(row)

    def set_live(self, row: int, live: bool) -> None:
        """Step ``row`` (live) or leave it idle from the next step on."""
        with self.lock:
            if self.live[row] != bool(live):
                self.version += 1
                self.live[row] = bool(live)

    def queue(self, row: int, block: Block) -> int:
        """Queue a block for ``row``; returns its first position (a copy of the prefix may follow it: ``reprefix``)."""
        with self.lock:
            self.version += 1
            restart = self.restarts.get(row)
            if restart is not None and restart.prefix is not None:  # after the prefix's own step
                waiting = self.after_prefix.setdefault(row, [])
                first = self.position[row] + 1 + sum(blk.n for blk in waiting)
                waiting.append(block)
                return first
            first = self.position[row] + (row in self.stepping)  # a step under way feeds the pending position
            self.blocks.setdefault(row, []).append(block)
            self.position[row] += block.n
            self._keep_persona(row)
            return first

    def take(self) -> StepHead:
        """The head of a step (:class:`StepHead`), its queues emptied, read under the sessions' lock."""
        with self.lock:
            return self._head(commit=True)

    def peek(self) -> StepHead:
        """The head :meth:`take` would hand now, nothing changed (to prepare a step ahead of it: the head is
        still the next step's while :attr:`version` equals ``head.version``)."""
        with self.lock:
            return self._head(commit=False)

    def _head(self, commit: bool) -> StepHead:
        """The next step's head; ``commit``: empty the queues it takes and note its pins (lock held)."""
        version = self.version
        rows = [i for i in range(self.batch_size) if self.live[i]]
        restarts = {i: self.restarts[i] for i in rows if i in self.restarts}
        blocks, deferred, left, waiting = self._take_blocks(rows, restarts)
        positions = list(self.position)
        for i, n in deferred.items():
            positions[i] -= n
        sampling = {i: self.sampling[i] for i in sorted(self.sampling_changed)}
        pins: dict[int, tuple[int, int]] = {}
        for i in rows:
            persona = self.persona.get(i)
            if persona is None or persona.policy != "pinned" or self.context is None or i in restarts:
                continue
            start = positions[i] - self.context + 1  # the window of this step's last query
            if start > 0:
                pins[i] = (start, persona.sinks)
                if commit and not persona.pinned:
                    persona.pinned = True
                    self._event(i, WindowEvent("pin", start, persona.sinks))
        if commit:
            for i in restarts:
                del self.restarts[i]
            for i, taken in blocks.items():
                self._note_reads(i, taken)
            self.blocks, self.waiting = left, waiting
            self.sampling_changed.clear()
            self.stepping = set(rows)
            self.version += 1
        text_top_k = [self.sampling[i].text.top_k for i in rows]
        return StepHead(rows, restarts, blocks, sampling, pins, text_top_k, positions, version)

    def _take_blocks(
        self, rows: list[int], restarts: dict[int, Restart]
    ) -> tuple[dict[int, list[Block]], dict[int, int], dict[int, list[Block]], list[int]]:
        """(the queued blocks this step reads, row -> the columns left queued, the queues left, the rows held back
        oldest first): see ``max_block_columns`` (lock held; nothing changed here)."""
        budget = self.max_block_columns
        left = dict(self.blocks)
        if budget is None or not left:
            return {i: left.pop(i) for i in rows if i in left}, {}, left, self.waiting
        used = sum(r.prefix.block.n for r in restarts.values() if r.prefix is not None)
        live = set(rows)
        order = [i for i in self.waiting if i in live] + [i for i in rows if i not in self.waiting]
        taken: dict[int, list[Block]] = {}
        deferred: dict[int, int] = {}
        for i in order:
            queued = left.pop(i, None)
            if not queued:
                continue
            persona = self.persona.get(i)
            copy = persona.copy if persona is not None else None
            k = len(queued)  # a restart's row, or one with a re-prefix copy queued, is read whole
            if i not in restarts and all(blk is not copy for blk in queued):
                k = 0  # its spans in order while they fit (the first of a step's always does)
                while k < len(queued) and (used == 0 or used + queued[k].n <= budget):
                    used += queued[k].n
                    k += 1
            else:
                used += sum(blk.n for blk in queued)
            if k:
                taken[i] = queued[:k]
            if k < len(queued):
                left[i] = queued[k:]
                deferred[i] = sum(blk.n for blk in queued[k:])
        # a row that read a span now goes behind those that read none: one row's backlog cannot starve the others
        held = [i for i in order if i in deferred]
        waiting = sorted(held, key=lambda i: i in taken) + [i for i in self.waiting if i not in live]
        return taken, deferred, left, waiting

    def _note_reads(self, row: int, taken: list[Block]) -> None:
        """Note the Context Spans and copies of the prefix among ``taken``, the blocks this step reads of ``row``
        (lock held, before the queues are replaced: the row's pending position still counts every queued block).
        A copy's ``reprefix`` event is made here, by the step that reads it, not when the previous step queued it:
        the runtime reports it at this step's frame, as it reports the spans."""
        position = self.position[row] - sum(blk.n for blk in self.blocks.get(row, ()))
        persona = self.persona.get(row)
        for blk in taken:
            if blk.span_seq is not None:
                reads = self.span_reads.setdefault(row, collections.deque(maxlen=SPAN_READS_KEPT))
                reads.append(SpanRead(blk.span_seq, position, blk.n))
            elif persona is not None and blk is persona.copy:
                self._event(row, WindowEvent("reprefix", position, blk.n))
            position += blk.n

    def take_span_reads(self, row: int) -> list[SpanRead]:
        """The Context Spans ``row``'s steps read since the last call (in order), emptied."""
        with self.lock:
            return list(self.span_reads.pop(row, ()))

    def advance(self, rows: Sequence[int]) -> None:
        """After a step of ``rows``: one position fed each; blocks waiting behind a prefix are queued now. A row
        reset while the step ran (another thread's ``reset`` or ``set_persona``) stays where its restart put it:
        the step took its restarts, so a restart queued now came after it."""
        with self.lock:
            self.version += 1
            self.stepping = set()
            for row in rows:
                if row in self.restarts:
                    continue
                self.position[row] += 1
                self.started[row] = True
                for block in self.after_prefix.pop(row, []):
                    self.blocks.setdefault(row, []).append(block)
                    self.position[row] += block.n
                self._keep_persona(row)

    def _keep_persona(self, row: int) -> None:
        """``reprefix``: queue a copy of the prefix when the next step's last query would no longer see the first
        position of the latest copy (lock held)."""
        persona = self.persona.get(row)
        if persona is None or persona.copy is None or self.context is None:
            return
        q = self.position[row] + (row in self.stepping)  # the position after the step under way, if any
        if q - persona.first < self.context:
            return
        self.blocks.setdefault(row, []).append(persona.copy)
        persona.first, persona.last = q, q + persona.copy.n - 1
        self.position[row] += persona.copy.n

    def _event(self, row: int, event: WindowEvent) -> None:
        self.window_events.setdefault(row, collections.deque(maxlen=WINDOW_EVENTS_KEPT)).append(event)

    def take_window_events(self, row: int) -> list[WindowEvent]:
        """What ``row``'s persona policy did since the last call (oldest first), emptied."""
        with self.lock:
            events = self.window_events.pop(row, None)
            return list(events) if events else []

    def prefix_visible(self, row: int, next_position: int) -> bool:
        """Whether the whole persona prefix (its latest copy, or its sinks) is visible to a query at
        ``next_position`` (False without a prefix)."""
        persona = self.persona.get(row)
        if persona is None:
            return False
        if self.context is None or persona.policy == "pinned":
            return True
        return next_position - persona.first < self.context

    def window_left(self, row: int, next_position: int) -> int | None:
        """Positions that can still be fed after ``next_position`` before the first position of the prefix's
        latest copy (position 0 without a prefix) leaves the window (None: unbounded)."""
        if self.context is None:
            return None
        persona = self.persona.get(row)
        first = 0 if persona is None else persona.first
        return max(0, self.context - 1 - (next_position - first))


class EngineState:
    """Device tensors of all B sessions (row B of the cache, grid and seeds: the scratch row).

    Args:
        lm: the :class:`cspan.core.lm.LMModel`.
        mimi: the Mimi codec, or None.
        batch_size: B.
        plan: the engine's plan (KV dtype).
        grid: the token grid's delays, initial tokens and user rows as ``(delays, initial, user_rows)``.

    Attributes:
        lm: the temporal KV cache (:class:`cspan.core.lm.LMState`), B + 1 rows.
        grid: the :class:`cspan.core.streams.TokenGrid`, B + 1 rows.
        seed: [B + 1] long, each session's sampling seed.
        text_temp, audio_temp: [B + 1] float32, each session's sampling temperatures (0: greedy).
        text_top_k, audio_top_k: [B + 1] long, each session's top-k (0: all).
        text_rules: the text sampler's per-row rules, kept with the parameters (a step reads them, it does not
            derive them): ``(vocab, top)`` -> :meth:`RowSampling.rule`'s tensors over the B + 1 rows, for every
            static top-k size ``top`` of :data:`cspan.core.sampling.TOP_K_BOUNDS`.
        encoder, decoder: the Mimi streaming states (B rows), or None.
    """

    def __init__(
        self, lm: Any, mimi: Any | None, batch_size: int, plan: ExecutionPlan, grid: tuple[list, list, list]
    ) -> None:
        B = batch_size
        self.batch_size = B
        self.scratch = B
        self._lm_model = lm
        self.lm = lm.new_state(B + 1, kv_dtype=plan.kv_dtype)
        self.grid = TokenGrid(grid[0], grid[1], grid[2], B + 1, lm.device)
        self.seed = torch.zeros(B + 1, dtype=torch.long, device=lm.device)
        self.text_temp = torch.zeros(B + 1, dtype=torch.float32, device=lm.device)
        self.audio_temp = torch.zeros(B + 1, dtype=torch.float32, device=lm.device)
        self.text_top_k = torch.zeros(B + 1, dtype=torch.long, device=lm.device)
        self.audio_top_k = torch.zeros(B + 1, dtype=torch.long, device=lm.device)
        self.text_vocab = vocab = lm.text_linear.out_features
        text = RowSampling(self.text_temp, self.text_top_k)
        self.text_rules = {(vocab, top): text.rule(vocab, top) for top in {min(vocab, b) for b in TOP_K_BOUNDS}}
        self.encoder = mimi.new_encoder_state(B) if mimi is not None else None
        self.decoder = mimi.new_decoder_state(B) if mimi is not None else None
        self._depformer: dict[int, Any] = {}
        transformer = lm.transformer
        self.rope_period = transformer.max_period if transformer.positional_embedding == "rope" else None
        # the prefix entries of ``pinned`` sessions past the window, placed with the fused kernel where the plan has it
        self.pinned = PinnedSinks(
            self.lm.transformer.cache, self.rope_period, plan.fused and plan.device.type == "cuda"
        )

    def depformer(self, rows: int) -> Any:
        """The depformer's per-frame state for ``rows`` rows (one per step size, kept)."""
        if rows not in self._depformer:
            self._depformer[rows] = self._lm_model.new_depformer_state(rows)
        return self._depformer[rows]

    def set_sampling(self, sampling: dict[int, SessionSampling]) -> None:
        """Write the sampling parameters of some rows (device work, between steps; one copy per tensor)."""
        rows = torch.tensor(list(sampling), dtype=torch.long, device=self.seed.device)
        values = list(sampling.values())
        most = torch.iinfo(torch.long).max  # a top-k at or above the vocabulary keeps all, however large
        for tensor, column in (
            (self.text_temp, [p.text.temperature for p in values]),
            (self.audio_temp, [p.audio.temperature for p in values]),
            (self.text_top_k, [min(p.text.top_k, most) for p in values]),
            (self.audio_top_k, [min(p.audio.top_k, most) for p in values]),
        ):
            tensor.index_copy_(0, rows, torch.tensor(column, dtype=tensor.dtype).to(tensor.device))
        text = RowSampling(self.text_temp[rows], self.text_top_k[rows])
        for (vocab, top), rule in self.text_rules.items():
            for kept, value in zip(rule, text.rule(vocab, top), strict=True):
                kept.index_copy_(0, rows, value)

    def row_sampling(self, rows: torch.Tensor | slice, text_top: int) -> tuple[RowSampling, RowSampling]:
        """(text, audio) sampling parameters of ``rows`` [b] or a slice of rows (device ops only), with the text
        rules of the step's static top-k size ``text_top``."""

        def take(t: torch.Tensor) -> torch.Tensor:
            return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)

        key = (self.text_vocab, min(self.text_vocab, text_top))
        rules = {key: tuple(take(t) for t in self.text_rules[key])}
        return (
            RowSampling(take(self.text_temp), take(self.text_top_k), rules),
            RowSampling(take(self.audio_temp), take(self.audio_top_k)),
        )

    def pin(self, pins: dict[int, tuple[int, int]]) -> None:
        """Place the pinned prefixes of some rows, row -> (the first position of the window its step's last query
        sees, its sink positions S), in one pass (device work, between steps; a row's entries are copied from its
        ring the first time: :class:`cspan.core.window.PinnedSinks`)."""
        for row, (_, sinks) in pins.items():
            if row not in self.pinned:
                self.pinned.add(row, sinks)
        self.pinned.place({row: first for row, (first, _) in pins.items()})

    def restart(self, row: int, restart: Restart) -> None:
        """Apply a queued restart to ``row`` (device work, between steps)."""
        self.pinned.remove(row)
        rows = torch.tensor([row], dtype=torch.long, device=self.seed.device)
        self.lm.reset(rows)
        self.grid.reset(rows)
        self.seed[row] = restart.seed
        for codec in (self.encoder, self.decoder):
            if codec is not None:
                codec.reset(rows)
        if restart.prefix is not None:
            self.grid.load(row, restart.prefix.delayed, restart.prefix.pending)


@dataclass(frozen=True)
class StepShape:
    """The static shape of one step (hashed into the CUDA-graph key with the kind of call, by every field but the
    eager path's host layout): padded rows b, padded ragged tokens
    N, queries per prefill block, prefill query blocks, whether input embeddings come with the blocks, whether the
    library decode reads the ring, the text sampler's top-k size, whether the step has one decode slot per row
    (False: every row reads a block, so every next position is the last token of its row's ragged sequence), the
    ragged sequences (rows with a block: the prefill grids have room for this many, not for b); and
    whether the rows are every session in order (0 .. B - 1, no padding: the step reads the sessions' state as
    views and returns its outputs as they are, no gather or scatter); the host layout of the blocks (used by
    the eager path only); and what the temporal attention launches are sized for (the decode's rows, the block's
    live query blocks, and whether the block shares the step with decode slots): those of the CUDA-graph bucket the
    step pads to, also when it is laid out unpadded (a step no bucket serves: its own), so that an eager step and
    its graph split every row's keys alike (functions of the other fields when padded, so not part of the key)."""

    rows: int
    columns: int
    block_m: int
    queries: int
    embeddings: bool
    library: bool = False
    text_top: int = MAX_TOP_K
    slots: bool = True
    identity: bool = False
    sequences: int = 0
    blocks: tuple[tuple[int, int, int], ...] = field(default=(), compare=False)
    first_rows: int = field(default=0, compare=False)
    sized_rows: int = field(default=0, compare=False)
    live_blocks: int = field(default=0, compare=False)
    sized_slots: bool = field(default=False, compare=False)


@dataclass
class StepBatch:
    """One step's host-built inputs (see the module docstring).

    Attributes:
        rows: the live rows stepped (before padding).
        shape: the static shape.
        packed: [*] long on the host: :func:`unpack`'s fields, concatenated.
        embeddings: (values [N, D], use [N] bool) of the ragged tokens, or None.
        first_call: rows whose step is their first call after a reset (they return nothing).
        slot_rows: the decode slots' cache rows on the host (b; a block row's and a padding row's: the scratch row),
            empty without slots (a library decode plans its reads from them).
    """

    rows: list[int]
    shape: StepShape
    packed: torch.Tensor
    embeddings: tuple[torch.Tensor, torch.Tensor] | None
    first_call: list[int]
    slot_rows: list[int]


def build_step(
    rows: list[int],
    blocks: dict[int, list[Block]],
    prefixes: dict[int, PrefixBlock],
    positions: list[int],
    max_delay: int,
    num_streams: int,
    scratch: int,
    capacity: int,
    plan: ExecutionPlan,
    dtype: torch.dtype,
    text_top: int = MAX_TOP_K,
) -> StepBatch:
    """Lay out one step: the live ``rows`` (padded to the plan's row bucket with the scratch row) and each row's
    block (its prefix's block, then its queued spans).

    A row with a block reads it and its next position as ONE ragged sequence of n + 1 tokens (the block's columns,
    then the next position's column, which the device fills in): the next position's attention is part of the
    block's prefill, as a batch-1 chunk of n + 1 positions would be. The ragged tokens of all rows follow one
    another, padded to the plan's block bucket (no bucket serves them: laid out unpadded, and the step runs
    eagerly). Rows without a block have a decode slot each (token i of the step is row i's next position); when
    every row has a block, the step has no decode slots. A block row's decode slot, when the step has slots, is a
    dummy on the scratch row.

    Args:
        rows: the live rows.
        blocks: row -> queued span blocks.
        prefixes: row -> the persona prefix its restart reads.
        positions: each session's position in this step, after the blocks it reads (``StepHead.positions``).
        max_delay: the grid's largest delay (a row at a pending position below it returns nothing).
        num_streams: K.
        scratch: the scratch row.
        capacity: the KV ring's slots C.
        plan: the engine's plan.
        dtype: of the input embeddings.
        text_top: the text sampler's top-k size for these rows (:func:`cspan.core.sampling.top_k_bound`).
    """
    b_live = len(rows)
    parts: list[tuple[int, Block]] = []  # (ragged token index of its first column, block)
    row_blocks: list[tuple[int, int, int]] = []  # (i, start, n): n block columns, then the next position
    lens = [0] * b_live
    start = 0
    for i, row in enumerate(rows):
        mine = ([prefixes[row].block] if row in prefixes else []) + blocks.get(row, [])
        n = sum(blk.n for blk in mine)
        if n:
            row_blocks.append((i, start, n))
            at = start
            for blk in mine:
                parts.append((at, blk))
                at += blk.n
            lens[i] = n
            start += n + 1
    N_real = start
    bucket = plan.block_bucket(N_real)
    padded = plan.buckets and bucket is not None  # padded to the graph buckets
    N = bucket if padded else N_real
    b = plan.rows_bucket(b_live) if padded else b_live
    slots = not (row_blocks and len(row_blocks) == b)  # every row reads a block: no decode slots
    d = b if slots else 0
    block_m = 0 if N == 0 else fused.block_m_for(N if padded else max(lens) + 1)
    # query blocks of the prefill grid: enough for the S sequences whatever their lengths in the padded bucket (each
    # adds at most one partial block: sum ceil(L_i / m) <= ceil(N / m) + S - 1), else exactly these. S is part of the
    # graph key: a grid sized for b sequences would launch mostly idle programs (a 16-column span into 1 of 64
    # sessions: 64 query blocks x 32 heads x 16 key splits, 63 of 64 idle, +6 ms a frame on the H200)
    S = len(row_blocks)
    Q = 0 if N == 0 else -(-N // block_m) + S - 1 if padded else sum(-(-(n + 1) // block_m) for _, _, n in row_blocks)
    has_emb = any(blk.embeddings is not None for _, blk in parts)
    in_order = not padded and rows == list(range(b_live))  # eager: the rings of rows 0 .. b - 1 read as views
    library = slots and plan.library_decode(b)
    identity = b == b_live == scratch and rows == list(range(b))  # every session, in order (the scratch row is B)
    # the temporal attention's launches sized as the graph's that the step pads to (the same when padded): an unpadded
    # step then splits every row's keys as its graph does; a step no block bucket serves keeps its own sizes
    N_graph = plan.graph_tokens(N_real)
    sized_rows, live_blocks, sized_slots = b_live, 0, slots
    if N_graph is not None:
        sized_rows = plan.graph_rows(b_live)
        live_blocks = -(-N_graph // fused.block_m_for(N_graph)) if N_real else 0
        sized_slots = not (row_blocks and len(row_blocks) == sized_rows)  # a padding row's dummy slot: mixed
    shape = StepShape(
        b, N, block_m, Q, has_emb, library, text_top, slots, identity, S, tuple(row_blocks), b_live if in_order else 0,
        sized_rows, live_blocks, sized_slots,
    )  # fmt: skip

    pad = b - b_live
    row_list = rows + [scratch] * pad
    slot_row = list(row_list)  # the decode slots' rows: a block row's is a dummy on the scratch row
    for i, _, _ in row_blocks:
        slot_row[i] = scratch
    ints = row_list + lens + [0] * pad + [int(row not in prefixes) for row in rows] + [0] * pad  # rows, lens, write
    tokens = None
    if N:  # every table as one host list (one tensor built from it), the block columns by slices
        tokens = torch.zeros(num_streams, N, dtype=torch.long)
        for at, blk in parts:
            tokens[:, at : at + blk.n] = blk.tokens
        fold = [-1] * b  # each block row's next position, as a ragged token index
        final = list(range(b))  # each row's next position, as a token index of the step
        seq_row, seq_start, seq_len = [scratch] * S, [0] * S, [0] * S
        last_seq, last_j = [-1] * S, [0] * S  # the query block holding each sequence's last token
        qb_seq, qb_j = [-1] * Q, [0] * Q
        tok_row, tok_j, tok_keep = [scratch] * N, [-1] * N, [0] * N
        q = 0
        for s, (i, st, n) in enumerate(row_blocks):
            L = n + 1
            fold[i], final[i] = st + n, d + st + n
            seq_row[s], seq_start[s], seq_len[s] = rows[i], st, L
            tok_row[st : st + L] = [rows[i]] * L
            tok_j[st : st + L] = range(L)
            keep = min(L, capacity)  # a sequence longer than the ring keeps its last C
            tok_keep[st + L - keep : st + L] = [1] * keep
            per = -(-L // block_m)
            qb_seq[q : q + per] = [s] * per
            qb_j[q : q + per] = range(0, per * block_m, block_m)
            q += per
            last_seq[s], last_j[s] = s, (per - 1) * block_m
        ints += slot_row + fold + final + seq_row + seq_start + seq_len + qb_seq + qb_j + last_seq + last_j
        ints += tok_row + tok_j + tok_keep
    embeddings = None
    if has_emb:
        width = next(blk.embeddings.shape[-1] for _, blk in parts if blk.embeddings is not None)
        values = torch.zeros(N, width, dtype=dtype)
        use = torch.zeros(N, dtype=torch.bool)
        for at, blk in parts:
            if blk.embeddings is not None:
                E = blk.embeddings.shape[0]
                values[at : at + E] = blk.embeddings.to(dtype)
                use[at : at + E] = True
        embeddings = (values, use)
    first_call = [row for row in rows if positions[row] < max_delay]
    packed = torch.tensor(ints, dtype=torch.long)
    if tokens is not None:
        packed = torch.cat([packed, tokens.view(-1)])
    if plan.device.type == "cuda":  # page-locked: the step's copy to the device is asynchronous (no host sync)
        packed = packed.pin_memory()
        embeddings = None if embeddings is None else (embeddings[0].pin_memory(), embeddings[1].pin_memory())
    return StepBatch(
        rows=rows, shape=shape, packed=packed, embeddings=embeddings, first_call=first_call,
        slot_rows=slot_row if slots else [],
    )  # fmt: skip


@dataclass
class StepInputs:
    """One step's inputs on the device (views of the packed tensor): rows [b], write_user [b] bool, the ragged
    tokens' columns [K, N] (a block row's next position column left to fill), each block row's next position as a
    ragged token index ``fold`` [b] (-1: no block; None without ragged tokens), and the transformer's
    :class:`StepLayout`."""

    rows: torch.Tensor
    write_user: torch.Tensor
    tokens: torch.Tensor
    fold: torch.Tensor | None
    layout: StepLayout


def unpack(packed: torch.Tensor, shape: StepShape, num_streams: int) -> StepInputs:
    """The views of a packed :class:`StepBatch` tensor (on the device)."""
    b, N, Q, S = shape.rows, shape.columns, shape.queries, shape.sequences
    sizes = [b, b, b]
    if N:
        sizes += [b, b, b, S, S, S, Q, Q, S, S, N, N, N, num_streams * N]
    parts = torch.split(packed, sizes)
    rows, block_len, write = parts[0], parts[1], parts[2].bool()
    ragged = last = fold = None
    slot_rows, final = rows, None
    tokens = packed.new_zeros(num_streams, 0)
    if N:
        slot_rows, fold, final = parts[3:6]
        seq_row, seq_start, seq_len, qb_seq, qb_j, last_seq, last_j, tok_row, tok_j, tok_keep = parts[6:16]
        tokens = parts[16].view(num_streams, N)
        ragged = fused.Ragged(
            seq_row=seq_row, seq_start=seq_start, seq_len=seq_len, qb_seq=qb_seq, qb_j=qb_j,
            tok_row=tok_row, tok_j=tok_j, tok_keep=tok_keep.bool(), block_m=shape.block_m,
            live_blocks=shape.live_blocks,
        )  # fmt: skip
        last = (last_seq, last_j)
    layout = StepLayout(
        rows=rows,
        block_len=block_len,
        slot_rows=slot_rows if shape.slots else None,
        final=final,
        blocks=list(shape.blocks),
        ragged=ragged,
        last_queries=last,
        first_rows=shape.first_rows,
        sized_rows=shape.sized_rows,
        sized_slots=shape.sized_slots,
    )
    return StepInputs(rows=rows, write_user=write, tokens=tokens, fold=fold, layout=layout)


__all__ = [
    "EngineState",
    "Persona",
    "Restart",
    "Sessions",
    "StepBatch",
    "StepHead",
    "StepInputs",
    "StepShape",
    "build_step",
    "unpack",
]
