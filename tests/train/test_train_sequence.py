"""The training layout equals what the streaming engine reads: persona prefix, dialogue, Context Span blocks.

Both directions are checked on a known dialogue:

- training -> inference: the columns the :class:`DuplexEngine` feeds while teacher-forced on the dialogue, with
  ``inject_span`` between two calls, are exactly the spliced training inputs (same ``span_block`` / ``splice_block``),
  and the text logits it computes at every call equal ``forward_delayed``'s at the same position -- including the
  position just before the block, whose training target is the column after the block;
- inference -> training: a session started with ``set_persona`` (the prefix read in one forward) continues exactly
  as the training sequence built from ``build_persona_prefix``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cspan.core.constants import SILENCE_TOKENS, SINE_TOKENS, SPAN_CLOSE, SPAN_OPEN
from cspan.core.engine import DuplexEngine
from cspan.core.lm import LMModel
from cspan.core.prefix import build_persona_prefix, prefix_frames
from cspan.core.span import ContextSpan, span_block, splice_block
from cspan.core.streams import delay_tokens
from cspan.core.tiny import tiny_lm_config
from cspan.train.dataset import assemble_sequence, crop_sequence


class ByteTokenizer:
    """A stand-in SentencePiece: one id per UTF-8 byte (ids 20..275)."""

    def encode(self, text: str) -> list[int]:
        return [20 + b for b in text.encode("utf-8")]


@pytest.fixture(scope="module")
def lm() -> LMModel:
    torch.manual_seed(3)
    return LMModel(tiny_lm_config(dep_q=16), dtype=torch.float32).eval()


def _dialogue(lm: LMModel, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, lm.card, (lm.num_codebooks, T), generator=g)
    codes[0] = torch.randint(20, 300, (T,), generator=g)
    return codes


def _initials(lm: LMModel) -> list[int]:
    return lm.initial_tokens()[0, :, 0].tolist()


def _run_engine(
    lm: LMModel,
    frames: torch.Tensor,
    first_call: int,
    spans: dict[int, list[int]],
    engine: DuplexEngine,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Teacher-force ``engine`` through calls ``first_call .. N - 1`` of the undelayed ``frames`` [K, N]; a span
    ``spans[c]`` (body ids) is injected before call c. Returns the fed columns (block columns included, in order)
    and the text logits per fed position (None for block positions)."""
    K, N = frames.shape
    G = delay_tokens(frames, lm.delays, _initials(lm), length=N + 1)
    user_rows = slice(1 + lm.n_q // 2, K)
    fed: list[torch.Tensor] = []
    logits: list[torch.Tensor | None] = []
    for c in range(first_call, N):
        if c in spans:
            report = engine.inject_span(0, ContextSpan.from_ids(spans[c]))
            block = span_block(report.ids, num_streams=K)
            for j in range(report.n):
                fed.append(block[:, j])
                logits.append(None)
        user = frames[user_rows, c - 1] if c >= 1 else torch.zeros(K // 2, dtype=torch.long)
        out = engine.step_tokens(user[None], G[:, c + 1][None])
        fed.append(out.input[0].clone())
        logits.append(out.text_logits[0].clone())
    return fed, logits


def test_block_layout_and_masks(lm: LMModel) -> None:
    codes = _dialogue(lm, 30, 0)
    prefix = prefix_frames([40, 41, 42], torch.full((8, 4), 7))
    P = prefix.shape[1]
    ids = [SPAN_OPEN, 100, 101, 102, SPAN_CLOSE]
    f = 12
    seq = assemble_sequence(codes, prefix, [(f, ids)], lm.delays, _initials(lm))
    n = len(ids)
    c = P + f + 1
    N = P + 30
    G = delay_tokens(torch.cat([prefix, codes], 1), lm.delays, _initials(lm), length=N + 1)
    assert seq.length == N + n
    assert seq.blocks == [(c, n)]
    # inputs = splice_block(G, c, block) without its last column
    block = span_block(ids, num_streams=lm.num_codebooks)
    assert torch.equal(seq.inputs, splice_block(G, c, block)[:, :-1])
    assert torch.equal(seq.inputs[0, c : c + n], torch.tensor(ids))
    assert torch.equal(seq.inputs[1:9, c], torch.tensor(SILENCE_TOKENS))
    assert torch.equal(seq.inputs[9:, c], torch.tensor(SINE_TOKENS))
    # the position before the block predicts the column after it (what the engine samples before reading the block)
    assert torch.equal(seq.targets[:, c - 1], seq.inputs[:, c + n])
    assert bool(seq.mask[:, c - 1].all())
    # block columns are never targets; everywhere else a target is the next input
    assert not bool(seq.mask[:, c : c + n].any())
    for i in range(seq.length - 1):
        if not c - 1 <= i < c + n:
            assert torch.equal(seq.targets[:, i], seq.inputs[:, i + 1]), i
    # prefix: text of frame P (first dialogue frame) is the first text target, at index P
    assert not bool(seq.mask[0, :P].any()) and bool(seq.mask[0, P])
    assert not bool(seq.mask[2, : P + 1].any()) and bool(seq.mask[2, P + 1])  # acoustic rows have delay 1
    assert seq.prefix_positions == P + 1


def test_two_spans_and_crop_never_cut_a_block(lm: LMModel) -> None:
    codes = _dialogue(lm, 40, 1)
    spans = [(25, [SPAN_OPEN, 5, 6, SPAN_CLOSE]), (8, [SPAN_OPEN, 7, SPAN_CLOSE])]
    seq = assemble_sequence(codes, torch.empty(17, 0, dtype=torch.long), spans, lm.delays, _initials(lm))
    assert seq.blocks == [(9, 3), (26 + 3, 4)]
    assert torch.equal(seq.inputs[0, 9:12], torch.tensor([SPAN_OPEN, 7, SPAN_CLOSE]))
    assert torch.equal(seq.inputs[0, 29:33], torch.tensor([SPAN_OPEN, 5, 6, SPAN_CLOSE]))
    for seed in range(40):
        crop = crop_sequence(seq, 20, np.random.default_rng(seed))
        assert crop.length == 20
        start = crop.offset
        assert torch.equal(crop.inputs, seq.inputs[:, start : start + 20])
        assert all(not (p < start < p + n) for p, n in seq.blocks)


def test_engine_feeds_the_training_sequence_with_a_span(lm: LMModel) -> None:
    codes = _dialogue(lm, 24, 2)
    prefix = prefix_frames([50, 51, 52, 53], torch.randint(0, 2048, (8, 3), generator=torch.Generator().manual_seed(9)))
    P = prefix.shape[1]
    body = [200, 201, 202, 203]
    f = 10
    ids = [SPAN_OPEN, *body, SPAN_CLOSE]
    seq = assemble_sequence(codes, prefix, [(f, ids)], lm.delays, _initials(lm))
    engine = DuplexEngine(lm, batch_size=1, temp=0.0, temp_text=0.0, seed=0)
    frames = torch.cat([prefix, codes], 1)
    c = P + f + 1
    fed, logits = _run_engine(lm, frames, 0, {c: body}, engine)
    # the engine fed exactly the training inputs (block included, at the same positions)
    assert torch.equal(torch.stack(fed, dim=1), seq.inputs)
    with torch.no_grad():
        text_logits, _ = lm.forward_delayed(torch.cat([seq.inputs, seq.targets[:, -1:]], 1)[None], seq.targets[None])
    for p, got in enumerate(logits):
        if got is not None:
            torch.testing.assert_close(got, text_logits[0, p], rtol=1e-4, atol=1e-4)
    assert logits[c - 1] is not None and all(x is None for x in logits[c : c + len(ids)])


def test_set_persona_then_teacher_forcing_equals_training(lm: LMModel) -> None:
    tok = ByteTokenizer()
    voice = torch.randint(0, 2048, (8, 4), generator=torch.Generator().manual_seed(5))
    prefix = build_persona_prefix(tok, "You are Ada.", voice, user_name="Priya", user_city="Sydney")
    P = prefix.num_frames
    engine = DuplexEngine(lm, batch_size=1, temp=0.0, temp_text=0.0, seed=0, tokenizer=tok)
    report = engine.set_persona(0, "You are Ada.", voice, user_name="Priya", user_city="Sydney")
    assert report.num_frames == P and report.text_ids == prefix.text_ids
    codes = _dialogue(lm, 16, 4)
    # the session's next step reads the prefix (its user codes unused); its sampling tail chose the text and semantic
    # code of frame P: the dialogue starts with them
    engine.step_tokens(torch.zeros(1, 8, dtype=torch.long))
    pending, position = engine.grid.row_state(0)
    assert int(position) == P + 1
    codes[0, 0] = pending[0, engine.grid.pending]
    codes[1, 0] = pending[1, engine.grid.pending]
    f = 6
    body = [210, 211]
    seq = assemble_sequence(codes, prefix.frames, [(f, [SPAN_OPEN, *body, SPAN_CLOSE])], lm.delays, _initials(lm))
    frames = torch.cat([prefix.frames, codes], 1)
    fed, logits = _run_engine(lm, frames, P + 1, {P + f + 1: body}, engine)
    assert torch.equal(torch.stack(fed, dim=1), seq.inputs[:, P + 1 :])
    with torch.no_grad():
        text_logits, _ = lm.forward_delayed(torch.cat([seq.inputs, seq.targets[:, -1:]], 1)[None], seq.targets[None])
    for j, got in enumerate(logits):
        if got is not None:
            torch.testing.assert_close(got, text_logits[0, P + 1 + j], rtol=1e-4, atol=1e-4)
