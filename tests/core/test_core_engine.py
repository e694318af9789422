"""DuplexEngine on the tiny checkpoint: PCM steps, batching, seeds, per-session reset."""

from __future__ import annotations

import pytest
import torch

from cspan.core.constants import FRAME_SIZE, RET
from cspan.core.engine import DuplexEngine
from cspan.core.errors import CheckpointError

PROMPTS = ["You are kind.", "You like the weather.", "Hi."]
SPANS = {0: (2, "It is sunny."), 1: (4, "The time is ten past nine."), 2: (3, "Yes.")}


def _pcm(frames: int, batch: int, seed: int) -> torch.Tensor:
    return 0.1 * torch.randn(frames, batch, FRAME_SIZE, generator=torch.Generator().manual_seed(seed))


def _run(engine: DuplexEngine, sessions: list[int], pcm: torch.Tensor) -> torch.Tensor:
    """Session ``sessions[i]``'s prompt, seed and span in batch row i; returns the frames [T, B, K]."""
    for row, s in enumerate(sessions):
        engine.set_persona(row, PROMPTS[s], seed=100 + s)
    frames = []
    for t in range(pcm.shape[0]):
        for row, s in enumerate(sessions):
            if SPANS[s][0] == t:
                engine.inject_span(row, SPANS[s][1])
        out = engine.step(pcm[t, sessions])
        frames.append(out.tokens.frame.clone())
    return torch.stack(frames)


def test_batched_sessions_equal_each_session_alone(tiny_checkpoint) -> None:
    """Sampling on (0.8/250, 0.7/25), one generator per session: batch rows do not influence each other."""
    pcm = _pcm(6, 3, seed=0)
    batched = _run(DuplexEngine(tiny_checkpoint, batch_size=3), [0, 1, 2], pcm)
    assert (batched != -2).all()
    for s in range(3):
        alone = _run(DuplexEngine(tiny_checkpoint, batch_size=1), [s], pcm)
        assert torch.equal(alone[:, 0], batched[:, s]), f"session {s} differs when batched"


def test_a_seed_reproduces_a_conversation(tiny_checkpoint) -> None:
    pcm = _pcm(4, 1, seed=1)
    runs = []
    for seed in (7, 7, 8):
        engine = DuplexEngine(tiny_checkpoint, seed=seed)
        assert engine.seeds == [seed]
        engine.set_persona(0, "Hi.")
        runs.append(torch.stack([engine.step(pcm[t]).tokens.frame for t in range(4)]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_reset_restarts_one_session_only(tiny_checkpoint) -> None:
    pcm = _pcm(6, 2, seed=2)
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=0)
    plain = DuplexEngine(tiny_checkpoint, batch_size=1, seed=0)  # session 0 without interruption
    fresh = DuplexEngine(tiny_checkpoint, batch_size=1)
    fresh.reset(0, seed=42)
    got0, ref0, got1, ref1 = [], [], [], []
    for t in range(6):
        if t == 3:
            engine.reset(1, seed=42)
            assert engine.positions == [3, 0] and engine.seeds[1] == 42
        out = engine.step(pcm[t])
        got0.append(out.tokens.frame[0])
        ref0.append(plain.step(pcm[t, :1]).tokens.frame[0])
        if t >= 3:
            got1.append(out.tokens.frame[1])
            ref1.append(fresh.step(pcm[t, 1:]).tokens.frame[0])
    assert torch.equal(torch.stack(got0), torch.stack(ref0))
    assert torch.equal(torch.stack(got1), torch.stack(ref1))  # user audio, codec states, KV, grid, generator


def test_step_outputs_and_frame_alignment(tiny_checkpoint) -> None:
    """Call 0 returns nothing; from call 1 on, call c returns agent frame c - 1, decoded by the streaming decoder
    exactly as a whole-sequence decode of the returned codes would."""
    engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
    pcm = _pcm(5, 1, seed=3)
    outs = [engine.step(pcm[t]) for t in range(5)]
    first = outs[0]
    assert first.agent_pcm.shape == (1, FRAME_SIZE) and first.agent_pcm.dtype == torch.float32
    assert not bool(first.valid[0]) and first.text_token.tolist() == [-1] and not bool(first.is_ret[0])
    assert (first.agent_pcm == 0).all()
    assert all(bool(o.valid[0]) for o in outs[1:])
    codes = torch.stack([o.agent_codes[0] for o in outs[1:]], dim=-1)  # [8, 4]
    assert codes.min() >= 0 and codes.max() < 2048
    whole = tiny_checkpoint.mimi.decode(codes[None])[0, 0]  # [4 * 1920]
    streamed = torch.cat([o.agent_pcm[0] for o in outs[1:]])
    torch.testing.assert_close(streamed, whole, atol=1e-4, rtol=0)
    # user audio reaches the LM through the streaming encoder: the PCM given to call c is user frame c - 1
    enc = tiny_checkpoint.mimi.encode(pcm[:4, 0].reshape(1, 1, -1))[0, :8]  # [8, 4]
    for c in (1, 2, 3):
        assert torch.equal(outs[c].tokens.frame[0, 9:17], enc[:, c])


def test_is_ret_follows_the_text_token(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
    pcm = _pcm(2, 1, seed=4)
    engine.step(pcm[0])
    engine.grid.buffer[0, 0, engine.grid.pending] = RET  # text of the frame the next call returns
    out = engine.step(pcm[1])
    assert out.text_token.tolist() == [RET] and out.is_ret.tolist() == [True]


def test_engine_from_a_checkpoint_folder_and_errors(tiny_checkpoint_dir, reference_lm) -> None:
    engine = DuplexEngine(str(tiny_checkpoint_dir), device="cpu", dtype=torch.float32)
    assert engine.dtype == torch.float32 and engine.tokenizer is not None and engine.mimi is not None
    assert engine.num_streams == 17 and engine.dep_q == 16 and engine.context == 3000
    report = engine.set_persona(0, "Hi.", "tiny0")  # a voice name of the loaded checkpoint
    assert report.voice_frames == 20 and report.text_frames > 0 and engine.started == [True]
    with pytest.raises(ValueError, match=r"\[1, 1920\]"):
        engine.step(torch.zeros(1, 960))
    with pytest.raises(IndexError):
        engine.reset(1)
    bare = DuplexEngine(reference_lm("lm-moshi-shaped"), agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    with pytest.raises(CheckpointError, match="Mimi"):
        bare.step(torch.zeros(1, FRAME_SIZE))
    with pytest.raises(TypeError):
        DuplexEngine(42)
