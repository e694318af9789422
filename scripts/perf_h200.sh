#!/usr/bin/env bash
# One device call (see docs/PERFORMANCE.md): environment and ceilings, the GPU tests, the bench on full rings
# (B = 1 / 32 / 64 / 80 in bf16, 128 with the FP8 cache, spans into k of B sessions), the upstream baseline in the
# same call, decode / prefill attention side by side with FlashInfer, capacity (bf16 and FP8 KV) and the FP8
# divergence on the random 7B. Every stage prints its duration, exit status and the end of its log; the call ends
# with a summary of every result (`scripts/perf_h200.py summary`) and $OUT/perf-logs.tgz (all logs and JSON).
#
# Prepare here (not on the device), from the repository root, once:   bash scripts/perf_h200.sh prepare
#   .whl/perf       pydantic, soundfile, soxr (+ their needs) and moshi==0.2.13 for the upstream baseline
#   .whl/flashinfer flashinfer-python==0.6.0 (JIT: nvcc builds its kernels on the device) + apache-tvm-ffi
#   .device/        ../shared/fixtures/reference (for the GPU tests) and ../shared/bench/moshi_baseline.py
# (all git-ignored). A branch to time against this tree in the `variants` stage, once per branch:
#   bash scripts/perf_h200.sh prepare-variant NAME GIT-REF   # REF's cspan-core as .device/variants/NAME/src
# Then, on the device, with carry [".whl", ".device"]:
#   bash scripts/perf_h200.sh            # call 1: env tests bench baseline attention (about 8.5 minutes)
#   bash scripts/perf_h200.sh env bench-fp8 capacity fp8 triton     # call 2 (about 6 minutes)
#   bash scripts/perf_h200.sh STAGES...  # any of: env tests bench bench-fp8 fresh before anatomy baseline attention
#                                        #         capacity fp8 triton profile tune-conv tune-prefill pinned fi-prefill splits
#                                        #         bench-apart span-jitter paced phases early
#                                        #         variants probe cprobe gemv tgemv span-libs
# BATCHES (optional, default "32 64 80"): the batch sizes of the bench and baseline stages besides B = 1.
# A stage that would start after BUDGET seconds (default 520) is skipped, and each stage's time limit is cut to
# what is left, so the summary and the tarball always come back inside the device's 10-minute call.
# Exits non-zero when a stage fails or is unknown (after running the others).
set -u
if [ "${1:-}" = "prepare-variant" ]; then  # NAME REF: REF's packages/cspan-core/src as .device/variants/NAME/src
  set -e
  [ $# -eq 3 ] || { echo "usage: bash scripts/perf_h200.sh prepare-variant NAME GIT-REF" >&2; exit 2; }
  rm -rf ".device/variants/$2" && mkdir -p ".device/variants/$2/src"
  git archive "$3" packages/cspan-core/src | tar -x --strip-components=3 -C ".device/variants/$2/src"
  exit 0
fi
if [ "${1:-}" = "prepare" ]; then
  set -e
  plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
    --platform manylinux_2_24_x86_64 --platform any"
  rm -rf .whl .device && mkdir -p .whl/perf .whl/flashinfer .device
  python3 -m pip download -q --no-deps $plat -d .whl/perf pydantic pydantic-core pydantic-settings python-dotenv \
    annotated-types typing-inspection typing-extensions soundfile cffi pycparser soxr moshi==0.2.13
  python3 -m pip download -q --no-deps $plat -d .whl/flashinfer flashinfer-python==0.6.0 "apache-tvm-ffi<0.2,>=0.1.6"
  cp -r ../shared/fixtures/reference .device/fixtures
  cp ../shared/bench/moshi_baseline.py .device/
  mkdir -p .device/before  # the engine before v2, for the `before` stage
  git archive 9236a36 packages/cspan-core/src packages/cspan-bench/src packages/cspan-backends/src scripts/perf_h200.py \
    | tar -x -C .device/before
  du -sh .whl .device
  exit 0
fi
OUT=${OUT:-/tmp/perf-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
stages=${*:-env tests bench baseline attention}
BUDGET=${BUDGET:-520}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/perf/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fisite .whl/flashinfer/*.whl \
  || echo "flashinfer wheels did not install: the attention stage runs without it"
# FlashInfer on the path: the engine reads full rings with it from 8 rows on (cspan.core.attention; the `triton`
# stage times the engine with CSPAN_ATTENTION=triton)
export PYTHONPATH=/tmp/site:/tmp/fisite:$PWD/packages/cspan-core/src:$PWD/packages/cspan-bench/src:$PWD/packages/cspan-backends/src
export PYTHONUNBUFFERED=1
if [ -d .device/fixtures ]; then mkdir -p ../shared/fixtures/reference && cp -r .device/fixtures/* ../shared/fixtures/reference/; fi
BENCH="python3 scripts/perf_h200.py bench"
old=$PWD/.device/before/packages  # the engine before v2 on the path (the `before`, `anatomy` and `variants` stages)
BEFORE_PATH=/tmp/site:$old/cspan-core/src:$old/cspan-bench/src:$old/cspan-backends/src
failed=0
run() {  # name, limit seconds, command...: log to $LOGS/name.log, print the tail
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET + 30 - SECONDS))
  if [ "$left" -lt 20 ]; then echo "=== $name: skipped (the call's time budget is spent)"; failed=1; return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-6}" "$LOGS/$name.log"
  [ "$rc" -eq 0 ] || failed=1
}
smi_log() {  # FILE: the GPU's clocks, power and clock-event reasons every 20 ms into FILE, in the background
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 20 >"$1" 2>&1 &
}
variant_path() {  # NAME: the PYTHONPATH with .device/variants/NAME/src in place of this tree's cspan-core
  echo "/tmp/site:/tmp/fisite:$PWD/.device/variants/$1/src:$PWD/packages/cspan-bench/src:$PWD/packages/cspan-backends/src"
}
for stage in $stages; do
  case $stage in
    env)
      run env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv;
        python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__)";
        date -u +%FT%TZ; python3 scripts/perf_h200.py ceilings' ;;
    tests)
      # TESTS (optional): the test ids to run instead of every gpu-marked test. TESTS_SHARD=1 / 2 (optional): the
      # fused-kernel file / the other three: a cold machine compiles for about 600 s over all 61 tests, more than one
      # call (C92 / C93), so a full run is `TESTS_SHARD=1 BUDGET=570 ... env tests`, then the same with 2
      shard1="tests/core/test_core_fused_cuda.py"
      shard2="tests/core/test_core_engine_cuda.py tests/core/test_core_lm_cuda_graph.py tests/core/test_core_mimi.py"
      case ${TESTS_SHARD:-all} in 1) all=$shard1 ;; 2) all=$shard2 ;; *) all="$shard1 $shard2" ;; esac
      # -s: a test's printed readings go to the log as it runs (a stage cut by its limit keeps them; -rP printed them
      # only at the end, and C107 lost the mixed test's reading that way)
      run tests 560 python3 -m pytest ${TESTS:-$all} -m gpu -v -s -p no:cacheprovider ;;
    bench)  # full rings: B = 1 table, then B = 32 / 64 / 80 with a 600-column span into 1 session of the frame
      # SPANS (optional, default "0 16 600"): the span lengths, at B = 1 and into 1 session of each batch
      run bench 180 $BENCH latency --random-7b --n ${SPANS:-0 16 600} --iters 20 --warmup 3 --batch-size ${BATCHES:-32 64 80} \
        --span-sessions 1 --out "$LOGS/latency.json" ;;
    bench-apart)  # spans into 1 session of B with the block attention after the decode attention, not beside it
      CSPAN_SPAN_OVERLAP=0 run bench-apart 150 $BENCH latency --random-7b --n 600 --iters 20 --warmup 3 \
        --batch-size ${BATCHES:-32 64 80} --span-sessions 1 --out "$LOGS/latency_apart.json" ;;
    span-jitter)  # where the span frame's p99 comes from: a 600-column span into 1 of 64 sessions, ITERS (default 60)
      # frames, each frame's time and its injection part in the JSON (frame_samples_ms, inject_samples_ms); the block
      # beside the decode, after it (CSPAN_SPAN_OVERLAP=0), and beside it with Python's GC off; the GPU's clocks,
      # power and clock-event reasons every 20 ms meanwhile ($LOGS/smi-jitter.csv); JITTER_VARIANTS (optional): the same
      # frames on .device/variants/NAME (see `variants`)
      smi_log "$LOGS/smi-jitter.csv"; smi=$!
      jit="latency --random-7b --n 600 --iters ${ITERS:-60} --warmup 5 --no-frame --batch-size 64 --span-sessions 1"
      run jitter-beside 120 $BENCH $jit --out "$LOGS/latency_jitter_beside.json"
      CSPAN_SPAN_OVERLAP=0 run jitter-apart 120 $BENCH $jit --out "$LOGS/latency_jitter_apart.json"
      run jitter-nogc 120 python3 -c 'import gc, runpy, sys; gc.disable(); sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")' scripts/perf_h200.py bench $jit --out "$LOGS/latency_jitter_nogc.json"
      for v in ${JITTER_VARIANTS:-}; do
        run "jitter-$v" 120 env PYTHONPATH="$(variant_path "$v")" $BENCH $jit --out "$LOGS/latency_jitter_$v.json"
      done
      kill $smi ;;
    phases)  # the host phases of a span step (scripts/span_phases.py; PHASES, default: B = 64 on full rings)
      TAIL=12 run phases 180 python3 scripts/span_phases.py ${PHASES:---batch-size 64 --fill 3000 --spans 16 600 --reps 20} ;;
    early)  # a span frame on an 80 ms clock with its host work before the tick, against at the tick (EARLY, default B = 64)
      TAIL=12 run early 300 python3 scripts/span_early.py ${EARLY:---batch-size 64 --spans 16 600 --iters 30} ;;
    paced)  # frames on an 80 ms clock as a server runs them (--pace-ms 80), B = 1 and PACED_BATCHES (default "32 64"),
      # spans of 16 / 600 columns into 1 session, ITERS (default 40): the spans arriving between frames (injected and
      # their step prepared then, as cspan serve reads them), at the frame's tick (--span-at-tick), and back to back;
      # the GPU's clocks and power every 20 ms meanwhile ($LOGS/smi-paced.csv); PACED_VARIANTS (optional):
      # .device/variants/NAME paced too; NO_AT_TICK / NO_UNPACED (optional): skip those series
      smi_log "$LOGS/smi-paced.csv"; smi=$!
      pac="latency --random-7b --n 16 600 --iters ${ITERS:-40} --warmup 5 --no-frame --batch-size ${PACED_BATCHES:-32 64} --span-sessions 1"
      run paced 240 $BENCH $pac --pace-ms 80 --out "$LOGS/latency_paced.json"
      [ -n "${NO_AT_TICK:-}" ] || run paced-at-tick 240 $BENCH $pac --pace-ms 80 --span-at-tick --out "$LOGS/latency_paced_at_tick.json"
      [ -n "${NO_UNPACED:-}" ] || run unpaced 150 $BENCH $pac --out "$LOGS/latency_unpaced.json"
      for v in ${PACED_VARIANTS:-}; do
        run "paced-$v" 240 env PYTHONPATH="$(variant_path "$v")" $BENCH $pac --pace-ms 80 --out "$LOGS/latency_paced_$v.json"
      done
      kill $smi ;;
    overlap)  # a block's attention beside 64 rows' decode attention on two streams, per kernel config
      TAIL=40 run overlap 200 python3 scripts/perf_h200.py overlap ;;
    bench-fp8)
      run bench-fp8 120 $BENCH latency --random-7b --kv-dtype fp8 --n 0 600 --iters 20 --warmup 3 \
        --batch-size 128 --span-sessions 2 --out "$LOGS/latency_fp8.json" ;;
    fresh)  # freshly reset streams: the batch-1 before/after table (no regression beyond 3 %)
      run fresh 120 $BENCH latency --random-7b --fresh --iters 50 --out "$LOGS/latency_fresh.json" ;;
    before)  # the same fresh-stream table on the engine before v2 (9236a36; `prepare` copies it to .device/before)
      run before 120 env PYTHONPATH=$BEFORE_PATH \
        python3 .device/before/scripts/perf_h200.py bench latency --random-7b --iters 50 --out "$LOGS/latency_fresh_before.json" ;;
    anatomy)  # batch-1 GPU busy time against host time and kernels per call, this tree and the engine before v2
      run anatomy 150 python3 scripts/step_anatomy.py --spans 16 64 600 --json "$LOGS/anatomy.json"
      run anatomy-before 150 env PYTHONPATH=$BEFORE_PATH \
        python3 scripts/step_anatomy.py --spans 16 64 600 --json "$LOGS/anatomy_before.json" ;;
    baseline)  # upstream moshi 0.2.13 in the same call (copied into .device by `prepare`)
      b=${BATCHES:-32 64 80}
      run baseline 150 env OUT="$LOGS" DEPQ=16 FILL=3000 FRAME=1 BATCHES=1,${b// /,} SPANS=600 \
        PREFILL_GRAPH=1 ITERS=20 WARM=3 SPAN_ITERS=10 python3 .device/moshi_baseline.py ;;
    span-libs)  # a 601-token block's attention over a full ring by cuDNN / FlashAttention 2 (torch) and FlashInfer
      # (fa2 / fa3) in pieces merged by log-sum-exp, against the engine's kernel (scripts/span_attention_libs.py)
      TAIL=${TAIL:-40} run span-libs 330 python3 scripts/span_attention_libs.py ;;
    attention)
      TAIL=${TAIL:-3} run attention 260 python3 scripts/perf_h200.py attention ;;
    triton)  # the engine with its own decode kernel everywhere (no FlashInfer), B = 32 / 64 / 80 on full rings
      CSPAN_ATTENTION=triton run triton 150 $BENCH latency --random-7b --n 0 600 --iters 20 --warmup 3 \
        --batch-size 32 64 80 --no-frame --out "$LOGS/latency_triton.json" ;;
    capacity)
      # CAPACITY_BF16 / CAPACITY_FP8 (optional): the batch sizes tried ("none": skip that KV dtype)
      [ "${CAPACITY_BF16:-}" = none ] || run capacity 150 $BENCH capacity --random-7b \
        --batch-size ${CAPACITY_BF16:-64 80} --kv-dtype auto --frames 100 --warmup 10 --out "$LOGS/capacity_bf16.json"
      [ "${CAPACITY_FP8:-}" = none ] || run capacity-fp8 150 $BENCH capacity --random-7b \
        --batch-size ${CAPACITY_FP8:-112 128} --kv-dtype fp8 --frames 100 --warmup 10 --out "$LOGS/capacity_fp8.json" ;;
    fi-prefill)  # FlashInfer's paged prefill over the ring through position-ordered page lists (docs/PERFORMANCE.md)
      TAIL=8 run fi-prefill 150 python3 scripts/flashinfer_prefill.py ;;
    fp8)
      run fp8 90 python3 scripts/fp8_kv.py --random-7b --steps 500 --out "$LOGS/fp8_kv.json" ;;
    profile)
      TAIL=80 run profile 150 python3 scripts/perf_h200.py profile ;;
    tune-conv)
      TAIL=80 run tune-conv 150 python3 scripts/perf_h200.py tune-conv ;;
    pinned)
      TAIL=8 run pinned 120 python3 scripts/perf_h200.py pinned ;;
    tune-prefill)
      TAIL=40 run tune-prefill 200 python3 scripts/perf_h200.py tune-prefill ;;
    splits)  # the split attention kernels by split count and ring fill (scripts/attention_splits.py: C47, C50)
      TAIL=30 run splits 120 bash -c 'python3 scripts/attention_splits.py --kernels-only && python3 scripts/attention_splits.py --decode' ;;
    variants)  # A/B of engine variants in one call, in ROUNDS (default 2) rounds of alternating order: this tree
      # ("tree"), the engine before v2 ("before", fresh streams only) and .device/variants/NAME/src (a git archive of a
      # branch's packages/cspan-core/src). VARIANTS (optional) names them (default: tree, then every .device/variants
      # folder). Per variant and round: the fresh-stream table (B = 1, spans N, default "0 16 64 600") and, with
      # RING=1 (default), the full-ring B = 1 step with a 600-column span (RING_N, optional: the span lengths, default
      # "0 600"; RING_BATCHES, optional: also these batch sizes on full rings, the span into 1 session of the frame).
      # FRESH=0 skips the fresh-stream table.
      names=${VARIANTS:-tree $(cd .device/variants 2>/dev/null && ls -d */ | tr -d /)}
      for r in $(seq 1 "${ROUNDS:-2}"); do
        order=$names; [ $((r % 2)) -eq 0 ] && order=$(echo $names | tr ' ' '\n' | tac | tr '\n' ' ')
        for v in $order; do
          core=$PWD/packages/cspan-core/src bench=$BENCH fresh=--fresh ring=${RING:-1}
          [ -d ".device/variants/$v" ] && core=$PWD/.device/variants/$v/src
          if [ "$v" = before ]; then  # its bench timed fresh streams by default
            core=$BEFORE_PATH bench="python3 .device/before/scripts/perf_h200.py bench" fresh= ring=0
          fi
          vpath=/tmp/site:/tmp/fisite:$core:$PWD/packages/cspan-bench/src:$PWD/packages/cspan-backends/src
          [ "${FRESH:-1}" = 1 ] && TAIL=0 run "fresh-$v-$r" 120 env PYTHONPATH=$vpath $bench latency --random-7b $fresh --n ${N:-0 16 64 600} \
            --iters ${ITERS:-30} --warmup 5 --no-frame --out "$LOGS/latency_fresh_$v-$r.json"
          [ "$ring" = 1 ] && TAIL=0 run "ring-$v-$r" 120 env PYTHONPATH=$vpath $bench latency --random-7b --n ${RING_N:-0 600} \
            --iters 20 --warmup 3 --no-frame ${RING_BATCHES:+--batch-size $RING_BATCHES --span-sessions 1} \
            --out "$LOGS/latency_ring_$v-$r.json"
        done
      done ;;
    probe)  # the depformer's chain of products: one launch per product against one persistent CUDA kernel
      # (scripts/depformer_chain_probe.cu, built here with nvcc; 1, 8 and 16 codebooks)
      TAIL=24 run probe 150 bash -c 'export PATH=$PATH:/usr/local/cuda/bin; nvcc -O3 -std=c++17 -arch=sm_90a \
        -o /tmp/depformer_chain_probe scripts/depformer_chain_probe.cu && for c in 1 8 16; do /tmp/depformer_chain_probe $c 30; done' ;;
    cprobe)  # the depformer in clusters: 12 grid exchanges per codebook instead of 24
      # (scripts/depformer_cluster_probe.cu, built here with nvcc): 16 clusters of 4 on 64 SMs, the one form that
      # fits an H200 at once (16 of 8 and 32 of 4 do not: C116, C117), 8 and 16 codebooks; then the chain probe's
      # launch chain and persistent forms at 8 codebooks beside it (C118: the clusters lose)
      TAIL=60 run cprobe 240 bash -c 'export PATH=$PATH:/usr/local/cuda/bin; set -e; nvcc -O3 -std=c++17 \
        -arch=sm_90a -DCLUSTER=4 -DBLOCKS=64 -o /tmp/dcp scripts/depformer_cluster_probe.cu; nvcc -O3 -std=c++17 \
        -arch=sm_90a -o /tmp/depformer_chain_probe scripts/depformer_chain_probe.cu; for c in 8 16; do \
        /tmp/dcp $c 30; done; /tmp/depformer_chain_probe 8 30' ;;
    gemv)  # the temporal products at B = 1: cuBLAS against a hand-written GEMV with and without PDL
      # (scripts/temporal_gemv_probe.cu, built here with nvcc; libcublas from torch's nvidia wheels, opened at run time)
      libs=$(python3 -c 'import pathlib, torch; site = pathlib.Path(torch.__file__).parent.parent
roots = [site / "nvidia", site / "torch" / "lib", pathlib.Path("/usr/local/cuda/lib64")]
print(":".join(sorted({str(p.parent) for r in roots if r.exists() for p in r.rglob("libcublas.so*")
                       if "stubs" not in p.parts})))')
      TAIL=12 run gemv 120 bash -c "export PATH=\$PATH:/usr/local/cuda/bin; nvcc -O3 -std=c++17 -arch=sm_90a \
        -o /tmp/temporal_gemv_probe scripts/temporal_gemv_probe.cu -ldl && echo libcublas in: $libs && \
        LD_LIBRARY_PATH=$libs:\${LD_LIBRARY_PATH:-} /tmp/temporal_gemv_probe 20" ;;
    tgemv)  # the temporal step of 1 / 2 / 4 rows on full rings: the engine's cuBLAS products, norms and SiLU gate
      # against the same layers as fused.gemv launches with the norm, gate and residual inside, per GEMV config;
      # then the depformer's 48 layers of a served B = 1 step per GEMV config (scripts/temporal_gemv_sweep.py; the
      # engine path is branch exp/temporal-gemv: prepare-variant, then variants). TGEMV_ARGS: the first run's options
      TAIL=30 run tgemv 240 python3 scripts/temporal_gemv_sweep.py --iters 30 ${TGEMV_ARGS:-} --out "$LOGS/tgemv.json"
      TAIL=12 run tgemv-depformer 120 python3 scripts/temporal_gemv_sweep.py --model depformer --rows 1 --iters 30 \
        --out "$LOGS/tgemv_depformer.json" ;;
    *)
      echo "=== unknown stage $stage (see the header)"; failed=1 ;;
  esac
done
python3 scripts/perf_h200.py summary "$LOGS"
tar czf "$OUT/perf-logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
exit $failed
