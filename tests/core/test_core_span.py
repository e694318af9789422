"""Context Spans: block layout, splicing, and a block read in the step == forcing the spliced sequence step by step.

Most tests run on the reference fixture LMs (card 64, text_card 100), so the placeholder codes are taken modulo 64
and span ids are given directly; one test runs the real tokenizer and placeholders on the tiny checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from cspan.core.constants import SILENCE_TOKENS, SINE_TOKENS, SPAN_CLOSE, SPAN_OPEN, UNGENERATED
from cspan.core.engine import DuplexEngine
from cspan.core.errors import SpanError
from cspan.core.span import (
    ContextSpan,
    span_block,
    splice_block,
    splice_mask,
    splice_span_frames,
)
from cspan.core.streams import delay_tokens, undelay_tokens

AGENT_PH = [t % 64 for t in SILENCE_TOKENS]
USER_PH = [t % 64 for t in SINE_TOKENS]
DELAYS_7B = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]


class _Spm:
    """A stand-in tokenizer: one id per character (enough for the encode/truncation rules)."""

    def encode(self, text: str) -> list[int]:
        return [20 + (ord(ch) % 70) for ch in text]


def _engine(lm, batch_size: int = 1, **kwargs) -> DuplexEngine:
    return DuplexEngine(
        lm, batch_size=batch_size, temp=0, temp_text=0, agent_placeholder=AGENT_PH, user_placeholder=USER_PH, **kwargs
    )


def _block(ids) -> torch.Tensor:
    return span_block(ids, agent_placeholder=AGENT_PH, user_placeholder=USER_PH)


def _kv(engine: DuplexEngine, row: int = 0):
    cache = engine.lm_state.transformer.cache
    return cache.keys[:, row], cache.values[:, row], int(cache.offset[row])


def _force_stepwise(engine: DuplexEngine, seq: torch.Tensor) -> None:
    """Feed the delayed sequence ``seq`` [K, L] (positions 0..L-1) through L - 1 ordinary calls: call c is given
    the user codes that put seq's user rows in place (row r at position c + delay_r) and forces the target column
    ``seq[:, c + 1]``. Afterwards the KV cache holds positions 0..L-2 and the pending column is ``seq[:, L-1]``."""
    L = seq.shape[1]
    rows = engine.user_rows
    for c in range(L - 1):
        user = torch.stack([seq[r, c + engine.grid.delays[r]] for r in rows])
        engine.step_tokens(user[None], seq[:, c + 1][None])


# -- layout ----------------------------------------------------------------------------------------------------------


def test_context_span_ids_and_truncation() -> None:
    spm = _Spm()
    ids, truncated = ContextSpan("  sunny  ").encode(spm)
    assert ids == [SPAN_OPEN, *spm.encode("sunny"), SPAN_CLOSE] and not truncated
    ids, truncated = ContextSpan("abcdefghij").encode(spm, max_frames=6)
    assert ids == [SPAN_OPEN, *spm.encode("abcd"), SPAN_CLOSE] and truncated
    assert ContextSpan.from_ids([5, 6]).encode() == ([12, 5, 6, 13], False)
    assert ContextSpan.from_ids([5, 6, 7], markers=False).encode(max_frames=3) == ([5, 6, 7], False)
    assert ContextSpan.from_ids([5, 6, 7, 8], markers=False).encode(max_frames=3) == ([5, 6, 7], True)
    with pytest.raises(SpanError, match="empty"):
        ContextSpan("   ").encode(spm)
    with pytest.raises(SpanError, match="tokenizer"):
        ContextSpan("hello").encode(None)
    with pytest.raises(SpanError, match="at least 3"):
        ContextSpan("hello").encode(spm, max_frames=2)


def test_span_block_is_constant_columns_in_delayed_coordinates() -> None:
    block = span_block([12, 50, 51, 13])
    assert block.shape == (17, 4)
    assert block[0].tolist() == [12, 50, 51, 13]
    assert all(block[1:9, j].tolist() == list(SILENCE_TOKENS) for j in range(4))
    assert all(block[9:17, j].tolist() == list(SINE_TOKENS) for j in range(4))
    with pytest.raises(SpanError):
        span_block([])


def test_splice_block_and_mask() -> None:
    seq = torch.arange(17 * 5).view(17, 5)
    block = span_block([12, 13])
    out = splice_block(seq, 3, block)
    assert out.shape == (17, 7)
    assert (
        torch.equal(out[:, :3], seq[:, :3]) and torch.equal(out[:, 3:5], block) and torch.equal(out[:, 5:], seq[:, 3:])
    )
    batched = splice_block(seq[None].expand(2, -1, -1), 0, block)
    assert torch.equal(batched[1, :, :2], block)
    mask = splice_mask(torch.ones(5, dtype=torch.bool), 3, 2)
    assert mask.tolist() == [True, True, True, False, False, True, True]
    with pytest.raises(ValueError):
        splice_block(seq, 6, block)


def test_splice_in_frames_is_the_move_convention() -> None:
    """Undelayed view (MindLogic Context Spanning ``assemble_training_sequence``): block before frame f, the
    acoustic codes of frame f - 1 replaced by placeholders and moved into the block's last frame."""
    g = torch.Generator().manual_seed(0)
    X = torch.randint(0, 2048, (17, 8), generator=g)
    X[0] = torch.randint(14, 1000, (8,), generator=g)
    ids = [12, 300, 301, 13]
    n, f = len(ids), 5
    block = span_block(ids)
    out = splice_span_frames(X, f, block, DELAYS_7B, [32000] + [2048] * 16)
    ac = [r for r in range(17) if DELAYS_7B[r] == 1]
    sem = [r for r in range(17) if DELAYS_7B[r] == 0]
    move = torch.cat([X[:, :f], block, X[:, f:]], dim=1)  # text/semantic rows: block before frame f
    move[ac, f - 1] = block[ac, 0]  # frame f-1's acoustics -> placeholders ...
    move[ac, f + n - 1] = X[ac, f - 1]  # ... and moved into the block's last frame
    assert torch.equal(out[sem], move[sem])
    assert torch.equal(out[ac], move[ac])
    assert (out != UNGENERATED).all()


# -- injection == forcing step by step -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "n", "context", "calls"),
    [
        ("lm-moshi-shaped", 1, None, 6),
        ("lm-moshi-shaped", 7, None, 6),
        ("lm-moshi-shaped", 64, None, 6),
        ("lm-personaplex-shaped", 7, None, 6),
        ("lm-moshi-shaped", 20, 16, 10),  # positions 10..29 with a window of 16: the block crosses the window
        ("lm-personaplex-shaped", 40, 16, 10),  # a block longer than the window (and the KV ring)
    ],
)
def test_inject_equals_forcing_the_spliced_sequence_step_by_step(reference_lm, name, n, context, calls) -> None:
    """inject_span queues the block (host only); the next step reads it with the session's next position in one
    forward. KV cache, grid, frames and logits equal forcing the spliced sequence one ordinary call at a time."""
    lm = reference_lm(name, **({} if context is None else {"context": context}))
    g = torch.Generator().manual_seed(n)
    user = torch.randint(0, 64, (calls + 3, 1, 8), generator=g)
    ids = torch.randint(14, 100, (n,), generator=g).tolist()

    live = _engine(lm)
    outs = [live.step_tokens(user[c]) for c in range(calls)]
    inputs = [o.input[0] for o in outs]
    pending = live.grid.row_state(0)[0][:, live.grid.pending]
    report = live.inject_span(0, ContextSpan.from_ids(ids, markers=False))
    assert (report.n, report.first_position, report.last_position, report.next_position) == (
        n,
        calls,
        calls + n - 1,
        calls + n,
    )
    assert live.positions == [calls + n] and report.deferred
    assert int(live.lm_state.offset[0]) == calls  # nothing read yet: queued on the host

    # the recorded delayed sequence with the block spliced in, forced one ordinary call at a time
    seq = splice_block(torch.stack([*inputs, pending], dim=1), calls, _block(ids))  # [K, calls + n + 1]
    ref = _engine(lm)
    _force_stepwise(ref, seq)
    assert ref.positions == live.positions
    for c in range(calls, calls + 3):
        a, b = live.step_tokens(user[c]), ref.step_tokens(user[c])
        if c == calls:  # the step that read the block fed the spliced pending column; no swallowed frame
            assert torch.equal(a.input[0], b.input[0]) and a.position.tolist() == [calls + n]
            assert torch.equal(a.frame[0, :2], outs[-1].column[0, :2])
            k_live, v_live, off_live = _kv(live)
            k_ref, v_ref, off_ref = _kv(ref)
            assert off_live == off_ref == calls + n + 1
            torch.testing.assert_close(k_live, k_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(v_live, v_ref, atol=1e-5, rtol=0)
            assert torch.equal(live.grid.buffer, ref.grid.buffer)
        torch.testing.assert_close(a.text_logits, b.text_logits, atol=1e-5, rtol=0)
        assert torch.equal(a.frame, b.frame) and torch.equal(a.column, b.column)


def test_injected_stream_equals_the_training_forward_on_spliced_frames(reference_lm) -> None:
    """Inference equals training: the engine's logits after a span = LMModel.forward on splice_span_frames(...)."""
    lm = reference_lm("lm-moshi-shaped")
    g = torch.Generator().manual_seed(5)
    calls = 6
    user = torch.randint(0, 64, (calls + 1, 1, 8), generator=g)
    ids = torch.randint(14, 100, (9,), generator=g).tolist()
    live = _engine(lm)
    inputs = [live.step_tokens(user[c]).input[0] for c in range(calls)]
    pending = live.grid.row_state(0)[0][:, live.grid.pending]
    live.inject_span(0, ContextSpan.from_ids(ids))
    after = live.step_tokens(user[calls])
    block = _block([SPAN_OPEN, *ids, SPAN_CLOSE])
    n = block.shape[1]

    # the run without the span, as undelayed frames 0..calls (frame `calls` is not known yet: never fed)
    before = torch.stack([*inputs, pending], dim=1)  # positions 0..calls
    before[:, calls] = after.input[0]  # the pending column as fed (user cb0 written by the last call)
    frames = undelay_tokens(before, DELAYS_7B, calls + 1)
    frames[frames == UNGENERATED] = 0
    initial = [lm.text_card] + [lm.card] * 16
    # the block goes before frame calls - 1 (= before position `calls`, the pending one)
    spliced = splice_span_frames(frames, calls - 1, block, DELAYS_7B, initial)
    fed = splice_block(torch.stack([*inputs, after.input[0]], dim=1), calls, block)  # positions 0..calls+n as fed
    assert torch.equal(delay_tokens(spliced, DELAYS_7B, initial)[:, : calls + n + 1], fed)
    out = lm(spliced[None])  # teacher-forced training forward (re-delays the frames itself)
    torch.testing.assert_close(out.text_logits[0, 0, calls + n], after.text_logits[0], atol=1e-5, rtol=0)


# -- engine-level behaviour ------------------------------------------------------------------------------------------


def test_span_error_before_the_stream_starts(reference_lm) -> None:
    engine = _engine(reference_lm("lm-moshi-shaped"), batch_size=2)
    span = ContextSpan.from_ids([20, 21])
    with pytest.raises(SpanError, match="has not started"):
        engine.inject_span(0, span)
    engine.step_tokens(torch.zeros(2, 8, dtype=torch.long))
    assert engine.inject_span(1, span).n == 4
    engine.reset(1)
    with pytest.raises(SpanError, match="session 1 has not started"):
        engine.inject_span(1, span)
    with pytest.raises(SpanError, match="empty"):
        engine.inject_span(0, "  ")
    with pytest.raises(IndexError):
        engine.inject_span(2, span)
    with pytest.raises(SpanError, match=r"text ids in \[0, 100\)"):
        engine.inject_span(0, ContextSpan.from_ids([20, 100]))
    assert engine.positions == [1, 0]  # nothing was read by the failed injections


def test_max_span_frames_truncates_and_reports(reference_lm) -> None:
    engine = _engine(reference_lm("lm-moshi-shaped"), max_span_frames=10)
    engine.step_tokens(torch.zeros(1, 8, dtype=torch.long))
    report = engine.inject_span(0, ContextSpan.from_ids(list(range(20, 40)), text="long reference"))
    assert report.truncated and report.n == 10
    assert list(report.ids) == [SPAN_OPEN, *range(20, 28), SPAN_CLOSE]
    assert engine.positions == [11]
    report = engine.inject_span(0, ContextSpan.from_ids([20, 21, 22]))
    assert not report.truncated and report.n == 5 and report.first_position == 11
    assert report.prefill_ms >= 0.0 and report.context == 3000 and report.window_positions_left == 3000 - 1 - 16


def test_report_says_when_the_prefix_leaves_the_window(reference_lm) -> None:
    """Policy ``none``: the prefix slides out; the report says when its first position left the next query's
    window. ``pinned`` keeps it (sink positions), ``reprefix`` queues a copy behind the span."""
    lm = reference_lm("lm-moshi-shaped", context=16)
    voice = torch.randint(0, 64, (8, 3), generator=torch.Generator().manual_seed(2))
    reports = {}
    for policy in ("none", "pinned", "reprefix"):
        engine = _engine(lm)
        prefix = engine.set_persona(0, None, voice, policy=policy)  # voice only: no tokenizer needed
        assert prefix.num_frames == 4 and prefix.next_position == 5
        engine.step_tokens(torch.zeros(1, 8, dtype=torch.long))  # the prefix (positions 0..4)
        first = engine.inject_span(0, ContextSpan.from_ids([20, 21, 22, 23]))  # positions 5..10, next 11
        assert first.prefix_in_window and first.window_positions_left == 4
        second = engine.inject_span(0, ContextSpan.from_ids([20] * 8))  # positions 11..20, next 21: 21 - 0 >= 16
        reports[policy] = (second, engine.positions[0], engine.prefix_in_window(0))
    second, position, visible = reports["none"]
    assert not second.prefix_in_window and second.window_positions_left == 0 and position == 21 and not visible
    second, position, visible = reports["pinned"]
    assert second.prefix_in_window and position == 21 and visible
    second, position, visible = reports["reprefix"]  # a copy of positions 1..4 is read at 21..24
    assert second.prefix_in_window and second.next_position == 21 and position == 25 and visible
    assert second.window_positions_left == 16 - 1 - (25 - 21)


def test_text_span_on_the_tiny_checkpoint(tiny_checkpoint) -> None:
    """Real tokenizer and placeholder codes: the block and the report of a text reference."""
    engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
    engine.step_tokens(None)  # dep_q 16: the user rows are predicted
    text = "It is sunny in Sydney."
    report = engine.inject_span(0, text)
    expected = [SPAN_OPEN, *tiny_checkpoint.tokenizer.encode(text), SPAN_CLOSE]
    assert list(report.ids) == expected and report.n == len(expected)
    assert report.first_position == 1 and engine.positions == [1 + len(expected)]
    out = engine.step_tokens(None)
    assert bool(out.valid[0]) and out.position.tolist() == [1 + len(expected)]


class _ByteFallback:
    """A tokenizer without normalisation: every UTF-8 byte is its byte piece (id 4 + byte, as SentencePiece's byte
    fallback numbers them after the four specials)."""

    def encode(self, text: str) -> list[int]:
        return [4 + b for b in text.encode()]


def test_control_characters_never_become_ret_or_a_span_marker(tiny_checkpoint) -> None:
    """With SentencePiece's byte fallback a control character its normaliser keeps becomes its byte piece, and
    <0x00>, <0x08>, <0x09> are <ret> and the span markers in the released vocabulary (and the tiny one, whose
    normaliser keeps the NUL). A reference, a persona prompt and a training word read every control character but
    the newline as a space, and ids given directly may not hold <ret> or a marker inside the markers."""
    from cspan.core.constants import RET
    from cspan.core.prefix import build_persona_prefix
    from cspan.core.text import encode_text

    specials = {RET, SPAN_OPEN, SPAN_CLOSE}
    raw = _ByteFallback()
    assert set(raw.encode("a\x00b\x08c\td")) >= specials  # what a tokenizer alone can make of them
    assert encode_text(raw, "a\x00b\x08c\td") == raw.encode("a b c d")
    assert encode_text(raw, "line one\nline two") == raw.encode("line one\nline two")  # the newline is text
    spm = tiny_checkpoint.tokenizer
    assert RET in spm.encode("a\x00b")
    engine = DuplexEngine(tiny_checkpoint, batch_size=1)
    engine.step_tokens(None)
    report = engine.inject_span(0, "\x00city\ttemp\x08 Sydney\t24\x7f\x85")
    assert list(report.ids) == [SPAN_OPEN, *spm.encode("city temp  Sydney 24"), SPAN_CLOSE]
    assert not specials & set(report.ids[1:-1])
    with pytest.raises(SpanError, match=r"hold \[4, 13\] \(<ret>, span open, span close\)"):
        ContextSpan.from_ids([20, 13, 4]).encode()
    assert ContextSpan.from_ids([20, 13, 4], markers=False).encode() == ([20, 13, 4], False)  # a whole block: as given
    prefix = build_persona_prefix(spm, "Be kind\x00.", None)
    assert RET not in prefix.text_ids and prefix.text_ids == build_persona_prefix(spm, "Be kind .", None).text_ids
    with pytest.raises(TypeError, match="reference text is a str, got NoneType"):
        ContextSpan(None)  # type: ignore[arg-type]


def test_text_that_is_not_unicode_is_refused_naming_the_call(tiny_checkpoint) -> None:
    """A lone surrogate (``os.fsdecode`` or ``surrogateescape`` of bytes that are not UTF-8) in a reference or a
    persona text is refused naming the call and the argument (was: SentencePiece's "Unable to cast Python instance
    of type <class 'str'> to C++ type", a RuntimeError, at injection), and the engine is left as it was."""
    engine = DuplexEngine(tiny_checkpoint, batch_size=1)
    engine.step_tokens(None)
    bad = "caf\udcc3\udca9 opens at 9"
    with pytest.raises(SpanError, match=r"^ContextSpan: the reference text is not valid Unicode text: U\+DCC3 at "):
        ContextSpan(bad)
    with pytest.raises(SpanError, match=r"U\+DCC3 at character 3 is a lone surrogate"):
        engine.inject_span(0, bad)
    for kwargs, name in (({"text_prompt": bad}, "text_prompt"), ({"text_prompt": "hi", "user_name": bad}, "user_name")):
        with pytest.raises(ValueError, match=rf"^set_persona: {name} is not valid Unicode text"):
            engine.set_persona(0, **kwargs)
    assert engine.positions == [1]
    assert engine.inject_span(0, "caf\u00e9 opens at 9").ids  # the same text, decoded: read


def test_span_ids_are_ints_or_refused() -> None:
    """Ids given directly are read as Python ints (numpy's and torch's too), and anything else is a TypeError: a
    float id was rounded, a bool read as 0 / 1, and numpy or torch scalars reached the SpanReport's ids."""
    import numpy as np

    assert ContextSpan.from_ids(np.array([5, 6])).token_ids == (5, 6)
    assert ContextSpan("x", token_ids=torch.tensor([5, 6])).encode() == ([12, 5, 6, 13], False)  # type: ignore[arg-type]
    assert all(type(i) is int for i in ContextSpan.from_ids(torch.tensor([7, 8])).token_ids or ())
    for ids, message in (
        ([5.7], "token ids are ints, got float 5.7"),
        ([True], "token ids are ints, got bool True"),
        (torch.tensor([5.0]), "token ids are ints, got Tensor"),
        ("56", "token_ids is a sequence of ints, got str"),
        (5, "token_ids is a sequence of ints, got int"),
    ):
        with pytest.raises(TypeError, match=message):
            ContextSpan.from_ids(ids)  # type: ignore[arg-type]
