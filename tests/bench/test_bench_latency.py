"""`cspan bench latency`: the JSON the report reads, the table's shape, the random-7B build path."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import pytest
import torch

from cspan.bench import report, run_files
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
        "--gap-steps", "1", "--n", "0", "16", "64", "--batch-size", "2", "--fresh", "--out", str(out), "--quiet",
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
    # the CPU reads the ring with torch's attention, not the Triton kernel (the report said "triton")
    assert cfg["fused"] is False and cfg["decode_attention"] == "eager (torch scaled_dot_product_attention)"
    # serve's engine settings: user-stream predictions skipped (and the step also timed with them), spans read in
    # the step that follows them; --fresh: no history
    assert cfg["predict_user"] is False and cfg["defer_spans"] is True and cfg["fill"] == 0
    assert cfg["kv_dtype"] == "float32" and cfg["span_sessions"] == 1 and cfg["span_at_tick"] is False
    _check_stats(doc["step_predict_user"], 3)
    assert "Plain step with the depformer's user-stream predictions" in printed
    assert "Engine: user-stream predictions skipped, spans read with the next step (deferred)." in printed
    # the batch row: a span into 1 of the 2 sessions in the timed frame, for each n > 0
    assert [(sp["n"], sp["sessions"]) for sp in batch["spans"]] == [(16, 1), (64, 1)]
    for sp in batch["spans"]:
        _check_stats(sp["frame"], 3)
        assert sp["minus_plain_p99_ms"] == pytest.approx(sp["frame"]["p99_ms"] - batch["frame"]["p99_ms"])
        # every timed frame, in order, and the host time of its span's arrival (injection and the step prepared,
        # before the frame: not part of it)
        frames, injects = sp["frame_samples_ms"], sp["inject_samples_ms"]
        assert len(frames) == len(injects) == 3 and all(i > 0 for i in injects)
        assert sp["inject_samples_cover"].startswith("inject_span + DuplexEngine.prepare, between frames")
        assert max(frames) == pytest.approx(sp["frame"]["max_ms"], abs=1e-3)
    assert "| batch | span n | sessions with a span |" in printed
    assert "The spans arrived between two frames, as cspan serve reads them" in printed

    # the report finds and renders it
    found = run_files.collect(out.parent)
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
        LatencyOptions(batch_sizes=(4,), span_sessions=5),
        LatencyOptions(pace_ms=-80),
    ):
        with pytest.raises(BenchError):
            bad.check()


def test_batch_row_options_without_batch_sizes_are_refused() -> None:
    """--span-sessions and --span-at-tick act on the batch rows only: without --batch-size they were ignored
    without a word (the JSON still said span_sessions 3), so they are refused."""
    for bad, flag in (
        (LatencyOptions(span_sessions=3), "--span-sessions 3"),
        (LatencyOptions(span_sessions=0), "--span-sessions 0"),
        (LatencyOptions(span_at_tick=True), "--span-at-tick"),
        (LatencyOptions(batch_sizes=(1,), span_at_tick=True), "--span-at-tick"),  # B = 1 is the main table
    ):
        with pytest.raises(BenchError, match=f"{flag}: .*--batch-size"):
            bad.check()
    LatencyOptions().check()  # the defaults (span_sessions 1) need no batch rows
    LatencyOptions(batch_sizes=(4,), span_sessions=3, span_at_tick=True).check()


def test_sizes_beyond_the_window_and_unwritable_out_are_refused_up_front(
    tiny_checkpoint_dir: Path, tmp_path: Path, cli, capsys
) -> None:
    """Issue 22 (F9, F11): `--n 100000` allocated 82 GB and crashed, `--fill 1000000` ran for hours, and a `--out`
    that cannot be written failed after the whole table: each is one clear line before anything is timed."""
    from fs_faults import read_only_folder

    ckpt = ("--checkpoint", str(tiny_checkpoint_dir), "--device", "cpu", "--iters", "1", "--quiet")
    for args, expect, status in (  # a setting out of range: exit 2; an unwritable output: 1
        (("--n", "100000"), "--n [100000]: a span must fit the model's context of 3000 positions (n <= 2999)", 2),
        (("--n", "0", "3000"), "--n [3000]: a span must fit", 2),
        (("--fill", "1000000", "--n", "0"), "--fill 1000000: more than the model's context of 3000 positions", 2),
        (("--n", "0", "--out", str(tmp_path)), "it is a folder; --out names the JSON file", 1),
    ):
        capsys.readouterr()
        assert cli("bench", "latency", *ckpt, *args) == status, args
        captured = capsys.readouterr()
        assert expect in captured.err and not captured.out, captured.err
    with read_only_folder(tmp_path / "ro") as ro:
        assert (
            cli("bench", "latency", "--checkpoint", str(tmp_path / "missing"), "--n", "0", "--out", str(ro / "l.json"))
            == 1
        )
    err = capsys.readouterr().err  # refused before the (missing) checkpoint is even looked at
    assert f"{ro / 'l.json'}: cannot write: " in err and "missing" not in err
    missing = str(tmp_path / "missing")
    with read_only_folder(tmp_path / "ro") as ro:
        for action in (
            ("qa", "--set", "webq", "--data", missing, "--checkpoint", missing),
            ("fdb-v1", "run", "--data", missing, "--checkpoint", missing),
            ("fdb-v3", "run", "--checkpoint", missing),
            ("serve",),
        ):
            capsys.readouterr()
            assert cli("bench", *action, "--out", str(ro / "o")) == 1, action
            written = "serve-load.json" if action == ("serve",) else "summary.json"  # the file each writes
            assert f"{ro / 'o' / written}: cannot write: " in capsys.readouterr().err, action


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_random_7b_refuses_the_cpu_without_allow_cpu(cli, capsys) -> None:
    rc = cli("bench", "latency", "--random-7b", "--iters", "2")
    assert rc == 1
    err = capsys.readouterr().err
    assert "--random-7b" in err and "--allow-cpu" in err and "CUDA" in err
    with pytest.raises(BenchError, match="allow-cpu"):
        load_models(None, random_7b=True, device=torch.device("cpu"), dtype=torch.bfloat16)


@pytest.mark.parametrize("verb", ["latency", "capacity"])
def test_an_unknown_dtype_is_a_bad_setting(verb: str, tmp_path: Path) -> None:
    """docs/BENCH.md: a setting is checked before anything runs, one line naming the flag, exit status 2;
    `--dtype int8` exited 1."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("CSPAN_")}
    done = subprocess.run(
        [sys.executable, "-m", "cspan.core.cli", "bench", verb, "--checkpoint", "/nonexistent", "--dtype", "int8",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"cspan bench {verb}: error: --dtype 'int8' is not a dtype; use one of bf16, fp16, fp32\n"
    assert not (tmp_path / "out").exists()


def test_timing_words_that_cannot_be_had_are_a_bad_setting() -> None:
    from cspan.bench.errors import BenchSettingsError
    from cspan.bench.qa import timing_source

    with pytest.raises(BenchSettingsError, match="--timing-words asr needs a transcriber") as err:
        timing_source("asr", None)
    assert err.value.exit_code == 2
    assert timing_source("auto", None) == "text" and timing_source("auto", object()) == "asr"


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
    options = LatencyOptions(span_lengths=(0, 16), iters=2, warmup=1, gap_steps=0, fill=0)
    doc = run_latency(models, options, device=torch.device("cpu"), dtype=torch.float32)
    assert [r["n"] for r in doc["rows"]] == [0, 16]
    for row in doc["rows"]:
        _check_stats(row, 2)
    _check_stats(doc["frame"], 2)
    assert doc["config"]["random_weights"] is True and doc["batch"] == {"sizes": [], "rows": [], "skipped": []}


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
        engine = make_engine(models, 2, options.span_lengths)
        bench = LatencyBench(engine, options)
        bench.restart()
        assert all(fill <= p < fill + engine.max_span_frames + 2 for p in engine.positions), engine.positions
        offsets = engine.lm_state.offset[:2].tolist()
        assert all(o >= fill for o in offsets), offsets
    assert LatencyBench(engine, LatencyOptions()).fill == context  # the default: a full ring
    doc = run_latency(models, LatencyOptions(span_lengths=(0,), iters=2, warmup=0, fill=40), device=torch.device("cpu"),
                      dtype=torch.float32)  # fmt: skip
    assert doc["config"]["fill"] == 40
    assert "every series starts from 40 positions of history" in latency_table(doc)


def test_pace_starts_every_call_on_the_frame_clock() -> None:
    """--pace-ms: every call of a series, the warm-up and a span series' gap steps included, starts one period after
    the one before (a server's frame clock; only lower bounds are asserted, the host may run late), and the JSON
    says so; without it the calls run back to back."""
    from cspan.bench.latency import LatencyBench, latency_table, make_engine
    from cspan.core.tiny import tiny_lm_config

    lm = random_lm(tiny_lm_config(), "cpu", torch.float32, seed=3)
    models = Models(lm=lm, mimi=None, tokenizer=None, source="random tiny", random=True)
    options = LatencyOptions(span_lengths=(0, 8), iters=3, warmup=2, gap_steps=1, fill=0, frame=False, pace_ms=30)
    bench = LatencyBench(make_engine(models, 1, options.span_lengths), options)
    bench.restart()
    starts: list[float] = []
    step = bench.lm_step

    def timed_step() -> None:
        starts.append(time.perf_counter())
        step()

    bench.lm_step = timed_step  # the span series' gap steps and timed steps go through it
    bench.series(timed_step)
    assert len(starts) == 5
    bench.span_series(8, (0,), timed_step)
    assert len(starts) == 5 + (2 + 3) * 2  # a gap step and the span's step per iteration
    # a clock: call k starts no earlier than k periods after the first (a start late by the sleep's overshoot
    # leaves the next one closer to it, so the gaps between two starts are not bounded below, the ticks are)
    since = [b - starts[0] - k * 0.030 for k, b in enumerate(starts)]
    assert min(since) >= -1e-3, since
    # a span arriving between frames (the batch rows' default): injected and its step prepared before the tick,
    # the step alone timed from it; the clock holds
    engine = bench.engine
    prepared: list[int] = []
    prepare = engine.prepare
    engine.prepare = lambda: prepared.append(len(starts)) or prepare()
    series = bench.span_series(8, (0,), timed_step, arrive_early=True)
    assert len(starts) == 15 + 10 and prepared == list(range(16, 26, 2))  # after each gap step, before the tick
    assert min(b - starts[15] - k * 0.030 for k, b in enumerate(starts[15:])) >= -1e-3
    assert series.total == series.next_step and all(p > 0 for p in series.prefill)
    doc = run_latency(models, options, device=torch.device("cpu"), dtype=torch.float32)
    assert doc["config"]["pace_ms"] == 30
    assert "Every call started on a 30 ms clock (--pace-ms)" in latency_table(doc)


def test_capacity_fills_rings_and_times_frames_with_poisson_spans() -> None:
    """`cspan bench capacity` (run_capacity): full rings, Poisson span arrivals, frame p99 per batch size and KV
    dtype; the search stops at the first batch size over the budget (tiny random model, context 64)."""
    import numpy as np

    from cspan.bench.capacity import CapacityOptions, arrivals, capacity_table, kv_bytes_per_session, run_capacity
    from cspan.core.tiny import tiny_lm_config, tiny_mimi_config

    lm = random_lm(tiny_lm_config().model_copy(update={"context": 64}), "cpu", torch.float32, seed=3)
    models = Models(lm=lm, mimi=random_mimi(tiny_mimi_config(), "cpu", seed=4), tokenizer=None, source="tiny",
                    random=True)  # fmt: skip
    options = CapacityOptions(batch_sizes=(1, 2), frames=4, warmup=1, span_interval_s=0.2, span_length=16,
                              max_span=40, budget_ms=60000.0)  # fmt: skip
    doc = run_capacity(models, options, device=torch.device("cpu"), dtype=torch.float32)
    assert doc["capacity"] == {"auto": 2, "fp8": 2}
    assert [(r["kv_dtype"], r["batch_size"]) for r in doc["results"]] == [("auto", 1), ("auto", 2), ("fp8", 1),
                                                                           ("fp8", 2)]  # fmt: skip
    for r in doc["results"]:
        _check_stats(r["frame"], 4)
        assert r["real_time"] and r["spans"] > 0  # 0.2 s between spans: ~2.5 spans per session in 5 frames
    assert "Sessions per device at frame P99 < 60000 ms: auto: 2, fp8: 2." in capacity_table(doc)
    assert doc["notes"] == [] and "Note:" not in capacity_table(doc)  # every row read spans
    strict_options = CapacityOptions(
        batch_sizes=(1, 2), frames=2, warmup=0, budget_ms=1e-3, max_span=40, span_length=16
    )
    strict = run_capacity(models, strict_options, device=torch.device("cpu"), dtype=torch.float32)
    assert strict["capacity"] == {"auto": None, "fp8": None} and len(strict["results"]) == 2  # stops at B = 1
    # arrivals: Poisson with the configured rate, lengths within [16, max_span]
    opts = CapacityOptions(span_interval_s=8.0, span_length=256, max_span=600)
    plan = arrivals(50, 2000, opts, 12.5, np.random.default_rng(0))
    lengths = [n for frame in plan for _, n in frame]
    assert abs(len(lengths) / (50 * 2000) - 1 / 100) < 0.002 and min(lengths) >= 16 and max(lengths) <= 600
    from cspan.core.config import LMConfig

    big = random_lm(LMConfig.personaplex_7b(), "meta", torch.bfloat16)
    assert kv_bytes_per_session(big, "auto") == 2 * 3000 * 32 * 4096 * 2  # 1.57 GB of bf16 keys and values
    assert kv_bytes_per_session(big, "fp8") == 2 * 3000 * 32 * 32 * (128 + 4)


def test_capacity_counts_a_16_bit_kv_cache_of_a_float32_model_in_16_bits() -> None:
    """--kv-dtype bf16 / fp16 store 2 bytes a value whatever the model's dtype: with --dtype fp32 the KV GiB column
    and the "does not fit" check counted 4 (the model's), twice the cache, and could skip a batch that fits."""
    from cspan.bench.capacity import kv_bytes_per_session
    from cspan.core.config import LMConfig

    fp32 = random_lm(LMConfig.personaplex_7b(), "meta", torch.float32)
    values = 2 * 3000 * 32 * 4096  # keys and values of every position, layer and channel
    assert kv_bytes_per_session(fp32, "auto") == values * 4
    assert kv_bytes_per_session(fp32, "bf16") == kv_bytes_per_session(fp32, "fp16") == values * 2
    assert kv_bytes_per_session(fp32, "fp8") == 2 * 3000 * 32 * 32 * (128 + 4)


def test_capacity_notes_rows_without_spans_and_says_no_graphs_on_the_cpu() -> None:
    """A row that read no span is noted in the JSON and the printed result (its capacity says nothing about spans);
    on the CPU the progress says there are no CUDA graphs instead of "compiling and capturing"."""
    from cspan.bench.capacity import CapacityOptions, capacity_table, run_capacity
    from cspan.core.tiny import tiny_lm_config, tiny_mimi_config

    lm = random_lm(tiny_lm_config().model_copy(update={"context": 64}), "cpu", torch.float32, seed=3)
    models = Models(lm=lm, mimi=random_mimi(tiny_mimi_config(), "cpu", seed=4), tokenizer=None, source="tiny",
                    random=True)  # fmt: skip
    options = CapacityOptions(batch_sizes=(1,), kv_dtypes=("auto",), frames=3, warmup=0, span_interval_s=math.inf,
                              span_length=16, max_span=40, budget_ms=60000.0)  # fmt: skip
    said: list[str] = []
    doc = run_capacity(models, options, device=torch.device("cpu"), dtype=torch.float32, progress=said.append)
    assert doc["capacity"] == {"auto": 1} and doc["results"][0]["spans"] == 0
    note = (
        "auto, B = 1: no span arrived in its 3 timed frames (spans read 0): its frame times, and a capacity resting "
        "on them, say nothing about spans; time more --frames or give a shorter --span-interval"
    )
    assert doc["notes"] == [note]
    assert capacity_table(doc).endswith(f"Sessions per device at frame P99 < 60000 ms: auto: 1.\n\nNote: {note}.")
    assert "B = 1, auto: warming every block bucket up to 40 (no CUDA graphs on CPU)" in said
    assert not any("capturing" in line for line in said)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"span_interval_s": -1.0}, r"--span-interval -1: give a number of seconds > 0 \(inf: no spans\)"),
        ({"max_span": 2}, "--max-span 2: give at least 16 columns"),
        ({"span_length": 0}, r"--span-length 0: give 16 to --max-span \(600\) columns"),
        ({"budget_ms": float("nan")}, "--budget-ms nan: give a number of milliseconds > 0"),
        ({"budget_ms": 0.0}, "--budget-ms 0: give"),
        ({"max_block_columns": -3}, "--max-block-columns -3: give >= 1 columns, or 0 for no limit"),
    ],
)
def test_capacity_options_name_the_setting_they_refuse(change: dict, message: str) -> None:
    from cspan.bench.capacity import CapacityOptions

    with pytest.raises(BenchError, match=message):
        dataclasses.replace(CapacityOptions(), **change).check()


def test_capacity_refuses_spans_longer_than_the_context() -> None:
    from cspan.bench.capacity import CapacityOptions, run_capacity
    from cspan.core.tiny import tiny_lm_config

    lm = random_lm(tiny_lm_config().model_copy(update={"context": 64}), "cpu", torch.float32, seed=3)
    models = Models(lm=lm, mimi=None, tokenizer=None, source="tiny", random=True)
    with pytest.raises(BenchError, match=r"--max-span 65: longer than the model's context \(64 positions\)"):
        run_capacity(models, CapacityOptions(batch_sizes=(1,), max_span=65, span_length=16),
                     device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip


def test_capacity_prewarm_fills_every_block_bucket_a_frame_can_reach() -> None:
    """The capacity bench captures every block bucket before its timed frames: one span per bucket while one is
    long enough, then two (the longest and the rest) while the step budget lets them be read in one step."""
    from cspan.bench.capacity import prewarm_spans
    from cspan.core.plan import BLOCK_BUCKETS

    spans = prewarm_spans(BLOCK_BUCKETS, 600, 640)
    assert spans[0] == [16] and [577] in spans and spans[-2:] == [[600, 3], [600, 40]]
    filled = sorted({next(b for b in BLOCK_BUCKETS if b >= sum(n + 1 for n in s)) for s in spans})
    assert filled == [b for b in BLOCK_BUCKETS if 17 <= b <= 705]  # 640 columns + 2 next positions: bucket 705
    assert all(sum(s) <= 640 for s in spans)
    assert prewarm_spans(BLOCK_BUCKETS, 600, None)[-1] == [600, 424]  # no budget: two longest spans, bucket 1281


def test_fill_history_reads_every_span_an_engine_budget_holds_back(tiny_checkpoint_dir: Path) -> None:
    """With a step budget of span columns the fill still leaves nothing queued: every ring is full when it returns."""
    from cspan.bench.latency import fill_history
    from cspan.core.checkpoint import load_checkpoint
    from cspan.core.engine import DuplexEngine

    checkpoint = load_checkpoint(tiny_checkpoint_dir, device="cpu", dtype=torch.float32)
    engine = DuplexEngine(checkpoint, batch_size=4, seed=0, max_block_columns=64)
    zeros = torch.zeros(4, engine.num_codebooks, dtype=torch.long)
    for _ in range(3):
        engine.step_tokens(zeros)
    fill_history(engine, 200)
    assert engine.sessions.blocks == {} and engine.sessions.waiting == []
    assert all(p >= 199 for p in engine.positions)
    assert engine.state.grid.position[:4].tolist() == engine.positions
