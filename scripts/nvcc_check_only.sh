#!/usr/bin/env bash
# An `nvcc` for type-checking only, used by .ci/run's clippy over the `cuda`/`nccl` features
# (set as $NVCC, which candle-kernels' build script, through cudaforge, runs).
#
# Why: that build script compiles candle's own CUDA C++ (PTX for its kernels and a static MoE/GGUF
# library) whenever candle-core's `cuda` feature is on, even for `cargo check`: 13 minutes of a
# 30-minute CI budget on 2 cores, for artifacts a type-check never links or runs. Our own kernels
# are CUDA C compiled at run time by NVRTC, so nvcc never sees code of ours.
#
# Queries (`--version`, `--list-gpu-code`) go to the real nvcc of scripts/cuda_toolchain.sh, so
# version detection behaves exactly as in a real build; compile steps write empty outputs:
# `--ptx` an empty .ptx per source, `-c` an empty object, `--lib` an empty archive. A binary built
# this way would have no device code, which is why only `cargo clippy`/`check` may use it; real
# builds (scripts/gpu_check.sh) use the real nvcc.
set -euo pipefail
real=${ACCEL_REAL_NVCC:?ACCEL_REAL_NVCC must name the real nvcc}
args=("$@")
mode="" out="" dir=""
for ((i = 0; i < ${#args[@]}; i++)); do
  case ${args[i]} in
    -c | --ptx | --lib) mode=${args[i]} ;;
    -o) out=${args[i + 1]:-} ;;
    --output-directory) dir=${args[i + 1]:-} ;;
  esac
done
case $mode in
  "") exec "$real" "$@" ;;
  --ptx)
    for a in "${args[@]}"; do
      if [[ $a == *.cu ]]; then
        stem=$(basename "${a%.cu}")
        : >"${out:-${dir:-.}/$stem.ptx}"
      fi
    done
    ;;
  -c) : >"${out:?nvcc_check_only.sh: -c without -o}" ;;
  --lib) rm -f "${out:?nvcc_check_only.sh: --lib without -o}" && ar rcs "$out" ;;
esac
