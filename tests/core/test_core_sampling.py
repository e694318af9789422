"""Sampling: greedy, top-k, the exponential race, per-session generators."""

from __future__ import annotations

import pytest
import torch

from cspan.core.sampling import SamplingParams, make_generator, sample_token


def test_greedy_is_argmax_with_first_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]], dtype=torch.bfloat16)
    assert sample_token(logits, 0.0, 25).tolist() == [1, 0]
    assert sample_token(logits, -1.0).tolist() == [1, 0]


def test_sampling_is_the_exponential_race_over_top_k() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=g)
    gen = make_generator("cpu", 11)
    token = sample_token(logits, 0.7, 5, [gen])
    # recompute by hand with the same noise (upstream moshi utils/sampling.py)
    probs = torch.softmax(logits / 0.7, dim=-1)
    top, idx = torch.topk(probs, 5, dim=-1)
    q = torch.empty(5).exponential_(1.0, generator=make_generator("cpu", 11))
    assert token.item() == idx[0, torch.argmax(top[0] / q)].item()
    assert token.item() in idx[0].tolist()


def test_top_k_limits_the_support() -> None:
    logits = torch.zeros(1, 100)
    logits[0, 40:43] = 10.0
    gen = make_generator("cpu", 0)
    seen = {sample_token(logits, 1.0, 3, [gen]).item() for _ in range(200)}
    assert seen == {40, 41, 42}
    # top_k larger than the vocabulary keeps everything
    assert sample_token(torch.randn(2, 7), 1.0, 250).min().item() >= 0


def test_each_row_uses_its_own_generator() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=g)
    batch = sample_token(logits, 0.8, 250, [make_generator("cpu", s) for s in (1, 2, 3)])
    alone = [
        sample_token(logits[i : i + 1], 0.8, 250, [make_generator("cpu", s)]).item() for i, s in enumerate((1, 2, 3))
    ]
    assert batch.tolist() == alone
    # same seeds, same draws
    a = sample_token(logits, 1.0, 0, [make_generator("cpu", s) for s in (5, 6, 7)])
    b = sample_token(logits, 1.0, 0, [make_generator("cpu", s) for s in (5, 6, 7)])
    assert torch.equal(a, b)


def test_defaults_and_errors() -> None:
    assert SamplingParams.text() == SamplingParams(0.7, 25)
    assert SamplingParams.audio() == SamplingParams(0.8, 250)
    assert SamplingParams(0.0, 10).greedy
    with pytest.raises(ValueError, match="one per row"):
        sample_token(torch.zeros(2, 4), 1.0, 0, [make_generator("cpu", 0)])
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample_token(torch.zeros(4), 1.0)


def test_the_static_text_top_k_size_covers_every_row_and_draws_the_same_tokens() -> None:
    from cspan.core.constants import MAX_TOP_K
    from cspan.core.modules.fused import race_noise
    from cspan.core.sampling import RowSampling, top_k_bound

    V = 32000
    assert top_k_bound([25, 25], V) == 64
    assert top_k_bound([25, 64], V) == 64
    assert top_k_bound([25, 65], V) == MAX_TOP_K
    assert top_k_bound([0, V, V + 5], V) == 64  # rows that keep every token need no top-k
    assert top_k_bound([], V) == 64
    assert top_k_bound([40], 50) == 50  # never above the vocabulary
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, V, generator=g) * 3
    rows = RowSampling(torch.tensor([0.7, 0.0, 1.0, 0.5]), torch.tensor([25, 25, 0, 64]))
    noise = race_noise(torch.arange(4), torch.full((4,), 7), 0, V)
    small = rows.race(logits, noise, top_k_bound(rows.top_k.tolist(), V))
    large = RowSampling(rows.temperature, rows.top_k).race(logits, noise, MAX_TOP_K)
    assert small.tolist() == large.tolist()
    assert small[1].item() == logits[1].argmax().item()


def test_the_noise_of_a_frames_codebooks_in_one_call_is_each_codebooks_bit_for_bit() -> None:
    """The eager step draws the depformer codebooks' noise in one call (``stream`` a range: on the CPU the call's
    operations cost their overhead, not their work); entry s is the noise of stream ``1 + s`` alone."""
    from cspan.core.modules.fused import race_noise

    seed, counter = torch.tensor([0, 5, -3, 2**62]), torch.tensor([0, 7, 123456, 9])
    together = race_noise(seed, counter, range(1, 17), 2048)
    assert together.shape == (4, 16, 2048)
    for s in range(16):
        assert torch.equal(together[:, s], race_noise(seed, counter, 1 + s, 2048))
