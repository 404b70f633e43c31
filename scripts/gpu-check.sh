#!/usr/bin/env bash
# The engine's checks on an NVIDIA GPU, in one table: the reference tests
# on CUDA (logits against llama.cpp, the tensor path against the host
# kernels, chunked prefill, batched sequences over the device KV pool, KV
# blocks crossing host <-> device, reuse from the warehouse, the step loop
# batched and sampling on the device), warm TTFT from engine memory (`granary bench ttft
# --device cuda`) and decode throughput at 1 and 16 streams against the
# CPU on the same model (`granary bench engine`).
#
# A GPU machine may reach no package registry, so the work is split:
#
#   scripts/gpu-check.sh build   here: builds granary and the test binaries
#                                with --features cuda (release) into
#                                target/gpu-check/, with the default model
#   scripts/gpu-check.sh run     on the GPU machine, from the repository root
#                                (target/gpu-check/ copied along)
#   scripts/gpu-check.sh         both, on a GPU machine that can build
#
# `build` needs the CUDA 13 toolkit (installed from PyPI by
# scripts/cuda-toolkit.sh) and CUDA_COMPUTE_CAP (default 90). `run` needs
# the NVIDIA driver and the CUDA 13 libraries the binary links (cuBLAS,
# cuRAND, NVRTC, the runtime): target/gpu-check/lib when they were bundled
# (GPU_CHECK_BUNDLE_LIBS=1 at build time, about 900 MB), else the system's.
# Goals (issue text): logits within the CPU fixture's tolerance, warm TTFT
# from engine memory at 8K tokens under 20 ms, decode at 16 streams at
# least 10x the CPU figure.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-check
mode=${1:-all}

build() {
  # shellcheck source=scripts/cuda-toolkit.sh
  source scripts/cuda-toolkit.sh
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
  echo "== building with --features cuda for compute capability $CUDA_COMPUTE_CAP"
  rm -rf "$out" && mkdir -p "$out/tests"
  cargo build --release -p granary --features cuda
  cp target/release/granary "$out/granary"
  cargo test --release -p granary-engine --features cuda --no-run --message-format=json \
    --test model_reference --test reuse --test engine 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
    while read -r name exe; do cp "$exe" "$out/tests/$name"; done
  cp "$("$out/granary" fetch default)" "$out/model.gguf"
  if [ "${GPU_CHECK_BUNDLE_LIBS:-0}" = 1 ]; then
    mkdir -p "$out/lib"
    cp -L "$CUDA_ROOT"/lib/lib{cublas,cublasLt,curand,nvrtc,cudart}.so.* "$CUDA_ROOT"/lib/libnvrtc-builtins.so.* "$out/lib/"
  fi
  ls -la "$out" "$out/tests"
}

run() {
  [ -x "$out/granary" ] || { echo "no $out/granary: run 'scripts/gpu-check.sh build' first" >&2; exit 1; }
  if [ -d "$out/lib" ]; then export LD_LIBRARY_PATH="$PWD/$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; fi
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  export GRANARY_TEST_CUDA=require GRANARY_TEST_MODEL="$PWD/$out/model.gguf" GRANARY_REQUIRE_EXTERNAL=1
  local log=$out/log && mkdir -p "$log"
  local rows=()
  # The engine's step loop on the tensor path only (its other tests are
  # CPU ones).
  local filter=(model_reference: reuse: engine:the_tensor_path)
  for tf in "${filter[@]}"; do
    local t=${tf%%:*} f=${tf#*:}
    if "$out/tests/$t" ${f:+"$f"} --test-threads 1 --nocapture >"$log/$t.txt" 2>&1; then r=pass; else r=FAIL; fi
    rows+=("test $t|$r|$(grep -cE '^test .* ok$' "$log/$t.txt") passed, $(grep -cE '^test .* FAILED$' "$log/$t.txt") failed")
    grep -E 'cuda' "$log/$t.txt" | grep -vE '^test ' | sed 's/^/    /' || true
  done
  "$out/granary" bench ttft --device cuda --model "$out/model.gguf" --sizes 1024,8192 --repeats 3 \
    --out "$log/ttft" >"$log/ttft.txt" 2>&1 && r=pass || r=FAIL
  rows+=("bench ttft --device cuda|$r|$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print("; ".join(f"warm from engine memory at {s[\"tokens\"]} tokens {s[\"median\"][\"memory_ms\"]:.1f} ms (goal < 20 ms at 8K), cold {s[\"median\"][\"cold_ms\"]:.0f} ms" for s in r["sizes"]))' "$log/ttft/ttft.json" 2>&1)")
  local decode=()
  for dev in cuda cpu; do
    "$out/granary" bench engine --device "$dev" --model "$out/model.gguf" --concurrency 1,16 --rounds 1 \
      --out "$log/engine-$dev" >"$log/engine-$dev.txt" 2>&1 && r=pass || r=FAIL
    decode+=("$(python3 -c 'import json, sys
r = json.load(open(sys.argv[1]))
print(max(l["decode_tok_s"] or 0 for l in r["granary"] if l["concurrency"] == 16))' "$log/engine-$dev/engine.json" 2>/dev/null || echo 0)")
    rows+=("bench engine --device $dev|$r|decode at 16 streams ${decode[-1]} tok/s")
  done
  rows+=("decode 16 streams cuda/cpu||$(python3 -c 'import sys; c, h = map(float, sys.argv[1:]); print(f"{c / h:.1f}x (goal >= 10x)" if h else "no CPU figure")' "${decode[0]}" "${decode[1]}")")
  echo
  printf '%-32s %-6s %s\n' check result figures
  for row in "${rows[@]}"; do IFS='|' read -r a b c <<<"$row"; printf '%-32s %-6s %s\n' "$a" "$b" "$c"; done
  echo "logs: $log"
  ! printf '%s\n' "${rows[@]}" | grep -q '|FAIL|'
}

case "$mode" in
  build) build ;;
  run) run ;;
  all) build && run ;;
  *) echo "usage: scripts/gpu-check.sh [build|run]" >&2; exit 2 ;;
esac
