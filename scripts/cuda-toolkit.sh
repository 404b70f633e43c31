# shellcheck shell=bash
# The CUDA 13 toolkit from PyPI, for building `granary --features cuda` on a
# machine with no CUDA installed (CI has no GPU and Debian packages no nvcc).
# Sourced, not run: it installs the compiler, headers and the libraries the
# binary links against into .venv-cuda (git-ignored, about 1.2 GB, once) and
# exports PATH, CUDA_ROOT, CUDA_PATH, CUDA_HOME and LD_LIBRARY_PATH for the
# build.
#
#   source scripts/cuda-toolkit.sh
#   CUDA_COMPUTE_CAP=90 cargo build -p granary --features cuda
#
# Versions are pinned together: cudarc 0.19.10 (candle 0.11's) knows CUDA up
# to 13.4, and ptxas must be the release nvvm emits PTX for, so the
# compiler, headers, nvvm, runtime and nvrtc are all 13.4 (cccl's own
# numbering: 13.3.4.x is CCCL 3.4 for CUDA 13).
#
# The wheels ship versioned libraries only (libcublas.so.13); the linker
# wants the unversioned link names, which are made here as symbolic links.
# The driver (libcuda.so.1) comes with the GPU's driver, not with any wheel:
# the link uses a stub built here from the driver functions cudarc declares,
# every one returning CUDA_ERROR_STUB_LIBRARY (34), with the driver's soname,
# so the binary finds the real driver at run time (NVIDIA's toolkit ships
# the same kind of stub in lib64/stubs).

cuda_venv="$PWD/.venv-cuda"
cuda_py() { "$cuda_venv/bin/python" "$@"; }
cuda_marker="$cuda_venv/.toolkit-13.4.92"
if [ ! -f "$cuda_marker" ]; then
  echo "== installing the CUDA 13.4 toolkit from PyPI into .venv-cuda (about 1.2 GB, once)"
  [ -x "$cuda_venv/bin/python" ] || python3 -m venv "$cuda_venv"
  cuda_py -m pip install -q \
    'nvidia-cuda-nvcc==13.4.92' 'nvidia-cuda-crt==13.4.92' 'nvidia-nvvm==13.4.92' \
    'nvidia-cuda-runtime==13.4.92' 'nvidia-cuda-nvrtc==13.4.92' 'nvidia-cuda-cccl==13.3.4.3.1' \
    'nvidia-cublas==13.10.0.20' 'nvidia-curand==10.4.5.25'
fi
CUDA_ROOT=$(cuda_py -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
export CUDA_ROOT CUDA_PATH="$CUDA_ROOT" CUDA_HOME="$CUDA_ROOT"
export PATH="$CUDA_ROOT/bin:$PATH"
export LD_LIBRARY_PATH="$CUDA_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [ ! -f "$cuda_marker" ]; then
  for lib in cublas cublasLt curand nvrtc cudart; do
    versioned=$(cd "$CUDA_ROOT/lib" && ls "lib$lib.so."* | sort | head -n 1)
    ln -sf "$versioned" "$CUDA_ROOT/lib/lib$lib.so"
  done
  # The stub's functions: every driver entry point cudarc's bindings name.
  mkdir -p "$CUDA_ROOT/lib/stubs"
  bindings=$(cargo metadata --format-version 1 --locked --features granary/cuda |
    cuda_py -c 'import json, sys, os; m = json.load(sys.stdin); print(next(os.path.dirname(p["manifest_path"]) for p in m["packages"] if p["name"] == "cudarc"))')
  grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$bindings/src/driver/sys/mod.rs" | awk '{print $4}' | sort -u |
    awk '{printf "int %s(void) { return 34; }\n", $1}' >"$CUDA_ROOT/lib/stubs/cuda_stub.c"
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$CUDA_ROOT/lib/stubs/libcuda.so" "$CUDA_ROOT/lib/stubs/cuda_stub.c"
  # The run-time name too, for starting a binary against the stub (never
  # on LD_LIBRARY_PATH where a real driver is).
  ln -sf libcuda.so "$CUDA_ROOT/lib/stubs/libcuda.so.1"
  touch "$cuda_marker"
fi
# cuobjdump, to list the machine code a build holds (scripts/test.sh).
[ -x "$CUDA_ROOT/bin/cuobjdump" ] || cuda_py -m pip install -q 'nvidia-cuda-cuobjdump==13.4.92'
nvcc --version | tail -n 2 | head -n 1

# cuda_caps "80 90": the next `cargo build --features cuda` makes one binary
# for every compute capability listed. candle compiles its kernels for one,
# CUDA_COMPUTE_CAP: that is the lowest here, whose PTX the driver compiles
# for later generations too; the others' machine code is added to candle's
# static kernel library by scripts/nvcc-archs. Cargo reruns candle's kernel
# build only when CUDA_COMPUTE_CAP changes, so a list other than the one
# the last cuda_caps build was made for cleans that build first (after a
# build with CUDA_COMPUTE_CAP alone, `cargo clean -p candle-kernels`).
cuda_caps() {
  local sorted
  sorted=$(tr ' ' '\n' <<<"$1" | grep . | sort -n -u | tr '\n' ' ')
  sorted=${sorted% }
  [ -n "$sorted" ] || { echo "cuda_caps: no compute capability given" >&2; return 1; }
  export CUDA_COMPUTE_CAP=${sorted%% *}
  export GRANARY_CUDA_EXTRA_CAPS=""
  [ "$sorted" = "$CUDA_COMPUTE_CAP" ] || GRANARY_CUDA_EXTRA_CAPS=${sorted#* }
  export GRANARY_NVCC="$CUDA_ROOT/bin/nvcc" NVCC="$PWD/scripts/nvcc-archs"
  local stamp=target/.cuda-caps
  if [ "$(cat "$stamp" 2>/dev/null)" != "$sorted" ]; then
    cargo clean -q -p candle-kernels
  fi
  mkdir -p target && echo "$sorted" >"$stamp"
}
