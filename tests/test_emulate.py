"""The --llamacpp-rounding diagnostic must round exactly as ggml-cpu does, bit for bit: numpy transcriptions
of quantize_row_q8_0 (AVX2 path) and quantize_row_q8_K_ref are the reference."""

from __future__ import annotations

import numpy as np
import pytensor
import pytensor.tensor as pt
import pytest

from alchemist.harness.emulate import round_like_q8_0, round_like_q8_k
from alchemist.runtime.backends import get_mode


def ggml_q8_0(x):
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(amax == 0, np.float32(0), np.float32(127) / amax).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (np.round(blocks * inverse) * d).reshape(x.shape)


def ggml_q8_k(x):
    blocks = x.reshape(x.shape[0], -1, 256)
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(-1)[..., None], -1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = (np.float32(-127) / signed_max).astype(np.float32)
        q = np.minimum(np.round(iscale * blocks), np.float32(127))
        out = q * (np.float32(1) / iscale)
    return np.where(signed_max == 0, np.float32(0), out).reshape(x.shape)  # ggml: d = 0, qs = 0


@pytest.fixture(scope="module")
def activations():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((64, 4864)) * rng.uniform(0.01, 3, (64, 1))).astype(np.float32)
    x[0, :256] = 0  # an all-zero block quantizes to zeros
    return x


@pytest.mark.parametrize("graph, reference", [(round_like_q8_0, ggml_q8_0), (round_like_q8_k, ggml_q8_k)])
def test_activation_rounding_is_bit_exact(activations, graph, reference):
    x = pt.matrix("x", dtype="float32")
    ours = pytensor.function([x], graph(x), mode=get_mode("c"))(activations)
    expected = reference(activations)
    assert not np.isnan(ours).any()
    mismatched = int((ours != expected).sum())
    assert mismatched == 0, f"{mismatched} of {ours.size} activations round differently from ggml"
