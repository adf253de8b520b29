"""Batched quantized products with and without VNNI: `python benchmarks/batched_kernels.py [--rows 1,2,4,8,32]
[--reps R] [--threads N]`.

The product shapes of one gemma-3-270m Q4_K_M layer and its tied output (random blocks of each tensor's GGUF type,
`ggml` numerics, C backend) at several activation-row counts T, each timed with the kernels as this machine builds
them and with `-DALCHEMIST_VNNI=0` (no `vpdpbusd` / `vpdpwssd`), alternating the two, best of R. Both must give the
same bits (checked before timing); on a CPU without AVX-512 VNNI or AVX-VNNI both builds are the same code and the
ratio is ~1. Prints which instruction sets the compiler targets.
"""

from __future__ import annotations

import argparse
import os
import time

SHAPES = (  # (name, GGUF type, n_out, n_in) of gemma-3-270m Q4_K_M
    ("output (tied token_embd)", "Q8_0", 262144, 640),
    ("ffn_gate / ffn_up", "Q5_0", 2048, 640),
    ("attn_q", "Q5_0", 1024, 640),
    ("attn_k", "Q5_0", 256, 640),
    ("attn_v (half the layers)", "Q8_0", 256, 640),
    ("attn_output", "Q4_K", 640, 1024),
    ("ffn_down (half the layers)", "Q6_K", 640, 2048),
    ("ffn_down (the other half)", "Q4_K", 640, 2048),
)


def _without_vnni():
    """QuantizedMatmul built with -DALCHEMIST_VNNI=0, a module-level class (PyTensor pickles an Op into its compile
    cache by module and name), defined once alchemist may be imported (after --threads)."""
    from alchemist.kernels.op import QuantizedMatmul

    class WithoutVnni(QuantizedMatmul):
        def c_compile_args(self, **kwargs):
            return [*super().c_compile_args(**kwargs), "-DALCHEMIST_VNNI=0"]

    WithoutVnni.__qualname__ = "WithoutVnni"
    globals()["WithoutVnni"] = WithoutVnni
    return WithoutVnni


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,32")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: as set)")
    args = ap.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import numpy as np
    import pytensor
    import pytensor.tensor as pt

    from alchemist.harness.quantize import quantize_array
    from alchemist.kernels.native import ops_flags
    from alchemist.kernels.op import QuantizedMatmul
    from alchemist.pytensor_ext.host import activated
    from alchemist.runtime.backends import get_mode

    WithoutVnni = _without_vnni()
    flags = ops_flags()
    vnni = [f for f in flags if "vnni" in f and not f.startswith("-mno-")]
    print(f"compiler targets: {' '.join(f for f in flags if f.startswith('-march'))}; VNNI: {' '.join(vnni) or 'none'}")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print("| product | type | n_out x n_in | T | VNNI ms | without ms | without / VNNI |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for name, ggml_type, n_out, n_in in SHAPES:
        w = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.02
        raw = quantize_array(w, ggml_type).reshape(n_out, -1)
        del w
        xv, wv = pt.matrix("x", dtype="float32"), pt.matrix("w", dtype="uint8", shape=raw.shape)
        with activated():  # alchemist's PyTensor settings while it compiles, as the engine has them
            fns = [
                pytensor.function([xv, wv], cls(ggml_type, n_out, n_in, numerics="ggml")(xv, wv), mode=get_mode("c"))
                for cls in (QuantizedMatmul, WithoutVnni)
            ]
        for T in rows:
            x = rng.standard_normal((T, n_in)).astype(np.float32)
            a, b = (np.asarray(f(x, raw)) for f in fns)
            assert np.array_equal(a, b), f"{name} T={T}: the two builds differ"
            best = [float("inf")] * 2
            reps = max(3, args.reps // 8) if n_out * T > 1_000_000 else args.reps
            for _ in range(reps):
                for i, f in enumerate(fns):
                    t0 = time.perf_counter()
                    f(x, raw)
                    best[i] = min(best[i], 1000 * (time.perf_counter() - t0))
            print(
                f"| {name} | {ggml_type} | {n_out}x{n_in} | {T} | {best[0]:.3f} | {best[1]:.3f} | {best[1] / best[0]:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
