"""MXFP4 (ggml type 39): the block format bit for bit against gguf-py and llama.cpp's own (de)quantizers, 3-D
expert stacks through a GGUF and back, the kernels on such a stack, and a llama fixture whose weights are
all MXFP4 validated against llama.cpp through the quantized kernels on C and Numba.

The generic kernel checks (every backend against dequantize-then-matmul, extreme scales, embeddings) run
for MXFP4 with every other type in tests/test_kernels.py."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.pytensor_ext.host import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from alchemist.kernels import as_blocks, dequantize_rows, quantized_linear, row_bytes  # noqa: E402
from alchemist.kernels.formats import E8M0_HALF_TABLE, KVALUES_MXFP4  # noqa: E402
from alchemist.runtime.backends import get_mode  # noqa: E402

MX = GGMLQuantizationType.MXFP4


def _bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _every_scale_and_code(rng, n_rows=256):
    """Rows of 4 blocks: row r's first block has exponent byte r (all 256, subnormal scales and overflow to
    inf included), the quant bytes are random (all 16 codes, +0 and -0)."""
    blocks = rng.integers(0, 256, size=(n_rows, 4, 17), dtype=np.uint8)
    blocks[:, 0, 0] = np.arange(n_rows, dtype=np.uint8)
    blocks[:, 1:, 0] = rng.integers(100, 140, size=(n_rows, 3), dtype=np.uint8)
    return blocks.reshape(n_rows, 4 * 17)


def test_tables_are_ggml():
    # ggml-impl.h ggml_e8m0_to_fp32_half: 2^(e - 128); e < 2 the two subnormals
    assert E8M0_HALF_TABLE[0] == np.float32(2.0**-128) and E8M0_HALF_TABLE[1] == np.float32(2.0**-127)
    assert E8M0_HALF_TABLE[128] == 1.0 and E8M0_HALF_TABLE[254] == np.float32(2.0**126)
    assert np.all(E8M0_HALF_TABLE[1:] / E8M0_HALF_TABLE[:-1] == 2)
    # kvalues_mxfp4 = 2 x E2M1, bit 3 the sign
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    np.testing.assert_array_equal(KVALUES_MXFP4, np.concatenate([2 * e2m1, -2 * e2m1]).astype(np.int8))


def test_dequantize_is_bit_exact_against_gguf_py_and_llamacpp():
    pytest.importorskip("llama_cpp")
    from alchemist.harness.quantize import dequantize_array

    raw = _every_scale_and_code(np.random.default_rng(0))
    with np.errstate(over="ignore", invalid="ignore"):
        ours = dequantize_rows(np, raw, "MXFP4", raw.shape[0], 128)
        ref = gguf_dequantize(raw, MX)
    llama = dequantize_array(raw, "MXFP4")
    np.testing.assert_array_equal(_bits(ours), _bits(ref))
    np.testing.assert_array_equal(_bits(ours), _bits(llama))
    assert np.isinf(ours).any() and (ours[0:2, :32][ours[0:2, :32] != 0] < 1e-37).all()  # the extremes were hit


def test_quantize_matches_llamacpp_reference():
    """gguf-py's MXFP4 quantizer and llama.cpp's quantize_row_mxfp4_ref (through ggml_quantize_chunk) write the
    same bytes, block maxima just below a power of two (the E8M0 exponent's edge) included; dequantizing them
    gives back the values to within the format's step."""
    pytest.importorskip("llama_cpp")
    from alchemist.harness.quantize import dequantize_array, quantize_array

    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 256)) * np.exp(rng.uniform(-20, 20, size=(3, 5, 1)))
    edge = np.nextafter(np.float32(2.0) ** np.arange(-60, 60, dtype=np.float32), np.float32(0))
    y = rng.standard_normal((len(edge), 32)) * edge[:, None] * 0.3
    y[:, 0] = edge
    for values in (x.astype(np.float32), y.astype(np.float32), np.zeros((2, 64), np.float32)):
        blocks = quantize_array(values, "MXFP4")
        assert blocks.shape == (*values.shape[:-1], row_bytes("MXFP4", values.shape[-1]))
        np.testing.assert_array_equal(blocks, gguf_quantize(values, MX))
        back = dequantize_array(blocks, "MXFP4")
        # largest code 12 * 2^(e - 128) = 1.5 * 2^floor(log2 amax): values above it saturate; below, half a step
        amax = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True)
        step = np.where(amax > 0, 2.0 ** np.floor(np.log2(np.where(amax > 0, amax, 1))), 0)
        err = np.abs(back.reshape(-1, 32).astype(np.float64) - values.reshape(-1, 32))
        assert np.all(err <= 0.5 * step + 1e-300)
    # e = floor(log2f(amax)) - 2 + 127 with a float32 log2: just below 2^k it rounds up to k for |k| >= 1
    e = quantize_array(y, "MXFP4")[:, 0].astype(np.int64)
    log2f = np.log2(edge.astype(np.float64)).astype(np.float32)
    np.testing.assert_array_equal(e, np.floor(log2f) - 2 + 127)
    assert (e != np.floor(np.log2(edge.astype(np.float64))) - 2 + 127).sum() >= 100


def test_expert_stack_through_a_gguf_and_the_kernels(tmp_path):
    """A 3-D MXFP4 tensor (n_expert, n_out, n_in) written with gguf-py, read back by alchemist's reader: its
    bytes, as_blocks' (n_expert, n_out, row_bytes) view, and each expert's matmul on C and Numba."""
    import gguf

    from alchemist.gguf_io import read_gguf

    n_expert, n_out, n_in = 3, 8, 96
    rng = np.random.default_rng(2)
    w = rng.standard_normal((n_expert, n_out, n_in)).astype(np.float32)
    blocks = gguf_quantize(w, MX)
    writer = gguf.GGUFWriter(tmp_path / "experts.gguf", "llama")
    writer.add_tensor("blk.0.ffn_up_exps.weight", blocks, raw_shape=blocks.shape, raw_dtype=MX)
    writer.add_tensor("blk.0.ffn_down.weight", blocks[1], raw_shape=blocks[1].shape, raw_dtype=MX)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    facts = read_gguf(tmp_path / "experts.gguf")
    info = facts.tensors["blk.0.ffn_up_exps.weight"]
    assert (info.ggml_type, info.shape, info.nbytes) == ("MXFP4", (n_expert, n_out, n_in), blocks.nbytes)
    assert facts.tensors["blk.0.ffn_down.weight"].shape == (n_out, n_in)
    stack = as_blocks(facts.tensor_bytes("blk.0.ffn_up_exps.weight"), "MXFP4", info.shape)
    np.testing.assert_array_equal(stack, blocks)
    ref = gguf_dequantize(stack, MX)
    assert ref.shape == (n_expert, n_out, n_in)
    np.testing.assert_array_equal(
        dequantize_rows(np, stack.reshape(-1, stack.shape[-1]), "MXFP4", 24, n_in), ref.reshape(24, n_in)
    )

    x = rng.standard_normal((5, n_in)).astype(np.float32)
    xs = pt.matrix("x", dtype="float32")
    ws = pt.matrix("w", dtype="uint8", shape=(n_out, row_bytes("MXFP4", n_in)))
    for backend in ("c", "numba"):
        f = pytensor.function([xs, ws], quantized_linear(xs, ws, "MXFP4", n_out, n_in), mode=get_mode(backend))
        for e in range(n_expert):
            for t in (1, 5):
                want = x[:t].astype(np.float64) @ ref[e].T.astype(np.float64)
                np.testing.assert_allclose(f(x[:t], stack[e]), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ against llama.cpp, end to end

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500, 64, 9]
CONTEXT = 64


@pytest.fixture(scope="module")
def llama_mxfp4(fixture_files):
    pytest.importorskip("llama_cpp")
    return fixture_files("llama", "F32"), fixture_files("llama", "MXFP4")


def test_llamacpp_quantizes_every_2d_weight_to_mxfp4_as_we_do(llama_mxfp4):
    """`quantize_fixture(..., "MXFP4")` (llama.cpp, pure MXFP4_MOE): every 2-D weight is MXFP4, byte for byte
    what quantize_array makes of the F32 source."""
    from alchemist.gguf_io import read_gguf
    from alchemist.harness.quantize import quantize_array

    f32, mx = (read_gguf(p) for p in llama_mxfp4)
    seen = 0
    for name, info in mx.tensors.items():
        assert info.ggml_type == ("MXFP4" if len(info.shape) == 2 else "F32"), name
        if info.ggml_type == "MXFP4":
            src = np.frombuffer(f32.tensor_bytes(name), dtype=np.float32).reshape(info.shape)
            got = as_blocks(mx.tensor_bytes(name), "MXFP4", info.shape)
            np.testing.assert_array_equal(got, quantize_array(src, "MXFP4"), err_msg=name)
            seen += 1
    assert seen >= 8


@pytest.mark.parametrize("backend", ("c", "numba"))
def test_llama_mxfp4_fixture_passes_through_the_kernels(llama_mxfp4, backend):
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, validate_backend

    path = str(llama_mxfp4[1])
    loaded = load_for_validation(path)
    with LlamaCppOracle(path, n_ctx=CONTEXT, n_threads=1) as oracle:
        res = validate_backend(loaded, backend, oracle, PROMPT, 32 if backend == "c" else 0, CONTEXT, quantized=True)
    assert res["passed"], res["failures"]
    assert res["quantized_kernels"]
    assert res["prompt"]["mean_kl"] <= 0.02 and res["prompt"]["mean_pearson"] >= 0.999
    assert res["prompt"]["top1_agree"] == len(PROMPT)


def test_llamacpp_rounding_explains_the_whole_mxfp4_difference(llama_mxfp4):
    """llama.cpp multiplies MXFP4 weights by Q8_0-rounded activations; emulating that (harness.emulate) leaves
    only float32 summation order between us and llama.cpp: logits NMSE ~1e-4 -> ~1e-15."""
    from alchemist.harness import LlamaCppOracle
    from alchemist.harness.validate import load_for_validation, validate_backend

    path = str(llama_mxfp4[1])
    loaded = load_for_validation(path, llamacpp_rounding=True)
    with LlamaCppOracle(path, n_ctx=CONTEXT, n_threads=1) as oracle:
        res = validate_backend(loaded, "c", oracle, PROMPT, 0, CONTEXT, quantized=True)
    assert res["prompt"]["logits_nmse"] <= 1e-10, res["prompt"]
