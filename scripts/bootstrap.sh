#!/usr/bin/env bash
# Create .venv (Python >= 3.12, see .python-version) and install alchemist with every extra.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# The C backend links PyTensor's BLAS ops against a system OpenBLAS (see alchemist/runtime/backends.py).
if [ ! -e /usr/lib/x86_64-linux-gnu/libopenblas.so ] && [ ! -e /usr/lib/aarch64-linux-gnu/libopenblas.so ] \
   && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q libopenblas-dev >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libopenblas-dev >/dev/null; } \
    || echo "bootstrap: libopenblas-dev not installed; the C backend will fall back to numpy's BLAS via Python" >&2
fi
# `alchemist graph --format png` draws with Graphviz's `dot` (DOT text needs nothing)
if ! command -v dot >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get install -y -q graphviz >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q graphviz >/dev/null; } \
    || echo "bootstrap: graphviz not installed; alchemist graph --format png will ask for it" >&2
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -c 'import sys; assert sys.version_info >= (3, 12), f"Python >= 3.12 needed, got {sys.version}"'
.venv/bin/python -m pip install -q --upgrade pip
# llama-cpp-python (the oracle) builds from source for this CPU's instruction sets, read from /proc/cpuinfo
# (GGML_NATIVE would also enable AMX, whose kernels crash on VMs that advertise but do not enable it; an
# AVX-512 build dies with SIGILL on a CPU without it). pip caches the wheel after the first (~10 min) build.
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { case "$cpu_flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
.venv/bin/python -m pip install -q -e '.[oracle,bench,models,pymc,test]'
# A wheel cached on a machine with other instruction sets dies with SIGILL here: drop it from pip's cache
# and rebuild it for this one (the new wheel is cached in its place).
if ! .venv/bin/python -c 'import llama_cpp; llama_cpp.llama_backend_init()' >/dev/null 2>&1; then
  echo "bootstrap: the installed llama-cpp-python does not run on this CPU; rebuilding it (~10 min)" >&2
  version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
  .venv/bin/python -m pip cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "llama-cpp-python==$version"
  .venv/bin/python -c 'import llama_cpp; llama_cpp.llama_backend_init()'
fi
