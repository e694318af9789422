"""Persona prefix: text, frame layout, and one forward == the same columns forced one call at a time."""

from __future__ import annotations

import pytest
import torch

from cspan.core.constants import PAD, SILENCE_TOKENS, SINE_TOKENS
from cspan.core.engine import DuplexEngine
from cspan.core.errors import CheckpointError, SpanError
from cspan.core.prefix import build_persona_prefix, persona_text, prefix_frames
from cspan.core.streams import delay_tokens


def test_persona_text() -> None:
    assert persona_text("You are kind.") == "<system> You are kind. <system>"
    assert persona_text("  <system> You are kind. <system> ") == "<system> You are kind. <system>"
    assert (
        persona_text("You are kind.", user_name="Priya", user_city="Sydney")
        == "<system> You are kind. The user's name is Priya. The user is in Sydney. <system>"
    )
    assert persona_text(None, user_city="Seoul") == "<system> The user is in Seoul. <system>"
    assert persona_text("", user_name=" ") == ""
    # control characters are spaces, as when tokenised: none of these is a prompt, a name or a city (was: a
    # "<system> \x00 <system>" prompt of system tags around nothing, and "The user's name is \x1b.")
    assert persona_text("\x00\x00", user_name="\x1b", user_city="\x7f") == ""
    assert (
        persona_text("You\tare\x00kind.", user_name="\x08Ada")
        == "<system> You are kind. The user's name is Ada. <system>"
    )


def test_prefix_frame_layout() -> None:
    voice = torch.arange(8 * 3).view(8, 3) + 100
    frames = prefix_frames([50, 51], voice)
    assert frames.shape == (17, 3 + 1 + 2 + 1)
    sil = torch.tensor([PAD, *SILENCE_TOKENS, *SINE_TOKENS])
    # voice frames: text PAD, agent = voice codes, user SINE
    assert (frames[0, :3] == PAD).all() and torch.equal(frames[1:9, :3], voice)
    assert all(frames[9:, j].tolist() == list(SINE_TOKENS) for j in range(7))
    # silence, text frames (agent SILENCE), silence
    assert torch.equal(frames[:, 3], sil) and torch.equal(frames[:, 6], sil)
    assert frames[0, 4:6].tolist() == [50, 51] and torch.equal(frames[1:, 4], sil[1:])
    assert prefix_frames([], None).shape == (17, 0)
    assert prefix_frames([7], None).shape == (17, 2)  # no voice: no silence frame before the text
    assert prefix_frames([], voice).shape == (17, 4)
    with pytest.raises(ValueError, match=r"\[8, N\]"):
        prefix_frames([], torch.zeros(4, 3, dtype=torch.long))


def test_build_persona_prefix_uses_the_tokenizer(tiny_checkpoint) -> None:
    spm = tiny_checkpoint.tokenizer
    prefix = build_persona_prefix(spm, "You are kind.", None, user_name="Priya")
    assert prefix.text == "<system> You are kind. The user's name is Priya. <system>"
    assert list(prefix.text_ids) == spm.encode(prefix.text)
    assert prefix.num_frames == len(prefix.text_ids) + 1 and prefix.voice_frames == 0
    with pytest.raises(CheckpointError, match="tokenizer"):
        build_persona_prefix(None, "You are kind.")


def _force_prefix_stepwise(engine: DuplexEngine, frames: torch.Tensor) -> list:
    """The reference: P + 1 ordinary calls, call c given user frame c - 1 and forcing target column c + 1."""
    P = frames.shape[1]
    delayed = delay_tokens(frames, engine.grid.delays, engine.grid.initial_t)  # [K, P + 2]
    rows = engine.user_rows
    outs = []
    for c in range(P + 1):
        user = frames[rows, c - 1] if c >= 1 else torch.tensor(engine.user_placeholder)
        outs.append(engine.step_tokens(user[None], delayed[:, c + 1][None]))
    return outs


@pytest.mark.parametrize("model", ["tiny", "lm-moshi-shaped"])
def test_prefix_in_one_forward_equals_stepwise_forcing(model, tiny_checkpoint, reference_lm) -> None:
    """set_persona queues the prefix; the session's next step reads it (positions 0..P - 1 as a block, position P
    as its next position) and samples position P + 1: the same state and frames as P + 1 forced calls."""
    g = torch.Generator().manual_seed(0)
    if model == "tiny":
        kwargs: dict = {}
        source = tiny_checkpoint
        voice = tiny_checkpoint.load_voice("tiny1")[:, :5]
        prompt, name, card = "Be kind.", "Priya", 2048
    else:  # dep_q 8, voice only (the fixture LM has no tokenizer); placeholders within its card of 64
        kwargs = {
            "agent_placeholder": [t % 64 for t in SILENCE_TOKENS],
            "user_placeholder": [t % 64 for t in SINE_TOKENS],
        }
        source = reference_lm(model)
        voice = torch.randint(0, 64, (8, 6), generator=g)
        prompt, name, card = None, None, 64
    one = DuplexEngine(source, temp=0, temp_text=0, **kwargs)
    ref = DuplexEngine(source, temp=0, temp_text=0, **kwargs)

    report = one.set_persona(0, prompt, voice, user_name=name)
    prefix = build_persona_prefix(
        one.tokenizer,
        prompt,
        voice,
        user_name=name,
        agent_placeholder=one.agent_placeholder,
        user_placeholder=one.user_placeholder,
    )
    P = prefix.num_frames
    assert report.num_frames == P and report.voice_frames == voice.shape[1]
    assert report.positions == P + 1 and report.next_position == P + 1 and one.positions == [P]
    assert int(one.lm_state.offset[0]) == 0  # queued: read by the next step
    ignored = torch.randint(0, card, (1, 8), generator=g)  # the prefix step's user audio is not used
    first = one.step_tokens(ignored)
    want = _force_prefix_stepwise(ref, prefix.frames)[-1]
    assert ref.positions == one.positions == [P + 1]
    assert torch.equal(first.frame, want.frame) and bool(first.valid[0])  # the prefix's last frame
    torch.testing.assert_close(first.text_logits, want.text_logits, atol=1e-5, rtol=0)

    k1, k2 = one.lm_state.transformer.cache, ref.lm_state.transformer.cache
    assert k1.offset.tolist() == k2.offset.tolist() == [P + 1, 0]
    torch.testing.assert_close(k1.keys, k2.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(k1.values, k2.values, atol=1e-5, rtol=0)
    assert torch.equal(one.grid.buffer, ref.grid.buffer) and torch.equal(one.grid.position, ref.grid.position)
    for _ in range(5):
        user = torch.randint(0, card, (1, 8), generator=g)
        a, b = one.step_tokens(user), ref.step_tokens(user)
        assert bool(a.valid[0])
        assert torch.equal(a.frame, b.frame) and torch.equal(a.column, b.column)
        torch.testing.assert_close(a.text_logits, b.text_logits, atol=1e-5, rtol=0)


def test_empty_persona_only_resets(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
    engine.step_tokens(None)
    report = engine.set_persona(0, "   ", None)
    assert report.num_frames == 0 and report.positions == 0 and engine.positions == [0]
    with pytest.raises(SpanError):
        engine.inject_span(0, "hello")
    assert not bool(engine.step_tokens(None).valid[0])  # the session starts again with call 0


def test_persona_without_tokenizer(reference_lm) -> None:
    engine = DuplexEngine(reference_lm("lm-moshi-shaped"), agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    with pytest.raises(CheckpointError, match="tokenizer"):
        engine.set_persona(0, "You are kind.")


def test_voice_by_name_and_bad_voice_codes(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
    report = engine.set_persona(0, None, "tiny1")
    assert report.voice_frames == tiny_checkpoint.load_voice("tiny1").shape[1]
    assert report.num_frames == report.voice_frames + 1 and report.text_frames == 0
    with pytest.raises(ValueError, match=r"\[0, 2048\)"):
        engine.set_persona(0, None, torch.full((8, 2), 2048))
    with pytest.raises(CheckpointError, match="not a known voice"):
        engine.set_persona(0, None, "nobody")
    assert engine.positions == [report.num_frames]  # failed calls leave the session as it was (prefix queued)
