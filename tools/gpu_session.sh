#!/usr/bin/env bash
# One call on the H200 (device tool): GPU tests, then the benchmark.
#
#   here:   ../shared/gpu/anchor-wheels.sh        # tokamax wheels -> .whl/
#           python3 -m pip download --no-deps --only-binary=:all: \
#             --python-version 3.12 --implementation cp \
#             --platform manylinux_2_17_x86_64 -d .whl pytest-xdist==3.8.0
#   device: bash tools/gpu_session.sh tests|bench|all|sweep|gpt [args...]
#           bash tools/gpu_session.sh stages PLAN.sh
#           (carry .whl; results land in $OUT)
#
# "stages" sources PLAN.sh (committed, e.g. tools/plans/, so that a plan
# outlives the session that wrote it), which calls
#   test_stage NAME SECONDS [pytest args...]    # -m gpu, xdist, -v
#   bench_stage NAME SECONDS [bench args...]    # python -m jaxflash.bench
# in order.  Each stage writes $OUT/logs/NAME.*, prints its summary (the
# bench's tables) and re-tars $OUT/logs into $OUT/logs.tgz, so that a
# call stopped by its limit still brings back every finished stage (a
# call returns few files: read the tarball).
set -u
what=${1:-all}; shift || true
out=${OUT:-out}; mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target .site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD/.site:$PWD/.whl/stub:$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# JAXFLASH_COMMIT: the commit of this tree (a copied .git may be stale).
echo "${JAXFLASH_COMMIT:-$(git log --oneline -1 2>/dev/null)}" \
  | tee "$out/commit.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
if [ "$what" = tests ] || [ "$what" = all ]; then
  # XDIST=0 for tests that use every GPU (tests/test_multigpu.py).
  n=${XDIST:-8}; python3 -c 'import xdist' 2>/dev/null || n=0
  # -v: one line per finished test, so a run stopped by the timeout still
  # says which tests passed.  TESTS picks files (default: all of tests/),
  # PYTEST_K a -k expression (default: every gpu test of those files).
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m gpu ${TESTS:-tests} \
    ${PYTEST_K:+-k "$PYTEST_K"} \
    -p no:benchmark -p no:cacheprovider -n "$n" -rfE --durations=15 -v \
    > "$out/gpu_tests.log" 2>&1
  echo "pytest rc=$?"
  echo "passed: $(grep -c ' PASSED' "$out/gpu_tests.log")" \
    "failed: $(grep -c ' FAILED' "$out/gpu_tests.log")" \
    "skipped: $(grep -c ' SKIPPED' "$out/gpu_tests.log")"
  grep -E "^(FAILED|ERROR)|passed|failed" "$out/gpu_tests.log" | tail -25
fi
if [ "$what" = sweep ]; then
  timeout "${SWEEP_TIMEOUT:-300}" python3 tools/mosaic_sweep.py --out "$out" \
    "$@" > "$out/sweep.log" 2>&1
  echo "sweep rc=$?"
  sed -n '/^best per/,$p' "$out/sweep.log"
fi
if [ "$what" = gpt ]; then
  # The training runs write logs, plots and checkpoints per run: keep them
  # off $OUT (a call returns few files) and bring back the two tables.
  tag=${GPT_TAG:-gpt}
  timeout "${GPT_TIMEOUT:-540}" python3 examples/gpt/compare.py \
    --out "/tmp/$tag" "$@" > "$out/$tag.log" 2>&1
  echo "gpt rc=$?"
  cp "/tmp/$tag/gpt-compare.json" "$out/$tag.json"
  cp "/tmp/$tag/gpt-compare.md" "$out/$tag.md" && cat "$out/$tag.md"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${BENCH_TIMEOUT:-540}" python3 -m jaxflash.bench --out "$out" \
    --name bench "$@" 2> "$out/bench.err"
  echo "bench rc=$?"
  tail -3 "$out/bench.err"
fi
if [ "$what" = stages ]; then
  plan=${1:?usage: gpu_session.sh stages PLAN.sh}
  mkdir -p "$out/logs"
  pack() { tar czf "$out/logs.tgz" -C "$out" logs; }
  test_stage() {
    local name=$1 limit=$2; shift 2; local t0=$SECONDS
    local n=${XDIST:-8}; python3 -c 'import xdist' 2>/dev/null || n=0
    timeout "$limit" python3 -m pytest -m gpu -p no:benchmark \
      -p no:cacheprovider -n "$n" -rfE --durations=10 -v "$@" \
      > "$out/logs/$name.log" 2>&1
    echo "== $name rc=$? $((SECONDS - t0))s" \
      "passed: $(grep -c ' PASSED' "$out/logs/$name.log")" \
      "failed: $(grep -c ' FAILED' "$out/logs/$name.log")" \
      "skipped: $(grep -c ' SKIPPED' "$out/logs/$name.log")"
    grep -E "^(FAILED|ERROR)" "$out/logs/$name.log" | head -20
    pack
  }
  bench_stage() {
    local name=$1 limit=$2; shift 2; local t0=$SECONDS
    timeout "$limit" python3 -m jaxflash.bench --out "$out/logs" \
      --name "$name" "$@" > "$out/logs/$name.out" 2> "$out/logs/$name.err"
    echo "== $name rc=$? $((SECONDS - t0))s"
    # The tables (results, paired ratios, same-program rows).
    sed -n '/^head_dim/,$p' "$out/logs/$name.out" | grep -v '^wrote '
    pack
  }
  # shellcheck source=/dev/null
  . "$plan"
fi
