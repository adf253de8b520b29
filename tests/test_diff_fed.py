"""`alchemist diff --fed`: every layer run on llama.cpp's own input to it (alchemist.harness.fed), live against
llama.cpp on tiny F32 fixtures: each layer's own error is within 1e-10, and a broken layer is named
as the fed diff's first divergence while the accumulated (whole-model) column carries its error onward."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from alchemist.errors import AlchemistError  # noqa: E402
from alchemist.harness import charts, fed  # noqa: E402
from alchemist.harness.validate import diff_model, diff_to_markdown, write_diff  # noqa: E402

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 500]


@pytest.fixture(scope="module")
def clean_diffs(fixture_files):
    """(arch, n_tokens, fed) -> diff_model(..., fed=fed) of its F32 fixture on PROMPT[:n_tokens] (numerics ggml, C)."""
    cache = {}

    def get(arch, n_tokens=len(PROMPT), fed=True):
        key = (arch, n_tokens, fed)
        if key not in cache:
            cache[key] = diff_model(str(fixture_files(arch, "F32")), "c", PROMPT[:n_tokens], fed=fed)
        return cache[key]

    return get


# Not gemma3: its GELU reads ggml's fp16 table, so a gate value one float32 ulp off can land on the other side of
# an fp16 rounding and move its output by an fp16 step. Which values are an ulp off depends on the F32 matmuls'
# summation order, i.e. on the BLAS kernel this CPU gets (OpenBLAS's Haswell or SkylakeX sgemm): whether any
# flips on a given prompt is chance. test_gelu_table_flips holds gemma3 to the bars that do not depend on it.
@pytest.mark.parametrize("arch, n_tokens, first_input", [("llama", 12, "embd"), ("lfm2", 12, None)])
def test_every_layer_fed_llamacpp_input_is_within_the_bar(clean_diffs, arch, n_tokens, first_input):
    """F32 weights: llama.cpp multiplies exact activations, so a layer fed its input differs only by float32
    summation order: every tap of every layer (and the head) within NMSE 1e-10."""
    diff = clean_diffs(arch, n_tokens)
    section = diff["fed"]
    if first_input:
        assert section["input"] == first_input
    n_layer = max(fed.layer_of(r["tensor"]) for r in section["rows"]) + 1
    assert [e["layer"] for e in section["layers"]] == list(range(n_layer)) + [fed.HEAD]
    assert section["first_divergence"] is None and section["tolerance"] == 1e-10
    for e in section["layers"]:
        assert e["max_nmse"] <= 1e-10, e
        assert e["first_exceeding"] is None and e["n_taps"] >= 2
    # every tap we compute is in the fed column, each layer's output among them
    assert [r["tensor"] for r in section["rows"]] == [n for n, _ in diff["rows"]]
    assert all(f"l_out-{il}" in {r["tensor"] for r in section["rows"]} for il in range(n_layer))
    if arch == "llama":
        # layer 0 reads the very tensor our whole model computes (the embedding rows, bit for bit): the fed
        # function computes what the engine's step computes, op for op, so its layer 0 is the same to the bit
        accumulated = dict(diff["rows"])
        layer0 = [r for r in section["rows"] if fed.layer_of(r["tensor"]) == 0]
        assert len(layer0) >= 5 and all(r["nmse"] == accumulated[r["tensor"]] for r in layer0)


def test_gelu_table_flips(llamacpp_bits, clean_diffs):
    """gemma3 on 12 tokens, each tap also computed from llama.cpp's taps before it (op-fed): every op is within
    1e-10 of llama.cpp given llama.cpp's inputs; fed only the layer input, ffn_out carries the GELU table's
    fp16 steps of the few gate values whose float32 ulp moved them across an fp16 rounding (<= 5e-9: which values
    are an ulp off is chance, the F32 matmuls' summation order; with RoPE and attention exact it is 1.6e-9)."""
    diff = clean_diffs("gemma3", len(PROMPT), "ops")
    assert diff["fed"]["input"] == "inp_scaled"  # gemma3's first block reads the scaled embedding
    rows = {r["tensor"]: r for r in diff["fed"]["rows"]}
    assert [r["tensor"] for r in diff["fed"]["rows"]] == [n for n, _ in diff["rows"]]
    assert all(r["op_nmse"] <= 1e-10 for r in rows.values())
    assert all(r["nmse"] <= 5e-9 for r in rows.values())
    for il in (0, 1):
        assert rows[f"ffn_out-{il}"]["op_nmse"] <= rows[f"ffn_out-{il}"]["nmse"]
        assert rows[f"ffn_norm-{il}"]["op_differing"] == 0 < rows[f"ffn_norm-{il}"]["differing"]


def test_fed_diff_names_the_broken_layer(fixture_files, monkeypatch, tmp_path, png_size):
    """One weight of layer 1's Q projection off by 1e-3: the fed diff names Qcur-1 (layer 0 stays within the bar,
    and so does everything fed llama.cpp's input after layer 1), while the accumulated column carries the error
    into every later tensor."""
    import alchemist.harness.validate as validate_mod

    real_loader = validate_mod.load_for_validation

    def broken_loader(path, **kwargs):
        loaded = real_loader(path, **kwargs)
        weights = loaded.weights_for("c")  # cached by the loaded model: what diff_model's engine gets
        q = np.array(weights["blk.1.attn_q.weight"], copy=True)
        q.reshape(-1)[0] += np.float32(1e-3)
        weights["blk.1.attn_q.weight"] = q
        return loaded

    monkeypatch.setattr(validate_mod, "load_for_validation", broken_loader)
    diff = diff_model(str(fixture_files("llama", "F32")), "c", PROMPT, fed=True)
    section = diff["fed"]
    layers = {e["layer"]: e for e in section["layers"]}
    assert section["first_divergence"] == "Qcur-1"
    assert layers[0]["first_exceeding"] is None and layers[0]["max_nmse"] <= 1e-10
    assert layers[1]["first_exceeding"] == "Qcur-1" and layers[1]["first_exceeding_nmse"] > 1e-10
    assert layers[fed.HEAD]["first_exceeding"] is None  # the head reads llama.cpp's l_out-1, not ours
    # accumulated: the error rides on through the later tensors and the logits; fed: it stays in layer 1
    accumulated = dict(diff["rows"])
    fed_nmse = {r["tensor"]: r["nmse"] for r in section["rows"]}
    for name in ("Qcur-1", "l_out-1", "result_norm", "result_output"):
        assert accumulated[name] > 1e-10, name
    assert fed_nmse["result_output"] <= 1e-10 < accumulated["result_output"]
    assert accumulated["Qcur-1"] == pytest.approx(fed_nmse["Qcur-1"], rel=0.5)  # the same error, measured twice

    paths = write_diff(diff, tmp_path, "llama_diff_c_fed")
    md = paths[1].read_text()
    assert "first tap over it: **Qcur-1**" in md
    assert "| 1 | " in md and "| Qcur-1 (" in md and "first fed over 1e-10" in md
    saved = json.loads(paths[0].read_text())
    assert saved["fed"]["first_divergence"] == "Qcur-1" and saved["chart"] == "llama_diff_c_fed.png"
    png_size(paths[2])
    import matplotlib.style

    with matplotlib.style.context("default"):
        fig = charts._diff_figure(saved)
    curve = [line for line in fig.axes[0].get_lines() if line.get_gid() == "fed"]
    assert len(curve) == 1
    xs, ys = curve[0].get_data()
    assert list(xs) == [0, 1, 2]  # layers 0, 1 and the head ("out")
    assert ys[1] == pytest.approx(layers[1]["max_nmse"]) and ys[0] < 1e-10 < ys[1]
    assert "fed: first over 1e-10: Qcur-1" in fig.get_suptitle()


def test_cli_diff_fed(fixture_files, tmp_path, capsys):
    from alchemist.cli import main

    path = str(fixture_files("llama", "F32"))
    tokens = ",".join(map(str, PROMPT[:6]))
    assert main(["diff", path, "--tokens", tokens, "--fed", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fed: every layer within NMSE 1.0e-10" in out and "llama_f32_diff_c_fed.png" in out
    assert "  layer 1   max " in out and "accumulated" in out.splitlines()[0]
    saved = json.loads((tmp_path / "llama_f32_diff_c_fed.json").read_text())
    assert saved["fed"]["input"] == "embd" and saved["fed"]["compile_s"] >= 0
    # a fed tolerance no layer can meet fails the command (exit status 1) and names the first tap
    assert main(["diff", path, "--tokens", tokens, "--fed", "--fed-tol", "0", "-o", str(tmp_path)]) == 1
    assert "fed: first tap over NMSE 0.0e+00: " in capsys.readouterr().out


def test_fed_is_refused_for_blocks_that_cannot_be_fed(tiny_module):
    module, _ = tiny_module("gemma3n")
    with pytest.raises(AlchemistError, match="fed-input diff is not available for gemma3n"):
        fed._cache_style(module)
    assert fed._cache_style(tiny_module("llama")[0]) == "kv"
    assert fed._cache_style(tiny_module("lfm2")[0]) == "tuple"  # its per-layer cache: (k, v) or (conv,)


def test_first_block_input_is_checked():
    theirs = {"embd": np.zeros((6, 8), np.float32), "inp_scaled": np.zeros((6, 8), np.float32)}
    assert fed.first_block_input(theirs, ["embd", "inp_scaled", "attn_norm-0"], 6, 8) == "inp_scaled"
    assert fed.first_block_input(theirs, ["embd", "attn_norm-0"], 6, 8) == "embd"
    with pytest.raises(AlchemistError, match=r"'inp_scaled' is \(6, 8\), expected .* \(5, 8\)"):
        fed.first_block_input(theirs, ["embd", "inp_scaled"], 5, 8)
    with pytest.raises(AlchemistError, match="evaluated none of"):
        fed.first_block_input(theirs, ["attn_norm-0"], 6, 8)


def test_fed_markdown_without_a_fed_section_is_unchanged(clean_diffs):
    diff = dict(clean_diffs("llama", len(PROMPT)))
    md_fed = diff_to_markdown(diff)
    assert "| tensor | accumulated NMSE | fed NMSE | fed: differing elements | |" in md_fed
    assert "**every layer within 1.0e-10**" in md_fed
    del diff["fed"]
    assert "| tensor | NMSE vs llama.cpp | |" in diff_to_markdown(diff)


def test_op_fed_isolates_each_op(llamacpp_bits, fixture_files):
    """--fed-ops: every tap computed from llama.cpp's taps before it. The residual adds and the RMSNorm given
    llama.cpp's exact inputs reproduce llama.cpp's bits (0 differing elements), where the same taps fed only the
    layer input inherit the float32 summation-order bits of the matmuls before them."""
    diff = diff_model(str(fixture_files("llama", "F32")), "c", PROMPT[:6], fed="ops")
    rows = {r["tensor"]: r for r in diff["fed"]["rows"]}
    assert all("op_nmse" in r for r in rows.values())
    for name in ("ffn_norm-0", "ffn_norm-1", "l_out-0", "l_out-1", "result_norm"):
        assert rows[name]["op_differing"] == 0 and rows[name]["op_nmse"] == 0.0, name
    assert rows["ffn_norm-1"]["differing"] > 0 and rows["l_out-1"]["differing"] > 0  # fed only the layer input
    # attention from llama.cpp's own Q, K and V is llama.cpp's to the bit (alchemist.kernels.attention), where
    # attention after our projections is not
    assert rows["kqv_out-1"]["op_nmse"] < rows["kqv_out-1"]["nmse"]
    assert rows["kqv_out-0"]["op_differing"] == rows["kqv_out-1"]["op_differing"] == 0
    assert all(r["op_nmse"] <= 1e-10 for r in rows.values())
    layers = {e["layer"]: e for e in diff["fed"]["layers"]}
    assert layers[1]["first_op_differing"] == "Qcur-1"  # the first op after attn_norm: an F32 matmul
    assert "op-fed NMSE" in diff_to_markdown(diff) and "first op not bit-exact" in diff_to_markdown(diff)
