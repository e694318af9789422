"""`cspan bench latency`: the JSON the report reads, the table's shape, the random-7B build path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cspan.bench import report
from cspan.bench.errors import BenchError
from cspan.bench.latency import (
    LatencyOptions,
    Models,
    init_cheap_,
    load_models,
    random_lm,
    random_mimi,
    run_latency,
    span_body,
    summarize_ms,
)

STAT_KEYS = {"mean_ms", "sd_ms", "p50_ms", "p99_ms", "min_ms", "max_ms", "iters"}


def _check_stats(stats: dict, iters: int) -> None:
    assert stats.keys() >= STAT_KEYS
    assert stats["iters"] == iters
    assert 0 < stats["min_ms"] <= stats["p50_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    assert stats["min_ms"] <= stats["mean_ms"] <= stats["max_ms"]
    assert stats["sd_ms"] >= 0


def test_latency_cli_on_tiny_checkpoint_writes_the_report_json(tiny_checkpoint_dir: Path, tmp_path: Path, cli, capsys):
    out = tmp_path / "run" / "latency.json"
    rc = cli(
        "bench", "latency", "--checkpoint", str(tiny_checkpoint_dir), "--iters", "3", "--warmup", "1",
        "--gap-steps", "1", "--n", "0", "16", "64", "--batch-size", "2", "--out", str(out), "--quiet",
    )  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| n (frames) | 0 | 16 | 64 |" in printed
    assert "Whole frame (Mimi encode + step + Mimi decode)" in printed

    doc = json.loads(out.read_text())
    assert doc["gpu"].startswith("cpu") and doc["gpu_name"] is None and doc["driver"] is None
    assert doc["torch"] == torch.__version__ and doc["dtype"] == "float32" and doc["cuda"] == torch.version.cuda
    assert doc["date"].endswith("+00:00")
    assert [r["n"] for r in doc["rows"]] == [0, 16, 64]
    for row in doc["rows"]:
        _check_stats(row, 3)
    for row in doc["rows"][1:]:  # span rows split the total into prefill + next step
        assert row["prefill_mean_ms"] > 0 and row["next_step_mean_ms"] > 0
        assert row["prefill_mean_ms"] + row["next_step_mean_ms"] == pytest.approx(row["mean_ms"], rel=1e-6)
    _check_stats(doc["step"], 3)
    _check_stats(doc["frame"], 3)
    assert doc["batch"]["sizes"] == [2]
    (batch,) = doc["batch"]["rows"]
    _check_stats(batch["step"], 3)
    assert batch["step_per_session_mean_ms"] == pytest.approx(batch["step"]["mean_ms"] / 2)
    cfg = doc["config"]
    assert cfg["source"] == str(tiny_checkpoint_dir) and cfg["random_weights"] is False
    assert cfg["lm"]["dep_q"] == 16 and cfg["lm"]["num_parameters"] > 0 and cfg["mimi"]["sample_rate"] == 24000
    assert cfg["cuda_graphs"] is False and cfg["span_lengths"] == [0, 16, 64]
    # serve's engine settings: user-stream predictions skipped (and the step also timed with them), spans read at
    # injection on the CPU (deferral needs CUDA graphs)
    assert cfg["predict_user"] is False and cfg["defer_spans"] is False
    _check_stats(doc["step_predict_user"], 3)
    assert "Plain step with the depformer's user-stream predictions" in printed
    assert "Engine: user-stream predictions skipped, spans read at injection." in printed

    # the report finds and renders it
    found = report.collect(out.parent)
    assert len(found.latency) == 1
    markdown, _ = report.build_report(out.parent, plots=False)
    assert "| n (frames) | 0 | 16 | 64 |" in markdown
    assert "mean ± sd, ms" in markdown and "P99, ms" in markdown
    assert "Engine: user-stream predictions skipped" in markdown and "user-stream predictions (all dep_q" in markdown


def test_summarize_ms_known_values() -> None:
    stats = summarize_ms([1.0, 2.0, 3.0, 4.0, 10.0])
    assert stats["mean_ms"] == pytest.approx(4.0)
    assert stats["sd_ms"] == pytest.approx(math.sqrt((9 + 4 + 1 + 0 + 36) / 4))
    assert stats["p50_ms"] == 3.0
    assert stats["p99_ms"] == pytest.approx(4.0 + 0.96 * 6.0)  # linear interpolation between 4 and 10
    assert (stats["min_ms"], stats["max_ms"], stats["iters"]) == (1.0, 10.0, 5)
    assert summarize_ms([7.5])["sd_ms"] == 0.0
    with pytest.raises(ValueError):
        summarize_ms([])


def test_span_body_gives_exactly_n_columns_without_special_ids() -> None:
    from cspan.core.span import ContextSpan

    for n in (3, 16, 600):
        body = span_body(n, 32000)
        ids, truncated = ContextSpan.from_ids(body).encode(max_frames=600)
        assert len(ids) == n and not truncated
        assert ids[0] == 12 and ids[-1] == 13
        assert all(32 <= i < 32000 for i in body)


def test_options_reject_impossible_settings() -> None:
    for bad in (
        LatencyOptions(iters=0),
        LatencyOptions(span_lengths=(0, 2)),
        LatencyOptions(row_step="both"),
        LatencyOptions(batch_sizes=(0,)),
        LatencyOptions(fill=-1),
    ):
        with pytest.raises(BenchError):
            bad.check()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_random_7b_refuses_the_cpu_without_allow_cpu(cli, capsys) -> None:
    rc = cli("bench", "latency", "--random-7b", "--iters", "2")
    assert rc == 1
    err = capsys.readouterr().err
    assert "--random-7b" in err and "--allow-cpu" in err and "CUDA" in err
    with pytest.raises(BenchError, match="allow-cpu"):
        load_models(None, random_7b=True, device=torch.device("cpu"), dtype=torch.bfloat16)


def test_random_7b_is_built_on_meta_at_the_real_dimensions() -> None:
    from cspan.core.config import LMConfig

    cfg = LMConfig.personaplex_7b()
    lm = random_lm(cfg, "meta", torch.bfloat16)
    assert lm.device.type == "meta"  # shapes only: nothing allocated
    assert sum(p.numel() for p in lm.parameters()) == 8_371_408_896
    assert (lm.cfg.dim, lm.cfg.num_layers, lm.dep_q, lm.cfg.context) == (4096, 32, 16, 3000)


def test_random_models_materialise_on_the_device_and_time_end_to_end() -> None:
    """The --random-7b path (meta -> to_empty -> in-place init -> engine -> table) on the tiny dimensions."""
    from cspan.core.tiny import tiny_lm_config, tiny_mimi_config

    lm = random_lm(tiny_lm_config(), "cpu", torch.float32, seed=3)
    mimi = random_mimi(tiny_mimi_config(), "cpu", seed=4)
    params = dict(lm.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    alphas = [p for n, p in params.items() if n.endswith(".alpha")]
    assert alphas and all(bool((a == 1).all()) for a in alphas)
    weight = params["transformer.layers.0.self_attn.in_proj_weight"]
    assert weight.std().item() == pytest.approx(1 / math.sqrt(weight.shape[1]), rel=0.2)
    # the same seed gives the same weights
    again = init_cheap_(random_lm(tiny_lm_config(), "cpu", torch.float32, seed=3), seed=3)
    assert torch.equal(again.text_emb.weight, lm.text_emb.weight)

    models = Models(lm=lm, mimi=mimi, tokenizer=None, source="random tiny", random=True)
    options = LatencyOptions(span_lengths=(0, 16), iters=2, warmup=1, gap_steps=0)
    doc = run_latency(models, options, device=torch.device("cpu"), dtype=torch.float32)
    assert [r["n"] for r in doc["rows"]] == [0, 16]
    for row in doc["rows"]:
        _check_stats(row, 2)
    _check_stats(doc["frame"], 2)
    assert doc["config"]["random_weights"] is True and doc["batch"] == {"sizes": [], "rows": []}


def test_fill_brings_every_session_to_that_much_history() -> None:
    """--fill: before each series every session holds at least that many positions (spans of text read like any
    span), past the model's context too (a full, wrapped ring); the JSON and the printout say so."""
    from cspan.bench.latency import LatencyBench, latency_table, make_engine
    from cspan.core.tiny import tiny_lm_config

    lm = random_lm(tiny_lm_config(), "cpu", torch.float32, seed=3)
    models = Models(lm=lm, mimi=None, tokenizer=None, source="random tiny", random=True)
    context = lm.cfg.context
    for fill in (40, context + 30):
        options = LatencyOptions(span_lengths=(0,), iters=2, warmup=0, gap_steps=0, fill=fill, frame=False)
        engine = make_engine(models, 2, torch.device("cpu"), torch.float32, options.span_lengths)
        bench = LatencyBench(engine, options)
        bench.restart()
        assert all(fill <= p < fill + engine.injector.max_span_frames + 2 for p in engine.positions), engine.positions
        offsets = engine.lm_state.offset.tolist()
        assert all(o >= fill for o in offsets), offsets
    doc = run_latency(models, LatencyOptions(span_lengths=(0,), iters=2, warmup=0, fill=40), device=torch.device("cpu"),
                      dtype=torch.float32)  # fmt: skip
    assert doc["config"]["fill"] == 40
    assert "every series starts from 40 positions of history" in latency_table(doc)
