"""Greedy streaming through DuplexEngine.step_tokens reproduces upstream LMGen on the reference fixtures.

Frame alignment (fixture README, "LMGen conventions"): call t is given ``user_codes[:, :, t]`` (user frame t - 1 in
the engine's numbering) and returns frame t - 1 (``tokens[t]``); call 0 returns nothing. With dep_q 16 upstream
LMGen uses no user codes (the depformer predicts the user rows), which ``step_tokens(None)`` reproduces.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from cspan.core.engine import DuplexEngine


@pytest.mark.parametrize("name", ["lm-moshi-shaped", "lm-personaplex-shaped"])
def test_greedy_stream_reproduces_reference_tokens(reference_lm, fixture_file, name: str) -> None:
    lm = reference_lm(name)
    ref = load_file(fixture_file("reference", name, "stream.safetensors"))
    T, B = ref["tokens"].shape[:2]
    dep_q = lm.dep_q
    # the fixture LM has card 64: placeholder codes must be in range (they are unused in this test)
    engine = DuplexEngine(lm, batch_size=B, temp=0, temp_text=0, agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    for t in range(T):
        user = ref["user_codes"][:, :, t] if dep_q < lm.n_q else None
        out = engine.step_tokens(user)
        assert out.valid.tolist() == [bool(ref["returned"][t])] * B, f"call {t}"
        if ref["returned"][t]:
            assert torch.equal(out.frame[:, : dep_q + 1], ref["tokens"][t]), f"call {t}: returned frame differs"
        else:
            assert (out.frame == -2).all()
        # what this call sampled: text then the depformer codebooks (call 0 included: LMGen runs all of them)
        assert torch.equal(out.column[:, 0], ref["step_text_tokens"][t]), f"call {t}: text token"
        assert torch.equal(out.column[:, 1 : 1 + dep_q], ref["step_audio_tokens"][t]), f"call {t}: audio tokens"
        torch.testing.assert_close(out.text_logits.float(), ref["step_text_logits"][t], atol=5e-5, rtol=0)
    assert engine.positions == [T] * B
    assert engine.grid.position[:B].tolist() == [T] * B  # (the last grid row is the scratch row)


def test_user_codes_are_required_when_the_depformer_does_not_predict_them(reference_lm) -> None:
    engine = DuplexEngine(reference_lm("lm-moshi-shaped"), agent_placeholder=[1] * 8, user_placeholder=[2] * 8)
    with pytest.raises(ValueError, match="user_codes"):
        engine.step_tokens(None)
    with pytest.raises(ValueError, match=r"user_codes must be \[1, 8\]"):
        engine.step_tokens(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"forced must be \[1, 17\]"):
        engine.step_tokens(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))
