#!/usr/bin/env bash
# Runs CUDA kernels' logic on the host, without a GPU: scripts/cuda_emulate/*_check.cpp include a
# kernel source with emulate.h (each CUDA thread an OS thread, __syncthreads and warp shuffles as
# barriers) and compare it with a double-precision reference. What a GPU adds (timing, the memory
# model, PTX) is scripts/gpu_check.sh's; what NVRTC accepts is scripts/check_cuda_sources.sh's.
#
#   scripts/check_cuda_emulated.sh          # every check, ~25 s on 2 cores
set -euo pipefail
cd "$(dirname "$0")/cuda_emulate"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for src in *_check.cpp; do
  name=${src%.cpp}
  ${CXX:-g++} -std=c++20 -O2 -pthread -Wall -Wno-unknown-pragmas -Werror -o "$out/$name" "$src"
  echo "== $name"
  timeout 600 "$out/$name"
done
