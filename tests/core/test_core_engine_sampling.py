"""Per-session sampling: each row of the engine's one batched step samples with its session's own temperature and
top-k (set host-side like its seed), and equals that session run alone with those parameters; bad values are
refused with a clear error and change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from padded_steps import padded

from cspan.core.constants import MAX_TOP_K
from cspan.core.engine import DuplexEngine
from cspan.core.modules import fused
from cspan.core.sampling import RowSampling, SamplingParams, SessionSampling, sample_race

PARAMS = [
    SessionSampling(SamplingParams(0.0, 0), SamplingParams(0.0, 0)),  # greedy
    SessionSampling(SamplingParams(1.3, 5), SamplingParams(0.5, 3)),
    SessionSampling(),  # the defaults: 0.7 / 25, 0.8 / 250
    SessionSampling(SamplingParams(2.0, 0), SamplingParams(1.0, 1)),  # audio top-1: the argmax whatever the noise
]


def test_sample_race_per_row_equals_one_call_per_row() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(6, 300, generator=gen)
    logits[2, :9] = logits[2, 4]  # ties with the k-th largest stay in the race
    seed, counter = torch.arange(6) * 77 + 1, torch.arange(6) + 10
    noise = fused.race_noise(seed, counter, 2, 300)
    temps = torch.tensor([0.8, 0.0, 1.5, 0.3, 1.0, 0.7])
    top_ks = torch.tensor([25, 5, 3, 0, 300, 1])
    rows = sample_race(logits, temps, top_ks, noise)
    for r in range(6):
        want = sample_race(logits[r : r + 1], float(temps[r]), int(top_ks[r]), noise[r : r + 1])
        assert rows[r].item() == want.item(), r
    assert rows[1].item() == logits[1].argmax().item() and rows[5].item() == logits[5].argmax().item()


def _run(engine: DuplexEngine, users: torch.Tensor, params: list[SessionSampling], rows: list[int]) -> list:
    for r, p in enumerate(params):
        engine.set_sampling(r, p.text, p.audio)
    out = []
    for t in range(users.shape[0]):
        step = engine.step_tokens(users[t, rows])
        out.append((step.column.clone(), step.text_logits.clone()))
    return out


@pytest.mark.parametrize("layout", ["unpadded", "padded"])
def test_rows_with_their_own_sampling_equal_batch1_runs(tiny_checkpoint, layout: str) -> None:
    """Four sessions with four different (temperature, top-k) pairs in one batch (padded: also laid out as the
    CUDA graphs run it) equal each session alone with its parameters and seed; an audio top-1 row samples exactly
    the greedy row's audio given the same history, and the parameters really change the tokens."""
    lm = tiny_checkpoint.lm
    C = lm.num_codebooks // 2
    users = torch.randint(0, lm.card, (8, 4, C), generator=torch.Generator().manual_seed(3))
    batch = DuplexEngine(tiny_checkpoint, batch_size=4, seed=11)
    if layout == "padded":
        padded(batch)
    together = _run(batch, users, PARAMS, [0, 1, 2, 3])
    assert batch.sampling == PARAMS
    for r in range(4):
        alone = _run(DuplexEngine(tiny_checkpoint, batch_size=1, seed=11 + r), users, [PARAMS[r]], [r])
        for t, ((col, logits), (col1, logits1)) in enumerate(zip(together, alone, strict=True)):
            assert torch.equal(col[r], col1[0]), (r, t)
            torch.testing.assert_close(logits[r], logits1[0], atol=1e-5, rtol=0)
    # session 3 again with the engine's defaults: other tokens (the parameters are applied, not ignored)
    default = _run(DuplexEngine(tiny_checkpoint, batch_size=1, seed=14), users, [SessionSampling()], [3])
    assert any(not torch.equal(a[0][3], b[0][0]) for a, b in zip(together, default, strict=True))


def test_audio_top1_is_greedy(tiny_checkpoint) -> None:
    """top-k 1 keeps only the most probable token: whatever the temperature and seed, the greedy tokens."""
    lm = tiny_checkpoint.lm
    users = torch.randint(0, lm.card, (6, 1, lm.num_codebooks // 2), generator=torch.Generator().manual_seed(5))
    greedy = SessionSampling(SamplingParams(0.0, 0), SamplingParams(0.0, 0))
    top1 = SessionSampling(SamplingParams(1.7, 1), SamplingParams(2.5, 1))
    a = _run(DuplexEngine(tiny_checkpoint, batch_size=1, seed=1), users, [greedy], [0])
    b = _run(DuplexEngine(tiny_checkpoint, batch_size=1, seed=99), users, [top1], [0])
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))


def test_sampling_follows_set_persona_and_reset(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, batch_size=2, temp=0.6, top_k=40, temp_text=0.5, top_k_text=7, seed=0)
    defaults = SessionSampling(SamplingParams(0.5, 7), SamplingParams(0.6, 40))
    assert engine.sampling == [defaults, defaults]
    mine = SessionSampling(SamplingParams(0.9, 3), SamplingParams(1.1, 100))
    too_long = torch.zeros(8, engine.context, dtype=torch.long)  # a voice prefix that fills the window
    with pytest.raises(ValueError, match="fills the model's"):
        engine.set_persona(1, None, too_long, sampling=mine)
    assert engine.sampling == [defaults, defaults]  # the failing call changed nothing
    engine.set_persona(1, None, None, sampling=mine)
    assert engine.sampling == [defaults, mine]
    engine.set_sampling(1, audio=SamplingParams(0.0, 0))
    assert engine.sampling[1] == SessionSampling(mine.text, SamplingParams(0.0, 0))
    engine.step_tokens(torch.zeros(2, engine.num_codebooks, dtype=torch.long))
    state = engine.state
    assert state.text_temp[:2].tolist() == pytest.approx([0.5, 0.9]) and state.text_top_k[:2].tolist() == [7, 3]
    assert state.audio_temp[:2].tolist() == pytest.approx([0.6, 0.0]) and state.audio_top_k[:2].tolist() == [40, 0]
    _assert_text_rules_follow(state)
    engine.reset(1)  # a new session starts from the engine's defaults
    assert engine.sampling[1] == defaults
    engine.step_tokens(torch.zeros(2, engine.num_codebooks, dtype=torch.long))
    assert state.text_top_k[:2].tolist() == [7, 7]
    _assert_text_rules_follow(state)


def _assert_text_rules_follow(state) -> None:
    """The text rules the engine keeps (a step reads them) are those of its current parameters, for every
    static top-k size."""
    fresh = RowSampling(state.text_temp, state.text_top_k)
    assert state.text_rules, "the engine keeps its text rules"
    for (vocab, top), kept in state.text_rules.items():
        for a, b in zip(kept, fresh.rule(vocab, top), strict=True):
            assert torch.equal(a, b), (vocab, top)


@pytest.mark.parametrize(
    ("text", "audio", "match"),
    [
        (SamplingParams(0.0004, 5), None, "use 0 for greedy decoding"),
        (SamplingParams(float("nan"), 5), None, "text temperature nan"),
        (SamplingParams(11.0, 5), None, "0 \\(greedy\\) or 0.001 to 10"),
        (None, SamplingParams(0.8, MAX_TOP_K + 1), f"audio top_k {MAX_TOP_K + 1}: at most {MAX_TOP_K}"),
        (None, SamplingParams(0.8, 2.5), "give an integer"),
    ],
)
def test_bad_sampling_is_refused_and_changes_nothing(tiny_checkpoint, text, audio, match: str) -> None:
    engine = DuplexEngine(tiny_checkpoint, batch_size=1)
    before = engine.sampling
    with pytest.raises(ValueError, match=match):
        engine.set_sampling(0, text, audio)
    assert engine.sampling == before
    with pytest.raises(ValueError, match=match):
        engine.set_persona(
            0, None, None, sampling=SessionSampling(text or SamplingParams.text(), audio or SamplingParams.audio())
        )
    assert engine.sampling == before
    with pytest.raises(ValueError, match="temperature 11"):
        DuplexEngine(tiny_checkpoint, batch_size=1, temp=11.0)


def test_top_k_at_or_above_the_vocabulary_keeps_all(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, batch_size=1)
    engine.set_sampling(0, audio=SamplingParams(0.8, tiny_checkpoint.lm.card + 5))
    assert engine.sampling[0].audio.top_k == tiny_checkpoint.lm.card + 5


KERNEL_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from padded_steps import _interpreter_index_shim
_interpreter_index_shim()
import torch
from cspan.core.modules import fused
from cspan.core.sampling import sample_race
gen = torch.Generator().manual_seed(11)
same = []
for dtype in (torch.float32, torch.bfloat16):
    logits = (torch.randn(8, 2048, generator=gen) * 3).to(dtype)
    logits[0, :12] = logits[0, 7]
    seed, counter = torch.arange(8) * 1000 + 5, torch.arange(8) + 77
    known = torch.full((8,), -2, dtype=torch.long)
    known[3] = 5
    noise = fused.race_noise(seed, counter, 3, 2048)
    temps = torch.tensor([0.8, 0.0, 1.3, 0.5, 0.7, 0.0, 2.0, 0.9])
    top_ks = torch.tensor([250, 25, 1, 0, 2048, 7, 3, 500])
    got = fused.sample_top_k(logits, temps, top_ks, seed, counter, 3, known, torch.empty(8, dtype=torch.long))
    same.append(got.tolist() == sample_race(logits, temps, top_ks, noise).where(known == -2, known).tolist())
print(json.dumps(same))
"""


@pytest.mark.skipif(
    os.environ.get("CSPAN_TEST_INTERPRETER") != "1",
    reason="Triton's interpreter: opt in with CSPAN_TEST_INTERPRETER=1 (needs triton installed)",
)
def test_the_sampling_kernel_reads_each_rows_parameters_under_the_interpreter(repo_root: Path) -> None:
    """fused.sample_top_k with per-row temperatures and top-k (greedy rows, top-1, all) picks sample_race's
    tokens, float32 and bf16 logits (Triton's interpreter in a subprocess; the GPU test checks the device)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", KERNEL_CHECK, str(repo_root / "tests" / "core")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True, True]


def test_numpy_numbers_and_any_large_top_k_are_sampling_parameters(tiny_checkpoint) -> None:
    """numpy's ints and floats were refused as "top_k np.int64(25): give an integer of at least 1" (the session
    index and the seed take them); a top-k past int64 (it keeps every token, as any k at or above the vocabulary)
    was accepted and then failed the next step of every session ("Overflow when unpacking long long"), after the
    step had taken the queued work. Errors name the method."""
    import numpy as np

    engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=4)
    engine.set_sampling(0, text=SamplingParams(np.float64(0.5), np.int64(7)), audio=SamplingParams(np.int32(1), 2**64))
    params = engine.sampling[0]
    assert params == SessionSampling(SamplingParams(0.5, 7), SamplingParams(1.0, 2**64))
    assert type(params.text.temperature) is float and type(params.text.top_k) is int
    every = DuplexEngine(tiny_checkpoint, batch_size=2, seed=4)  # top-k 0: every token, the same race
    every.set_sampling(0, text=SamplingParams(0.5, 7), audio=SamplingParams(1.0, 0))
    user = torch.zeros(2, engine.num_codebooks, dtype=torch.long)
    for _ in range(4):
        got, want = engine.step_tokens(user), every.step_tokens(user)
        assert torch.equal(got.frame, want.frame) and torch.equal(got.column, want.column)
    assert engine.state.audio_top_k[0].item() == torch.iinfo(torch.long).max
    with pytest.raises(ValueError, match=r"^set_sampling: text top_k np\.float64\(2\.0\): give an integer"):
        engine.set_sampling(1, text=SamplingParams(0.5, np.float64(2.0)))
    with pytest.raises(ValueError, match=r"^set_persona: audio temperature 12: give 0 \(greedy\)"):
        engine.set_persona(1, "Hi.", sampling=SessionSampling(audio=SamplingParams(12, 5)))
    with pytest.raises(TypeError, match=r"^set_sampling: text sampling is a SamplingParams"):
        engine.set_sampling(1, text=(0.5, 5))
    with pytest.raises(ValueError, match=r"^DuplexEngine: audio top_k -1"):
        DuplexEngine(tiny_checkpoint, top_k=-1)
    assert engine.sampling[1] == SessionSampling(engine.text_params, engine.audio_params)
