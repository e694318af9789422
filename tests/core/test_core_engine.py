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


def test_skipping_the_user_predictions_changes_no_output(tiny_checkpoint) -> None:
    """predict_user=False (serve / infer) runs the depformer over the agent codebooks only: personas, spans, PCM
    steps, the frames, agent PCM, text and logits are the same as with the user stream predicted (sampling on, so
    the generators must stay in step too); only the skipped prediction in the column is -1."""
    pcm = _pcm(6, 2, seed=3)
    outs = []
    for predict_user in (True, False):
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=5, predict_user=predict_user)
        assert engine.dep_q == 16 and engine.num_codebooks == 8
        rows = []
        for row, s in enumerate([0, 1]):
            engine.set_persona(row, PROMPTS[s])
        for t in range(pcm.shape[0]):
            if t == 2:
                engine.inject_span(1, SPANS[1][1])
            rows.append(engine.step(pcm[t]))
        outs.append(rows)
    for t, (a, b) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a.tokens.frame, b.tokens.frame), f"frame {t}"
        assert torch.equal(a.agent_pcm, b.agent_pcm) and torch.equal(a.text_token, b.text_token)
        assert torch.equal(a.tokens.text_logits, b.tokens.text_logits)
        assert torch.equal(a.tokens.column[:, :9], b.tokens.column[:, :9])
        assert (b.tokens.column[:, 9] == -1).all() and (a.tokens.column[:, 9] >= 0).all()
        assert torch.equal(a.tokens.column[:, 10:], b.tokens.column[:, 10:])  # known user codes
    engine = DuplexEngine(tiny_checkpoint, batch_size=1, predict_user=False)
    engine.step_tokens(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="user_codes are required with predict_user=False"):
        engine.step_tokens(None)  # would feed the skipped user prediction


def _forced_columns(engine: DuplexEngine, count: int, seed: int) -> list[torch.Tensor]:
    """Whole target columns to force (valid text and audio ids), so two engines see the same token history."""
    gen = torch.Generator().manual_seed(seed)
    cols = []
    for _ in range(count):
        col = torch.randint(0, int(engine.lm.card), (1, engine.num_streams), generator=gen)
        col[:, 0] = torch.randint(0, int(engine.lm.text_card), (1,), generator=gen)
        cols.append(col)
    return cols


def test_deferred_spans_equal_immediate_injection(tiny_checkpoint) -> None:
    """defer_spans reads a block in the next step's forward: same KV cache, offsets, positions, reports and
    logits as reading it at inject_span, also for two blocks injected before one step and after a reset."""
    runs = []
    for defer in (False, True):
        engine = DuplexEngine(tiny_checkpoint, batch_size=1, seed=1, defer_spans=defer)
        assert engine.defer_spans is defer
        forced = _forced_columns(engine, 12, seed=4)
        user = torch.randint(0, 2048, (12, 1, 8), generator=torch.Generator().manual_seed(5))
        reports, outs = [], []
        engine.set_persona(0, PROMPTS[0])
        for t in range(12):
            if t == 7:
                engine.reset(0, seed=2)
                engine.set_persona(0, PROMPTS[1])
            if t in (2, 5):
                reports.append(engine.inject_span(0, SPANS[1][1]))
            if t in (5, 9):
                reports.append(engine.inject_span(0, SPANS[2][1]))
            outs.append(engine.step_tokens(user[t], forced[t]))
        cache = engine.lm_state.transformer.cache
        runs.append((reports, outs, cache.offset.clone(), cache.keys.clone(), list(engine.positions)))
    (ra, oa, off_a, ka, pa), (rb, ob, off_b, kb, pb) = runs
    assert torch.equal(off_a, off_b) and pa == pb
    assert all(r.deferred for r in rb) and not any(r.deferred for r in ra)
    for x, y in zip(ra, rb, strict=True):
        assert (x.n, x.ids, x.first_position, x.next_position) == (y.n, y.ids, y.first_position, y.next_position)
    assert torch.allclose(ka, kb, atol=1e-4, rtol=1e-4)
    for t, (x, y) in enumerate(zip(oa, ob, strict=True)):
        assert torch.equal(x.column, y.column) and torch.equal(x.position, y.position), f"step {t}"
        assert torch.allclose(x.text_logits, y.text_logits, atol=1e-4, rtol=1e-4), f"step {t}"


def test_deferred_span_in_a_pcm_frame_and_flush_when_too_long(tiny_checkpoint) -> None:
    """The whole-frame path reads a deferred block too; a block that would not fit the longest combined read
    with the pending one makes the pending one be read at once. Same frames as immediate injection."""
    pcm = _pcm(6, 1, seed=6)
    frames = []
    for defer in (False, True):
        engine = DuplexEngine(tiny_checkpoint, batch_size=1, seed=3, defer_spans=defer, max_span_frames=8)
        engine.set_persona(0, PROMPTS[2], seed=3)
        got = []
        for t in range(6):
            if t == 2:
                first = engine.inject_span(0, "It is sunny.")
                second = engine.inject_span(0, "Yes.")
                assert first.n + second.n + 1 > engine._span_buckets[-1]
                if defer:  # the first block was read when the second came; the second waits for the step
                    assert engine._pending[0] is not None and engine._pending[0].shape[-1] == second.n
            got.append(engine.step(pcm[t]).tokens.frame)
        frames.append(torch.stack(got))
    assert torch.equal(frames[0], frames[1])
    with pytest.raises(ValueError, match="defer_spans needs batch_size 1"):
        DuplexEngine(tiny_checkpoint, batch_size=2, defer_spans=True)


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
