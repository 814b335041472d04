#!/usr/bin/env bash
# Writes tests/fixtures/zoo/unpatched_outputs_{avx512,avx2}.jsonl: the inference outputs of
# tests/user_crate/src/infer.rs built against candle-nn and candle-transformers 0.11.1 as
# published (taken from the commits that vendored them, before any accel-rs patch), on this
# checkout's candle-core (whose patches touch gradients and variables, not forward ops).
# tests/tests/user_crate.rs compares the patched crates' outputs with the file of its CPU, bit
# for bit. Two files, because candle's f32 matmul is the gemm crate's, whose microkernels sum in
# another order on AVX-512 (what accel-nn's `gemm/x86-v4` feature compiles, and the user crate
# links) than on AVX2: the first build has the feature (run on a CPU with AVX-512), the second
# leaves it off, so gemm runs its AVX2 kernels as it does on a CPU without AVX-512.
#
#   scripts/zoo_unpatched_outputs.sh            # offline, into this checkout's target folder
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$repo/target/zoo_unpatched
# The commits that vendored the crates as published ("... as published ..., to be patched").
nn_commit=c1088da
transformers_commit=c9418ab
rm -rf "$work"
mkdir -p "$work/src"
git -C "$repo" archive "$nn_commit" vendor/candle-nn | tar -x -C "$work"
git -C "$repo" archive "$transformers_commit" vendor/candle-transformers | tar -x -C "$work"
if grep -rq "accel-rs patch" "$work/vendor"; then
  echo "the archived crates carry accel-rs patches: wrong commits" >&2
  exit 1
fi
cat > "$work/Cargo.toml" <<EOF
[package]
name = "accel-zoo-unpatched"
version = "0.1.0"
edition = "2021"
publish = false

[dependencies]
candle-core = "0.11.1"
candle-nn = "0.11.1"
candle-transformers = "0.11.1"
anyhow = "1"
serde_json = "1"
@GEMM@

[patch.crates-io]
candle-core = { path = "$repo/vendor/candle-core" }
candle-nn = { path = "$work/vendor/candle-nn" }
candle-transformers = { path = "$work/vendor/candle-transformers" }

[workspace]

# tests/user_crate's profiles: f32 results differ in their last bits between an unoptimised
# build of the candle crates and an optimised one, so both sides are built alike.
[profile.dev.package."*"]
opt-level = 3
debug = false

[profile.dev]
opt-level = 1
debug = "line-tables-only"
EOF
cp "$repo/tests/user_crate/src/infer.rs" "$work/src/infer.rs"
cat > "$work/src/main.rs" <<'EOF'
mod infer;

fn main() -> anyhow::Result<()> {
    let only: Vec<String> = std::env::args().skip(1).collect();
    infer::run(&only)
}
EOF
cp "$repo/Cargo.lock" "$work/Cargo.lock"
cp "$work/Cargo.toml" "$work/Cargo.toml.in"
for isa in avx512 avx2; do
  if [ "$isa" = avx512 ]; then
    grep -q avx512f /proc/cpuinfo || { echo "the avx512 file needs a CPU with AVX-512" >&2; exit 1; }
    gemm='gemm = { version = "0.19", features = ["x86-v4"] }'
  else
    gemm=''
  fi
  sed "s|@GEMM@|$gemm|" "$work/Cargo.toml.in" > "$work/Cargo.toml"
  out=$repo/tests/fixtures/zoo/unpatched_outputs_$isa.jsonl
  (cd "$work" && CARGO_TARGET_DIR="$repo/target" cargo run --offline --quiet) > "$out.tmp"
  mv "$out.tmp" "$out"
  echo "wrote $out ($(wc -l < "$out") lines)"
done
