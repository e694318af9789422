"""``LMModel.forward_delayed`` (training on already-delayed sequences) equals ``LMModel.forward`` on the same codes."""

from __future__ import annotations

import pytest
import torch

from cspan.core.lm import LMModel
from cspan.core.streams import delay_tokens
from cspan.core.tiny import tiny_lm_config


@pytest.fixture(scope="module")
def lm() -> LMModel:
    torch.manual_seed(0)
    return LMModel(tiny_lm_config(dep_q=16), dtype=torch.float32).eval()


def _codes(lm: LMModel, B: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, lm.card, (B, lm.num_codebooks, T), generator=g)
    codes[:, 0] = torch.randint(0, lm.text_card, (B, T), generator=g)
    return codes


def test_forward_delayed_equals_forward(lm: LMModel) -> None:
    B, T = 2, 12
    codes = _codes(lm, B, T, 1)
    with torch.no_grad():
        ref = lm.forward(codes)
        initial = lm.initial_tokens()[0, :, 0].tolist()
        delayed = delay_tokens(codes, lm.delays, initial, length=T + 1)  # [B, K, T + 1]
        text, audio = lm.forward_delayed(delayed)
    assert text.shape == (B, T, lm.text_card)
    assert audio.shape == (B, lm.dep_q, T, lm.card)
    # text has delay 0: position t predicts frame t
    torch.testing.assert_close(text, ref.text_logits[:, 0], rtol=1e-5, atol=1e-5)
    for k in range(lm.dep_q):
        d = lm.delays[1 + k]
        n = T - d
        # forward() undelays: its logits at frame t come from position t + d
        torch.testing.assert_close(audio[:, k, d : d + n], ref.logits[:, k, :n], rtol=1e-5, atol=1e-5)
        assert bool(ref.mask[:, k, :n].all())


def test_forward_delayed_explicit_targets_feed_the_depformer(lm: LMModel) -> None:
    B, T = 1, 8
    delayed = delay_tokens(_codes(lm, B, T, 2), lm.delays, lm.initial_tokens()[0, :, 0].tolist(), length=T + 1)
    with torch.no_grad():
        text_a, audio_a = lm.forward_delayed(delayed)
        _, audio_b = lm.forward_delayed(delayed, delayed[:, :, 1:].clone())
        other = delayed[:, :, 1:].clone()
        other[:, :, 3] = delayed[:, :, 6]  # position 3 teacher-forced with another column
        text_c, audio_c = lm.forward_delayed(delayed, other)
    torch.testing.assert_close(audio_a, audio_b)
    torch.testing.assert_close(text_a, text_c)  # the temporal path does not read the targets
    torch.testing.assert_close(audio_a[:, :, :3], audio_c[:, :, :3])
    assert not torch.allclose(audio_a[:, 1:, 3], audio_c[:, 1:, 3])  # steps k >= 1 read target rows k >= 1


def test_forward_delayed_rejects_bad_shapes(lm: LMModel) -> None:
    with pytest.raises(ValueError, match="delayed must be"):
        lm.forward_delayed(torch.zeros(1, 3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be"):
        lm.forward_delayed(torch.zeros(1, lm.num_codebooks, 5, dtype=torch.long), torch.zeros(1, 17, 5).long())
