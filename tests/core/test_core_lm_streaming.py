"""Streaming LM API: reproduces upstream LMGen's greedy streams; chunked temporal == single steps; rows."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cspan.core.config import LMConfig
from cspan.core.lm import LMModel

SHAPED = ["lm-moshi-shaped", "lm-personaplex-shaped"]


def _load(fixture_file, name: str, weights: str, **overrides) -> LMModel:
    cfg = LMConfig.from_upstream(json.loads(fixture_file("reference", name, "config.json").read_text()))
    if overrides:
        cfg = cfg.model_copy(update=overrides)
    model = LMModel(cfg, dtype=torch.float32).eval()
    model.load_state_dict(load_file(fixture_file("reference", name, weights)), strict=True)
    return model


def _input_column(
    model: LMModel, B: int, t: int, previous: torch.Tensor | None, user_codes: torch.Tensor | None
) -> torch.Tensor:
    """Model input of call t under upstream LMGen's conventions (fixture README): generated rows (text and the
    dep_q depformer rows) carry the tokens sampled at call t - 1, user row j carries ``user_codes[:, j, t - delay]``,
    and any row with ``t <= delay`` carries its initial token. [B, K]."""
    col = model.initial_tokens()[:, :, 0].expand(B, -1).clone()
    for r, delay in enumerate(model.delays):
        if t <= delay:
            continue
        if r <= model.dep_q:
            col[:, r] = previous[:, r]
        else:
            col[:, r] = user_codes[:, r - model.dep_q - 1, t - delay]
    return col


def _greedy_call(model: LMModel, column: torch.Tensor, state, dep_state) -> tuple[torch.Tensor, torch.Tensor]:
    """One LMGen-like greedy call: temporal step, text argmax, then all dep_q depformer steps (also at call 0).
    Returns (text logits [B, text_card], sampled [B, 1 + dep_q])."""
    hidden, text_logits = model.temporal(column[:, :, None], state)
    text = text_logits[:, 0].float().argmax(-1)
    dep_state.reset()
    prev, sampled = text, [text]
    for k in range(model.dep_q):
        prev = model.depformer_logits(k, hidden[:, 0], prev, dep_state).float().argmax(-1)
        sampled.append(prev)
    return text_logits[:, 0], torch.stack(sampled, dim=1)


@pytest.mark.parametrize("name", SHAPED)
def test_stream_reproduces_upstream_lmgen(fixture_file, name: str) -> None:
    model = _load(fixture_file, name, "model.safetensors")
    ref = load_file(fixture_file("reference", name, "stream.safetensors"))
    user_codes, forward_codes = ref["user_codes"], ref["forward_codes"]
    B, T = user_codes.shape[0], ref["step_text_logits"].shape[0]
    state, dep_state = model.new_state(B), model.new_depformer_state(B)
    initial = model.initial_tokens()[0, :, 0]
    sampled_at: list[torch.Tensor] = []
    with torch.no_grad():
        for t in range(T):
            column = _input_column(model, B, t, sampled_at[-1] if sampled_at else None, user_codes)
            # the same column read from the teacher-forcing layout: row r is forward_codes[:, r, t - 1 - delay]
            for r, delay in enumerate(model.delays):
                f = t - 1 - delay
                expected = forward_codes[:, r, f] if f >= 0 else initial[r].expand(B)
                assert torch.equal(column[:, r], expected), (t, r)
            text_logits, sampled = _greedy_call(model, column, state, dep_state)
            sampled_at.append(sampled)
            assert torch.allclose(text_logits, ref["step_text_logits"][t], atol=5e-5, rtol=0), t
            assert torch.equal(sampled[:, 0], ref["step_text_tokens"][t]), t
            assert torch.equal(sampled[:, 1:], ref["step_audio_tokens"][t]), t  # includes the call-0 depformer quirk
            if ref["returned"][t]:
                # call t returns frame t - 1: row r as sampled at call t - 1 + delay_r
                frame = torch.stack(
                    [sampled_at[t - 1 + d][:, r] for r, d in enumerate(model.delays[: model.dep_q + 1])], 1
                )
                assert torch.equal(frame, ref["tokens"][t]), t
    assert state.offset.tolist() == [T] * B


def test_kyutai_tiny_model_greedy_stream(fixture_file) -> None:
    """Kyutai's tiny model (sin embeddings in both transformers, context 4, depformer schedule [0, 1, 1], low-rank
    depformer embeddings, delays up to 4) streamed greedily gives upstream LMGen's frames (reference digest §8)."""
    model = _load(fixture_file, "kyutai-test-lm", "test_lm_model.safetensors")
    state, dep_state = model.new_state(1), model.new_depformer_state(1)
    sampled_at: list[torch.Tensor] = []
    with torch.no_grad():
        for t in range(16):
            column = _input_column(model, 1, t, sampled_at[-1] if sampled_at else None, None)
            sampled_at.append(_greedy_call(model, column, state, dep_state)[1])
    frames = [[int(sampled_at[f + d][0, r]) for r, d in enumerate(model.delays)] for f in range(12)]
    assert frames == [
        [25, 4, 1, 0], [28, 24, 13, 17], [27, 11, 25, 13], [21, 29, 29, 5],
        [37, 29, 21, 13], [41, 4, 19, 13], [43, 11, 29, 13], [23, 10, 20, 14],
        [29, 6, 20, 23], [1, 24, 25, 13], [44, 23, 29, 13], [7, 29, 20, 13],
    ]  # fmt: skip


def _random_tokens(model: LMModel, B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.card + 1, (B, model.num_codebooks, T), generator=g)
    tokens[:, 0] = torch.randint(0, model.text_card + 1, (B, T), generator=g)
    return tokens


def test_temporal_chunk_equals_single_steps_across_the_window(fixture_file) -> None:
    """context 5: chunks that cross the window boundary, wrap the ring, and exceed its capacity."""
    model = _load(fixture_file, "lm-moshi-shaped", "model.safetensors", context=5)
    assert model.new_state(1).transformer.cache.capacity == 5
    tokens = _random_tokens(model, 2, 30, seed=5)
    stepped, chunked = model.new_state(2), model.new_state(2)
    with torch.no_grad():
        ref = [model.temporal(tokens[:, :, t : t + 1], stepped) for t in range(30)]
        ref_hidden = torch.cat([h for h, _ in ref], dim=1)
        ref_text = torch.cat([x for _, x in ref], dim=1)
        start = 0
        for size in (1, 3, 4, 1, 7, 12, 2):  # 3+4 crosses the window, 7 wraps, 12 > capacity
            hidden, text = model.temporal(tokens[:, :, start : start + size], chunked)
            assert torch.allclose(hidden, ref_hidden[:, start : start + size], atol=1e-5, rtol=0), size
            assert torch.allclose(text, ref_text[:, start : start + size], atol=1e-5, rtol=0), size
            start += size
    assert chunked.offset.tolist() == stepped.offset.tolist() == [30, 30]
    assert torch.allclose(chunked.transformer.cache.keys, stepped.transformer.cache.keys, atol=1e-5, rtol=0)


def test_temporal_rows_subset_at_different_offsets(fixture_file) -> None:
    """A batch of 3 rows at offsets 2, 4 and 0; a 7-position chunk on rows [2, 0] equals stepping each row alone,
    row 1 is untouched, and a later full-batch step agrees too."""
    model = _load(fixture_file, "lm-moshi-shaped", "model.safetensors", context=5)
    tokens = _random_tokens(model, 3, 12, seed=9)
    chunked, stepped = model.new_state(3), model.new_state(3)
    rows_02 = torch.tensor([2, 0])
    with torch.no_grad():
        # bring both states to offsets [2, 4, 0] with the same steps
        for state in (chunked, stepped):
            for t in range(2):
                model.temporal(tokens[0:1, :, t : t + 1], state, rows=torch.tensor([0]))
            for t in range(4):
                model.temporal(tokens[1:2, :, t : t + 1], state, rows=torch.tensor([1]))
        assert chunked.offset.tolist() == [2, 4, 0]
        row1_keys = chunked.transformer.cache.keys[:, 1].clone()

        # rows [2, 0] get 7 positions each: row 2 its positions 0..6, row 0 its positions 2..8
        chunk_tokens = torch.stack([tokens[2, :, 0:7], tokens[0, :, 2:9]])
        hidden, text = model.temporal(chunk_tokens, chunked, rows=rows_02)
        assert hidden.shape == (2, 7, model.cfg.dim) and text.shape == (2, 7, model.cfg.text_card)
        for j, (row, first) in enumerate([(2, 0), (0, 2)]):
            for t in range(7):
                h, x = model.temporal(
                    tokens[row : row + 1, :, first + t : first + t + 1], stepped, rows=torch.tensor([row])
                )
                assert torch.allclose(hidden[j, t], h[0, 0], atol=1e-5, rtol=0), (row, t)
                assert torch.allclose(text[j, t], x[0, 0], atol=1e-5, rtol=0), (row, t)
        assert chunked.offset.tolist() == stepped.offset.tolist() == [9, 4, 7]
        assert torch.equal(chunked.transformer.cache.keys[:, 1], row1_keys)

        last = tokens[:, :, 11:12]
        h_chunked, _ = model.temporal(last, chunked)
        h_stepped, _ = model.temporal(last, stepped)
        assert torch.allclose(h_chunked, h_stepped, atol=1e-5, rtol=0)

        chunked.reset(torch.tensor([0]))
        assert chunked.offset.tolist() == [0, 5, 8]


def test_embeddings_path_equals_tokens_path(fixture_file) -> None:
    model = _load(fixture_file, "lm-moshi-shaped", "model.safetensors")
    tokens = _random_tokens(model, 2, 4, seed=3)
    a, b = model.new_state(2), model.new_state(2)
    with torch.no_grad():
        ha, ta = model.temporal(tokens, a)
        hb, tb = model.temporal(None, b, embeddings=model.embed(tokens))
    assert torch.equal(ha, hb) and torch.equal(ta, tb)
    with pytest.raises(ValueError, match="exactly one"):
        model.temporal(tokens, a, embeddings=model.embed(tokens))
    with pytest.raises(ValueError, match="depformer step"):
        model.depformer_logits(model.dep_q, ha[:, 0], tokens[:, 0, 0], model.new_depformer_state(2))


def test_the_depformer_reuses_its_cache_plans_on_the_cpu_with_the_same_logits(fixture_file) -> None:
    """On the CPU the depformer state keeps each step's cache plan and mask from frame to frame (about 23 small
    operations a codebook step fewer). Three frames of a state that reuses them give the logits of a state that
    builds them every call, bit for bit; a partial reset turns the reuse off, and what follows is still exact."""
    model = _load(fixture_file, "lm-personaplex-shaped", "model.safetensors")
    B = 2
    tokens = _random_tokens(model, B, 3, seed=5)
    state = model.new_state(B)
    reusing = model.new_depformer_state(B)
    building = model.depformer.new_state(B, capacity=model.dep_q)
    assert reusing.plans == {} and building.plans is None
    with torch.no_grad():
        hidden, _ = model.temporal(tokens, state)
        for t in range(3):
            for dep in (reusing, building):
                dep.reset()
            prev = tokens[:, 0, t]
            for k in range(model.dep_q):
                a = model.depformer_logits(k, hidden[:, t], prev, reusing)
                b = model.depformer_logits(k, hidden[:, t], prev, building)
                assert torch.equal(a, b), (t, k)
                prev = a.float().argmax(-1)
        assert reusing.plans is not None and len(reusing.plans) == model.dep_q
        reusing.reset(torch.tensor([1]))
        assert reusing.plans is None
        for dep in (reusing, building):
            dep.reset()
        assert torch.equal(
            model.depformer_logits(0, hidden[:, 0], tokens[:, 0, 0], reusing),
            model.depformer_logits(0, hidden[:, 0], tokens[:, 0, 0], building),
        )
