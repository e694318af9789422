"""DuplexEngine on the tiny checkpoint: PCM steps, batching, seeds, per-session reset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cspan.core.checkpoint import load_checkpoint
from cspan.core.constants import FRAME_SIZE, RET
from cspan.core.engine import DuplexEngine, TokenStepOutput
from cspan.core.errors import CheckpointError
from cspan.core.sampling import SamplingParams, SessionSampling
from cspan.core.sessions import SpanRead
from cspan.core.span import ContextSpan, SpanReport

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
    with pytest.raises(ValueError, match=r"user_codes \[\d+, \d+\] are required with predict_user=False"):
        engine.step_tokens(None)  # would feed the skipped user prediction


def _user(frames: int, batch: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, batch, 8), generator=torch.Generator().manual_seed(seed))


def _script(
    engine: DuplexEngine, sessions: list[int], user: torch.Tensor, prepare: str | None = None
) -> list[TokenStepOutput]:
    """Session s of MIXED in batch row i: personas, spans (several rows in the same step, two spans before one
    step), a reset with a new persona while other rows read spans, an idle stretch; returns each step's output.
    ``prepare``: call ``engine.prepare()`` "before" or "after" each step's changes (None: never)."""
    outs = []
    for t in range(user.shape[0]):
        if prepare == "before":
            engine.prepare()
        for row, s in enumerate(sessions):
            for kind, arg in MIXED[s].get(t, []):
                if kind == "persona":
                    engine.set_persona(row, PROMPTS[arg], seed=100 + s)
                elif kind == "span":
                    engine.inject_span(row, arg)
                elif kind == "live":
                    engine.set_live(row, arg)
        if prepare == "after":
            engine.prepare()
        outs.append(engine.step_tokens(user[t, sessions]))
    return outs


MIXED = {
    0: {0: [("persona", 0)], 2: [("span", "It is sunny.")], 4: [("span", "Yes."), ("span", "No, it rains.")]},
    1: {0: [("persona", 1)], 2: [("span", "The time is ten past nine.")], 4: [("persona", 2)]},
    2: {1: [("persona", 2)], 2: [("live", False)], 4: [("live", True), ("span", "Hi.")]},
    3: {},
}


def test_mixed_batch_rows_equal_each_session_alone(tiny_checkpoint) -> None:
    """One step for every case: in the same steps some rows read Context Spans, one a persona prefix after a reset,
    one is idle, one steps plainly; every row equals the batch-1 engine running that session alone (sampling on:
    the noise of a session depends on its seed and positions only)."""
    user = _user(7, 4, seed=8)
    batched = _script(DuplexEngine(tiny_checkpoint, batch_size=4, seed=0), [0, 1, 2, 3], user)
    for s in range(4):
        alone = _script(DuplexEngine(tiny_checkpoint, batch_size=1, seed=s), [s], user)
        for t, (a, b) in enumerate(zip(alone, batched, strict=True)):
            assert torch.equal(a.frame[0], b.frame[s]), f"session {s}, step {t}"
            assert torch.equal(a.valid[0], b.valid[s]) and torch.equal(a.column[0], b.column[s])
            torch.testing.assert_close(a.text_logits[0], b.text_logits[s], atol=1e-5, rtol=0)
    idle = [o.valid[2].item() for o in batched]
    assert idle[2:4] == [False, False] and batched[2].position[2] == -1  # not stepped while idle


def test_an_idle_session_keeps_its_state(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=1)
    user = _user(5, 2, seed=2)
    engine.step_tokens(user[0])
    engine.set_live(np.flatnonzero([False, True]), False)  # a numpy array of rows (was: "a session is an int index")
    offset = engine.lm_state.offset.clone()
    engine.inject_span(1, "It is sunny.")  # queued until the session is live again
    for t in (1, 2):
        out = engine.step_tokens(user[t])
        assert out.valid.tolist() == [True, False] and out.frame[1].eq(-2).all()
    assert engine.live == [True, False] and int(engine.lm_state.offset[1]) == int(offset[1]) == 1
    engine.set_live([1])
    out = engine.step_tokens(user[3])
    n = engine.positions[1] - 1 - 1
    assert out.valid.tolist() == [True, True] and int(engine.lm_state.offset[1]) == 1 + n + 1


def test_prefix_input_embeddings_replace_the_token_embeddings(tiny_checkpoint) -> None:
    """A prefix block may carry input embeddings for its first E positions (PersonaPlex voices stored as
    embeddings): the embeddings the tokens would give change nothing; others change the outputs."""
    from cspan.core.prefix import prefix_block

    lm = tiny_checkpoint.lm
    voice = tiny_checkpoint.load_voice("tiny1")[:, :6]
    engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
    frames = build_frames(engine, voice)
    E = 5
    block = prefix_block(frames, lm.delays, engine.grid.initial_t)
    same = lm.embed(block.block.tokens[None, :, :E])[0]
    outs = []
    for emb in (None, same, same + 0.5):
        engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0)
        assert engine.set_prefix(0, frames, emb) == frames.shape[1]
        outs.append(engine.step_tokens(torch.zeros(1, 8, dtype=torch.long)).text_logits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    assert (outs[0] - outs[2]).abs().max() > 1e-3


def build_frames(engine: DuplexEngine, voice: torch.Tensor) -> torch.Tensor:
    from cspan.core.prefix import build_persona_prefix

    prefix = build_persona_prefix(
        engine.tokenizer, "Be kind.", voice, agent_placeholder=engine.agent_placeholder,
        user_placeholder=engine.user_placeholder,
    )  # fmt: skip
    return prefix.frames


@pytest.mark.parametrize("storage", ["fp8", "fp16", "bf16"])
def test_a_narrower_kv_cache_runs_close_to_the_float_cache(tiny_checkpoint, storage: str) -> None:
    """kv_dtype="fp8": e4m3 codes with a scale per position and head, dequantized by the eager attention; "fp16" /
    "bf16" of a float32 model: the ring stored in 16 bits, read back as float32."""
    user = _user(8, 1, seed=4)
    logits = []
    stored = {"fp8": torch.float8_e4m3fn, "fp16": torch.float16, "bf16": torch.bfloat16, "auto": torch.float32}
    for kv in ("auto", storage):
        engine = DuplexEngine(tiny_checkpoint, temp=0, temp_text=0, kv_dtype=kv)
        engine.set_persona(0, "Be kind.")
        got = []
        for t in range(8):
            if t == 3:
                engine.inject_span(0, "It is sunny in Sydney.")
            got.append(engine.step_tokens(user[t]).text_logits.float())
        logits.append(torch.stack(got))
        cache = engine.lm_state.transformer.cache
        assert cache.keys.dtype == stored[kv]
    diff = (logits[0] - logits[1]).abs().max().item()
    assert 0 < diff < 0.5 * logits[0].abs().max().item()


def test_a_kv_dtype_that_is_no_cache_storage_is_refused(tiny_checkpoint) -> None:
    """``kv_dtype=torch.int8`` (or float64) was taken as the ring's storage: the engine ran, its keys and values
    truncated to integers. A torch dtype is now one of the storages the names give."""
    for dtype in (torch.int8, torch.float64, torch.bool):
        with pytest.raises(ValueError, match=rf"kv_dtype {dtype} is not a KV cache storage: use one of auto, bf16"):
            DuplexEngine(tiny_checkpoint, kv_dtype=dtype)
    engine = DuplexEngine(tiny_checkpoint, kv_dtype=torch.bfloat16)
    assert engine.kv_dtype == torch.bfloat16 and engine.lm_state.transformer.cache.keys.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"agent_placeholder": [99999] * 8}, ValueError, "agent_placeholder[0] = 99999 is outside 0 .. 2047"),
        ({"user_placeholder": [5, 6, 7, 8, 9, 10, 11, 2048]}, ValueError, "user_placeholder[7] = 2048 is outside 0 .."),
        ({"agent_placeholder": [-1] * 8}, ValueError, "agent_placeholder[0] = -1 is outside 0 .. 2047"),
        ({"agent_placeholder": [1, 2, 3]}, ValueError, "agent_placeholder must hold 8 Mimi codes (one per codebook"),
        ({"user_placeholder": [1.5] * 8}, TypeError, "user_placeholder[0] is float 1.5; Mimi codes are ints"),
        ({"agent_placeholder": "12345678"}, TypeError, "agent_placeholder is a sequence of 8 Mimi codes, got str"),
        ({"predict_user": "no"}, TypeError, "predict_user is True or False, got str 'no'"),
        ({"cuda_graphs": "no"}, TypeError, "cuda_graphs is True, False or None, got str 'no'"),
        ({"fused": 0}, TypeError, "fused is True, False or None, got int 0"),
    ],
)
def test_placeholders_and_switches_are_checked_at_construction(tiny_checkpoint, kwargs, error, message) -> None:
    """``DuplexEngine(checkpoint, agent_placeholder=[99999] * 8)`` was accepted and failed at the first
    ``set_persona`` ("frames[1, 20] = 99999 is outside -1 .. 2048"); ``predict_user="no"`` was read as True and
    ``cuda_graphs="no"`` as a request for CUDA graphs. Each is refused when the engine is built, naming the
    argument."""
    with pytest.raises(error) as caught:
        DuplexEngine(tiny_checkpoint, **kwargs)
    assert str(caught.value).startswith(f"DuplexEngine: {message}"), caught.value


def test_the_default_placeholders_need_the_released_codec(fixture_file) -> None:
    """A model whose codec has fewer than 2048 codes (the reference fixtures' small Mimi: 64) cannot use PersonaPlex's
    silence and sine frames: a CheckpointError (one line under ``cspan infer``) instead of a ValueError about
    ``agent_placeholder[0] = 948``; its own placeholders are taken."""
    import json

    from safetensors.torch import load_file

    from cspan.core.config import LMConfig
    from cspan.core.errors import CheckpointError
    from cspan.core.lm import LMModel

    folder = fixture_file("reference", "lm-personaplex-shaped")
    lm = LMModel(LMConfig.from_upstream(json.loads((folder / "config.json").read_text())), dtype=torch.float32)
    lm.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
    assert lm.card < 948
    with pytest.raises(CheckpointError, match=rf"audio streams have {lm.card} codes, but the default agent_place"):
        DuplexEngine(lm)
    C = lm.n_q // 2
    engine = DuplexEngine(lm, agent_placeholder=[1] * C, user_placeholder=[2] * C)
    assert engine.agent_placeholder == (1,) * C


def test_placeholders_in_range_are_taken_as_ints(tiny_checkpoint) -> None:
    engine = DuplexEngine(
        tiny_checkpoint, agent_placeholder=np.arange(8) + 2040, user_placeholder=torch.zeros(8, dtype=torch.int32)
    )
    assert engine.agent_placeholder == tuple(range(2040, 2048)) and engine.user_placeholder == (0,) * 8
    assert all(type(c) is int for c in engine.agent_placeholder + engine.user_placeholder)
    engine.set_persona(0, "You are kind.", "tiny0")  # the prefix's silence frames hold them
    assert DuplexEngine(tiny_checkpoint, predict_user=np.bool_(False)).predict_user is False


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


def test_non_finite_user_audio_is_silence_and_loud_audio_is_clipped(tiny_checkpoint) -> None:
    """step() reads its PCM by sanitize_pcm's rule: a frame of NaN / infinite samples gives exactly what a silent
    frame gives, samples beyond full scale what +-1.0 gives, and the session keeps hearing afterwards (a NaN in
    the codec's state made it deaf for good, reset included); the other session never notices."""
    pcm = _pcm(8, 2, seed=4)
    bad, clean = pcm.clone(), pcm.clone()
    bad[2, 0, :100], clean[2, 0, :100] = float("nan"), 0.0
    bad[2, 0, 100:200], clean[2, 0, 100:200] = float("inf"), 0.0
    bad[3, 0] = 1e30 * torch.sign(pcm[3, 0])
    clean[3, 0] = torch.sign(pcm[3, 0])
    runs = []
    for frames in (bad, clean):
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=1)
        runs.append(torch.stack([engine.step(frames[t]).tokens.frame for t in range(8)]))
    assert torch.equal(runs[0], runs[1])
    assert len(set(runs[0][4:, 0, 9:].flatten().tolist())) > 1  # user codes still follow the audio


def test_a_codec_reset_clears_what_reached_its_state(tiny_checkpoint) -> None:
    """Mimi's streaming encoder fed a NaN directly (past the engine's sanitizing), then reset: the row encodes as
    a fresh state does (the transformer's KV rows are zeroed, not only their offsets)."""
    mimi = tiny_checkpoint.mimi
    pcm = _pcm(4, 2, seed=6)
    state, fresh = mimi.new_encoder_state(2), mimi.new_encoder_state(1)
    poisoned = pcm[0].clone()
    poisoned[0, :50] = float("nan")
    mimi.encode_step(poisoned[:, None], state)
    state.reset(torch.tensor([0]))
    for t in range(1, 4):
        got = mimi.encode_step(pcm[t][:, None], state)
        want = mimi.encode_step(pcm[t][:1, None], fresh)
        assert torch.equal(got[:1], want), f"frame {t}"


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


def test_engine_from_a_loaded_checkpoint_and_errors(tiny_checkpoint, reference_lm) -> None:
    engine = DuplexEngine(tiny_checkpoint)
    assert engine.dtype == torch.float32 and engine.tokenizer is not None and engine.mimi is not None
    assert engine.num_streams == 17 and engine.dep_q == 16 and engine.context == 3000
    report = engine.set_persona(0, "Hi.", "tiny0")  # a voice name of the loaded checkpoint
    assert report.voice_frames == 20 and report.text_frames > 0 and engine.started == [True]
    with pytest.raises(ValueError, match=r"\[1, 1920\]"):
        engine.step(torch.zeros(1, 960))
    with pytest.raises(TypeError, match=r"float torch\.Tensor .* got ndarray"):
        engine.step(torch.zeros(1, FRAME_SIZE).numpy())
    with pytest.raises(TypeError, match=r"got a torch\.int16 tensor"):
        engine.step(torch.zeros(1, FRAME_SIZE, dtype=torch.int16))
    with pytest.raises(IndexError):
        engine.reset(1)
    bare = DuplexEngine(reference_lm("lm-moshi-shaped"), agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    with pytest.raises(CheckpointError, match="Mimi"):
        bare.step(torch.zeros(1, FRAME_SIZE))
    with pytest.raises(TypeError, match="loaded Checkpoint"):
        DuplexEngine("path/to/a/checkpoint")


def test_bad_session_arguments_change_nothing(tiny_checkpoint) -> None:
    """Indices that are no session (out of range, negative, bool, str) raise for every per-session method, and
    set_live checks every row before it changes any; a batch size that is no int, a span that is no text, a
    negative top-k raise; a span longer than the attention window says that its head is out of sight."""
    engine = DuplexEngine(tiny_checkpoint, batch_size=2)
    for method in (engine.window_positions_left, engine.prefix_in_window, engine.take_window_events, engine.reset):
        for bad in (2, -1):
            with pytest.raises(IndexError, match=rf"session {bad} is outside 0\.\.1"):
                method(bad)
        for bad in (True, "0", 0.0):
            with pytest.raises(TypeError, match="a session is an int index"):
                method(bad)
    with pytest.raises(IndexError, match="session 7"):
        engine.set_live([0, 7], False)
    assert engine.live == [True, True]
    engine.step(torch.zeros(2, FRAME_SIZE))
    with pytest.raises(TypeError, match="a ContextSpan or a str, got NoneType"):
        engine.inject_span(0, None)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        DuplexEngine(tiny_checkpoint, batch_size=1.5)
    with pytest.raises(ValueError, match="top_k -5: give an integer of at least 1"):
        DuplexEngine(tiny_checkpoint, top_k=-5)
    assert engine.inject_span(0, "It is sunny.").span_in_window
    wide = DuplexEngine(tiny_checkpoint, max_span_frames=10**7)
    wide.step(torch.zeros(1, FRAME_SIZE))
    report = wide.inject_span(0, "It is sunny in Sydney today. " * 600)
    assert report.n >= wide.context and not report.truncated and not report.span_in_window


def test_bad_seeds_and_tokens_are_refused_before_anything_changes(tiny_checkpoint) -> None:
    """A seed the device cannot hold (past 2**63 - 1, negative, or seed + i past it for the constructor's B
    sessions) or that is no int raises at the call, not at the next step after the restart was queued; float
    tokens, and tokens the embedding tables do not hold, raise in step_tokens with the place named."""
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=5)
    for _ in range(3):
        engine.step(torch.zeros(2, FRAME_SIZE))
    for call in (
        lambda seed: engine.reset(0, seed=seed),
        lambda seed: engine.set_persona(0, "Be brief.", seed=seed),
        lambda seed: engine.set_prefix(0, torch.zeros(17, 0, dtype=torch.long), seed=seed),
    ):
        with pytest.raises(ValueError, match=r"seed 18446744073709551616 is outside 0 \.\. 2\*\*63 - 1"):
            call(2**64)
        with pytest.raises(ValueError, match="seed -1 is outside"):
            call(-1)
        for bad in ("7", 1.9, True):
            with pytest.raises(TypeError, match="a seed is an int or None"):
                call(bad)
    assert engine.seeds == [5, 6] and engine.positions == [3, 3]  # nothing queued
    engine.reset(0, seed=2**63 - 1)
    engine.step(torch.zeros(2, FRAME_SIZE))
    assert engine.seeds == [2**63 - 1, 6] and engine.positions == [1, 4]
    with pytest.raises(ValueError, match=r"seed \+ i for 2 sessions"):
        DuplexEngine(tiny_checkpoint, batch_size=2, seed=2**63 - 1)
    assert DuplexEngine(tiny_checkpoint, batch_size=2, seed=np.int64(9)).seeds == [9, 10]  # numpy's ints are ints
    other = DuplexEngine(tiny_checkpoint, batch_size=1)
    other.reset(0, seed=torch.tensor(11))
    assert other.seeds == [11] and type(other.seeds[0]) is int

    card, K = engine.lm.card, engine.num_streams
    with pytest.raises(ValueError, match=r"user_codes\[1, 2\] = -7 is outside 0 \.\. " + str(card)):
        engine.step_tokens(
            torch.zeros(2, 8, dtype=torch.long).index_put_((torch.tensor(1), torch.tensor(2)), torch.tensor(-7))
        )
    with pytest.raises(ValueError, match="user_codes must be an integer"):
        engine.step_tokens(torch.zeros(2, 8))
    forced = torch.full((2, K), -2, dtype=torch.long)
    forced[0, 0] = 99999
    with pytest.raises(ValueError, match=r"forced\[0, 0\] = 99999 is outside 0 \.\. \d+ or -2 \(sample\)"):
        engine.step_tokens(torch.zeros(2, 8, dtype=torch.long), forced)
    with pytest.raises(ValueError, match=r"voice codes are Mimi codes .* got torch\.float32"):
        engine.set_persona(0, None, torch.full((8, 5), 7.9))
    assert engine.positions == [1, 4]
    assert engine.step_tokens(torch.full((2, 8), card, dtype=torch.long)).valid.all()  # the placeholder id is held


def test_a_prefix_of_any_integer_dtype_is_read_as_its_ids(tiny_checkpoint) -> None:
    """uint8 frames were refused with a wrong message ("frames[0, 0] = 0 is outside -1 .. 1000": the -1 of the
    check wrapped to 255), and an int8 prefix was read with its delayed columns' initial tokens (1000, 2048)
    wrapped; any integer dtype whose values are in range reads the same as long frames."""
    outputs = []
    for dtype in (torch.long, torch.uint8, torch.int16, torch.int8):
        engine = DuplexEngine(tiny_checkpoint, batch_size=1, seed=5)
        K = engine.num_streams
        frames = torch.arange(6 * K).reshape(K, 6) % 120
        assert engine.set_prefix(0, frames.to(dtype)) == 6
        outputs.append(torch.stack([engine.step(torch.zeros(1, FRAME_SIZE)).agent_pcm for _ in range(2)]))
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_a_prefix_takes_no_input_anywhere_but_in_the_agent_codes_its_step_returns(tiny_checkpoint) -> None:
    """-1 (no input) is read in any cell of a prefix but the last column's agent codes, which the prefix's step
    returns as the agent's frame and decodes (was: accepted, then the step raised an IndexError in Mimi after the
    device state had advanced, and the session's host positions stayed one behind it)."""
    engine = DuplexEngine(tiny_checkpoint, batch_size=1, seed=0)
    K, C = engine.num_streams, engine.num_codebooks
    frames = torch.zeros(K, 5, dtype=torch.long)
    frames[:, :4] = -1  # no input in every row of the other columns
    frames[0, 4] = frames[1 + C :, 4] = -1  # and in the last column's text and user rows
    assert engine.set_prefix(0, frames) == 5
    for _ in range(3):
        out = engine.step(torch.zeros(1, FRAME_SIZE))
        assert out.valid.all() and out.agent_pcm.shape[-1] == FRAME_SIZE
    assert engine.positions == engine.state.grid.position.tolist()[:1] == [8]  # host and device agree
    for k in range(1, 1 + C):
        bad = frames.clone()
        bad[k, 4] = -1
        with pytest.raises(ValueError, match=rf"frames\[{k}, 4\] = -1: the prefix's last column"):
            engine.set_prefix(0, bad)
    assert engine.positions == [8]


def test_a_bad_prefix_or_input_is_refused_at_the_call_and_loses_no_other_work(tiny_checkpoint) -> None:
    """A prefix whose ids no embedding table holds, float frames, embeddings of the wrong width, a sparse or meta
    PCM tensor: each raises at the call, before the step takes the queued work, so the next step reads every
    session's queued persona and span and the whole batch equals a run that never saw the bad calls."""
    import numpy as np

    from cspan.core.sampling import SamplingParams

    def run(bad_calls: bool) -> tuple[torch.Tensor, list[int]]:
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=3)
        engine.set_persona(1, "You are kind.", "tiny0")
        pcm, texts = torch.zeros(2, FRAME_SIZE), []
        for _ in range(3):
            texts.append(engine.step(pcm).text_token)
        engine.inject_span(1, "The museum opens at nine.")
        engine.set_persona(0, "Be brief.")
        if bad_calls:
            K, D = engine.num_streams, engine.lm.cfg.dim
            with pytest.raises(ValueError, match=r"set_prefix: frames\[0, 0\] = 99999 is outside -1 \.\. \d+"):
                engine.set_prefix(0, torch.full((K, 5), 99999, dtype=torch.long))
            with pytest.raises(ValueError, match=rf"frames must be \[{K}, P\] integer ids, got torch.float32"):
                engine.set_prefix(0, torch.zeros(K, 5))
            with pytest.raises(ValueError, match=rf"embeddings must be \[E <= 5, {D}\] floats"):
                engine.set_prefix(0, torch.zeros(K, 5, dtype=torch.long), torch.zeros(7, 3))
            nan = torch.zeros(3, D)
            nan[2, 1] = float("nan")
            with pytest.raises(ValueError, match=r"set_prefix: embeddings\[2\] holds NaN or infinite values"):
                engine.set_prefix(0, torch.zeros(K, 5, dtype=torch.long), nan)
            with pytest.raises(TypeError, match=r"frames must be a torch\.Tensor, got list"):
                engine.set_prefix(0, [[1]])
            no_code = torch.zeros(K, 5, dtype=torch.long)
            no_code[2, 4] = -1  # the last column is the frame the prefix's step returns: its audio codes are decoded
            with pytest.raises(ValueError, match=r"set_prefix: frames\[2, 4\] = -1: the prefix's last column .* agent"):
                engine.set_prefix(0, no_code)
            for bad_pcm, kind in ((pcm.to_sparse(), "sparse_coo"), (torch.zeros(2, FRAME_SIZE, device="meta"), "meta")):
                with pytest.raises(TypeError, match=f"user_pcm must be a dense tensor with data, got a.*{kind}"):
                    engine.step(bad_pcm)
            with pytest.raises(TypeError, match=r"user_codes must be a torch\.Tensor, got ndarray"):
                engine.step_tokens(np.zeros((2, 8), np.int64))
            for call, message in (
                (lambda: engine.set_persona(1, 123), "text_prompt is a str or None, got int"),
                (lambda: engine.set_persona(1, "hi", user_name=5), "user_name is a str or None, got int"),
                (lambda: engine.set_persona(1, "hi", np.zeros((8, 5), np.int64)), "voice is a VoicePrompt"),
                (lambda: engine.set_persona(1, "hi", sampling=(0.5, 10)), "sampling is a SessionSampling"),
                (lambda: engine.set_sampling(1, text=(0.5, 5)), "text sampling is a SamplingParams"),
                (lambda: engine.set_live(1, "no"), "live is True or False, got str"),
                (lambda: engine.set_live(0.0), "a session is an int index, got float"),
            ):
                with pytest.raises(TypeError, match=message):
                    call()
            engine.set_sampling(np.int64(1), text=SamplingParams.text(0.7, 25))  # numpy's ints are session indices
            engine.set_live(torch.tensor([0, 1]), True)
        for _ in range(4):
            texts.append(engine.step(pcm).text_token)
        return torch.stack(texts), engine.positions

    (texts, positions), (clean_texts, clean_positions) = run(True), run(False)
    assert torch.equal(texts, clean_texts) and positions == clean_positions
    with pytest.raises(TypeError, match=r"max_span_frames must be an int, got 10\.5"):
        DuplexEngine(tiny_checkpoint, max_span_frames=10.5)


def test_load_checkpoint_names_a_device_or_dtype_it_cannot_use(tiny_checkpoint_dir) -> None:
    from cspan.core.errors import CspanError

    with pytest.raises(CheckpointError, match=r"dtype torch\.float64: the model runs in bfloat16, float16 or float32"):
        load_checkpoint(tiny_checkpoint_dir, dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"dtype torch\.int8"):
        load_checkpoint(tiny_checkpoint_dir, dtype=torch.int8)
    with pytest.raises(CspanError, match="device tpu: not a device torch knows"):
        load_checkpoint(tiny_checkpoint_dir, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(CspanError, match="device cuda: this torch has no CUDA device"):
            load_checkpoint(tiny_checkpoint_dir, device="cuda")


def test_a_step_with_every_session_idle_computes_nothing(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, batch_size=2)
    engine.step(torch.zeros(2, FRAME_SIZE))
    engine.set_live([0, 1], False)
    out = engine.step(torch.zeros(2, FRAME_SIZE))
    assert not out.valid.any() and (out.agent_pcm == 0).all() and out.text_token.tolist() == [-1, -1]
    assert engine.positions == [1, 1] and engine.step_tokens(torch.zeros(2, 8, dtype=torch.long)).frame.eq(-2).all()


def _budget_script(
    engine: DuplexEngine, sessions: list[int], user: torch.Tensor, plan: dict, prepare: str | None = None
) -> list:
    """Steps with, before step t, the spans / personas ``plan[t]`` lists as (session, kind, arg) for the sessions
    in ``sessions`` (batch row = index); returns each step's output (``prepare``: as in :func:`_script`)."""
    outs = []
    for t in range(user.shape[0]):
        if prepare == "before":
            engine.prepare()
        for s, kind, arg in plan.get(t, []):
            if s not in sessions:
                continue
            row = sessions.index(s)
            if kind == "span":
                engine.inject_span(row, ContextSpan.from_ids(arg))
            else:
                engine.set_persona(row, PROMPTS[arg], seed=100 + s)
        if prepare == "after":
            engine.prepare()
        outs.append(engine.step_tokens(user[t, sessions]))
    return outs


def test_a_column_budget_reads_held_back_spans_in_later_steps(tiny_checkpoint) -> None:
    """max_block_columns: a step reads the queued spans of as many sessions as fit, oldest waiting first; the
    others wait, whole and in order, and each session equals the batch-1 engine that received its span as many
    steps later as it waited. A persona prefix is never held back (it takes the budget first)."""
    span = [100 + i for i in range(6)]  # 8 columns with the markers
    batched_plan = {
        1: [(0, "span", span), (1, "span", span), (2, "span", span)],  # 24 columns against 10: three steps
        4: [(3, "persona", 0), (1, "span", span)],  # the prefix is read now, the span waits one step
        6: [(0, "span", span), (0, "span", span)],  # one session's two spans: the second waits one step
    }
    user = _user(9, 4, seed=3)
    engine = DuplexEngine(tiny_checkpoint, batch_size=4, seed=0, max_block_columns=10)
    batched = _budget_script(engine, [0, 1, 2, 3], user, batched_plan)
    assert engine.sessions.waiting == [] and engine.sessions.blocks == {}
    alone_plans = {  # when each session reads its span(s) in the batch
        0: {1: [(0, "span", span)], 6: [(0, "span", span)], 7: [(0, "span", span)]},
        1: {2: [(1, "span", span)], 5: [(1, "span", span)]},
        2: {3: [(2, "span", span)]},
        3: {4: [(3, "persona", 0)]},
    }
    for s in range(4):
        alone = _budget_script(DuplexEngine(tiny_checkpoint, batch_size=1, seed=s), [s], user, alone_plans[s])
        for t, (a, b) in enumerate(zip(alone, batched, strict=True)):
            assert torch.equal(a.frame[0], b.frame[s]), f"session {s}, step {t}"
            assert torch.equal(a.position[0], b.position[s]), f"session {s}, step {t}"
            torch.testing.assert_close(a.text_logits[0], b.text_logits[s], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="max_block_columns"):
        DuplexEngine(tiny_checkpoint, batch_size=1, max_block_columns=0)


def test_a_column_budget_does_not_let_one_session_starve_the_others(tiny_checkpoint) -> None:
    """max_block_columns: a session that read a span in a step goes behind the sessions that read none, so one
    session's backlog of spans cannot hold another's span back step after step (the backlogged session stayed at
    the head of the waiting rows and read all three of its spans before session 1 read its one)."""
    span = ContextSpan.from_ids([100 + i for i in range(6)])  # 8 columns: one span per step under a budget of 10
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=0, max_block_columns=10)
    engine.step_tokens()
    seqs = [engine.inject_span(0, span).seq for _ in range(3)] + [engine.inject_span(1, span).seq]
    reads = []
    for _ in range(4):
        engine.step_tokens()
        reads.append([[r.seq for r in engine.take_span_reads(s)] for s in range(2)])
    assert reads == [[[seqs[0]], []], [[], [seqs[3]]], [[seqs[1]], []], [[seqs[2]], []]]


def test_a_long_block_is_attended_in_query_chunks_with_the_same_result(tiny_checkpoint, monkeypatch) -> None:
    """The eager step attends a block in chunks of ``EAGER_QUERY_ROWS`` query positions (so many spans read in one
    step take memory in proportion to their length, not its square); chunked, every row's text logits and tokens
    are the same as in one call."""
    from cspan.core.modules import transformer

    def run(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        monkeypatch.setattr(transformer, "EAGER_QUERY_ROWS", rows)
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=0)
        engine.step_tokens()
        engine.inject_span(0, ContextSpan.from_ids([100 + i for i in range(38)]))  # 40 columns
        engine.inject_span(0, ContextSpan.from_ids([200 + i for i in range(18)]))  # read in the same step
        engine.inject_span(1, ContextSpan.from_ids([300 + i for i in range(10)]))
        got = []
        for _ in range(3):
            out = engine.step_tokens()
            got.append((out.text_logits.float().clone(), out.column.clone()))
        return got

    whole, chunked = run(1024), run(7)
    for (logits_w, column_w), (logits_c, column_c) in zip(whole, chunked, strict=True):
        torch.testing.assert_close(logits_c, logits_w, rtol=1e-5, atol=1e-5)
        assert torch.equal(column_c, column_w)


def test_the_step_that_reads_a_span_reports_it(tiny_checkpoint, caplog) -> None:
    """``take_span_reads``: each span is reported by the step that reads it, by its ``SpanReport.seq``, at its
    first position as read: the report's, plus one per step the column budget held it back (the schedule of the
    test above). ``reset`` and ``set_persona`` drop spans queued for the old stream, with a warning."""
    span = [100 + i for i in range(6)]  # 8 columns
    engine = DuplexEngine(tiny_checkpoint, batch_size=4, seed=0, max_block_columns=10)
    user = _user(9, 4, seed=3)
    plan = {
        1: [(0, "span"), (1, "span"), (2, "span")],
        4: [(3, "persona"), (1, "span")],
        6: [(0, "span"), (0, "span")],
    }
    reports: dict[int, SpanReport] = {}
    injected: dict[int, int] = {}  # seq -> the step before which it was injected
    read: dict[int, tuple[int, SpanRead]] = {}  # seq -> (the step that read it, what it said)
    for t in range(user.shape[0]):
        for s, kind in plan.get(t, []):
            if kind == "span":
                report = engine.inject_span(s, ContextSpan.from_ids(span))
                reports[report.seq], injected[report.seq] = report, t
            else:
                engine.set_persona(s, PROMPTS[0], seed=100 + s)
        engine.step_tokens(user[t])
        for s in range(4):
            for r in engine.take_span_reads(s):
                assert reports[r.seq].session == s and r.seq not in read
                read[r.seq] = (t, r)
    assert sorted(read) == sorted(reports) == list(range(6))
    assert [read[q][0] for q in range(6)] == [1, 2, 3, 5, 6, 7]  # the schedule of the budget test above
    for seq, (t, r) in read.items():
        assert r.n == 8 and r.first_position == reports[seq].first_position + (t - injected[seq]), seq
    # a restart drops what was queued for the old stream, and says so
    engine.inject_span(0, ContextSpan.from_ids(span))
    engine.inject_span(0, ContextSpan.from_ids(span))
    with caplog.at_level("WARNING", logger="cspan.core.engine"):
        engine.reset(0)
    engine.step_tokens(user[0])
    assert engine.take_span_reads(0) == [] and int(engine.positions[0]) == 1
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "reset: session 0 had 2 Context Span(s) queued and not read yet; they belonged to the stream it restarts and "
        "are dropped"
    ]


def test_a_prepared_step_equals_the_step_it_prepares(tiny_checkpoint, monkeypatch) -> None:
    """``prepare()`` between frames builds the next step's inputs ahead of it: the step reads them when nothing
    changed since (no second build), and builds its own when a span, persona, live flag or step came in between;
    either way every output equals the engine that never prepares (mixed batches with personas, spans, an idle
    stretch; a column budget holding spans back)."""
    import cspan.core.engine as engine_module

    builds = []
    build_step = engine_module.build_step
    monkeypatch.setattr(engine_module, "build_step", lambda *a, **k: builds.append(1) or build_step(*a, **k))
    user = _user(7, 4, seed=8)
    expected = _script(DuplexEngine(tiny_checkpoint, batch_size=4, seed=0), [0, 1, 2, 3], user)
    unprepared = len(builds)
    for prepare in ("after", "before"):
        engine = DuplexEngine(tiny_checkpoint, batch_size=4, seed=0)
        builds.clear()
        got = _script(engine, [0, 1, 2, 3], user, prepare)
        for t, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a.frame, b.frame) and torch.equal(a.column, b.column), f"{prepare}, step {t}"
            assert torch.equal(a.text_logits, b.text_logits) and torch.equal(a.position, b.position)
        # "after": each step read the inputs prepared for it (no build twice); "before": the changes came after
        # prepare, so the steps with changes built theirs again
        assert len(builds) == unprepared if prepare == "after" else len(builds) > unprepared, prepare
    span = [100 + i for i in range(6)]
    plan = {1: [(0, "span", span), (1, "span", span), (2, "span", span)], 4: [(3, "persona", 0), (1, "span", span)]}
    user = _user(6, 4, seed=3)
    outs = []
    for prepare in (None, "after", "before"):
        engine = DuplexEngine(tiny_checkpoint, batch_size=4, seed=0, max_block_columns=10)
        outs.append(_budget_script(engine, [0, 1, 2, 3], user, plan, prepare))
    for t, steps in enumerate(zip(*outs, strict=True)):
        for other in steps[1:]:
            assert torch.equal(steps[0].frame, other.frame) and torch.equal(steps[0].position, other.position), t
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=0)
    engine.step_tokens(user[0, :2])
    engine.inject_span(0, ContextSpan.from_ids(span))
    engine.prepare()
    version = engine.sessions.version
    engine.prepare()  # preparing again reads the same head and changes nothing
    assert engine.sessions.version == version and engine.sessions.blocks  # still queued for the step
    out = engine.step_tokens(user[1, :2])
    assert int(out.position[0]) == 1 + len(span) + 2 and not engine.sessions.blocks  # after the 8 columns


def test_every_refused_argument_names_its_method(tiny_checkpoint) -> None:
    """A session index that is no session said only "session 9 is outside 0..1" or "a session is an int index",
    whichever method refused it; voice codes in a meta or sparse tensor failed inside torch (RuntimeError,
    NotImplementedError) and voice codes of the wrong shape named prefix_frames' ``voice_codes``; an empty voice
    name was "voice '.' is a directory". Each is now refused with the method and the argument named, and the
    engine goes on as one that never saw the calls."""
    K = 17

    def run(bad_calls: bool) -> tuple[torch.Tensor, list[int]]:
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=3)
        engine.set_persona(0, "You are kind.", "tiny0")
        pcm, texts = _pcm(6, 2, seed=8), []
        texts.append(engine.step(pcm[0]).text_token)
        engine.inject_span(0, "The museum opens at nine.")
        if bad_calls:
            for name, call in (
                ("reset", lambda i: engine.reset(i)),
                ("set_sampling", lambda i: engine.set_sampling(i)),
                ("set_live", lambda i: engine.set_live([0, i], False)),
                ("set_persona", lambda i: engine.set_persona(i, "Hi.")),
                ("set_prefix", lambda i: engine.set_prefix(i, torch.zeros(K, 3, dtype=torch.long))),
                ("inject_span", lambda i: engine.inject_span(i, "It is sunny.")),
                ("window_positions_left", lambda i: engine.window_positions_left(i)),
                ("prefix_in_window", lambda i: engine.prefix_in_window(i)),
                ("take_window_events", lambda i: engine.take_window_events(i)),
            ):
                with pytest.raises(IndexError, match=rf"^{name}: session 9 is outside 0\.\.1 \(engine batch_size 2\)"):
                    call(np.int64(9))
                with pytest.raises(TypeError, match=rf"^{name}: a session is an int index, got float 1\.0"):
                    call(1.0)
            codes = torch.zeros(8, 5, dtype=torch.long)
            for voice, error, message in (
                (codes.to("meta"), TypeError, "voice must be a dense tensor with data, got a meta tensor"),
                (codes.to_sparse(), TypeError, "voice must be a dense tensor with data, got a torch.sparse_coo"),
                (codes[:4], ValueError, r"voice codes must be \[8, N\] Mimi codes, got \[4, 5\]"),
                (codes[0], ValueError, r"voice codes must be \[8, N\] Mimi codes, got \[5\]"),
                ("", CheckpointError, "voice '' is empty"),
            ):
                with pytest.raises(error, match=message):
                    engine.set_persona(1, "Hi.", voice)
        for t in range(1, 6):
            texts.append(engine.step(pcm[t]).text_token)
        return torch.stack(texts), engine.positions

    (texts, positions), (clean_texts, clean_positions) = run(True), run(False)
    assert torch.equal(texts, clean_texts) and positions == clean_positions


def test_a_reset_while_a_step_runs_takes_effect_at_the_next_step(tiny_checkpoint) -> None:
    """``reset`` from another thread, landing after the step took its queued work and before it recorded the
    position it fed: the step counted that position on the reset session (position 1 instead of 0, started), so
    the host's layout no longer matched the device and a later frame failed for every session ("index out of range
    in self" in the codec). The session now equals one reset right after that step."""

    def run(race: bool) -> tuple[torch.Tensor, list[int]]:
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=3)
        engine.set_persona(0, "You are kind.", "tiny0")
        engine.set_persona(1, "Hi.", "tiny1")
        pcm, frames = _pcm(8, 2, seed=2), []
        for t in range(3):
            frames.append(engine.step(pcm[t]).tokens.frame)
        advance = engine.sessions.advance
        if race:  # the other thread's reset lands between the step's take and its advance

            def reset_then_advance(rows):
                engine.reset(0, seed=11)
                advance(rows)

            engine.sessions.advance = reset_then_advance
        frames.append(engine.step(pcm[3]).tokens.frame)
        engine.sessions.advance = advance
        if not race:
            engine.reset(0, seed=11)
        assert engine.positions[0] == 0 and engine.started[0] is False
        for t in range(4, 8):
            frames.append(engine.step(pcm[t]).tokens.frame)
        return torch.stack(frames), engine.positions

    (frames, positions), (clean_frames, clean_positions) = run(True), run(False)
    assert positions == clean_positions == [4, positions[1]]
    assert torch.equal(frames, clean_frames)


def test_a_span_injected_while_a_step_runs_reports_where_it_is_read(tiny_checkpoint) -> None:
    """``inject_span`` from another thread, landing after the step took its head and before it recorded the
    position it fed: the span is read by the next step, after that position, and its report says so (was:
    ``first_position`` and ``next_position`` one less, the position the running step fed, while ``take_span_reads``
    gave the true one). The session equals one given the span right after that step."""

    def run(race: bool) -> tuple[SpanReport, list[SpanRead], torch.Tensor, list[int]]:
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=3)
        engine.set_persona(0, "You are kind.", "tiny0")
        engine.set_persona(1, "Hi.", "tiny1")
        pcm, frames, reports = _pcm(6, 2, seed=2), [], []
        for t in range(3):
            frames.append(engine.step(pcm[t]).tokens.frame)
        advance = engine.sessions.advance
        if race:  # the other thread's span lands between the step's take and its advance

            def inject_then_advance(rows):
                reports.append(engine.inject_span(1, "It is sunny."))
                advance(rows)

            engine.sessions.advance = inject_then_advance
        frames.append(engine.step(pcm[3]).tokens.frame)
        engine.sessions.advance = advance
        if not race:
            reports.append(engine.inject_span(1, "It is sunny."))
        for t in range(4, 6):
            frames.append(engine.step(pcm[t]).tokens.frame)
        return reports[0], engine.take_span_reads(1), torch.stack(frames), engine.positions

    (report, reads, frames, positions), (clean, clean_reads, clean_frames, clean_positions) = run(True), run(False)
    assert (report.first_position, report.next_position) == (clean.first_position, clean.next_position)
    assert report.window_positions_left == clean.window_positions_left
    assert reads == clean_reads == [SpanRead(report.seq, report.first_position, report.n)]
    assert positions == clean_positions and positions[1] == report.next_position + 2
    assert torch.equal(frames, clean_frames)


def test_a_restart_and_its_sampling_reach_the_step_together(tiny_checkpoint) -> None:
    """``reset`` queued the restart and then the default sampling in two updates of the sessions record (and
    ``set_persona(..., sampling=)`` its prefix and then its sampling): a step taking its work from another thread
    between the two read the restarted session with its old parameters. Both now land in one update; a policy or
    a prefix refused by ``set_persona`` names ``set_persona``, not the ``set_prefix`` it calls."""
    greedy = SamplingParams(0.0, 0)
    user = [torch.randint(0, 2048, (1, 8), generator=torch.Generator().manual_seed(t)) for t in range(6)]

    def run(race: bool, persona: bool) -> torch.Tensor:
        engine = DuplexEngine(tiny_checkpoint, seed=3)
        engine.set_sampling(0, text=greedy, audio=greedy)
        frames = [engine.step_tokens(user[t]).frame for t in range(2)]
        reset = engine.sessions.reset
        if race:  # the other thread's step takes its head right after the restart was queued

            def reset_then_step(*args, **kwargs):
                reset(*args, **kwargs)
                frames.append(engine.step_tokens(user[2]).frame)

            engine.sessions.reset = reset_then_step
        if persona:
            engine.set_persona(0, "Hi.", "tiny0", seed=5, sampling=SessionSampling(SamplingParams(0.7, 25), greedy))
        else:
            engine.reset(0, seed=5)
        engine.sessions.reset = reset
        if not race:
            frames.append(engine.step_tokens(user[2]).frame)
        frames += [engine.step_tokens(user[t]).frame for t in range(3, 6)]
        return torch.stack(frames)

    for persona in (False, True):
        assert torch.equal(run(True, persona), run(False, persona))
    engine = DuplexEngine(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"^set_persona: persona policy 'pin': use one of pinned"):
        engine.set_persona(0, "Hi.", policy="pin")
    with pytest.raises(ValueError, match=r"^set_persona: a persona prefix of \d+ frames fills the model's 3000"):
        engine.set_persona(0, "Hi.", torch.zeros(8, 3000, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^DuplexEngine: persona policy 'pin'"):
        DuplexEngine(tiny_checkpoint, persona_policy="pin")
