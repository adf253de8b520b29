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

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -c 'import sys; assert sys.version_info >= (3, 12), f"Python >= 3.12 needed, got {sys.version}"'
.venv/bin/python -m pip install -q --upgrade pip
# llama-cpp-python (the oracle) builds from source; AMX kernels crash on VMs that advertise but do not
# enable AMX, so build for AVX2/AVX-512 explicitly. pip caches the wheel after the first (~10 min) build.
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
.venv/bin/python -m pip install -q -e '.[oracle,models,test]'
