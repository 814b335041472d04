#!/usr/bin/env bash
# GPU checks in one go, on a machine with an NVIDIA GPU, a CUDA toolkit (nvcc, for
# candle's kernels) and the CUDA/NCCL libraries (libcuda, libnvrtc, libcublas(Lt),
# libcurand, libcudart, libnccl):
#
#   scripts/gpu_check.sh            # build, then tests + bench; prints a summary
#   GPU_CHECK_SKIP_BUILD=1 scripts/gpu_check.sh   # reuse the last build
#
# 1. builds accel-kernels (feature cuda) and accel-dist (feature nccl): tests + examples;
# 2. accel-kernels/tests/cuda.rs: casts bit for bit against candle's to_dtype (all 65536
#    bf16/f16 patterns, f32 specials), unscale flag, in-place and optimizer ops vs CPU;
#    plus the NVRTC-only source check;
# 3. accel-dist/tests/nccl.rs: NCCL init + every collective (world 1; world 2 with 2 GPUs);
#    accel-bigmodel: cpu_offload_with_hook evicts the previous model from the GPU;
#    accel-core: set_seed seeds candle's CUDA generator;
# 4. accel-kernels/examples/device_bench.rs: one JSON line, GB/s vs peak and vs memcpy.
# After the build the steps take well under 10 minutes (each is bounded by `timeout`).
# The CUDA/NCCL tests are #[ignore]d in ordinary runs and run here with --include-ignored;
# without a visible GPU they fail (they never pass silently).
set -uo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
PKGS=(-p accel-kernels -p accel-dist --features accel-dist/nccl --release)

if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda/bin /opt/cuda/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH"; done
fi
command -v nvcc >/dev/null || { echo "gpu_check: nvcc not found (candle-kernels needs it); install a CUDA toolkit or source <(scripts/cuda_toolchain.sh)" >&2; exit 2; }
if [ -z "${CUDA_COMPUTE_CAP:-}" ] && command -v nvidia-smi >/dev/null; then
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.[:space:]')
  [ -n "$cap" ] && export CUDA_COMPUTE_CAP=$cap
fi
echo "gpu_check: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1); nvcc $(nvcc --version | tail -1)"
echo "gpu_check: CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-unset} CARGO_TARGET_DIR=$CARGO_TARGET_DIR"

declare -a SUMMARY
status=0
run_step() { # name timeout_s command...
  local name=$1 limit=$2; shift 2
  local log="$CARGO_TARGET_DIR/gpu_check.$name.log"
  local start=$SECONDS
  echo "=== $name"
  timeout "$limit" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local skips; skips=$(grep -c "skipped" "$log" || true)
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict="FAIL(rc=$rc)" && status=1
  SUMMARY+=("$(printf '%-14s %-12s %4ss  skipped-notes=%s  log=%s' "$name" "$verdict" $((SECONDS - start)) "$skips" "$log")")
}

if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ]; then
  run_step build 3000 cargo test "${PKGS[@]}" --no-run
  run_step build-bench 1200 cargo build "${PKGS[@]}" --examples
fi
run_step kernels-test 240 cargo test "${PKGS[@]}" --test cuda -- --include-ignored --nocapture --test-threads=1
# The GPU tests are #[ignore]d (a CPU run must not count them as passed); run them here.
NCCL_SKIP=()
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "gpu_check: $gpus GPU(s): two_ranks_on_two_gpus_reduce_and_gather is not run (needs two)"
  NCCL_SKIP=(--skip two_ranks_on_two_gpus)
fi
run_step nccl-test 180 cargo test "${PKGS[@]}" --test nccl -- --include-ignored "${NCCL_SKIP[@]}" --nocapture --test-threads=1
run_step unit-tests 240 cargo test "${PKGS[@]}" --lib -- --include-ignored
run_step nn-hooks-test 900 cargo test -p accel-nn --features cuda --release --lib cpu_offload_with_hook -- --include-ignored
run_step core-test 900 cargo test -p accel-core --features cuda --release --lib set_seed_makes_cuda_randn_repeat -- --include-ignored
BENCH_JSON="$CARGO_TARGET_DIR/device_bench.json"
run_step device-bench 180 bash -c "'$CARGO_TARGET_DIR/release/examples/device_bench' | tee '$BENCH_JSON'"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
[ -s "$BENCH_JSON" ] && echo "bench JSON: $BENCH_JSON"
exit $status
