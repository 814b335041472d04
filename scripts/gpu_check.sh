#!/usr/bin/env bash
# GPU checks in one go. Three ways to run it:
#
#   scripts/gpu_check.sh              # a GPU machine with Rust and a CUDA toolkit: build, then check
#   scripts/gpu_check.sh build DIR    # any x86-64 Linux machine: build, pack the binaries into DIR
#   scripts/gpu_check.sh run DIR      # the GPU machine (no Rust needed): unpack DIR, then check
#
# `build` compiles candle's kernels with a real nvcc (scripts/cuda_toolchain.sh installs one from
# PyPI) and links against the CUDA libraries' pip wheels (PyPI ships no libcuda, so a stub with
# the driver API's names stands in for it at link time; the machine's driver is what loads). The
# binaries are linked with lazy binding, so a function the GPU machine's NCCL lacks fails only if
# called. `run` finds libcuda, libnvrtc, libcublas(Lt), libcurand, libcudart and libnccl on the GPU machine
# (ldconfig, the CUDA toolkit, the Python `nvidia` packages) and makes the build's repository
# path point at this checkout (the test binaries hold absolute paths to fixtures and helpers).
#
# The checks (each bounded by `timeout`; a summary line each at the end):
# 1. accel-kernels/tests/cuda.rs: casts bit for bit against candle's to_dtype (all 65536
#    bf16/f16 patterns, f32 specials), unscale flag, in-place and optimizer ops vs CPU, a kernel
#    write seen by another thread's stream, freed memory kept until empty_cache; plus the NVRTC
#    source check (accel-kernels lib);
# 2. accel-kernels/examples/device_bench.rs: one JSON line, GB/s vs peak and vs memcpy;
# 3. accel-dist/tests/nccl.rs: NCCL init + every collective (world 1; world 2 with 2 GPUs);
#    accel-nn: cpu_offload_with_hook evicts the previous model from the GPU; the CUDA layer
#    norm and RMS norm kernels against the composed ops and the CPU kernel's gradients;
#    the patched candle-nn's fused-op backward on CUDA against the CPU's (nn-cuda-candle-grads);
#    the activation, rope, softmax and loss kernels (nn-cuda-activations) and the tiled attention
#    kernels (nn-cuda-attention) against the CPU kernels and their gradients; the 4-bit and
#    8-bit products of quant.cu against the CPU kernels (nn-cuda-quant);
#    accel-core: set_seed seeds candle's CUDA generator;
# 4. DDP buckets and the parameter broadcast on CUDA tensors of one GPU shared by two
#    processes over TCP (staged through host memory), f32/bf16/f16, with compression;
# 5. the example GPT (train_gpt) on cuda:0 in fp32, bf16 and fp16 (loss scaling) against the
#    same run on the CPU: per-step losses within 0.1% (fp32) / 5% (bf16, fp16); candle-transformers'
#    Llama (finetune_candle) likewise in fp32 and bf16, every parameter with a gradient (candle-cuda);
# 6. hf_logits on the Llama fixture with a GPU budget smaller than the model
#    (`--max-memory 0=60KB,cpu=90KB,disk=1GB`): GPU, CPU and disk placements, logits
#    within 1e-4 of the plain CPU run;
# 7. the Llama, Llama 3, Mistral, Qwen2 and GPT-2 fixtures wholly on the GPU: logits within 1e-4
#    of transformers' and greedy tokens equal to its `generate`; finetune_hf on the GPU in fp32,
#    bf16 and fp16 against the CPU run (fp32 within 1e-4, the others 5%);
# 8. bench_train's GPT workload on cuda:0, and torch's on the same GPU when torch is there; then
#    profile_gpt on the tracked and untracked devices alternating in one process, with the host's
#    share of each step (profile-gpu); GPT-2 124M in bf16 against torch (bench-gpt2); causal attention
#    at GPT-2's shape against torch's SDPA (bench-attention).
# The CUDA/NCCL tests are #[ignore]d in ordinary runs and run here with --ignored; without a
# visible GPU they fail (they never pass silently). Logs go to $GPU_CHECK_LOGS (default: the
# target dir), so a device tool can bring them back; GPU_CHECK_ONLY="gpt-cuda bench-gpu" runs
# only the steps named.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=${1:-all}
BUNDLE=${2:-}
case $MODE in
  all) ;;
  build|run) [ -n "$BUNDLE" ] || { echo "gpu_check: $MODE needs a bundle folder" >&2; exit 2; } ;;
  *) echo "gpu_check: unknown mode '$MODE' (all, build DIR, run DIR)" >&2; exit 2 ;;
esac
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
[ "$MODE" = all ] || export CARGO_TARGET_DIR=$ROOT/target/gpu
FEATURES=accel-core/nccl
# The CUDA libraries the binaries link (libcuda.so.1 comes from the driver; at build time a stub).
CUDA_LIBS=(libnvrtc.so.13 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 libnccl.so.2 libcudart.so.13)
MANIFEST=$CARGO_TARGET_DIR/gpu_check.bins

# ------------------------------------------------------------------------------------ build
toolchain() {
  if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /opt/cuda/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH"; done
  fi
  if ! command -v nvcc >/dev/null || [ "$MODE" = build ]; then
    local env; env=$(scripts/cuda_toolchain.sh) || return 1
    eval "$env"
  fi
  if [ -z "${CUDA_COMPUTE_CAP:-}" ] && command -v nvidia-smi >/dev/null; then
    local cap; cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '.[:space:]')
    [ -n "$cap" ] && export CUDA_COMPUTE_CAP=$cap
  fi
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
  echo "gpu_check: nvcc $(nvcc --version | tail -1); CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
}

# Link-time stand-ins for a machine without a GPU: the wheels' libraries, and a libcuda stub.
link_libs() {
  local dir=$CARGO_TARGET_DIR/cudalink wheels=$CARGO_TARGET_DIR/cudalink.wheels
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir" && mkdir -p "$dir" "$wheels" || return 1
    python3 -m pip download --quiet --no-deps -d "$wheels" "nvidia-cuda-nvrtc==13.0.*" \
      "nvidia-curand>=10.4,<10.5" "nvidia-cublas==13.0.*" "nvidia-nccl-cu13" "nvidia-cuda-runtime==13.0.*" || return 1
    local w; for w in "$wheels"/*.whl; do unzip -q -o "$w" 'nvidia/*/lib/*' -d "$wheels/x" || return 1; done
    local so; for so in "${CUDA_LIBS[@]}"; do
      cp "$(find "$wheels/x" -name "$so" | head -1)" "$dir/" && ln -sf "$so" "$dir/${so%%.so*}.so" || return 1
    done
    local sys; sys=$(find ~/.cargo/registry/src -path '*cudarc-*/src/driver/sys' -type d | sort | tail -1)
    grep -oh "fn cu[A-Za-z0-9_]*" -r "$sys" | sort -u | sed 's/^fn \(.*\)/void \1(void){}/' > "$dir/cuda_stub.c"
    cc -shared -fPIC -o "$dir/libcuda.so" -Wl,-soname,libcuda.so.1 "$dir/cuda_stub.c" || return 1
    rm -rf "$wheels"
    touch "$dir/.complete"
  fi
  export RUSTFLAGS="-L native=$dir -C link-arg=-Wl,-rpath-link,$dir -C link-arg=-Wl,--allow-shlib-undefined -C link-arg=-Wl,-z,lazy"
}

# Builds every binary the checks run and lists them in $MANIFEST: "name<TAB>path<TAB>cwd".
build() {
  toolchain || return 1
  [ "$MODE" = build ] && { link_libs || return 1; export CARGO_PROFILE_RELEASE_DEBUG=0; }
  local json=$CARGO_TARGET_DIR/gpu_check.build.json
  mkdir -p "$CARGO_TARGET_DIR"
  cargo test --release -p accel-kernels -p accel-dist -p accel-nn -p accel-core --features "$FEATURES" \
    --no-run --lib --test cuda --test nccl --test collectives --message-format=json-render-diagnostics > "$json" || return 1
  cargo build --release -p accel-examples -p accel-kernels --features "$FEATURES,accel-examples/cuda" --example train_gpt \
    --example hf_logits --example bench_train --example device_bench --example generate --example finetune_hf \
    --example profile_gpt --example finetune_candle --example bench_attention \
    --message-format=json-render-diagnostics >> "$json" || return 1
  python3 - "$json" "$MANIFEST" <<'PY' || return 1
import json, os, sys
NEEDED = {"cuda.test", "nccl.test", "collectives.test", "dist_worker.bin", "accel_kernels.lib",
          "accel_nn.lib", "accel_core.lib", "device_bench.example", "train_gpt.example",
          "hf_logits.example", "bench_train.example", "generate.example", "profile_gpt.example",
          "finetune_hf.example", "finetune_candle.example", "bench_attention.example"}
rows = {}
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    t = m["target"]
    name = f'{t["name"]}.{t["kind"][0]}'
    if name not in NEEDED:
        continue
    rows[name] = (m["executable"], os.path.dirname(m["manifest_path"]))
with open(sys.argv[2], "w") as f:
    for name, (exe, cwd) in sorted(rows.items()):
        f.write(f"{name}\t{exe}\t{cwd}\n")
missing = NEEDED - set(rows)
if missing:
    sys.exit(f"gpu_check: the build made no {', '.join(sorted(missing))}")
print("gpu_check: built " + ", ".join(sorted(rows)))
PY
}

if [ "$MODE" != run ]; then
  build || { echo "gpu_check: build failed" >&2; exit 1; }
fi
if [ "$MODE" = build ]; then
  mkdir -p "$BUNDLE"
  list=$(mktemp)
  echo "$MANIFEST" > "$list"
  cut -f2 "$MANIFEST" >> "$list"
  sed -i "s|^$ROOT/||" "$list"
  tar -C "$ROOT" -cf - -T "$list" | zstd -q -T0 -19 --long=31 -f -o "$BUNDLE/bundle.tar.zst" || exit 1
  echo "$ROOT" > "$BUNDLE/build_root"
  # The GPU machine may lack zstd: a copy with its libraries (not libc) goes along.
  mkdir -p "$BUNDLE/zstd" && cp "$(command -v zstd)" "$BUNDLE/zstd/" || exit 1
  ldd "$(command -v zstd)" | awk '$3 ~ /^\// && $1 !~ /^(libc|ld-linux)/ { print $3 }' | xargs -r cp -L -t "$BUNDLE/zstd/"
  rm -f "$list"
  echo "gpu_check: $(du -h "$BUNDLE/bundle.tar.zst" | cut -f1) in $BUNDLE (run: scripts/gpu_check.sh run $BUNDLE)"
  exit 0
fi

# -------------------------------------------------------------------------------------- run
if [ "$MODE" = run ]; then
  built=$(cat "$BUNDLE/build_root")
  # The binaries hold absolute paths under the build's checkout (fixtures, helper binaries).
  if [ "$built" != "$ROOT" ]; then
    if [ -e "$built" ] && [ "$(cd "$built" && pwd -P)" != "$(pwd -P)" ]; then
      echo "gpu_check: $built exists and is not this checkout; run from a checkout there" >&2; exit 2
    fi
    mkdir -p "$(dirname "$built")" && ln -sfn "$ROOT" "$built"
  fi
  unzstd=(zstd)
  command -v zstd >/dev/null || unzstd=(env "LD_LIBRARY_PATH=$BUNDLE/zstd" "$BUNDLE/zstd/zstd")
  "${unzstd[@]}" -q -d --long=31 -c "$BUNDLE/bundle.tar.zst" | tar -C "$ROOT" -xf - || exit 1
  # The CUDA libraries: the driver's, the toolkit's, or the Python wheels'.
  py_nvidia=$(python3 -c 'import nvidia, os; print(" ".join(nvidia.__path__))' 2>/dev/null || true)
  for so in libcuda.so.1 "${CUDA_LIBS[@]}"; do
    ldconfig -p 2>/dev/null | grep -q "$so " && continue
    hit=$(find /usr/local/nvidia /usr/local/cuda* /usr/lib/x86_64-linux-gnu $py_nvidia -name "$so" 2>/dev/null | head -1)
    if [ -n "$hit" ]; then export LD_LIBRARY_PATH=$(dirname "$hit")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    else echo "gpu_check: $so not found"; fi
  done
  echo "gpu_check: LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
fi
echo "gpu_check: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1)"
LOGS=${GPU_CHECK_LOGS:-$CARGO_TARGET_DIR}
mkdir -p "$LOGS"
bin() { awk -F'\t' -v n="$1" '$1 == n { print $2 }' "$MANIFEST"; }
cwd() { awk -F'\t' -v n="$1" '$1 == n { print $3 }' "$MANIFEST"; }
# A test binary run as cargo runs it: from its package's folder.
test_bin() { local name=$1; shift; (cd "$(cwd "$name")" && "$(bin "$name")" "$@"); }
export -f bin cwd test_bin
ldd "$(bin device_bench.example)" | grep -E "cuda|nvrtc|cublas|curand|nccl|not found"

declare -a SUMMARY
status=0
run_step() { # name timeout_s command...
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then return 0; fi
  local log="$LOGS/gpu_check.$name.log"
  local start=$SECONDS
  echo "=== $name"
  # `timeout` runs programs, not shell functions: the steps run in a child bash, which gets
  # the functions and variables exported below.
  timeout "$limit" bash -c '"$@"' "$name" "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local verdict=PASS
  [ "$rc" -ne 0 ] && verdict="FAIL(rc=$rc)" && status=1
  SUMMARY+=("$(printf '%-14s %-12s %4ss  log=%s' "$name" "$verdict" $((SECONDS - start)) "$log")")
}

BIN_DIR=$(dirname "$(bin train_gpt.example)")
WORK=$(mktemp -d)
export MANIFEST BIN_DIR WORK LOGS
trap 'rm -rf "$WORK"' EXIT
BENCH_JSON="$LOGS/device_bench.json"

# 1-2. Kernels, then their bandwidth.
run_step kernels-test 180 test_bin cuda.test --include-ignored --test-threads=1
run_step nvrtc-test 60 test_bin accel_kernels.lib --ignored
run_step device-bench 120 bash -c "set -o pipefail; '$(bin device_bench.example)' | tee '$BENCH_JSON'"

# 3. NCCL at the GPUs there are; the GPU tests of accel-nn and accel-core.
NCCL_SKIP=()
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "gpu_check: $gpus GPU(s): two_ranks_on_two_gpus_reduce_and_gather is not run (needs two)"
  NCCL_SKIP=(--skip two_ranks_on_two_gpus)
fi
run_step nccl-test 120 test_bin nccl.test --include-ignored "${NCCL_SKIP[@]}" --nocapture --test-threads=1
run_step nn-hooks-test 60 test_bin accel_nn.lib --ignored cpu_offload_with_hook
run_step nn-cuda-norms 60 test_bin accel_nn.lib --ignored cuda_norms
run_step nn-cuda-activations 60 test_bin accel_nn.lib --ignored cuda_swiglu cuda_activations cuda_rope cuda_softmax cuda_cross_entropy cuda_linear_cross_entropy
run_step nn-cuda-attention 120 test_bin accel_nn.lib --ignored cuda_attention
run_step nn-cuda-quant 60 test_bin accel_nn.lib --ignored cuda_quantized
run_step nn-cuda-candle-grads 60 test_bin accel_nn.lib --ignored cuda_candle_nn_backward
run_step core-test 60 test_bin accel_core.lib --ignored set_seed_makes_cuda_randn_repeat

# 4. Two processes on one GPU over TCP.
run_step ddp-shared-gpu 120 test_bin collectives.test --ignored ddp_buckets_on_one_gpu --nocapture

# 5. Loss curves: the CPU run of the same precision is the reference (fp16's loss scaler skips
# the same steps there; against fp32 it differs by up to 75% for a few steps after the skip).
gpt_curves() {
  local steps=40 mp
  for mp in no bf16 fp16; do
    "$BIN_DIR/train_gpt" --cpu --steps $steps --mixed-precision $mp --out "$WORK/gpt_cpu_$mp" >/dev/null || return 1
    "$BIN_DIR/train_gpt" --steps $steps --mixed-precision $mp --out "$WORK/gpt_$mp" >/dev/null || return 1
  done
  python3 - "$WORK" <<'PY'
import glob, json, sys
def losses(run):
    path = glob.glob(f"{sys.argv[1]}/{run}/**/metrics.jsonl", recursive=True)[0]
    rows = [json.loads(l) for l in open(path)]
    # The JSONL tracker's rows: {"step": k, "values": {"loss": ..., "lr": ...}, "wall_time": ...}.
    return [r["values"]["loss"] for r in rows if "loss" in r.get("values", {})]
def worst(a, b):
    return max(abs(x - y) / y for x, y in zip(a, b))
fp32 = losses("gpt_cpu_no")
ok = True
for mp, tol in [("no", 1e-3), ("bf16", 0.05), ("fp16", 0.05)]:
    gpu, cpu = losses(f"gpt_{mp}"), losses(f"gpt_cpu_{mp}")
    good = len(gpu) == len(cpu) == len(fp32) and worst(gpu, cpu) <= tol
    ok &= good
    print(json.dumps({"mixed_precision": mp, "steps": len(gpu), "first_loss": gpu[0],
                      "last_loss": gpu[-1], "cpu_last_loss": cpu[-1],
                      "max_rel_diff_vs_cpu": round(worst(gpu, cpu), 5), "tolerance": tol,
                      "max_rel_diff_vs_cpu_fp32": round(worst(gpu, fp32), 4), "ok": good}))
sys.exit(0 if ok else 1)
PY
}
export -f gpt_curves

# 5b. candle-transformers' Llama (the patched candle-nn's fused ops and their composed backward)
# fine-tuned on cuda:0 against the same run on the CPU: every parameter with a gradient, losses
# within 1e-3 (fp32) / 5% (bf16).
candle_curves() {
  local mp fixture=$ROOT/tests/fixtures/hf/llama
  for mp in no bf16; do
    ACCELERATE_USE_CPU=1 "$BIN_DIR/finetune_candle" --model llama --model-dir "$fixture" --steps 8 \
      --mixed-precision $mp --json > "$WORK/candle_cpu_$mp.jsonl" || return 1
    "$BIN_DIR/finetune_candle" --model llama --model-dir "$fixture" --steps 8 \
      --mixed-precision $mp --json > "$WORK/candle_gpu_$mp.jsonl" || return 1
  done
  python3 - "$WORK" <<'PY'
import json, sys
ok = True
for mp, tol in [("no", 1e-3), ("bf16", 0.05)]:
    gpu, cpu = ([json.loads(l) for l in open(f"{sys.argv[1]}/candle_{d}_{mp}.jsonl")] for d in ("gpu", "cpu"))
    worst = max(abs(g["loss"] - c["loss"]) / c["loss"] for g, c in zip(gpu, cpu))
    grads = all(s["with_grad"] == s["params"] for s in gpu)
    good = len(gpu) == len(cpu) == 8 and worst <= tol and grads
    ok &= good
    print(json.dumps({"mixed_precision": mp, "first_loss": gpu[0]["loss"], "last_loss": gpu[-1]["loss"],
                      "max_rel_diff_vs_cpu": round(worst, 6), "every_parameter_has_a_gradient": grads,
                      "tolerance": tol, "ok": good}))
sys.exit(0 if ok else 1)
PY
}
export -f candle_curves
run_step gpt-cuda 240 gpt_curves
run_step candle-cuda 120 candle_curves

# 6. Offload with a GPU budget smaller than the model.
offload_gpu() {
  local model=tests/fixtures/hf/llama ids=1,17,42
  "$BIN_DIR/hf_logits" --model $model --input-ids $ids > "$WORK/plain.json" || return 1
  "$BIN_DIR/hf_logits" --model $model --input-ids $ids --max-memory 0=60KB,cpu=90KB,disk=1GB \
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
export -f offload_gpu
run_step offload-gpu 120 offload_gpu

# 7. The Hugging Face fixtures wholly on the GPU: logits and greedy tokens against transformers'
# (reference.json), and fine-tuning on the GPU against the same run on the CPU.
export HF_GPU=${HF_GPU:-0=1GB}
hf_gpu() {
  local m ok=0
  for m in llama llama3 mistral qwen2 gpt2; do
    "$BIN_DIR/hf_logits" --model tests/fixtures/hf/$m --input-ids 1,17,42,5,99,63,7 \
      --max-memory "$HF_GPU" > "$WORK/logits_$m.json" || return 1
    "$BIN_DIR/generate" --model tests/fixtures/hf/$m --prompt-ids 1,17,42,5,99,63,7 \
      --max-new-tokens 8 --ignore-eos --max-memory "$HF_GPU" > "$WORK/generate_$m.json" || return 1
  done
  local data=$WORK/ids.json
  python3 -c "import json; print(json.dumps(json.load(open('tests/fixtures/hf/llama/reference.json'))['input_ids']))" > "$data"
  local ft=(--model tests/fixtures/hf/llama --data-ids "$data" --steps 4 --lr 1e-2 --json)
  ACCELERATE_USE_CPU=1 "$BIN_DIR/finetune_hf" "${ft[@]}" --mixed-precision no > "$WORK/ft_cpu.json" || return 1
  for mp in no bf16 fp16; do
    "$BIN_DIR/finetune_hf" "${ft[@]}" --mixed-precision $mp > "$WORK/ft_$mp.json" || return 1
  done
  python3 - "$WORK" "$HF_GPU" <<'PY'
import json, sys
work, budget = sys.argv[1], sys.argv[2]
ok = True
for m in ["llama", "llama3", "mistral", "qwen2", "gpt2"]:
    ref = json.load(open(f"tests/fixtures/hf/{m}/reference.json"))
    got = json.load(open(f"{work}/logits_{m}.json"))
    want = ref["logits"][0]
    diff = max(abs(a - b) for ra, rb in zip(got["logits"], want) for a, b in zip(ra, rb))
    places = sorted(set(map(str, got["device_map"].values())))
    tokens = json.load(open(f"{work}/generate_{m}.json"))["tokens"]
    want_tokens = ref["generate"]["tokens"]
    good = diff <= 1e-4 and tokens == want_tokens and len(got["logits"]) == len(want)
    ok &= good
    print(json.dumps({"model": m, "placements": places, "max_abs_diff_vs_transformers": diff,
                      "greedy_tokens_equal": tokens == want_tokens, "ok": good}))
def losses(name):
    rows = [json.loads(l) for l in open(f"{work}/ft_{name}.json") if l.strip()]
    return rows[0]["setup"], [r["loss"] for r in rows if "loss" in r]
_, cpu = losses("cpu")
ref_loss = json.load(open("tests/fixtures/hf/llama/reference.json"))["loss"]
for mp, tol in [("no", 1e-4), ("bf16", 0.05), ("fp16", 0.05)]:
    setup, gpu = losses(mp)
    worst = max(abs(g - c) / c for g, c in zip(gpu, cpu))
    good = len(gpu) == len(cpu) == 4 and worst <= tol and abs(gpu[0] - ref_loss) <= 4 * tol * ref_loss
    ok &= good
    print(json.dumps({"finetune_hf": mp, "setup": setup, "losses": gpu, "cpu_losses": cpu,
                      "transformers_first_loss": ref_loss, "max_rel_diff_vs_cpu": worst,
                      "tolerance": tol, "ok": good}))
sys.exit(0 if ok else 1)
PY
}
export -f hf_gpu
run_step hf-gpu 240 hf_gpu

# 8. One GPT step on the GPU, accel-rs against torch (when importable) in the same run.
run_step bench-gpu 240 bash -c "set -o pipefail; '$BIN_DIR/bench_train' --device cuda --only gpt --rounds 3 --json | tee '$LOGS/bench_train_cuda.json'"
# Causal attention forward+backward at GPT-2 small's shape in bf16: the CUDA kernels, the composed
# ops and torch's SDPA, in TFLOP/s.
run_step bench-attention 180 bash -c "set -o pipefail; '$BIN_DIR/bench_attention' --device cuda --json | tee '$LOGS/bench_attention_cuda.json'"
# GPT-2 small in bf16 (8 x 1024 tokens a step) against torch eager with SDPA and fused AdamW.
run_step bench-gpt2 300 bash -c "set -o pipefail; '$BIN_DIR/bench_train' --device cuda --workload gpt2_124m --mixed-precision bf16 --rounds 3 --json | tee '$LOGS/bench_train_gpt2_124m_cuda.json'"
# With and without cudarc's cross-stream event tracking (candle's own device), alternating in one
# process, with the host's share of each step. (Across processes, `bench_train --device
# cuda-untracked` against the step above varied more than the effect.)
run_step profile-gpu 240 bash -c "set -o pipefail; '$BIN_DIR/profile_gpt' --device cuda-both --only gpt --steps 60 | tee '$LOGS/profile_gpt_cuda.jsonl'"

echo "=== summary"
printf '%s\n' "${SUMMARY[@]}"
[ -s "$BENCH_JSON" ] && echo "bench JSON: $BENCH_JSON"
exit $status
