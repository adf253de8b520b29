"""The report charts on synthetic metric data (no llama.cpp): valid PNGs of a sensible size, deterministic bytes,
the first divergence marked at its layer, and reports that are still written when a chart cannot be drawn."""

from __future__ import annotations

import json

import numpy as np
import pytest

from alchemist.harness import charts
from alchemist.harness.validate import THRESHOLDS, diff_to_markdown, to_markdown, write_diff, write_validation


def _series(rng, n, decisive=(), ties=()):
    return {
        "kl": [0.0] + list(10 ** rng.uniform(-6, -2, n - 1)),  # a bit-identical row is drawn at the floor
        "pearson": [None] + list(1 - 10 ** rng.uniform(-7, -3.5, n - 1)),  # a constant row has no Pearson
        "top10_overlap": [int(v) for v in rng.integers(6, 11, n)],
        "top1_agree": [i not in decisive and i not in ties for i in range(n)],
        "near_tie": [i in ties for i in range(n)],
    }


@pytest.fixture
def validation_report():
    rng = np.random.default_rng(0)
    backend = {
        "backend": "c",
        "exact_weights": False,
        "passed": False,
        "failures": ["prompt top-1 differs at positions [4] (not near-ties)"],
        "prompt": {
            "n_positions": 12,
            "mean_kl": 3e-3,
            "mean_pearson": 0.9995,
            "top1_agree_decisive": 11,
            "n_decisive": 12,
            "n_near_ties": 0,
            "logits_nmse": 1e-4,
        },
        "greedy": {"n_agree": 15, "n_steps": 16},
        "compile_count": 2,
        "seconds": 1.0,
        "positions": {"prompt": _series(rng, 12, decisive=(4,)), "generated": _series(rng, 16, ties=(9,))},
    }
    return {
        "model": "Tiny Synthetic",
        "source_file": "tiny-Q8_0.gguf",
        "source_sha256": "0" * 64,
        "architecture": "llama",
        "weight_types": ["F32", "Q8_0"],
        "thresholds": THRESHOLDS,
        "numerics": "exact",
        "arithmetic": {"note": "oracle: llama.cpp built for x86-64 AVX2+FMA+F16C"},
        "prompt_token_ids": list(range(12)),
        "backends": {"c": backend},
        "passed": False,
    }


def _diff(first_layer: int | None = 2, n_layer: int = 5, tol: float = 1e-6) -> dict:
    kinds = ["attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "ffn_inp", "ffn_out", "l_out"]
    rows = [("inp_embd", 0.0)]
    for il in range(n_layer):
        for j, kind in enumerate(kinds):
            bad = first_layer is not None and (il, j) >= (first_layer, 1)  # from Qcur of first_layer on
            rows.append((f"{kind}-{il}", 10 ** (-4 + 0.1 * il) if bad else 10 ** (-12 + 0.3 * il)))
    rows += [("result_norm", rows[-1][1]), ("result_output", rows[-1][1] * 2)]
    first = next((n for n, v in rows if v > tol), None)
    return {
        "model": "Tiny Synthetic",
        "source_file": "tiny-F32.gguf",
        "source_sha256": "0" * 64,
        "architecture": "llama",
        "weight_types": ["F32"],
        "numerics": "exact",
        "arithmetic": {"note": "oracle: llama.cpp built for x86-64 AVX2+FMA+F16C"},
        "prompt_token_ids": [1, 2, 3],
        "prompt_tokens": 3,
        "backend": "c",
        "tolerance": tol,
        "exact_weights": True,
        "rows": rows,
        "first_divergence": first,
    }


def test_validation_chart_is_a_sensible_deterministic_png(validation_report, tmp_path, png_size):
    a = charts.validation_chart(validation_report, "c", tmp_path / "a.png")
    b = charts.validation_chart(validation_report, "c", tmp_path / "b.png")
    width, height = png_size(a)
    assert 800 <= width <= 2000 and 600 <= height <= 1500
    assert a.read_bytes() == b.read_bytes()


def test_validation_chart_marks_the_failing_positions(validation_report):
    import matplotlib.style

    with matplotlib.style.context("default"):
        fig = charts._validation_figure(validation_report, "c")
    kl_axis = fig.axes[0]
    # vertical lines: the decisive disagreement (prompt row 4 -> context length 5) and the near-tie (generated
    # step 9 -> context length 12 + 9); nothing else
    marks = sorted(
        (line.get_xdata()[0], line.get_linestyle())
        for line in kl_axis.get_lines()
        if len(set(line.get_xdata())) == 1 and line.get_xdata()[0] == line.get_xdata()[-1] and line.get_ydata()[0] == 0
    )
    assert marks == [(5, "-"), (21, ":")]
    assert "FAIL" in fig.get_suptitle() and "c backend" in fig.get_suptitle()


def test_validation_chart_without_positions_is_reported_not_raised(validation_report, tmp_path):
    del validation_report["backends"]["c"]["positions"]
    png, error = charts.draw(charts.validation_chart, validation_report, "c", tmp_path / "x.png")
    assert png is None and "no per-position metrics" in error
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("first_layer", [0, 2, 4])
def test_diff_chart_marks_the_first_divergent_layer(first_layer, tmp_path, png_size):
    diff = _diff(first_layer)
    assert diff["first_divergence"] == f"Qcur-{first_layer}"
    import matplotlib.style

    with matplotlib.style.context("default"):
        fig = charts._diff_figure(diff)
    ring = [line for line in fig.axes[0].get_lines() if line.get_gid() == "first-divergence"]
    # x: the layer, plus a small offset for the kind's place in the layer's evaluation order
    assert len(ring) == 1 and round(ring[0].get_xdata()[0]) == first_layer
    assert ring[0].get_ydata()[0] == pytest.approx(dict(diff["rows"])[diff["first_divergence"]])
    # the heatmap outlines the same cell: the first divergence's layer (column) and kind (row)
    from matplotlib.patches import Rectangle

    boxes = [b for b in fig.axes[1].patches if isinstance(b, Rectangle) and not b.get_fill()]
    assert [(b.get_x() + 0.5, b.get_y()) for b in boxes] == [(first_layer, 2)]  # rows: inp_embd, attn_norm, Qcur
    notes = [t.get_text() for t in fig.axes[0].texts]
    assert any(f"first divergent op: Qcur-{first_layer}" in t for t in notes)
    assert f"Qcur-{first_layer}" in fig.get_suptitle()
    width, height = png_size(charts.diff_chart(diff, tmp_path / "d.png"))
    assert 800 <= width <= 2000 and 400 <= height <= 1200


def test_diff_layout_places_tensors_outside_the_layers():
    by_kind, xs, n_layer = charts.diff_layout(_diff(None, n_layer=3)["rows"])
    assert n_layer == 3
    assert xs["inp_embd"] == -1 and xs["attn_norm-2"] == 2 and xs["result_output"] == 3
    assert list(by_kind)[:3] == ["inp_embd", "attn_norm", "Qcur"]
    assert [x for x, _ in by_kind["l_out"]] == [0, 1, 2]
    assert charts.split_name("ffn_out-12") == ("ffn_out", 12) and charts.split_name("result_norm") == (
        "result_norm",
        None,
    )


def test_clean_diff_chart(tmp_path):
    diff = _diff(None)
    assert diff["first_divergence"] is None
    import matplotlib.style

    with matplotlib.style.context("default"):
        fig = charts._diff_figure(diff)
    assert not [line for line in fig.axes[0].get_lines() if line.get_gid() == "first-divergence"]
    assert "no tensor over 1e-06" in fig.get_suptitle()


def test_reports_link_their_charts(validation_report, tmp_path, png_size):
    paths = write_validation(validation_report, tmp_path, "tiny")
    assert [p.name for p in paths] == ["tiny.json", "tiny.md", "tiny_c.png"]
    png_size(tmp_path / "tiny_c.png")
    assert "![c backend: KL, Pearson and top-1/top-10 per position](tiny_c.png)" in (tmp_path / "tiny.md").read_text()
    assert json.loads((tmp_path / "tiny.json").read_text())["backends"]["c"]["chart"] == "tiny_c.png"

    diff = _diff(1)
    paths = write_diff(diff, tmp_path, "tiny_diff_c")
    assert [p.name for p in paths] == ["tiny_diff_c.json", "tiny_diff_c.md", "tiny_diff_c.png"]
    md = (tmp_path / "tiny_diff_c.md").read_text()
    assert "![per-layer NMSE against llama.cpp](tiny_diff_c.png)" in md
    assert "first divergent tensor: **Qcur-1**" in md and "| Qcur-1 | 1.259e-04 | first divergence |" in md
    assert json.loads((tmp_path / "tiny_diff_c.json").read_text())["chart"] == "tiny_diff_c.png"


def test_reports_survive_a_chart_that_cannot_be_drawn(validation_report, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no usable font (simulated)")

    monkeypatch.setattr(charts, "validation_chart", broken)
    monkeypatch.setattr(charts, "diff_chart", broken)
    paths = write_validation(validation_report, tmp_path, "tiny")
    assert [p.name for p in paths] == ["tiny.json", "tiny.md"]
    md = (tmp_path / "tiny.md").read_text()
    assert "| c |" in md and "chart not drawn (RuntimeError: no usable font (simulated))" in md
    assert json.loads((tmp_path / "tiny.json").read_text())["backends"]["c"]["chart_error"].startswith("RuntimeError")
    assert not list(tmp_path.glob("*.png"))

    diff = _diff(2)
    write_diff(diff, tmp_path, "d")
    md = (tmp_path / "d.md").read_text()
    assert "chart not drawn (RuntimeError: no usable font (simulated))" in md and "| Qcur-2 |" in md
    assert to_markdown(validation_report) and diff_to_markdown(diff)  # a second render of the same dicts still works


def test_redraw_from_saved_reports(validation_report, tmp_path):
    write_validation(validation_report, tmp_path, "tiny")
    write_diff(_diff(3), tmp_path, "tiny_diff_c")
    before = (tmp_path / "tiny_diff_c.png").read_bytes()
    (tmp_path / "tiny_c.png").unlink()
    (tmp_path / "tiny_diff_c.png").unlink()
    assert [p.name for p in charts.redraw(tmp_path / "tiny.json")] == ["tiny_c.png"]
    assert [p.name for p in charts.redraw(tmp_path / "tiny_diff_c.json")] == ["tiny_diff_c.png"]
    assert (tmp_path / "tiny_diff_c.png").read_bytes() == before
