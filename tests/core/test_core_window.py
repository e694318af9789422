"""The persona past the attention window (``cspan.core.window``): pinned sink positions and re-read copies.

Every test records what the engine fed each session (the prefix, span and copy columns of each step, and the
step's input column), recomputes the temporal transformer's keys and values from those tokens with an independent
reference (a whole-sequence forward in which each query sees the window the policy defines), and compares the
engine's KV ring with it. The long test runs the tiny checkpoint with its real 3000-position window over more than
three windows, checking at every frame that the persona is in the window.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest
import torch
from torch.nn import functional as F

from cspan.core.constants import SILENCE_TOKENS, SINE_TOKENS
from cspan.core.engine import DuplexEngine
from cspan.core.modules.rope import apply_rope
from cspan.core.prefix import prefix_block
from cspan.core.span import ContextSpan
from cspan.core.window import WindowEvent, reprefix_block, rope_rotate

AGENT_PH = [t % 64 for t in SILENCE_TOKENS]
USER_PH = [t % 64 for t in SINE_TOKENS]


# -- an independent reference ------------------------------------------------------------------------------------


def rotate(x: torch.Tensor, delta: int, period: float) -> torch.Tensor:
    """RoPE keys x [..., Dh] moved by ``delta`` positions, with complex numbers in float64 (independent of
    ``cspan.core.window.rope_rotate``)."""
    Dh = x.shape[-1]
    freqs = torch.exp(torch.arange(Dh // 2, dtype=torch.float32) * (-math.log(period) * 2 / Dh)).double()
    c = torch.view_as_complex(x.double().reshape(*x.shape[:-1], Dh // 2, 2).contiguous())
    turn = torch.polar(torch.ones_like(freqs), delta * freqs)
    return torch.view_as_real(c * turn).reshape(x.shape).to(x.dtype)


@dataclass
class Record:
    """What one session was fed: ``columns`` [K, T] at positions 0 .. T - 1, and per step the first position it
    read ``o``, its last query ``q`` and where the pinned prefix was placed (0: not placed)."""

    columns: list[torch.Tensor] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (first position, length) of each copy read

    @property
    def length(self) -> int:
        return sum(c.shape[1] for c in self.columns)


def reference_kv(lm, record: Record, window: int, sinks: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys [H, T, Dh] (RoPE at their own positions) and values of every layer, recomputed from the fed tokens.

    The query at position p of a step that read positions ``o .. q`` sees the positions ``p - W < p' <= p``, where
    a step that placed the pinned prefix at ``d`` (> 0) holds prefix entry j (key moved from position j to
    ``d + j``) at the positions ``d .. d + S - 1`` older than ``o``, and the previous step's placement stays where
    the current one does not reach (the ring is not cleared between steps)."""
    tr = lm.transformer
    H, Dh, period = tr.num_heads, tr.head_dim, tr.max_period
    columns = torch.cat(record.columns, dim=1)
    T = columns.shape[1]
    x = lm.embed(columns[None])[0]
    positions = torch.arange(T)[None]
    keys_out, values_out = [], []
    for layer in tr.layers:
        h = layer.norm1(x[None])[0]
        qkv = F.linear(h, layer.self_attn.in_proj_weight).view(T, 3, H, Dh).permute(1, 2, 0, 3)
        q, k = apply_rope(qkv[0][None], qkv[1][None], positions, period)
        q, k, v = q[0], k[0], qkv[2]
        out = torch.zeros(H, T, Dh)
        previous = 0
        for o, last, placed in record.steps:
            lo = max(0, o - window + 1)
            keys, values = k[:, lo : last + 1].clone(), v[:, lo : last + 1].clone()
            for d in (previous, placed):  # the previous placement first: the current one overrides it
                a, b = max(d, lo), min(d + sinks, o)  # entries j = p - d at positions lo <= p < o
                if d > 0 and a < b:
                    keys[:, a - lo : b - lo] = rotate(k[:, a - d : b - d], d, period)
                    values[:, a - lo : b - lo] = v[:, a - d : b - d]
            qp, kp = torch.arange(o, last + 1), torch.arange(lo, last + 1)
            delta = qp[:, None] - kp[None, :]
            mask = (delta >= 0) & (delta < window)
            out[:, o : last + 1] = F.scaled_dot_product_attention(q[:, o : last + 1], keys, values, attn_mask=mask)
            previous = placed
        keys_out.append(k)
        values_out.append(v)
        attn = F.linear(out.transpose(0, 1).reshape(T, H * Dh), layer.self_attn.out_proj.weight)
        x = x + layer.layer_scale_1(attn)
        x = x + layer.layer_scale_2(layer.feed_forward(layer.norm2(x[None]), None)[0])
    return keys_out, values_out


def expected_ring(keys, values, capacity: int, last: int, placed: int, sinks: int, period: float):
    """The ring [L, H, C, Dh] (keys, values) after a step whose last query was ``last`` and whose pinned prefix
    went to ``placed``; and the filled slots."""
    k, v = torch.stack(keys), torch.stack(values)  # [L, H, T, Dh]
    held = torch.arange(max(0, last - capacity + 1), last + 1)  # the positions the ring holds
    ring_k, ring_v = k[:, :, held].clone(), v[:, :, held].clone()
    if placed > 0:
        ring_k[:, :, :sinks] = rotate(k[:, :, :sinks], placed, period)  # positions placed .. placed + S - 1
        ring_v[:, :, :sinks] = v[:, :, :sinks]
        assert int(held[0]) == placed
    slots = held % capacity
    out_k, out_v = torch.zeros(*k.shape[:2], capacity, k.shape[3]), torch.zeros(*k.shape[:2], capacity, k.shape[3])
    out_k[:, :, slots], out_v[:, :, slots] = ring_k, ring_v
    filled = torch.zeros(capacity, dtype=torch.bool)
    filled[slots] = True
    return out_k, out_v, filled


def engine_capacity(lm) -> int:
    return lm.transformer.default_capacity()


class Recorder:
    """Wraps ``engine.sessions.take`` to record what each session's step reads (prefix, spans, copies, pins)."""

    def __init__(self, engine: DuplexEngine, rows: list[int]) -> None:
        self.engine = engine
        self.records = {r: Record() for r in rows}
        self._pending: dict[int, tuple[int, int]] = {}
        take = engine.sessions.take

        def recording_take():
            head = take()
            live, restarts, blocks, pins = head.rows, head.restarts, head.blocks, head.pins
            for row in live:
                if row not in self.records:
                    continue
                rec = self.records[row]
                restart = restarts.get(row)
                if restart is not None and restart.prefix is not None:
                    rec.columns, rec.steps, rec.copies = [], [], []
                o = rec.length
                if restart is not None and restart.prefix is not None:
                    rec.columns.append(restart.prefix.block.tokens)
                copy = engine.sessions.persona[row].copy if row in engine.sessions.persona else None
                for block in blocks.get(row, []):
                    if copy is not None and block is copy:
                        rec.copies.append((rec.length, block.n))
                    rec.columns.append(block.tokens)
                self._pending[row] = (o, pins.get(row, (0, 0))[0])
            return head

        engine.sessions.take = recording_take

    def after(self, out) -> None:
        """Record the step's input columns (``out``: its :class:`TokenStepOutput`)."""
        for row, (o, placed) in self._pending.items():
            rec = self.records[row]
            assert int(out.position[row]) == rec.length  # the last query follows the blocks read
            rec.columns.append(out.input[row][:, None].cpu())
            rec.steps.append((o, rec.length - 1, placed))
        self._pending = {}


def snapshot(engine: DuplexEngine, row: int) -> tuple[torch.Tensor, torch.Tensor]:
    cache = engine.lm_state.transformer.cache
    return cache.keys[:, row].clone(), cache.values[:, row].clone()


def check_ring(engine, row, snap, keys, values, step, sinks, atol=2e-5) -> None:
    _, last, placed = step
    lm = engine.lm
    cache = engine.lm_state.transformer.cache
    ring_k, ring_v, filled = expected_ring(keys, values, cache.capacity, last, placed, sinks, lm.transformer.max_period)
    torch.testing.assert_close(snap[0][:, :, filled], ring_k[:, :, filled], atol=atol, rtol=1e-4)
    torch.testing.assert_close(snap[1][:, :, filled], ring_v[:, :, filled], atol=atol, rtol=1e-4)


# -- units -----------------------------------------------------------------------------------------------------------


def test_rope_rotate_moves_a_key_to_another_position() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 3, 16, generator=gen), torch.randn(1, 2, 3, 16, generator=gen)
    at = torch.tensor([[5, 6, 7]])
    _, k5 = apply_rope(q, k, at, 10_000.0)
    _, k_far = apply_rope(q, k, at + 40, 10_000.0)
    torch.testing.assert_close(rope_rotate(k5, 40, 10_000.0), k_far, atol=2e-6, rtol=0)
    torch.testing.assert_close(rope_rotate(k5, 40, 10_000.0), rotate(k5, 40, 10_000.0), atol=1e-6, rtol=0)
    back = rope_rotate(rope_rotate(k5, 123_456, 10_000.0), -123_456, 10_000.0)
    torch.testing.assert_close(back, k5, atol=1e-6, rtol=0)  # any distance: float64 angles
    per_key = rope_rotate(k5[0, 0], torch.tensor([1, 2, 3]), 10_000.0)
    torch.testing.assert_close(per_key[1], rotate(k5[0, 0, 1], 2, 10_000.0), atol=1e-6, rtol=0)


def test_reprefix_block_is_the_prefix_without_its_start_column() -> None:
    delays = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    initial = [100] + [64] * 16
    frames = torch.randint(0, 64, (17, 5), generator=torch.Generator().manual_seed(1))
    emb = torch.randn(3, 8)
    prefix = prefix_block(frames, delays, initial, emb)
    copy = reprefix_block(prefix, delays, AGENT_PH, USER_PH)
    assert copy.n == 5  # positions 1 .. P
    assert torch.equal(copy.tokens[:, 1:], prefix.delayed[:, 2:6])
    first = copy.tokens[:, 0]  # position 1: text and semantic codes of frame 0, no acoustic codes yet
    assert torch.equal(first[[0, 1, 9]], frames[[0, 1, 9], 0])
    assert first[2:9].tolist() == AGENT_PH[1:] and first[10:].tolist() == USER_PH[1:]
    assert torch.equal(copy.embeddings, emb[1:])  # positions 1 .. E - 1


def test_a_span_queued_while_a_step_runs_places_the_copy_where_it_is_read() -> None:
    """``reprefix``, window 16, prefix of 3 frames: a 6-column span queued for the session while its step feeding
    position 10 runs (another thread) is read after position 10, at 11..16, so the copy it makes due starts at 17,
    as when the span comes right after that step (was: 16, the position the running step fed)."""
    from cspan.core.sampling import SamplingParams, SessionSampling
    from cspan.core.sessions import Persona, Sessions
    from cspan.core.span import Block

    delays = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    prefix = prefix_block(torch.zeros(17, 3, dtype=torch.long), delays, [100] + [64] * 16)
    copy = reprefix_block(prefix, delays, AGENT_PH, USER_PH)
    span = Block(torch.zeros(17, 6, dtype=torch.long), span_seq=0)

    def run(race: bool) -> tuple[list, list[int], list]:
        sampling = SessionSampling(SamplingParams.text(0.7, 25), SamplingParams.audio(0.8, 250))
        sessions = Sessions([1], sampling, context=16)
        sessions.reset([0], [1], prefix, Persona("reprefix", sinks=4, copy=copy))
        while sessions.position[0] < 10:
            sessions.take(), sessions.advance([0])
        head = sessions.take()  # the step feeding position 10 is under way
        assert head.positions == [10]
        first = sessions.queue(0, span) if race else None
        sessions.advance([0])
        if not race:
            first = sessions.queue(0, span)
        reads = (sessions.take(), sessions.take_span_reads(0))[1]
        return [first, *reads], sessions.position, sessions.take_window_events(0)

    raced, clean = run(True), run(False)
    assert raced == clean
    (first, read), position, events = clean
    assert first == read.first_position == 11 and events == [WindowEvent("reprefix", 17, copy.n)]
    assert position == [17 + copy.n]


def test_a_copy_is_reported_by_the_step_that_reads_it() -> None:
    """``reprefix``, window 16, prefix of 3 frames: the step feeding position 15 makes the copy due (the next query
    would not see position 0); the next step reads it at 16..18, before its own frame at 19, and the ``reprefix``
    event comes with that step. It came with the step that queued it, so ``cspan infer`` reported the copy (its
    ``persona`` event, ``window.reprefix_frames``) at the frame before the one whose head read it."""
    from cspan.core.sampling import SamplingParams, SessionSampling
    from cspan.core.sessions import Persona, Sessions

    delays = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]
    prefix = prefix_block(torch.zeros(17, 3, dtype=torch.long), delays, [100] + [64] * 16)
    copy = reprefix_block(prefix, delays, AGENT_PH, USER_PH)
    sampling = SessionSampling(SamplingParams.text(0.7, 25), SamplingParams.audio(0.8, 250))
    sessions = Sessions([1], sampling, context=16)
    sessions.reset([0], [1], prefix, Persona("reprefix", sinks=4, copy=copy))
    seen = []
    for _ in range(16):
        head = sessions.take()
        seen.append((head.positions[0], [blk.n for blk in head.blocks.get(0, [])], sessions.take_window_events(0)))
        sessions.advance([0])
        assert sessions.take_window_events(0) == []  # never at the step that queued the copy
    reads = [(position, events) for position, blocks, events in seen if blocks or events]
    assert reads == [(19, [WindowEvent("reprefix", 16, copy.n)])] and copy.n == 3
    assert seen[12][0] == 15  # the step that queued it fed position 15


# -- the policies against the reference, window of 16 ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["pinned", "reprefix", "none"])
def test_policy_equals_the_reference_at_every_step(reference_lm, policy) -> None:
    """A window of 16, a prefix of 5 positions and spans crossing the window: after every step the KV ring equals
    the reference recomputation (pinned: the prefix at the window's oldest positions; reprefix: the copies read)."""
    lm = reference_lm("lm-moshi-shaped", context=16)
    engine = DuplexEngine(lm, temp=0.8, temp_text=0.7, seed=3, agent_placeholder=AGENT_PH, user_placeholder=USER_PH)
    voice = torch.randint(0, 64, (8, 3), generator=torch.Generator().manual_seed(2))
    engine.set_persona(0, None, voice, policy=policy)  # P = 4: positions 0 .. 4
    recorder = Recorder(engine, [0])
    gen = torch.Generator().manual_seed(5)
    snaps = []
    for c in range(70):
        if c in (9, 30, 31, 50):
            engine.inject_span(0, ContextSpan.from_ids(torch.randint(20, 90, (c % 7 + 1,), generator=gen).tolist()))
        out = engine.step_tokens(torch.randint(0, 64, (1, 8), generator=gen))
        recorder.after(out)
        snaps.append(snapshot(engine, 0))
        assert engine.prefix_in_window(0) == (policy != "none" or engine.positions[0] < 16)
    rec = recorder.records[0]
    assert rec.length > 4 * 16
    keys, values = reference_kv(lm, rec, 16, 5)
    for step, snap in zip(rec.steps, snaps, strict=True):
        check_ring(engine, 0, snap, keys, values, step, 5)
    placed = [d for _, _, d in rec.steps]
    if policy == "pinned":
        assert placed == [max(0, q - 15) for _, q, _ in rec.steps]
        assert [e.kind for e in engine.take_window_events(0)] == ["pin"]
    else:
        assert not any(placed)
    if policy == "reprefix":
        events = engine.take_window_events(0)
        assert [(e.position, e.positions) for e in events] == rec.copies and len(rec.copies) >= 4
        first = 0
        for _o, q, _ in rec.steps:  # every last query saw the whole latest copy
            first = max([f for f, _ in rec.copies if f <= q] + [0])
            assert q - first < 16
    else:
        assert not rec.copies


# -- the tiny checkpoint, its real window, more than three windows -------------------------------------------------


@pytest.mark.timeout(300)
def test_three_windows_on_the_tiny_checkpoint(tiny_checkpoint) -> None:
    """Two sessions of the tiny checkpoint (window 3000) in one engine, one ``pinned`` and one ``reprefix``,
    through more than three windows of positions: 430 frames and sixteen 600-column Context Spans (the longest a
    span may be), so that the test stays lean on a CPU while every kind of step crosses the window. At every frame:
    the whole persona is visible to the session's next query (pinned: the prefix entries sit at the window's oldest
    positions, keys rotated there; reprefix: the latest copy is inside the window). At every span, copy, the first
    pin and every 100 frames: the KV ring equals the reference recomputation."""
    lm = tiny_checkpoint.lm
    W = lm.cfg.context
    assert W == 3000 and engine_capacity(lm) == W
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=11, predict_user=False)
    policies = {0: "pinned", 1: "reprefix"}
    for row, policy in policies.items():
        engine.set_persona(row, "You are a tiny assistant who keeps its role.", "tiny0", policy=policy)
    P = engine.prefix_end[0]
    S = P + 1
    recorder = Recorder(engine, [0, 1])
    gen = torch.Generator().manual_seed(7)
    period = lm.transformer.max_period
    span_frames = set(range(10, 410, 25))  # 16 spans of 600 columns: 9600 positions
    snaps: dict[int, list[tuple[int, tuple[torch.Tensor, torch.Tensor]]]] = {0: [], 1: []}
    cache = engine.lm_state.transformer.cache
    frames = 430
    for c in range(frames):
        if c in span_frames:
            for row in (0, 1):
                ids = torch.randint(20, 900, (598,), generator=gen).tolist()
                engine.inject_span(row, ContextSpan.from_ids(ids))
        out = engine.step_tokens(torch.randint(0, 2048, (2, 8), generator=gen))
        recorder.after(out)
        for row in (0, 1):
            rec = recorder.records[row]
            o, q, placed = rec.steps[-1]
            assert engine.prefix_in_window(row)
            if row == 0:  # the pinned prefix: entries 0 .. S - 1 at the window's oldest positions
                assert placed == max(0, q - W + 1)
                if placed:
                    sink = engine.state.pinned[0]
                    slots = (placed + torch.arange(S)) % cache.capacity
                    moved = rotate(sink.keys, placed, period)
                    torch.testing.assert_close(cache.keys[:, 0][:, :, slots], moved, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(cache.values[:, 0][:, :, slots], sink.values, atol=0, rtol=0)
            else:  # the latest copy of the prefix is inside the window of every last query
                first = max([f for f, _ in rec.copies] + [0])
                assert q - first < W
            due = c in span_frames or c % 100 == 99 or (rec.copies and rec.copies[-1][0] >= o)
            due = due or (row == 0 and placed and len(rec.steps) > 1 and not rec.steps[-2][2])
            if due:
                snaps[row].append((len(rec.steps) - 1, snapshot(engine, row)))
    for row in (0, 1):
        rec = recorder.records[row]
        assert rec.length > 3 * W, rec.length  # more than three windows of positions
        events = engine.take_window_events(row)
        if row == 0:
            assert [e.kind for e in events] == ["pin"] and events[0].positions == S
        else:
            assert [(e.position, e.positions) for e in events] == rec.copies and len(rec.copies) >= 3
        keys, values = reference_kv(lm, rec, W, S)
        assert len(snaps[row]) >= 15
        for k, snap in snaps[row]:
            check_ring(engine, row, snap, keys, values, rec.steps[k], S, atol=1e-4)


def _pinned_cache(kv_dtype: torch.dtype, sinks: dict[int, int], seed: int = 3):
    """A KV cache whose rows of ``sinks`` hold random entries at positions 0 .. S - 1, and those entries."""
    from cspan.core.kv_cache import KVCache, quantize_fp8

    gen = torch.Generator().manual_seed(seed)
    L, B, H, Dh, C = 2, 3, 3, 8, 24
    cache = KVCache(L, B, H, Dh, C, torch.device("cpu"), kv_dtype, torch.float32)
    entries = {}
    for row, S in sinks.items():
        k, v = (torch.randn(L, H, S, Dh, generator=gen) for _ in range(2))
        for buf, scale, x in ((cache.keys, cache.key_scale, k), (cache.values, cache.value_scale, v)):
            if scale is not None:
                x, sc = quantize_fp8(x)
                scale[:, row, :, :S] = sc
            buf[:, row, :, :S] = x.to(buf.dtype)
        entries[row] = (k, v)
    return cache, entries


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_pinned_prefixes_of_several_rows_are_placed_in_one_pass(kv_dtype: torch.dtype) -> None:
    """PinnedSinks: rows with different sink counts and windows, one pass = each row's entries rotated to its
    window's oldest positions (float64 reference) in the slots of those positions; a row not placed in the step and
    a removed row keep their slots; FP8 within its rounding."""
    from cspan.core.window import PinnedSinks

    period = 10_000.0
    sinks = {0: 5, 1: 4, 2: 3}
    cache, entries = _pinned_cache(kv_dtype, sinks)
    C = cache.capacity
    store = PinnedSinks(cache, period, kernel=False)
    for row, S in sinks.items():
        store.add(row, S)
    store.remove(1)
    before_row1 = cache.keys[:, 1].clone()
    firsts = {0: 1000, 2: 77_777}
    store.place(firsts)
    tol = 1e-5 if kv_dtype == torch.float32 else 0.07
    for row in firsts:
        S = sinks[row]
        slots = (firsts[row] + torch.arange(S)) % C
        got_k, got_v = cache.keys[:, row][:, :, slots].float(), cache.values[:, row][:, :, slots].float()
        if cache.key_scale is not None:
            got_k = got_k * cache.key_scale[:, row][:, :, slots][..., None]
            got_v = got_v * cache.value_scale[:, row][:, :, slots][..., None]
        k, v = entries[row]
        want_k = rope_rotate(k, firsts[row], period)
        torch.testing.assert_close(got_k, want_k, atol=tol * want_k.abs().max().item(), rtol=tol)
        torch.testing.assert_close(got_v, v, atol=tol * v.abs().max().item(), rtol=tol)
    assert torch.equal(cache.keys[:, 1], before_row1)  # removed: untouched


@pytest.mark.skipif(
    os.environ.get("CSPAN_TEST_INTERPRETER") != "1", reason="Triton's interpreter: opt in with CSPAN_TEST_INTERPRETER=1"
)
def test_pinned_sinks_kernel_equals_the_tensor_path() -> None:
    """The fused kv_write with RoPE (the CUDA path of PinnedSinks.place) = the tensor path, one row not placed
    (float32: the interpreter's FP8 conversion is not the GPU's; kv_write's FP8 store is covered on the GPU by
    test_core_fused_cuda)."""
    kv_dtype = torch.float32
    from cspan.core.window import PinnedSinks

    sinks = {0: 5, 1: 4, 2: 3}
    out = []
    for kernel in (False, True):
        cache, _ = _pinned_cache(kv_dtype, sinks)
        store = PinnedSinks(cache, 10_000.0, kernel=kernel)
        for row, S in sinks.items():
            store.add(row, S)
        store.place({0: 1000, 2: 77_777})
        out.append(cache)
    a, b = out
    torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.values, b.values, atol=0, rtol=0)
