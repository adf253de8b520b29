"""`alchemist perplexity`: the windowing convention, its errors, and agreement with llama.cpp on the same windows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from alchemist.errors import AlchemistError
from alchemist.perplexity import (
    check_window_args,
    compare,
    log_softmax_at,
    make_windows,
    perplexity,
    perplexity_file,
    read_text,
)

SAMPLE = Path(__file__).parent / "data" / "perplexity_sample.txt"
# the fixtures' SentencePiece vocabulary has these words and every letter: ~140 tokens, 5 windows of 32
FIXTURE_TEXT = "the cat sat on the mat and it was in the house of the dog. " * 3
CONTEXT = 32


# ---------------------------------------------------------------------------------------------- windows


def _scored(windows):
    """{position in the tokenized text: left context it was scored with}."""
    seen = {}
    for w in windows:
        assert len(w.ids) <= CONTEXT
        for i, pos in zip(range(w.score_from, len(w.ids)), w.positions()):
            assert pos not in seen, f"token {pos} scored twice"
            seen[pos] = i
    return seen


@pytest.mark.parametrize("stride", [None, 31, 10, 1])
def test_windows_with_bos_score_every_text_token_once(stride):
    body = list(range(100, 200))
    stride = check_window_args(CONTEXT, stride, 1)
    windows = make_windows([1], body, CONTEXT, stride)
    assert all(w.ids[0] == 1 for w in windows)
    scored = _scored(windows)
    assert sorted(scored) == list(range(1, 101))  # BOS is position 0, never a target
    for w in windows:  # each window's tokens are the text's, in place
        assert w.ids[1:] == body[w.start - 1 : w.start - 1 + len(w.ids) - 1]
    # every token is scored where it has the most left context any window offers it
    offered = {}
    for w in windows:
        for i in range(1, len(w.ids)):
            pos = w.start + i - 1
            offered[pos] = max(offered.get(pos, 0), i)
    assert scored == offered
    assert len(windows) == 1 + math.ceil((100 - (CONTEXT - 1)) / stride)


def test_windows_without_bos_follow_hugging_face():
    body = list(range(100, 180))
    windows = make_windows([], body, CONTEXT, CONTEXT)  # non-overlapping: a window's first token has no context
    assert [w.start for w in windows] == [0, 32, 64]
    assert sorted(_scored(windows)) == [p for p in range(80) if p % 32 != 0]
    windows = make_windows([], body, CONTEXT, 16)  # overlapping: only the very first token is unscored
    assert sorted(_scored(windows)) == list(range(1, 80))


def test_log_softmax_is_float64_and_stable():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((5, 50)).astype(np.float32) * 3
    targets = np.array([0, 7, 49, 3, 3])
    expect = [math.log(math.exp(r[t]) / sum(math.exp(v) for v in r)) for r, t in zip(rows.astype(float), targets)]
    got = log_softmax_at(rows, targets)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, expect, rtol=1e-12)
    big = log_softmax_at(np.array([[1000.0, 990.0]]), np.array([1]))  # exp would overflow
    assert big[0] == pytest.approx(-10 - math.log1p(math.exp(-10)), rel=1e-12)


@pytest.mark.parametrize(
    "context, stride, prefix, n_ctx, message",
    [
        (1, None, 0, 512, "--context 1: a window needs at least 2 tokens"),
        (600, None, 1, 512, "--context 600: the model's context is 512 tokens"),
        (32, 0, 1, 512, "--stride 0: must be between 1 and 31"),
        (32, 32, 1, 512, "--stride 32: must be between 1 and 31 (32 - 1 for the BOS"),
        (32, 33, 0, 512, "--stride 33: must be between 1 and 32"),
    ],
)
def test_bad_windows_are_named(context, stride, prefix, n_ctx, message):
    with pytest.raises(AlchemistError) as e:
        check_window_args(context, stride, prefix, n_ctx)
    assert message in str(e.value)


def test_bad_text_files_are_named(tmp_path):
    with pytest.raises(AlchemistError, match="nope.txt: no such text file"):
        read_text(tmp_path / "nope.txt")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    with pytest.raises(AlchemistError, match="latin1.txt: not UTF-8 text"):
        read_text(bad)
    # both before any model is loaded
    with pytest.raises(AlchemistError, match="latin1.txt: not UTF-8"):
        perplexity_file(tmp_path / "no-such-model.gguf", bad)


def test_cli_error_is_one_line(tmp_path, capsys):
    from alchemist.cli import main

    assert main(["perplexity", str(tmp_path / "m.gguf"), str(tmp_path / "t.txt")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "t.txt: no such text file" in err


# ---------------------------------------------------------------------------------------------- vs llama.cpp


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf, tiny_dir):
    """tiny_model(arch, weight_type) -> LoadedModel (C backend, KV cache of CONTEXT); Q4_K from llama.cpp's quantizer."""
    from alchemist import load_llm

    cache = {}

    def get(arch, wtype="F32"):
        if (arch, wtype) not in cache:
            path = tiny_gguf(arch, "F32")
            if wtype != "F32":
                from alchemist.harness.quantize import quantize_fixture

                dst = tiny_dir / f"{arch}-{wtype}.gguf"
                if not dst.exists():
                    quantize_fixture(path, dst, wtype, nthread=1)
                path = dst
            cache[arch, wtype] = load_llm(path, "c", context=CONTEXT, progress=False, compile_now=False)
        return cache[arch, wtype]

    return get


# F32: the same arithmetic as llama.cpp up to summation order. Q4_K: llama.cpp rounds every matmul input to
# 8 bits (Q8_K) and alchemist does not; on gemma3's fixture (logits on a realistic scale, ~7 nats per token)
# that stays under 1e-3. The llama and qwen fixtures' random logits are extreme (40-170 nats per token), where
# the same rounding moves perplexity by ~1% (see the report), so their Q4_K files are not held to 1e-3.
CASES = [
    ("llama", "F32", 1e-4),
    ("gemma3", "F32", 1e-4),
    ("qwen2", "F32", 1e-4),  # no BOS: the first token of the text is never scored
    ("gemma3", "Q4_K", 1e-3),
]


@pytest.mark.parametrize("stride", [None, 8], ids=["no-overlap", "stride8"])
@pytest.mark.parametrize("arch, wtype, bar", CASES, ids=[f"{a}-{w}" for a, w, _ in CASES])
@pytest.mark.oracle
def test_perplexity_matches_llamacpp(tiny_model, arch, wtype, bar, stride):
    pytest.importorskip("llama_cpp")
    model = tiny_model(arch, wtype)
    result = compare(model, FIXTURE_TEXT, context=CONTEXT, stride=stride, progress=False, n_threads=1)
    ours, ref = result.ours, result.llamacpp
    ids = model.tokenizer.encode(FIXTURE_TEXT)
    bos = model.tokenizer.add_bos
    assert ref.extra["tokenizer_agrees"]
    assert ours.token_ids == ref.token_ids and ours.positions == ref.positions
    assert ours.n_text_tokens == len(ids) > 2 * CONTEXT
    assert ours.n_windows >= 2 and ours.n_windows == ref.n_windows
    room = CONTEXT - bos
    n_expected = len(ids) - 1 if (bos or stride) else len(ids) - ours.n_windows
    assert ours.n_scored == n_expected
    assert ours.token_ids == [ids[p] for p in ours.positions]
    assert ours.stride == (stride or room)
    assert math.isfinite(ours.perplexity) and ours.perplexity > 1
    assert abs(result.relative_diff) < bar, result.table()
    if wtype == "F32":
        assert result.max_abs_logprob_diff < 1e-2, result.table()


def test_perplexity_without_oracle_and_bad_text(tiny_model):
    model = tiny_model("llama")
    with pytest.raises(AlchemistError, match="sample: 1 token"):
        perplexity(model, "", name="sample")  # BOS alone
    with pytest.raises(AlchemistError, match="--context 64: the model was loaded with a KV cache of 32"):
        perplexity(model, FIXTURE_TEXT, context=64)
    one = perplexity(model, [1, 300], context=CONTEXT, progress=False)  # token ids, BOS + one token: one prediction
    assert one.n_scored == 1 and one.n_windows == 1 and one.perplexity == pytest.approx(math.exp(-one.logprobs[0]))


@pytest.mark.oracle
def test_cli_writes_table_and_json(tiny_gguf, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    from alchemist.cli import main

    text = tmp_path / "t.txt"
    text.write_text(FIXTURE_TEXT)
    out = tmp_path / "ppl.json"
    argv = ["perplexity", str(tiny_gguf("llama")), str(text), "--context", "32", "--stride", "16", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for row in ("tokens scored", "windows", "alchemist [c] ppl", "llama.cpp ppl", "relative diff", "max |Δ logprob|"):
        assert row in printed
    data = json.loads(out.read_text())
    assert data["alchemist"]["n_scored"] == len(data["llamacpp"]["logprobs"]) == len(data["alchemist"]["positions"])
    assert data["alchemist"]["stride"] == 16 and abs(data["relative_diff"]) < 1e-4


# ---------------------------------------------------------------------------------------------- reference model


# gemma-3-270m is Q4_K_M: llama.cpp rounds every matmul input to 8 bits (Q8_K/Q8_0) and alchemist multiplies
# exact activations, which on this text puts alchemist's perplexity 1.7% below llama.cpp's (per-token differences
# with a standard deviation of 0.10 nats, in line with `alchemist validate`'s mean KL of 4e-3). The bar (1%)
# applies like for like: with llama.cpp's rounding emulated in our graph (alchemist.harness.emulate) the same
# windows must agree to 1%; the exact run is checked for the same tokens and windows and a sane value.
@pytest.mark.slow
@pytest.mark.oracle
def test_gemma_perplexity_matches_llamacpp(reference_models):
    pytest.importorskip("llama_cpp")
    path = reference_models["gemma-3-270m"]
    exact = perplexity_file(path, SAMPLE, context=128, progress=False, numerics="exact")
    ours, ref = exact.ours, exact.llamacpp
    print("\n" + exact.table())
    assert ref.extra["tokenizer_agrees"]
    assert ours.n_text_tokens > 256 and ours.n_windows == 3 and ours.n_scored == ours.n_text_tokens - 1
    assert 5 < ours.perplexity < 100  # English prose under a real model
    rounded = perplexity_file(path, SAMPLE, context=128, progress=False, llamacpp_rounding=True)
    print("\n" + rounded.table())
    assert rounded.ours.token_ids == ours.token_ids
    assert abs(rounded.relative_diff) < 0.01, rounded.table()
