"""PersonaPlex's prefix layout against NVIDIA PersonaPlex's own outputs (``fixtures/reference/personaplex-prefix``).

The fixture runs ``LMGen.step_system_prompts`` (voice, 6 silence frames, ``<system>``-wrapped text, 6 silence frames)
and 20 greedy conversation calls on the tiny PersonaPlex-shaped LM, with the voice from a wav, from the ``.pt``
PersonaPlex saved from it, and without a voice. Here the same prefix is laid out by
:func:`cspan.core.prefix.build_persona_prefix` (``PERSONAPLEX``), read in ONE step by the engine
(:meth:`cspan.core.engine.DuplexEngine.set_prefix`, embedding voices included), and the conversation continues
through the engine's steps. Integers (frames, positions, token ring, voice codes, returned tokens) must match exactly, the voice PCM
bit for bit; floats within the README's tolerances (logits 5e-5; hidden states, input embeddings, KV 2e-5).

Coordinates: PersonaPlex's frame 0 never reaches the model, so our prefix is its frames ``1 .. P-1`` (P' = P - 1
columns) and our forward over positions ``0 .. P'`` is its P - 1 prompt calls plus its conversation call 0; our live
call j is its conversation call j + 1 and returns its ``tokens[j + 1]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from cspan.core.checkpoint import load_mimi, load_tokenizer
from cspan.core.config import PERSONAPLEX, MimiConfig
from cspan.core.engine import DuplexEngine
from cspan.core.prefix import build_persona_prefix, prefix_inputs
from cspan.core.streams import delay_tokens
from cspan.core.voice import load_voice_prompt, prepare_voice_audio, voice_embeddings_form

ATOL_LOGITS = 5e-5
ATOL_STATE = 2e-5
RUNS = ("voice_wav", "voice_pt", "no_voice")


@pytest.fixture(scope="module")
def pp(fixtures_dir: Path, reference_lm) -> SimpleNamespace:
    folder = fixtures_dir / "reference" / "personaplex-prefix"
    if not folder.is_dir():
        pytest.skip(f"fixture not found: {folder}")
    lm = reference_lm("lm-personaplex-shaped")
    mimi_dir = fixtures_dir / "reference" / "mimi-small"
    mimi_cfg = MimiConfig.from_upstream(json.loads((mimi_dir / "config.json").read_text()))
    mimi = load_mimi(mimi_dir / "model.safetensors", mimi_cfg)
    meta = json.loads((folder / "meta.json").read_text())
    common = load_file(folder / "common.safetensors")
    return SimpleNamespace(
        folder=folder,
        lm=lm,
        mimi=mimi,
        tokenizer=load_tokenizer(folder / "tokenizer.model"),
        prompt=meta["text"]["prompt"],
        Z=common["silence_tokens"].tolist(),
        S=common["sine_tokens"].tolist(),
        text_tokens=common["text_tokens"].tolist(),
        user_codes=common["user_codes"],
        voice_input=load_file(folder / "voice_input.safetensors"),
        runs={name: load_file(folder / f"run_{name}.safetensors") for name in RUNS},
        # what load_voice_prompt reads from a checkpoint: voice names, LM sizes, the codec
        checkpoint=SimpleNamespace(voices={}, lm_config=lm.cfg, mimi=mimi),
    )


def _voice(pp: SimpleNamespace, run: str):
    if run == "voice_wav":
        return load_voice_prompt(pp.folder / "voice.wav", pp.checkpoint)
    if run == "voice_pt":
        return load_voice_prompt(pp.folder / "voice.pt", pp.checkpoint)
    return None


def _prefix(pp: SimpleNamespace, run: str):
    return build_persona_prefix(
        pp.tokenizer,
        pp.prompt,
        _voice(pp, run),
        layout=PERSONAPLEX,
        agent_placeholder=pp.Z,
        user_placeholder=pp.S,
    )


def _initial(lm) -> list[int]:
    return [lm.text_initial_token_id] + [lm.initial_token_id] * lm.n_q


# --- the voice from a wav, and PersonaPlex's .pt form of it ---------------------------------------------------------


def test_voice_audio_matches_personaplex(pp) -> None:
    """Loudness normalisation as PersonaPlex's ``normalize_audio``: pyloudnorm's float32 measurement differs from the
    fixture's in the 9th significant digit (NumPy / CPU reductions: -20.3970052 vs -20.3970055 LUFS here), so the gain
    differs by 3e-8 relative and the fed PCM by at most one float32 ulp; the voice codes are identical."""
    audio = prepare_voice_audio(pp.folder / "voice.wav")
    expected = pp.voice_input["pcm_fed"][0, 0].numpy()
    assert audio.samples == 49000 and audio.num_frames == 26
    assert abs(audio.loudness_lufs - float(pp.voice_input["loudness_lufs"][0])) < 1e-6
    assert abs(audio.gain / float(pp.voice_input["gain"][0]) - 1) < 1e-7
    assert (np.abs(audio.pcm - expected) <= np.spacing(np.abs(expected))).all()  # within one float32 ulp
    assert (audio.pcm[49000:] == 0).all() and (expected[49000:] == 0).all()
    voice = load_voice_prompt(pp.folder / "voice.wav", pp.checkpoint)
    assert voice.kind == "codes" and torch.equal(voice.codes, pp.voice_input["codes"][0])


def test_voice_pcm_bit_for_bit_given_personaplex_loudness(pp, monkeypatch) -> None:
    """With PersonaPlex's measured loudness, the gain and the fed PCM are its own bit for bit (float64 product,
    rounded to float32) where this machine's ``10 ** x`` rounds as the fixture's did: its last bit is the platform's
    (the fixture's 0.6604657100476848 is what NumPy gives on an AVX-512 machine; glibc's ``pow``, which NumPy uses on
    an AVX2 one, gives 0.660465710047685, one float64 ulp above), and with the other gain a sample of the product may
    round to the neighbouring float32."""
    import pyloudnorm

    loudness = float(pp.voice_input["loudness_lufs"][0])
    monkeypatch.setattr(pyloudnorm.Meter, "integrated_loudness", lambda self, data: loudness)
    audio = prepare_voice_audio(pp.folder / "voice.wav")
    gain, fed = float(pp.voice_input["gain"][0]), pp.voice_input["pcm_fed"][0, 0].numpy()
    assert abs(audio.gain - gain) <= np.spacing(gain)
    if audio.gain == gain:
        assert np.array_equal(audio.pcm, fed)
    else:
        assert (np.abs(audio.pcm - fed) <= np.spacing(np.abs(fed))).all()


def test_embeddings_form_is_personaplex_voice_pt(pp) -> None:
    """cspan voice encode's PersonaPlex form of the wav's codes = the voice.pt PersonaPlex wrote."""
    stored = torch.load(pp.folder / "voice.pt", weights_only=True)
    form = voice_embeddings_form(pp.voice_input["codes"][0], pp.lm, user_placeholder=pp.S)
    assert torch.equal(form["cache"], stored["cache"])
    assert form["embeddings"].shape == stored["embeddings"].shape == (25, 1, 1, 64)
    assert torch.equal(form["embeddings"], stored["embeddings"])


def test_embedding_voice_loads_with_frames_from_the_ring(pp) -> None:
    voice = load_voice_prompt(pp.folder / "voice.pt", pp.checkpoint)
    assert voice.kind == "embeddings" and voice.embeddings.shape == (25, 64) and voice.frames.shape == (17, 25)
    codes = pp.voice_input["codes"][0]
    # our frame j is PersonaPlex's frame j + 1; only entries read at positions >= 25 come from the ring
    assert voice.frames[1:9, 24].tolist() == codes[:, 25].tolist()  # the last voice frame, every agent row
    assert voice.frames[2:9, 23].tolist() == codes[1:, 24].tolist()  # acoustic rows of the one before
    assert voice.frames[1, 23].item() == 64 and (voice.frames[0] == 3).all()  # dummy: initial token, text PAD


# --- the prefix frames and positions ----------------------------------------------------------------------------


@pytest.mark.parametrize("run", RUNS)
def test_prefix_frames_and_positions_match(pp, run: str) -> None:
    prefix = _prefix(pp, run)
    ref = pp.runs[run]
    P = int(ref["offset_after_prompt"][0])
    assert (
        list(prefix.text_ids) == pp.text_tokens
        and prefix.text == json.loads((pp.folder / "meta.json").read_text())["text"]["wrapped"]
    )
    assert prefix.num_frames == P - 1 and prefix.layout == "personaplex"
    delayed = delay_tokens(prefix.frames, pp.lm.delays, _initial(pp.lm))  # positions 0 .. P
    E = 0 if prefix.embeddings is None else prefix.embeddings.shape[0]
    assert ref["embedded"][:P].nonzero().flatten().tolist() == list(range(E))
    # every position the model reads as tokens: the P - 1 prompt calls and conversation call 0 (position P - 1)
    assert torch.equal(delayed[:, E:P], ref["positions"][:, E:P])
    if run != "voice_pt":
        assert torch.equal(prefix.frames, ref["frames"][:, 1:])  # PersonaPlex's frame 0 never reaches the model
    else:  # dummy frames where the embeddings are read, the ring's codes where tokens are
        assert torch.equal(prefix.frames[:, 25:], ref["frames"][:, 26:])
        assert torch.equal(prefix.frames[:, :23], ref["frames"][:, 1:24])
    # PersonaPlex's token ring after the prompt (column = position mod 4) holds the same entries
    ring = ref["token_cache"][0]
    for p in range(P - 3, P):
        assert torch.equal(ring[:, p % 4], delayed[:, p])
    acoustic = [k for k, d in enumerate(pp.lm.delays) if d == 1]
    assert torch.equal(ring[acoustic, P % 4], delayed[acoustic, P])


# --- one forward: the state after the prompt and the conversation -------------------------------------------------


@torch.no_grad()
def _run(pp, prefix, calls: int):
    """The engine reads the prefix in one step (``set_prefix`` + its next step: PersonaPlex's prompt calls and its
    conversation call 0), then makes ``calls`` live calls; returns what each step saw (its hidden state, caught at
    ``out_norm``; text logits; column), the live frames and the KV cache right after the prefix's step."""
    lm = pp.lm
    engine = DuplexEngine(lm, temp=0, temp_text=0, agent_placeholder=pp.Z, user_placeholder=pp.S)
    hidden: list[torch.Tensor] = []
    hook = lm.out_norm.register_forward_hook(lambda _m, _i, out: hidden.append(out[0].clone()))
    try:
        engine.set_prefix(0, prefix.frames, prefix.embeddings)
        steps = [engine.step_tokens(pp.user_codes[:, :, 0])]  # the prefix's step: its user codes are not used
        cache = engine.lm_state.transformer.cache
        kv = (cache.keys.clone(), cache.values.clone())
        steps += [engine.step_tokens(pp.user_codes[:, :, j]) for j in range(calls)]
    finally:
        hook.remove()
    assert all(bool(o.valid[0]) for o in steps)
    outputs = [(h, o.text_logits[0].clone(), o.column[0].clone()) for h, o in zip(hidden, steps, strict=True)]
    return outputs, torch.stack([o.frame[0] for o in steps[1:]]), kv


@pytest.mark.parametrize("run", RUNS)
def test_one_forward_state_and_conversation_match(pp, run: str) -> None:
    prefix = _prefix(pp, run)
    ref = pp.runs[run]
    P = int(ref["offset_after_prompt"][0])
    T = ref["tokens"].shape[0]
    outputs, frames, (keys, values) = _run(pp, prefix, T - 1)

    # the conversation: live call j returns PersonaPlex's tokens[j + 1], all 17 rows exactly
    assert torch.equal(frames, ref["tokens"][1:])
    # its text logits and hidden states (row P - 1 is PersonaPlex's conversation call 0, our sampling tail)
    hidden = torch.stack([h for h, _, _ in outputs])
    text_logits = torch.stack([t for _, t, _ in outputs])
    torch.testing.assert_close(text_logits, ref["text_logits"][P - 1 :], atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(hidden, ref["hidden"][P - 1 :], atol=ATOL_STATE, rtol=0)
    # the text token that conditioned each call's depformer
    assert [int(c[0]) for _, _, c in outputs] == ref["depformer_text_in"][P - 1 :].tolist()

    # KV cache after the prompt: positions 0 .. P-2 (PersonaPlex's prompt calls; ours also holds P - 1)
    n = P - 1
    assert ref["kv_positions"].tolist() == list(range(n))
    for layer, name in ((0, "kv_layer0"), (pp.lm.cfg.num_layers - 1, "kv_last")):
        torch.testing.assert_close(keys[layer, 0, :, :n], ref[name][0], atol=ATOL_STATE, rtol=0)
        torch.testing.assert_close(values[layer, 0, :, :n], ref[name][1], atol=ATOL_STATE, rtol=0)


@pytest.mark.parametrize("run", RUNS)
@torch.no_grad()
def test_prompt_positions_and_depformer_logits_match(pp, run: str) -> None:
    """Every prompt position's input embedding, hidden state and text logits; the conversation's depformer logits
    teacher-forced with what PersonaPlex's depformer was given (step 15 against the correct ring)."""
    lm = pp.lm
    prefix = _prefix(pp, run)
    ref = pp.runs[run]
    P = int(ref["offset_after_prompt"][0])
    delayed = delay_tokens(prefix.frames, lm.delays, _initial(lm))
    x = prefix_inputs(lm, delayed[:, :P], prefix.embeddings)  # positions 0 .. P-1
    torch.testing.assert_close(x[0], ref["input_embeddings"][:P], atol=ATOL_STATE, rtol=0)
    hidden, text_logits = lm.temporal(None, lm.new_state(1), embeddings=x)
    torch.testing.assert_close(hidden[0], ref["hidden"][:P], atol=ATOL_STATE, rtol=0)
    torch.testing.assert_close(text_logits[0], ref["text_logits"][:P], atol=ATOL_LOGITS, rtol=0)

    outputs, _, _ = _run(pp, prefix, ref["tokens"].shape[0] - 1)
    dep = lm.new_depformer_state(1)
    for c, (h, _, _) in enumerate(outputs):
        row = P - 1 + c
        given = ref["depformer_tokens"][row].clone()
        provided = ref["depformer_provided"][row]
        # PersonaPlex's provided values: the last silence frame's acoustics at c = 0, the user's codes
        user = pp.user_codes[0, :, c].clone()
        user[1:] = pp.user_codes[0, 1:, c - 1] if c else torch.tensor(pp.S[1:])
        forced = torch.cat([torch.tensor([-1, *pp.Z[1:]]), user])
        given = torch.where(provided, forced, given)
        prev = ref["depformer_text_in"][row : row + 1]
        dep.reset()
        for k in range(lm.dep_q):
            logits = lm.depformer_logits(k, h[None], prev, dep)[0]
            want = ref["step_audio_logits_k15_full_window"][c] if k == 15 else ref["step_audio_logits"][c, k]
            torch.testing.assert_close(logits, want, atol=ATOL_LOGITS, rtol=0)
            prev = given[k : k + 1]


@torch.no_grad()
def test_embedding_voice_equals_codes_voice_after_the_embeddings(pp) -> None:
    """PersonaPlex: from position N - 1 on, the .pt run equals the wav run bit for bit; so does ours."""
    wav, _, kv_wav = _run(pp, _prefix(pp, "voice_wav"), 4)
    pt, _, kv_pt = _run(pp, _prefix(pp, "voice_pt"), 4)
    for a, b in zip(wav, pt, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert torch.equal(kv_wav[0], kv_pt[0]) and torch.equal(kv_wav[1], kv_pt[1])


@torch.no_grad()
def test_one_forward_equals_stepwise(pp) -> None:
    """The prefix read in one forward (embedding voice included) = the same inputs fed one position at a time."""
    lm = pp.lm
    prefix = _prefix(pp, "voice_pt")
    P = prefix.num_frames
    delayed = delay_tokens(prefix.frames, lm.delays, _initial(lm))
    x = prefix_inputs(lm, delayed[:, : P + 1], prefix.embeddings)
    one = lm.new_state(1)
    hidden_one, logits_one = lm.temporal(None, one, embeddings=x)
    step = lm.new_state(1)
    parts = [lm.temporal(None, step, embeddings=x[:, p : p + 1]) for p in range(P + 1)]
    torch.testing.assert_close(torch.cat([h for h, _ in parts], 1), hidden_one, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([t for _, t in parts], 1), logits_one, atol=1e-5, rtol=0)
    cache_one, cache_step = one.transformer.cache, step.transformer.cache
    torch.testing.assert_close(cache_one.keys, cache_step.keys, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache_one.values, cache_step.values, atol=1e-5, rtol=0)
