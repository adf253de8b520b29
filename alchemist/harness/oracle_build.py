"""Which instruction-set variant of ggml-cpu the installed llama.cpp executes, and which one alchemist reproduces.

ggml-cpu's arithmetic depends on the instruction set it was compiled for: the AVX2 and AVX-512 builds sum dot
products and softmax rows in other orders and vectorize expf/SiLU over 8 or 16 lanes, so their logits differ
in the last bits. `numerics="ggml"` reproduces one variant, `REPRODUCED`: ggml-cpu built for AVX2 + FMA + F16C
without AVX-512 (x86-64-v3), the build `scripts/bootstrap.sh` pins for the oracle on every x86-64 machine.
A comparison against any other build is not expected to agree to the bit; validation says so and applies its
tolerance bars instead.

`python -m alchemist.harness.oracle_build` prints the installed oracle's variant; `--check` exits 1 unless it is
the reproduced one (bootstrap rebuilds the wheel then).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# ggml-cpu's compile-time feature names (ggml_backend_cpu_get_features) that decide a variant's arithmetic
AVX2_VARIANT = "x86-64 AVX2+FMA+F16C"
AVX512_VARIANT = "x86-64 AVX-512"
NEON_VARIANT = "arm64 NEON"
SCALAR_VARIANT = "portable C"

REPRODUCED = AVX2_VARIANT


@dataclass(frozen=True)
class OracleBuild:
    """What the installed llama.cpp's CPU backend was compiled for, as `llama_print_system_info()` reports it."""

    variant: str
    features: tuple[str, ...]  # the CPU backend's features that are on, in llama.cpp's order
    system_info: str  # llama.cpp's own line, verbatim

    @property
    def reproduced(self) -> bool:
        """Whether numerics="ggml" on this machine computes what this build computes, to the bit."""
        return self.variant == REPRODUCED and host_reproduces_avx2()


def variant_of(features: set[str] | frozenset[str]) -> str:
    """The arithmetic family a set of ggml-cpu features selects (AVX-512 wins over AVX2 in ggml's kernels)."""
    if features & {"AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AMX_INT8"}:
        return AVX512_VARIANT
    if {"AVX2", "FMA", "F16C"} <= features:
        return AVX2_VARIANT
    if "NEON" in features:
        return NEON_VARIANT
    return SCALAR_VARIANT


def parse_system_info(text: str) -> tuple[str, ...]:
    """The features switched on in the CPU backend's part of `llama_print_system_info()`.

    The line looks like `CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | ... | REPACK = 1 |`, possibly after other
    backends' parts (`Metal : EMBED_LIBRARY = 1 | CPU : ...`); only the CPU part decides the arithmetic.
    Older builds print no backend names: then every field is the CPU's."""
    features, backend = [], None if ":" in text else "CPU"
    for field in text.split("|"):
        if ":" in field:
            backend, field = (part.strip() for part in field.split(":", 1))
        name, _, value = field.partition("=")
        if backend == "CPU" and value.strip() == "1":
            features.append(name.strip())
    return tuple(features)


@cache
def oracle_build() -> OracleBuild:
    """The installed llama-cpp-python's CPU variant (imports llama_cpp; raises ImportError without it)."""
    import llama_cpp

    text = llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip()
    features = parse_system_info(text)
    return OracleBuild(variant=variant_of(set(features)), features=features, system_info=text)


@cache
def host_flags() -> frozenset[str]:
    """This CPU's flags from /proc/cpuinfo (empty where there is none), read once per process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def host_reproduces_avx2() -> bool:
    """alchemist's C kernels take ggml's AVX2 paths when they are compiled for a CPU with AVX2, FMA and F16C
    (an AVX-512 CPU included: the ggml kernels keep the 8-lane AVX2 code); elsewhere they are portable C."""
    return {"avx2", "fma", "f16c"} <= host_flags()


def ours() -> str:
    """The variant numerics="ggml" reproduces on this machine."""
    return REPRODUCED if host_reproduces_avx2() else SCALAR_VARIANT


def describe(build: OracleBuild) -> str:
    """One sentence for reports: the oracle's variant, ours, and what agreement to expect."""
    if build.reproduced:
        return f"oracle: llama.cpp built for {build.variant}, the arithmetic numerics='ggml' reproduces"
    return (
        f"oracle: llama.cpp built for {build.variant}; numerics='ggml' reproduces {ours()}: the arithmetic differs, "
        "so bit-for-bit agreement is not expected and the tolerance bars decide"
    )


def arithmetic(numerics: str) -> dict:
    """The report section naming both arithmetics: the oracle's build and what alchemist computed."""
    build = oracle_build()
    return {
        "oracle_variant": build.variant,
        "oracle_system_info": build.system_info,
        "reproduced_variant": ours() if numerics == "ggml" else "exact float32 (no ggml variant)",
        "same_arithmetic": numerics == "ggml" and build.reproduced,
        "note": (
            describe(build)
            if numerics == "ggml"
            else f"oracle: llama.cpp built for {build.variant}; "
            "numerics='exact' does not reproduce llama.cpp's rounding: the tolerance bars decide"
        ),
    }


def numerics_line(numerics: str) -> str:
    """What `alchemist run` says about its arithmetic, and about the oracle's when llama-cpp-python is installed."""
    if numerics != "ggml":
        return f"numerics {numerics}: exact float32 activations, not llama.cpp's rounding"
    line = f"numerics ggml: llama.cpp's {ours()} arithmetic"
    try:
        build = oracle_build()
    except (ImportError, OSError):
        return line + " (llama-cpp-python is not installed: no oracle to compare with)"
    same = "the same arithmetic" if build.reproduced else "another arithmetic: expect differences in the last bits"
    return line + f"; the installed llama.cpp is built for {build.variant}, {same}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    build = oracle_build()
    print(build.system_info)
    print(describe(build))
    if "--check" in argv and build.variant != REPRODUCED:
        print(f"the oracle must be the {REPRODUCED} build (see scripts/bootstrap.sh)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
