"""The CUDA graphs' padded step layout (row and block-column buckets, the scratch row) changes no result: run eagerly
in float32 on the CPU it equals the unpadded step within rounding, with spans, a persona prefix with input
embeddings and idle rows mixed in the same steps (the GPU test ``test_7b_mixed_ragged_steps_graphed_equal_eager_and
_stepwise`` compares the same layouts in bf16, where rounding may flip greedy tokens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from padded_steps import differences, load_case, mixed_run, padded, scenario, session

from cspan.core.constants import FRAME_SIZE
from cspan.core.engine import DuplexEngine
from cspan.core.sampling import SamplingParams
from cspan.core.span import ContextSpan

TOL = 1e-5


def _assert_same(diff: dict) -> None:
    assert diff["offsets_equal"] and diff["columns_equal"] and diff["grid_equal"], diff
    assert diff["logits"] <= TOL and diff["keys"] <= TOL and diff["values"] <= TOL, diff


def test_the_plan_pads_only_with_buckets(tiny_checkpoint) -> None:
    engine = DuplexEngine(tiny_checkpoint, batch_size=3)
    assert not engine.plan.buckets and engine.plan.rows_bucket(3) == 3 and engine.plan.block_bucket(100) == 100
    plan = padded(engine).plan
    assert plan.rows_bucket(3) == 4 and plan.rows_bucket(5) == 8
    assert plan.block_bucket(0) == 0 and plan.block_bucket(100) is None  # eager modules: blocks are never padded
    engine.sessions.live[0] = False
    batch = engine._prepare()
    assert batch.rows == [1, 2] and batch.shape.rows == 2  # bucket 2: no padding row
    engine.sessions.live[1] = False
    batch = engine._prepare()
    assert batch.rows == [2] and batch.shape.rows == 1


def test_the_library_decode_follows_the_measured_sweep(tiny_checkpoint) -> None:
    """FlashInfer's decode where C8's sweep found it at least as fast (8 rows and more except 25 to 32), the Triton
    kernel elsewhere; forced either way by CSPAN_ATTENTION; never when the plan chose no library."""
    import dataclasses

    plan = DuplexEngine(tiny_checkpoint, batch_size=1).plan
    assert plan.library is None and not plan.library_decode(64)  # CPU: no library
    measured = dataclasses.replace(plan, library="measured")
    assert [r for r in (1, 2, 4, 5, 8, 16, 24, 25, 32, 33, 48, 64, 80, 128, 200) if measured.library_decode(r)] == [
        5,
        8,
        16,
        24,
        33,
        48,
        64,
        80,
        128,
        200,
    ]
    assert all(dataclasses.replace(plan, library="always").library_decode(r) for r in (1, 32, 128))


def test_the_span_overlap_switch(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """CSPAN_SPAN_OVERLAP: on by default, off with 0, anything else refused; never a second stream on the CPU."""
    from cspan.core.modules.fused import settings_from_env

    monkeypatch.delenv("CSPAN_SPAN_OVERLAP", raising=False)
    assert settings_from_env().span_overlap
    monkeypatch.setenv("CSPAN_SPAN_OVERLAP", "0")
    assert not settings_from_env().span_overlap
    monkeypatch.setenv("CSPAN_SPAN_OVERLAP", "yes")
    with pytest.raises(ValueError, match="CSPAN_SPAN_OVERLAP must be 0 or 1, got 'yes'"):
        settings_from_env()
    monkeypatch.delenv("CSPAN_SPAN_OVERLAP")
    assert DuplexEngine(tiny_checkpoint, batch_size=2).plan.attention_stream is None


@pytest.mark.parametrize("model", ["tiny", "wrapped", "personaplex"])
def test_padded_mixed_steps_equal_the_unpadded_and_batch1(model: str, tiny_checkpoint, fixtures_dir: Path) -> None:
    """Mixed steps (spans in two rows, a persona prefix in a third, plain steps, idle rows, live rows out of order)
    laid out padded to the buckets equal the unpadded layout, and every session equals itself run alone (batch
    1, the same seed): "tiny" the tiny checkpoint (prefix with input embeddings), "wrapped" a ring of 16 slots
    that spans of 20 columns wrap, "personaplex" the GPU test's shapes (dep_q 16, spans of 64 and 40, a prefix
    of codes only)."""
    if model == "tiny":
        lm, kw = tiny_checkpoint.lm, {"seed": 3}
        users, spans, prefix = scenario(lm, 7, (20, 9))
    else:
        lm, users, spans, prefix, kw = load_case(fixtures_dir / "reference", model)
    a = mixed_run(DuplexEngine(lm, batch_size=4, **kw), users, spans, prefix)
    b = mixed_run(padded(DuplexEngine(lm, batch_size=4, **kw)), users, spans, prefix)
    _assert_same(differences(a, b, sessions=4))
    for s in range(4):
        alone = padded(DuplexEngine(lm, batch_size=1, **{**kw, "seed": kw["seed"] + s}))
        _assert_same(differences(mixed_run(alone, users, spans, prefix, (s,)), session(b, s), sessions=1))


def test_padded_frames_equal_the_unpadded_frames(tiny_checkpoint) -> None:
    """Whole frames (Mimi in and out) with one session idle and one restarted: padded rows change nothing."""
    pcm = 0.1 * torch.randn(4, 3, FRAME_SIZE, generator=torch.Generator().manual_seed(2))
    outs = []
    for engine in (
        DuplexEngine(tiny_checkpoint, batch_size=3, seed=1),
        padded(DuplexEngine(tiny_checkpoint, batch_size=3, seed=1)),
    ):
        frames = []
        for t in range(pcm.shape[0]):
            engine.set_live(1, t != 2)
            if t == 2:
                engine.reset(0, seed=9)
            out = engine.step(pcm[t])
            frames.append((out.agent_pcm.clone(), out.tokens.frame.clone(), out.tokens.text_logits.clone()))
        outs.append(frames)
    for t, (a, b) in enumerate(zip(*outs, strict=True)):
        assert torch.equal(a[1], b[1]), f"frame {t}"
        torch.testing.assert_close(a[0], b[0], atol=TOL, rtol=0)
        torch.testing.assert_close(a[2], b[2], atol=TOL, rtol=0)


def test_plain_steps_reuse_their_inputs_and_anything_else_builds_new_ones(tiny_checkpoint, monkeypatch) -> None:
    """A plain step of the same rows reuses the last plain step's host inputs (no new tensor per frame); a first call,
    a span, a reset or a row going idle builds them again; the tokens equal those of an engine that builds them
    every step."""
    import cspan.core.engine as engine_module

    built: list[list[int]] = []
    real = engine_module.build_step

    def counting(rows, *args, **kwargs):
        built.append(list(rows))
        return real(rows, *args, **kwargs)

    monkeypatch.setattr(engine_module, "build_step", counting)
    codes = torch.randint(0, 32, (12, 2, 8), generator=torch.Generator().manual_seed(4))

    def run(reuse: bool) -> list[torch.Tensor]:
        engine = DuplexEngine(tiny_checkpoint, batch_size=2, seed=1)
        frames = []
        for t in range(codes.shape[0]):
            if t == 5:
                engine.inject_span(0, ContextSpan.from_ids([40, 41]))
            if t == 8:
                engine.set_live(1, False)
            if t == 9:
                engine.set_sampling(0, text=SamplingParams.text(0.7, 5))
            if t == 10:
                engine.reset(0, seed=3)
            if not reuse:
                engine._plain_batch = None
            frames.append(engine.step_tokens(codes[t]).frame.clone())
        return frames

    reused = run(reuse=True)
    delay = DuplexEngine(tiny_checkpoint, batch_size=2, seed=1).max_delay
    assert built[: delay + 1] == [[0, 1]] * (delay + 1)  # the first calls, then the first plain step
    # built again: the span's step and the plain step after it, the idle row, the reset and its first calls
    assert built[delay + 1 :] == [[0, 1], [0, 1], [0]] + [[0]] * (1 + delay), built
    before = len(built)
    rebuilt = run(reuse=False)
    assert len(built) - before == codes.shape[0]
    for t, (a, b) in enumerate(zip(reused, rebuilt, strict=True)):
        assert torch.equal(a, b), f"step {t}"


INTERPRETER = pytest.mark.skipif(
    os.environ.get("CSPAN_TEST_INTERPRETER") != "1",
    reason="minutes of Triton's interpreter: opt in with CSPAN_TEST_INTERPRETER=1 (needs triton installed)",
)


@pytest.mark.slow
@INTERPRETER
def test_padded_fused_step_equals_the_unpadded_under_the_interpreter(fixtures_dir: Path, repo_root: Path) -> None:
    """The fused kernels' path with the ragged tables padded to the block bucket and rows to the row bucket, for
    both cases of ``padded_steps.CASES`` (a wrapped ring; the GPU test's shapes), against the unpadded layout and
    batch 1: Triton's interpreter, float32, in a subprocess (the interpreter is chosen at import)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CSPAN_FUSED": "1"}
    script = repo_root / "tests" / "core" / "padded_steps.py"
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), str(fixtures_dir / "reference")],
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in json.loads(proc.stdout.strip().splitlines()[-1]).values():
        _assert_same(case["padded"])
        for diff in case["batch1"]:
            _assert_same(diff)


def test_a_block_row_reads_its_next_position_as_the_last_token_of_its_sequence() -> None:
    """The step's layout (sessions.build_step): a row with a block of n columns is one ragged sequence of n + 1
    tokens (its next position last, its decode slot a dummy on the scratch row); a step where every row reads a
    block has no decode slots; the buckets hold n + 1 tokens; a step over every session in order is `identity`."""
    import dataclasses

    from cspan.core.plan import ExecutionPlan
    from cspan.core.sessions import build_step, unpack
    from cspan.core.span import Block

    plan = ExecutionPlan(
        device=torch.device("cpu"), fused=True, depformer_gemv=False, pdl=False, cuda_graphs=False,
        kv_dtype=torch.float32, decode_config=None, library=None, buckets=True,
    )  # fmt: skip
    K, scratch = 3, 4  # four sessions: the scratch row is 4

    def block(n: int) -> Block:
        return Block(torch.arange(K * n).view(K, n) + 1)

    def layout(rows: list[int], blocks: dict[int, list[Block]], p: ExecutionPlan = plan):
        batch = build_step(rows, blocks, {}, [10] * 4, 1, K, scratch, 3000, p, torch.float32)
        return batch.shape, unpack(batch.packed, batch.shape, K)

    shape, io = layout([0, 1], {0: [block(16)], 1: [block(5), block(3)]})
    assert not shape.slots and io.layout.slots == 0 and io.layout.slot_rows is None
    assert shape.rows == 2 and shape.columns == 33 and not shape.identity  # 17 + 9 tokens, bucket 33; 2 of 4 rows
    assert io.fold.tolist() == [16, 25] and io.layout.final.tolist() == [16, 25]
    ragged = io.layout.ragged
    assert ragged.seq_len[:2].tolist() == [17, 9] and ragged.seq_start[:2].tolist() == [0, 17]
    assert ragged.tok_row[:26].tolist() == [0] * 17 + [1] * 9 and (ragged.tok_row[26:] == scratch).all()
    assert ragged.tok_j[:26].tolist() == [*range(17), *range(9)] and (ragged.tok_j[26:] == -1).all()
    assert torch.equal(io.tokens[:, 17:22], block(5).tokens) and torch.equal(io.tokens[:, 22:25], block(3).tokens)
    assert (io.tokens[:, [16, 25]] == 0).all()  # the next positions' columns: the device writes them
    last_seq, last_j = io.layout.last_queries
    assert last_seq.tolist() == [0, 1] and last_j.tolist() == [0, 0]  # block_m 64: one block each
    # the prefill grids have room for the step's 2 sequences, not for every row: ceil(33 / 64) + 2 - 1 query blocks
    assert shape.sequences == 2 and shape.queries == 2 and ragged.seq_row.tolist() == [0, 1]

    shape, io = layout([0, 1, 2, 3], {2: [block(64)]})
    assert shape.slots and shape.identity and shape.columns == 65 and shape.rows == 4
    assert io.layout.slot_rows.tolist() == [0, 1, scratch, 3]  # row 2's next position is in its sequence
    assert io.layout.final.tolist() == [0, 1, 4 + 64, 3]
    assert shape.sequences == 1 and shape.queries == 2  # 65 tokens: two blocks of 64 queries, one sequence

    shape, io = layout([1, 2, 3], {})  # no blocks: one decode slot per row, padded to the row bucket
    assert shape.slots and shape.columns == 0 and shape.rows == 4 and not shape.identity
    assert io.layout.final is None and io.rows.tolist() == [1, 2, 3, scratch]
    eager = dataclasses.replace(plan, buckets=False)
    assert layout([0, 1, 2, 3], {}, eager)[0].identity


def test_an_unpadded_step_is_sized_as_its_graph_bucket() -> None:
    """An eager step laid out unpadded sizes its attention launches (the decode's rows, the prefill's live query
    blocks, hence their key splits) as the CUDA-graph bucket it would pad to, so it gives the graph's bits: the GPU
    test's step of two spans and a prefix beside a plain row (114 ragged tokens, bucket 129), and three rows after
    one went idle (bucket 4). Without the sizing the H200's grids differ (device call C106: 4 key splits against 2
    for the block, 11 against 3 for the decode)."""
    import dataclasses

    from cspan.core.modules import fused
    from cspan.core.plan import ExecutionPlan
    from cspan.core.sessions import build_step, unpack
    from cspan.core.span import Block

    graphs = ExecutionPlan(
        device=torch.device("cpu"), fused=True, depformer_gemv=False, pdl=False, cuda_graphs=False,
        kv_dtype=torch.float32, decode_config=None, library=None, buckets=True,
    )  # fmt: skip
    eager = dataclasses.replace(graphs, buckets=False)
    K, scratch, heads, sms, key_blocks = 3, 4, 32, 132, 47  # the H200 and the 7B's full ring in 64-slot blocks

    def shapes(rows: list[int], blocks: dict[int, list[Block]]):
        out = []
        for plan in (eager, graphs):
            batch = build_step(rows, blocks, {}, [10] * 4, 1, K, scratch, 3000, plan, torch.float32)
            out.append((batch.shape, unpack(batch.packed, batch.shape, K).layout))
        return out

    block = {n: Block(torch.ones(K, n, dtype=torch.long)) for n in (64, 40, 7, 65)}
    (e, e_io), (g, g_io) = shapes([0, 1, 2, 3], {0: [block[64]], 1: [block[40]], 2: [block[7]]})
    assert (e.columns, e.queries, g.columns, g.queries) == (114, 4, 129, 5)
    assert e.sized_rows == g.sized_rows == 4 and e.live_blocks == g.live_blocks == 3

    def grid(shape, ragged) -> tuple[int, int]:
        q = ragged.qb_seq.shape[0]
        return fused.prefill_grid(q, shape.columns, shape.block_m, heads, key_blocks, sms, True, None, None, True,
                                  ragged.live_blocks)  # fmt: skip

    assert grid(e, e_io.ragged) == (2, 4 * heads * 2) and grid(g, g_io.ragged) == (2, 5 * heads * 2)
    assert fused.prefill_grid(4, 114, 64, heads, key_blocks, sms, True)[0] == 4  # sized by its own tokens
    (e, _), (g, _) = shapes([0], {0: [block[65]]})  # one block of 66 tokens: 2 query blocks, its bucket's 3
    assert (e.queries, g.queries, e.live_blocks, g.live_blocks) == (2, 3, 3, 3)
    (e, e_io), (g, g_io) = shapes([0, 1, 3], {})  # three rows after one went idle: sized as the bucket of 4
    assert (e.rows, g.rows, e_io.sized_rows, g_io.sized_rows) == (3, 4, 4, 4)

    # every live row reads a block, but the bucket of 4 rows has a padding row's dummy decode slot: the graph's block
    # runs beside a decode (one key split once its programs fill the SMs), and the unpadded step is sized the same
    block[200] = Block(torch.ones(K, 200, dtype=torch.long))
    (e, e_io), (g, g_io) = shapes([0, 1, 2], {r: [block[200]] for r in range(3)})
    assert (e.slots, g.slots, e_io.sized_slots, g_io.sized_slots) == (False, True, True, True)
    beside = [io.slots > 0 or io.sized_slots for io in (e_io, g_io)]  # as StreamingTransformer.forward_step
    grids = [
        fused.prefill_grid(io.ragged.qb_seq.shape[0], shape.columns, shape.block_m, heads, key_blocks, sms, side,
                           None, None, False, io.ragged.live_blocks)
        for (shape, io), side in zip(((e, e_io), (g, g_io)), beside, strict=True)
    ]  # fmt: skip
    assert grids[0][0] == grids[1][0] == 1
    assert fused.prefill_grid(e_io.ragged.qb_seq.shape[0], e.columns, e.block_m, heads, key_blocks, sms)[0] == 2

    # a step no block bucket serves (more than 2049 ragged tokens) runs unpadded in both and keeps its own sizes
    block[2100] = Block(torch.ones(K, 2100, dtype=torch.long))
    (e, e_io), (g, g_io) = shapes([0, 1, 2], {0: [block[2100]]})
    assert e == g and (e.rows, e.sized_rows, e.live_blocks, e.sized_slots) == (3, 3, 0, True)
