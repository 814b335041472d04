#!/usr/bin/env bash
# Installs a CUDA 13 compiler toolchain from PyPI (no GPU, no system toolkit needed) so that
# `--features cuda` / `--features nccl` can be compile-checked on a CPU-only machine.
#
#   source <(scripts/cuda_toolchain.sh)      # installs once into $CUDA_VENV, prints the exports
#
# $CUDA_VENV defaults to ~/.cache/accel-rs/cuda13-venv, outside the repo and the target dir,
# so `.ci/run` installs it once per machine (~1 minute, ~1 GB) and reuses it afterwards.
#   cargo check --workspace --features accel-core/cuda
#
# Why CUDA 13: the PyPI `*-cu12` nvcc wheels ship only ptxas (no nvcc, no cicc); the CUDA 13
# wheels form a complete layout and work with gcc 12. cudarc 0.19 accepts CUDA up to 13.4.
# `cargo check` needs no CUDA libraries. `cargo build` does: candle 0.11 enables cudarc's
# `dynamic-linking`, so the link wants libcuda, libnvrtc, libcublas(Lt), libcurand, libcudart
# (and libnccl); on a machine without them link against stub libraries, and build for real only
# on a GPU machine. The first check compiles candle-kernels' PTX and MoE kernels (~6 min on 2 cores).
set -euo pipefail
CUDA_VENV=${CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/accel-rs/cuda13-venv}
if [ ! -f "$CUDA_VENV/.complete" ]; then
  # Installed into a scratch venv and renamed, so an interrupted install is never reused.
  rm -rf "$CUDA_VENV.partial"
  mkdir -p "$(dirname "$CUDA_VENV")"
  python3 -m venv "$CUDA_VENV.partial" >&2
  "$CUDA_VENV.partial/bin/pip" install --quiet \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85 >&2
  touch "$CUDA_VENV.partial/.complete"
  rm -rf "$CUDA_VENV"
  mv "$CUDA_VENV.partial" "$CUDA_VENV"
fi
root=$("$CUDA_VENV/bin/python" -c 'import os, nvidia; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
[ -x "$root/bin/nvcc" ] || { echo "cuda_toolchain.sh: no nvcc under $root" >&2; exit 1; }
cat <<ENV
export CUDA_ROOT=$root
export CUDA_HOME=$root
export CUDA_PATH=$root
export PATH=$root/bin:\$PATH
export NVCC_CCBIN=/usr/bin/g++
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
ENV
