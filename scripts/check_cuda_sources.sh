#!/usr/bin/env bash
# Compile-checks the embedded CUDA kernel sources without a GPU:
#   1. `nvcc --ptx` of each accel-kernels/src/cuda/*.cu (standalone, via its guarded
#      #include "common.cuh");
#   2. NVRTC itself (libnvrtc from the nvidia-cuda-nvrtc wheel, loaded with ctypes) on
#      exactly the text and options the crate uses: common.cuh + the .cu file,
#      --fmad=false --prec-div=true --prec-sqrt=true --ftz=false --gpu-architecture=sm_XX (the
#      attention sources with attention.cuh between the two, as ModuleId::source does);
#   3. ptxas on the PTX NVRTC produced (catches bad inline PTX).
# Uses the PyPI toolchain of scripts/cuda_toolchain.sh (installs nvrtc into it once).
#
#   scripts/check_cuda_sources.sh [sm_75 sm_80 sm_90 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source <(scripts/cuda_toolchain.sh)
CUDA_VENV=${CUDA_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/accel-rs/cuda13-venv}
"$CUDA_VENV/bin/python" -m pip install --quiet nvidia-cuda-nvrtc==13.0.88 >&2
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(sm_75 sm_80 sm_90)
src=accel-kernels/src/cuda
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for f in "$src"/*.cu; do
  nvcc --ptx -arch="${archs[-1]}" -fmad=false -o "$out/nvcc_$(basename "$f" .cu).ptx" "$f"
  echo "nvcc --ptx ok: $f"
done
lib="$CUDA_ROOT/lib"
LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" "$CUDA_VENV/bin/python" - "$lib/libnvrtc.so.13" "$src" "$out" "${archs[@]}" <<'PY'
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1]); src_dir, out = sys.argv[2], sys.argv[3]
common = open(os.path.join(src_dir, "common.cuh")).read()
names = sorted(f[:-3] for f in os.listdir(src_dir) if f.endswith(".cu"))
failed = False
for arch in sys.argv[4:]:
    for name in names:
        # As ModuleId::source: the attention sources get attention.cuh after common.cuh.
        shared = open(os.path.join(src_dir, "attention.cuh")).read() if name.startswith("attention") else ""
        text = (common + "\n" + shared + "\n" + open(os.path.join(src_dir, name + ".cu")).read()).encode()
        prog = ctypes.c_void_p()
        assert lib.nvrtcCreateProgram(ctypes.byref(prog), text, (name + ".cu").encode(), 0, None, None) == 0
        opts = [b"--ftz=false", b"--prec-sqrt=true", b"--prec-div=true", b"--fmad=false",
                ("--gpu-architecture=" + arch).encode()]
        r = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, log)
        if r != 0:
            failed = True
            print(f"NVRTC FAILED {name}.cu {arch}:\n{log.value.decode()}")
            continue
        lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
        ptx = ctypes.create_string_buffer(n.value); lib.nvrtcGetPTX(prog, ptx)
        p = ptx.value.decode()
        open(os.path.join(out, f"{name}.{arch}.ptx"), "w").write(p)
        print(f"nvrtc ok: {name}.cu {arch}: {p.count('.entry')} kernels, {p.count('fma.')} fma")
sys.exit(1 if failed else 0)
PY
for p in "$out"/*.sm_*.ptx; do
  arch=${p##*.sm_}; arch=sm_${arch%.ptx}
  ptxas -arch="$arch" -o /dev/null "$p"
  echo "ptxas ok: $(basename "$p")"
done
