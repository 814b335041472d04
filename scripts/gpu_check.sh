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
# 4. accel-kernels/examples/device_bench.rs: one JSON line, GB/s vs peak and vs memcpy;
# 5. DDP buckets and the parameter broadcast on CUDA tensors of one GPU shared by two
#    processes over TCP (staged through host memory), f32/bf16/f16, with compression;
# 6. the example GPT (train_gpt) on cuda:0 in fp32, bf16 and fp16 (loss scaling) against the
#    same run on the CPU: per-step losses within 5% (fp32) / 15% (bf16, fp16);
# 7. hf_logits on the Llama fixture with a GPU budget smaller than the model
#    (`--max-memory 0=60KB,cpu=90KB,disk=1GB`): GPU, CPU and disk placements, logits
#    within 1e-4 of the plain CPU run;
# 8. bench_train's GPT workload on cuda:0, and torch's on the same GPU when torch is there.
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

EXAMPLES=(-p accel-examples --features accel-examples/cuda --release --example train_gpt --example hf_logits --example bench_train)
if [ -z "${GPU_CHECK_SKIP_BUILD:-}" ]; then
  run_step build 3000 cargo test "${PKGS[@]}" --no-run
  run_step build-bench 1200 cargo build "${PKGS[@]}" --examples
  run_step build-examples 1200 cargo build "${EXAMPLES[@]}"
fi
BIN="$CARGO_TARGET_DIR/release/examples"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
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
run_step ddp-shared-gpu 240 cargo test "${PKGS[@]}" --test collectives ddp_buckets_on_one_gpu -- --include-ignored --nocapture

# 6. Loss curves: the CPU run is the reference.
gpt_curves() {
  local steps=40
  "$BIN/train_gpt" --cpu --steps $steps --out "$WORK/gpt_cpu" >/dev/null || return 1
  for mp in no bf16 fp16; do
    "$BIN/train_gpt" --steps $steps --mixed-precision $mp --out "$WORK/gpt_$mp" >/dev/null || return 1
  done
  python3 - "$WORK" <<'PY'
import glob, json, sys
def losses(run):
    path = glob.glob(f"{sys.argv[1]}/{run}/**/metrics.jsonl", recursive=True)[0]
    rows = [json.loads(l) for l in open(path)]
    return [r["loss"] for r in rows if "loss" in r]
cpu = losses("gpt_cpu")
ok = True
for mp, tol in [("no", 0.05), ("bf16", 0.15), ("fp16", 0.15)]:
    gpu = losses(f"gpt_{mp}")
    worst = max(abs(g - c) / c for g, c in zip(gpu, cpu))
    good = len(gpu) == len(cpu) and worst <= tol
    ok &= good
    print(json.dumps({"mixed_precision": mp, "steps": len(gpu), "first_loss": gpu[0],
                      "last_loss": gpu[-1], "cpu_last_loss": cpu[-1],
                      "max_rel_diff_vs_cpu": round(worst, 4), "tolerance": tol, "ok": good}))
sys.exit(0 if ok else 1)
PY
}
run_step gpt-cuda 600 gpt_curves

# 7. Offload with a GPU budget smaller than the model.
offload_gpu() {
  local model=tests/fixtures/hf/llama ids=1,17,42
  "$BIN/hf_logits" --model $model --input-ids $ids > "$WORK/plain.json" || return 1
  "$BIN/hf_logits" --model $model --input-ids $ids --max-memory 0=60KB,cpu=90KB,disk=1GB \
    --offload-folder "$WORK/offload" > "$WORK/gpu.json" || return 1
  python3 - "$WORK" <<'PY'
import json, sys
plain = json.load(open(f"{sys.argv[1]}/plain.json"))
gpu = json.load(open(f"{sys.argv[1]}/gpu.json"))
places = sorted(set(map(str, gpu["device_map"].values())))
diff = max(abs(a - b) for ra, rb in zip(plain["logits"], gpu["logits"]) for a, b in zip(ra, rb))
ok = diff <= 1e-4 and {"0", "cpu", "disk"} <= set(places)
print(json.dumps({"placements": places, "max_abs_diff": diff, "ok": ok}))
sys.exit(0 if ok else 1)
PY
}
run_step offload-gpu 300 offload_gpu

# 8. One GPT step on the GPU, accel-rs against torch (when importable) in the same run.
run_step bench-gpu 600 bash -c "'$BIN/bench_train' --device cuda --only gpt --rounds 3 --json | tee '$CARGO_TARGET_DIR/bench_train_cuda.json'"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
[ -s "$BENCH_JSON" ] && echo "bench JSON: $BENCH_JSON"
exit $status
