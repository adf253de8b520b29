"""The oracle's instruction-set variant: read from llama.cpp itself, pinned by bootstrap, named in every report."""

from __future__ import annotations

import os

import pytest

from alchemist.harness import oracle_build as ob

AVX2_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
    "OPENMP = 1 | REPACK = 1 | "
)
AVX512_INFO = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
    "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
NEON_INFO = "Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | ACCELERATE = 1 | "


@pytest.mark.parametrize(
    "text, variant",
    [
        (AVX2_INFO, ob.AVX2_VARIANT),
        (AVX512_INFO, ob.AVX512_VARIANT),
        (NEON_INFO, ob.NEON_VARIANT),
        ("CPU : SSE3 = 1 | LLAMAFILE = 1 | ", ob.SCALAR_VARIANT),
    ],
)
def test_variant_is_read_from_llamacpps_own_line(text, variant):
    features = ob.parse_system_info(text)
    assert ob.variant_of(set(features)) == variant
    assert "EMBED_LIBRARY" not in features  # another backend's part of the line is not the CPU's


def test_the_installed_oracle_is_the_pinned_build():
    """scripts/bootstrap.sh builds llama-cpp-python for the variant numerics="ggml" reproduces, whatever this CPU
    has (an AVX-512 machine included), so the bit-for-bit tests run here and never skip for a wrong build."""
    pytest.importorskip("llama_cpp")
    if os.environ.get("ALCHEMIST_ORACLE_ANY_BUILD") == "1":
        pytest.skip("ALCHEMIST_ORACLE_ANY_BUILD=1: a build other than the pinned one was asked for")
    build = ob.oracle_build()
    assert build.variant == ob.REPRODUCED, build.system_info
    assert "AVX2" in build.features and "AVX512" not in build.features, build.system_info
    assert build.reproduced == ob.host_reproduces_avx2()
    assert "the arithmetic numerics='ggml' reproduces" in ob.describe(build)


def test_a_mismatched_oracle_is_reported(fixture_files, monkeypatch, tmp_path, capsys):
    """Validating against a llama.cpp built for AVX-512 (another arithmetic) says so in the report, the markdown
    and the progress line: the tolerance bars decide, and no bit-for-bit agreement is claimed."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.validate import diff_model, diff_to_markdown, to_markdown, validate_model

    avx512 = ob.OracleBuild(ob.AVX512_VARIANT, ob.parse_system_info(AVX512_INFO), AVX512_INFO)
    monkeypatch.setattr(ob, "oracle_build", lambda: avx512)
    path = str(fixture_files("llama", "Q8_0"))
    report = validate_model(path, ["c"], prompt=[1, 40, 300, 7, 99], n_generate=0, context=32, n_threads=1)
    arithmetic = report["arithmetic"]
    assert arithmetic["oracle_variant"] == ob.AVX512_VARIANT and not arithmetic["same_arithmetic"]
    assert arithmetic["reproduced_variant"] == ob.ours() and "AVX512 = 1" in arithmetic["oracle_system_info"]
    expected = "bit-for-bit agreement is not expected and the tolerance bars decide"
    assert expected in arithmetic["note"] and expected in to_markdown(report)
    assert expected in capsys.readouterr().out
    assert report["passed"], report["backends"]["c"]["failures"]  # the bars themselves are unchanged

    diff = diff_model(path, "c", [1, 40, 300])
    assert expected in diff_to_markdown(diff)


def test_the_pinned_oracle_is_reported_as_the_same_arithmetic(monkeypatch):
    avx2 = ob.OracleBuild(ob.AVX2_VARIANT, ob.parse_system_info(AVX2_INFO), AVX2_INFO)
    monkeypatch.setattr(ob, "oracle_build", lambda: avx2)
    monkeypatch.setattr(ob, "host_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx512f"}))
    assert ob.arithmetic("ggml")["same_arithmetic"]
    assert not ob.arithmetic("exact")["same_arithmetic"]
    assert ob.numerics_line("ggml").endswith("built for x86-64 AVX2+FMA+F16C, the same arithmetic")
    # a host whose kernels cannot take ggml's AVX2 paths does not claim them, whatever the oracle is
    monkeypatch.setattr(ob, "host_flags", lambda: frozenset({"sse2"}))
    assert not ob.arithmetic("ggml")["same_arithmetic"] and ob.ours() == ob.SCALAR_VARIANT
