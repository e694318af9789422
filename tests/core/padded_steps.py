"""The padded (CUDA-graph bucket) layout of the engine's step against the unpadded one, run eagerly on the CPU.

A CUDA graph runs a step at a row bucket (padding rows compute on the scratch row) and a block-column bucket
(padding columns that nothing stores); :attr:`cspan.core.plan.ExecutionPlan.buckets` lays a step out that way
without graphs. :func:`mixed_run` drives four sessions as the GPU test
``test_7b_mixed_ragged_steps_graphed_equal_eager_and_stepwise`` does (two spans, a persona prefix with input
embeddings, a plain row that goes idle) plus a first row that is idle for one step (live rows out of order).

Imported by ``test_core_engine_buckets.py``; run as a script (``python tests/core/padded_steps.py``) under
``TRITON_INTERPRET=1 CSPAN_FUSED=1`` it checks the fused kernels' path (the ragged tables padded to the buckets)
and prints the differences as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import interpreter_shims
import torch


def mixed_run(
    engine: Any,
    users: torch.Tensor,
    spans: list[Any],
    prefix: tuple[torch.Tensor, torch.Tensor | None],
    sessions: tuple[int, ...] = (0, 1, 2, 3),
) -> dict:
    """Step ``engine`` through ``users`` [T, 4, C] as sessions ``sessions`` of the scenario (engine row r is session
    ``sessions[r]``; one session alone in a batch-1 engine is the batch-1 reference): spans into sessions 0 and 1
    and the persona prefix (frames, embeddings or None) into session 2 at steps 2 and 4; session 3 idle from step
    4 on; session 0 idle at step 3 (the live rows are then out of order).

    Returns:
        {"logits" [T, b, V], "columns" [T, b, K], "offset", "keys", "values", "grid"} (clones, the engine's rows
        with the scratch row last).
    """
    row = {s: r for r, s in enumerate(sessions)}
    logits, columns = [], []
    for t in range(users.shape[0]):
        if t in (2, 4):
            for s in (0, 1):
                if s in row:
                    engine.inject_span(row[s], spans[s])
            if 2 in row:
                engine.set_prefix(row[2], prefix[0], prefix[1])
        if 3 in row:
            engine.set_live(row[3], t < 4)
        if 0 in row:
            engine.set_live(row[0], t != 3)
        out = engine.step_tokens(users[t, list(sessions)])
        logits.append(out.text_logits.float().clone())
        columns.append(out.column.clone())
    cache = engine.lm_state.transformer.cache
    return {
        "logits": torch.stack(logits),
        "columns": torch.stack(columns),
        "offset": cache.offset.clone(),
        "keys": cache.keys.float().clone(),
        "values": cache.values.float().clone(),
        "grid": engine.grid.buffer.clone(),
    }


def session(run: dict, r: int) -> dict:
    """Engine row ``r`` of a :func:`mixed_run` result, as the result of a batch-1 run (row 0, scratch row 1)."""
    return {
        "logits": run["logits"][:, r : r + 1],
        "columns": run["columns"][:, r : r + 1],
        "offset": run["offset"][r : r + 1],
        "keys": run["keys"][:, r : r + 1],
        "values": run["values"][:, r : r + 1],
        "grid": run["grid"][r : r + 1],
    }


def padded(engine: Any) -> Any:
    """``engine`` with its steps laid out as its CUDA graphs would run them (padded to the buckets, no graphs)."""
    engine.plan = dataclasses.replace(engine.plan, buckets=True)
    return engine


def differences(a: dict, b: dict, sessions: int) -> dict:
    """Max differences of two :func:`mixed_run` results over the real sessions (keys and values in filled slots
    only: the scratch row and unwritten slots hold anything)."""
    from cspan.core.kv_cache import slot_positions

    offset = a["offset"][:sessions]
    filled = (slot_positions(offset, a["keys"].shape[3]) >= 0)[None, :, None, :, None]
    return {
        "offsets_equal": torch.equal(a["offset"][:sessions], b["offset"][:sessions]),
        "columns_equal": torch.equal(a["columns"], b["columns"]),
        "grid_equal": torch.equal(a["grid"][:sessions], b["grid"][:sessions]),
        "logits": (a["logits"] - b["logits"]).abs().max().item(),
        "keys": ((a["keys"][:, :sessions] - b["keys"][:, :sessions]).abs() * filled).max().item(),
        "values": ((a["values"][:, :sessions] - b["values"][:, :sessions]).abs() * filled).max().item(),
        "max_logit": a["logits"].abs().max().item(),
    }


def scenario(lm: Any, steps: int, span_lengths: tuple[int, int], seed: int = 8) -> tuple:
    """(users [T, 4, C], two spans from ids, a prefix (frames [K, P], embeddings [E, D])) for ``lm``."""
    from cspan.core.span import ContextSpan

    gen = torch.Generator().manual_seed(seed)
    C, K = (lm.num_codebooks - 1) // 2, lm.num_codebooks
    users = torch.randint(0, lm.card, (steps, 4, C), generator=gen)
    text_card = lm.text_linear.out_features
    spans = [
        ContextSpan.from_ids(torch.randint(0, text_card, (n,), generator=gen).tolist(), markers=False)
        for n in span_lengths
    ]
    frames = torch.randint(0, lm.card, (K, 6), generator=gen)
    frames[0] = torch.randint(0, text_card, (6,), generator=gen)
    embeddings = 0.1 * torch.randn(4, lm.cfg.dim, generator=gen)
    return users, spans, (frames, embeddings)


CASES = {
    "wrapped": ("lm-moshi-shaped", 16, True, 6, (20, 9)),
    "personaplex": ("lm-personaplex-shaped", None, False, 8, (64, 40)),
}
"""name -> (reference fixture, context override or None, prefix with input embeddings, steps, span lengths):
a ring of 16 slots that the spans wrap (moshi-shaped, dep_q 8), and the GPU test's case (PersonaPlex-shaped,
dep_q 16, a 3000-slot ring, spans of 64 and 40 columns, a prefix of codes only)."""


def load_case(folder: Any, name: str) -> tuple:
    """(lm, users, spans, prefix, engine keywords) of :data:`CASES` ``name``; ``folder``: the reference fixtures."""
    from safetensors.torch import load_file

    from cspan.core.config import LMConfig
    from cspan.core.lm import LMModel

    fixture, context, with_embeddings, steps, lengths = CASES[name]
    cfg = LMConfig.from_upstream(json.loads((folder / fixture / "config.json").read_text()))
    if context is not None:
        cfg = cfg.model_copy(update={"context": context})
    lm = LMModel(cfg, dtype=torch.float32).eval()
    lm.load_state_dict(load_file(folder / fixture / "model.safetensors"), strict=True)
    users, spans, (frames, embeddings) = scenario(lm, steps, lengths)
    C = lm.n_q // 2
    kw = {"seed": 3, "agent_placeholder": [1] * C, "user_placeholder": [2] * C}
    return lm, users, spans, (frames, embeddings if with_embeddings else None), kw


def main() -> None:
    """The fused path under the interpreter, for each of :data:`CASES`: the padded layout against the unpadded
    one (4 sessions), and each session of the padded run against that session alone (batch 1); prints
    ``{case: {"padded": differences, "batch1": [differences per session]}}`` as JSON."""
    interpreter_shims.apply()
    from pathlib import Path

    from cspan.core.engine import DuplexEngine

    torch.set_num_threads(1)
    folder = Path(sys.argv[1])
    result = {}
    for name in sys.argv[2:] or list(CASES):
        lm, users, spans, prefix, kw = load_case(folder, name)
        kw = {**kw, "fused": True}
        plain = mixed_run(DuplexEngine(lm, batch_size=4, **kw), users, spans, prefix)
        pad = mixed_run(padded(DuplexEngine(lm, batch_size=4, **kw)), users, spans, prefix)
        alone = [
            mixed_run(DuplexEngine(lm, batch_size=1, **{**kw, "seed": 3 + s}), users, spans, prefix, (s,))
            for s in range(4)
        ]
        result[name] = {
            "padded": differences(plain, pad, sessions=4),
            "batch1": [differences(alone[s], session(pad, s), sessions=1) for s in range(4)],
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
