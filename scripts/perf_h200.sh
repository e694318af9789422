#!/usr/bin/env bash
# One device call (see docs/PERFORMANCE.md): environment, ceilings, GPU tests, component breakdown, and
# `cspan bench latency --random-7b` with the fused kernels (default) and without them (CSPAN_FUSED=0: the eager
# modules of the current code; the "committed core before this work" of PERFORMANCE.md is the `orig` stage).
# Run from the repository root on the GPU machine with `.whl` and `.device` carried; logs go to $OUT.
# Preparing them here: `pip download --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64
# --platform manylinux_2_28_x86_64 -d .whl/perf pydantic soundfile soxr` and `cp -r ../shared/fixtures/reference
# .device/fixtures/` (both paths are git-ignored).
# Exits non-zero when a stage fails or is unknown (after running the others).
# Usage: bash scripts/perf_h200.sh [STAGES...]
#   stages: env tests breakdown profile tune-conv tune tune-prefill bench immediate nopdl unfused nogemv orig
#   (default: env tests breakdown bench unfused; keep one call under the device's 10-minute limit)
# orig: the same bench on an older core copied to .device/orig (git archive COMMIT packages/cspan-core/src).
set -u
OUT=${OUT:-/tmp/perf-out}
mkdir -p "$OUT"
stages=${*:-env tests breakdown bench unfused}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/perf/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/packages/cspan-core/src:$PWD/packages/cspan-bench/src:$PWD/packages/cspan-backends/src
export PYTHONUNBUFFERED=1
if [ -d .device/fixtures ]; then mkdir -p ../shared/fixtures && cp -r .device/fixtures/* ../shared/fixtures/; fi
failed=0
run() {  # name, command...: log to $OUT/name.log, print the tail
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  [ "$rc" -eq 0 ] || failed=1
}
for stage in $stages; do
  case $stage in
    env)
      run env bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv;
        python3 -c "import torch, triton; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__)";
        date -u +%FT%TZ; python3 scripts/perf_h200.py ceilings' ;;
    tests)
      TAIL=12 run tests python3 -m pytest tests/core/test_core_fused_cuda.py tests/core/test_core_engine_cuda.py \
        tests/core/test_core_lm_cuda_graph.py tests/core/test_core_mimi.py -m gpu -q -p no:cacheprovider ;;
    breakdown)
      TAIL=80 run breakdown python3 scripts/perf_h200.py breakdown ;;
    profile)
      TAIL=150 run profile python3 scripts/perf_h200.py profile ;;
    tune-conv)
      TAIL=80 run tune-conv python3 scripts/perf_h200.py tune-conv ;;
    tune)
      TAIL=60 run tune python3 scripts/perf_h200.py tune ;;
    tune-prefill)
      TAIL=40 run tune-prefill python3 scripts/perf_h200.py tune-prefill ;;
    immediate)
      TAIL=12 run immediate python3 scripts/perf_h200.py bench latency --random-7b --n 16 64 256 600 --iters 50 \
        --warmup 5 --no-frame --no-defer-spans --out "$OUT/latency_immediate.json" ;;
    nopdl)
      TAIL=20 CSPAN_PDL=0 run nopdl python3 scripts/perf_h200.py bench latency --random-7b --iters 50 --warmup 5 \
        --out "$OUT/latency_nopdl.json" ;;
    bench)
      TAIL=40 run bench python3 scripts/perf_h200.py bench latency --random-7b --batch-size 8 32 --out "$OUT/latency.json" ;;
    unfused)
      TAIL=20 CSPAN_FUSED=0 run unfused python3 scripts/perf_h200.py bench latency --random-7b --n 0 16 600 --iters 30 \
        --warmup 5 --batch-size 32 --out "$OUT/latency_unfused.json" ;;
    nogemv)
      TAIL=12 CSPAN_GEMV=0 run nogemv python3 scripts/perf_h200.py bench latency --random-7b --n 0 16 --iters 50 \
        --no-frame --out "$OUT/latency_nogemv.json" ;;
    orig)
      TAIL=20 PYTHONPATH=/tmp/site:$PWD/.device/orig/packages/cspan-core/src:$PWD/packages/cspan-bench/src run orig \
        python3 scripts/perf_h200.py bench latency --random-7b --iters 30 --warmup 5 --batch-size 8 32 \
        --out "$OUT/latency_orig.json" ;;
    *)
      echo "=== unknown stage $stage (see the header)"; failed=1 ;;
  esac
done
exit $failed
