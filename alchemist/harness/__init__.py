"""Validation harness: llama.cpp as an independent oracle, comparison metrics, fixture quantization.

- `LlamaCppOracle(path, n_ctx=512, n_threads=None)`: logits / greedy / rescore / intermediates / tokenize
- `compare_logits(ours, oracle)`, `nmse`, `first_divergence`, `greedy_agreement`
- `quantize_fixture(src, dst, qtype)` through `llama_model_quantize`

llama-cpp-python (the `oracle` extra) is imported lazily: importing this package works without it.
"""

from alchemist.harness._llama import OracleError
from alchemist.harness.metrics import (
    NEAR_TIE,
    DivergenceReport,
    GreedyAgreement,
    PositionMetrics,
    compare_logits,
    first_divergence,
    greedy_agreement,
    kl_divergence,
    log_softmax,
    nmse,
    pearson,
    top2_gap,
)
from alchemist.harness.oracle import LlamaCppOracle
from alchemist.harness.quantize import FIXTURE_QTYPES, QuantizeReport, ftype_for, quantize_fixture

__all__ = [
    "DivergenceReport",
    "FIXTURE_QTYPES",
    "GreedyAgreement",
    "LlamaCppOracle",
    "NEAR_TIE",
    "OracleError",
    "PositionMetrics",
    "QuantizeReport",
    "compare_logits",
    "first_divergence",
    "ftype_for",
    "greedy_agreement",
    "kl_divergence",
    "log_softmax",
    "nmse",
    "pearson",
    "quantize_fixture",
    "top2_gap",
]
