"""The kernels' C and C++ live in alchemist/kernels/csrc as source files: shared headers are inlined into each
Op's one translation unit, and every file there is one an Op or a library builds."""

from __future__ import annotations

import re

from alchemist.kernels import sources


def test_local_includes_are_inlined_and_system_ones_kept():
    silu, attention, header = sources.source("silu.cpp"), sources.source("attention.cpp"), sources.source("v_expf.h")
    assert header in silu and header in attention  # one vectorized expf, shared by the two ops
    for text in (silu, attention):
        assert not re.search(r'^#include "', text, re.M)
        assert "#include <math.h>" in text
    handlers = sources.source("jax_ffi_handlers.cpp")
    assert '#include "xla/ffi/api/ffi.h"' in handlers  # not a file of csrc/: left for the compiler


def test_every_source_file_is_used():
    from alchemist.kernels import attention, c_kernels, gelu, jax_ffi, mlx_affine, native, rms_norm, rope, silu

    used = {"v_expf.h", "v_expf_includes.h", jax_ffi._HANDLERS}
    compiled = [c_kernels.C_SOURCE, attention.ATTENTION_C, silu.SILU_C, gelu.GELU_C, rms_norm.RMS_NORM_C, rope.ROPE_C,
                mlx_affine.C_SOURCE]  # fmt: skip
    for path in sorted(sources.CSRC.iterdir()):
        text = sources.source(path.name)
        if any(text.split("/*Q5_HIGH_BITS*/")[0] in c for c in compiled):  # the matmul's table is generated
            used.add(path.name)
    assert {p.name for p in sources.CSRC.iterdir()} == used
    assert native._ops_source().count(sources.source("v_expf.h")) == 2  # attention's and SiLU's


def test_entry_points_are_declared_once():
    """The kernel libraries' C entry points come from one table: the exported wrappers' C declarations, the JAX
    handlers' extern declarations (the handlers' source declares none itself), MLX's ctypes and Numba's types."""
    import pytensor

    from alchemist.kernels import native, signatures

    assert not re.search(r"^extern \"C\"", sources.source("jax_ffi_handlers.cpp"), re.M)
    entries = native.entry_points(pytensor.config.cxx)
    assert set(entries) == set(signatures.ENTRY_POINTS)
    for name, (ret, args) in signatures.ENTRY_POINTS.items():
        restype, argtypes = signatures.ctypes_signature(name)
        assert len(argtypes) == len(args) == len(signatures.numba_signature(name).args)
        assert (restype is None) == (ret == "void")
        declaration = signatures.c_declaration(name, "f")
        assert declaration.count(",") == len(args) - 1 and declaration.startswith(("int f(", "void f("))
    assert signatures.c_declaration("matmul", "f") in native._source("f")
    assert all(signatures.c_declaration(n, f"p_{n}") in native._ops_entries("p") for n in ("rope", "attention"))
