"""PNG charts for the validation and diff reports, drawn from the reports' JSON-able dicts.

`validation_chart(report, backend, path)`: per-position KL, 1 − Pearson and top-10 overlap over the prompt
positions and the generated (fresh-prefix) steps, with the bars drawn as lines and the top-1 disagreements
marked. `diff_chart(diff, path)`: per-layer NMSE of every intermediate kind llama.cpp and we both compute,
the tolerance and the first divergent tensor marked. `draw(fn, *args)` never raises: it returns an error
string instead, so a report is written whether or not its picture could be.

Drawn with matplotlib's object API (`Figure`, no pyplot): no display, no global backend state, the PNG goes
through Agg. Matplotlib's default style is pinned and the PNG's "Software" tag dropped, so the same report
gives the same bytes on the same matplotlib version. `python -m alchemist.harness.charts report.json` redraws
the chart of a saved report (validation or diff) beside it.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

DPI = 110
PASS_COLOR, FAIL_COLOR = "#1a7f37", "#cf222e"
PROMPT_COLOR, GEN_COLOR = "#0969da", "#bc4c00"
NEAR_TIE_COLOR = "#d4a72c"
BAR_COLOR = "#cf222e"
_LAYERED = re.compile(r"^(.*)-(\d+)$")


def draw(fn, *args, **kwargs) -> tuple[Path | None, str | None]:
    """(path, None) when `fn(*args)` drew its PNG, (None, reason) when it could not (never raises)."""
    try:
        return Path(fn(*args, **kwargs)), None
    except Exception as exc:  # a missing font, a headless quirk, odd data: the report must still be written
        return None, f"{type(exc).__name__}: {exc}".strip()


def _figure(width: float, height: float):
    from alchemist.pictures import figure

    return figure(width, height, dpi=DPI, layout="constrained")


def _save(fig, path) -> Path:
    import matplotlib.style

    from alchemist.pictures import save

    with matplotlib.style.context("default"):
        return save(fig, path, dpi=DPI, format="png")


def _wrap(lines: list[str], width: int) -> str:
    """Subtitle lines, each wrapped so that none runs off the figure."""
    import textwrap

    return "\n".join(textwrap.fill(line, width, break_on_hyphens=False) for line in lines)


def _floor(values, fallback: float) -> float:
    """Where a log axis draws zeros: a decade below the smallest positive value."""
    positive = [v for v in values if v is not None and math.isfinite(v) and v > 0]
    if not positive:
        return fallback
    return max(10.0 ** (math.floor(math.log10(min(positive))) - 1), 1e-30)


def _on_log(values, floor: float) -> list[float]:
    return [floor if v is None or not math.isfinite(v) or v <= floor else v for v in values]


# ---------------------------------------------------------------------------------------- validation


def _series(report: dict, backend: str) -> tuple[dict, dict | None]:
    res = report["backends"][backend]
    pos = res.get("positions")
    if not pos or "prompt" not in pos:
        raise ValueError(f"backend {backend!r}: the report holds no per-position metrics to draw")
    return pos["prompt"], pos.get("generated")


def validation_chart(report: dict, backend: str, path) -> Path:
    """Three stacked panels over the context length at which the next-token logits are compared: KL(llama.cpp ‖
    ours) in nats (log), 1 − Pearson of the logits (log) and the top-10 overlap, prompt positions then the
    greedy steps re-scored by llama.cpp; the bars as dashed lines, top-1 disagreements as vertical lines."""
    import matplotlib.style

    with matplotlib.style.context("default"):
        return _save(_validation_figure(report, backend), path)


def _validation_figure(report: dict, backend: str):
    res = report["backends"][backend]
    th = report["thresholds"]
    prompt, gen = _series(report, backend)
    n_prompt = len(prompt["kl"])
    xs = {"prompt": list(range(1, n_prompt + 1))}  # row i: the logits after token i, i.e. context length i + 1
    series = {"prompt": prompt}
    if gen and gen["kl"]:
        xs["generated"] = list(range(n_prompt, n_prompt + len(gen["kl"])))
        series["generated"] = gen
    colors = {"prompt": PROMPT_COLOR, "generated": GEN_COLOR}
    labels = {"prompt": "prompt (one prefill, all positions)", "generated": "generated (our greedy prefix, re-scored)"}
    exact = res.get("exact_weights", False)

    fig = _figure(10.5, 8.2)
    axes = fig.subplots(3, 1, sharex=True, height_ratios=[1.25, 1.0, 0.85])
    verdict = "PASS" if res["passed"] else "FAIL"
    fig.suptitle(
        f"alchemist validate: {report['model']} ({report['architecture']}) — {backend} backend — {verdict}",
        fontsize=13,
        fontweight="bold",
        color=PASS_COLOR if res["passed"] else FAIL_COLOR,
    )
    g = res.get("greedy")
    p = res["prompt"]
    sub = [
        f"{Path(report['source_file']).name}; weights {', '.join(report['weight_types'])}; "
        f"numerics {report.get('numerics', 'exact')}",
        f"prompt {n_prompt} tokens: mean KL {p['mean_kl']:.2e}, mean Pearson {p['mean_pearson']:.6f}, "
        f"top-1 {p['top1_agree_decisive']}/{p['n_decisive']} decisive"
        + (f"; greedy {g['n_agree']}/{g['n_steps']} fresh-prefix decisions agree" if g else ""),
    ]
    if res["failures"]:
        sub.append("failures: " + "; ".join(res["failures"]))
    axes[0].set_title(_wrap(sub, 150), fontsize=9, loc="left")

    # KL, log scale (bit-identical rows are 0: drawn at the floor)
    groups = {"series": [], "kl": [], "pearson": []}  # legend entries
    ax = axes[0]
    all_kl = [v for s in series.values() for v in s["kl"]]
    floor = _floor(all_kl + [th["mean_kl"]], 1e-12)
    for key, s in series.items():
        groups["series"] += ax.plot(
            xs[key], _on_log(s["kl"], floor), "o-", ms=3.5, lw=1, color=colors[key], label=labels[key]
        )
    bar_label = f"bar: mean KL ≤ {th['mean_kl']:g}" + (" (quantized weights)" if exact else "")
    kl_bar = ax.axhline(th["mean_kl"], color=BAR_COLOR, ls="--", lw=1.2, label=bar_label)
    for key, s in series.items():
        mean = sum(s["kl"]) / len(s["kl"])
        groups["kl"].append(
            ax.axhline(max(mean, floor), color=colors[key], ls=":", lw=1, label=f"{key} mean KL {mean:.2e}")
        )
    ax.set_yscale("log")
    ax.set_ylabel("KL(llama.cpp ‖ ours)\nnats")
    if any(v is not None and v <= floor for v in all_kl):
        ax.text(0.995, 0.03, f"0 drawn at {floor:.0e}", transform=ax.transAxes, ha="right", fontsize=8, color="0.4")

    # 1 - Pearson, log scale
    ax = axes[1]
    one_minus = {k: [None if r is None else 1.0 - r for r in s["pearson"]] for k, s in series.items()}
    bar = 1.0 - th["mean_pearson"]
    floor_p = _floor([v for vs in one_minus.values() for v in vs] + [bar], 1e-12)
    for key in series:
        ax.plot(xs[key], _on_log(one_minus[key], floor_p), "o-", ms=3.5, lw=1, color=colors[key])
        finite = [v for v in one_minus[key] if v is not None]
        mean = sum(finite) / max(len(finite), 1)
        label = f"{key} mean Pearson {1 - mean:.6f}"
        groups["pearson"].append(ax.axhline(max(mean, floor_p), color=colors[key], ls=":", lw=1, label=label))
    label = f"bar: mean Pearson ≥ {th['mean_pearson']:g}"
    groups["pearson"].append(ax.axhline(bar, color=BAR_COLOR, ls="--", lw=1.2, label=label))
    ax.set_yscale("log")
    ax.set_ylabel("1 − Pearson\n(logits)")

    # top-10 overlap, and the top-1 agreement as a row of markers at the top
    ax = axes[2]
    for key, s in series.items():
        if s.get("top10_overlap") is not None:
            ax.plot(xs[key], s["top10_overlap"], "o-", ms=3.5, lw=1, color=colors[key])
    ax.set_ylim(-0.5, 12.2)
    ax.set_yticks([0, 2, 4, 6, 8, 10, 11.35], ["0", "2", "4", "6", "8", "10", "top-1"])
    ax.set_ylabel("top-10 overlap\n(of 10)")
    marked = {"agree": False, "decisive": False, "near": False}
    for key, s in series.items():
        for x, agree, tie in zip(xs[key], s["top1_agree"], s["near_tie"]):
            if agree:
                kind, color, m = "agree", colors[key], "|"
            else:
                kind, color, m = ("near", NEAR_TIE_COLOR, "D") if tie else ("decisive", FAIL_COLOR, "X")
                for a in axes:
                    a.axvline(x, color=color, lw=1.0, ls="-" if kind == "decisive" else ":", alpha=0.8, zorder=0)
            ax.plot([x], [11.35], m, ms=7 if m != "|" else 9, color=color, mew=1.5)
            marked[kind] = True
    ax.set_xlabel("context length (tokens) at which the next-token logits are compared")

    if "generated" in xs:
        start = xs["generated"][0] - 0.5
        for a in axes:
            a.axvspan(start, xs["generated"][-1] + 0.5, color=GEN_COLOR, alpha=0.06, lw=0, zorder=0)
    from matplotlib.ticker import MaxNLocator

    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_xlim(0.3, max(max(v) for v in xs.values()) + 0.7)
    for a in axes:
        a.grid(True, which="major", alpha=0.3)

    # one legend for the three panels, under them
    from matplotlib.lines import Line2D

    groups["kl"].append(kl_bar)
    handles = groups["series"]
    handles.append(Line2D([], [], color="0.3", marker="|", ms=9, mew=1.5, ls="", label="top-1 agrees"))
    if marked["decisive"]:
        handles.append(Line2D([], [], color=FAIL_COLOR, marker="X", ls="-", label="top-1 differs (decisive: fails)"))
    if marked["near"]:
        handles.append(
            Line2D(
                [],
                [],
                color=NEAR_TIE_COLOR,
                marker="D",
                ls=":",
                label=f"top-1 differs at a near-tie (< {th['near_tie']:g})",
            )
        )
    # three columns (series and top-1 marks | KL | Pearson), padded with blanks so no group spills over
    columns = [handles, groups["kl"], groups["pearson"]]
    rows = max(len(c) for c in columns)
    blank = Line2D([], [], ls="", label=" ")
    ordered = [h for c in columns for h in c + [blank] * (rows - len(c))]
    fig.legend(handles=ordered, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    return fig


# ---------------------------------------------------------------------------------------- diff


def split_name(name: str) -> tuple[str, int | None]:
    """`"attn_norm-3"` -> ("attn_norm", 3); a tensor outside the layers (`result_norm`) -> (name, None)."""
    m = _LAYERED.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def diff_layout(rows: list[tuple[str, float]]) -> tuple[dict[str, list[tuple[int, float]]], dict[str, int], int]:
    """(kind -> [(x, nmse)], x of each tensor name, number of layers): layer tensors at their layer, tensors
    outside the layers one step before the first layer ("in") or after the last ("out"), kinds in order."""
    layers = [split_name(n)[1] for n, _ in rows if split_name(n)[1] is not None]
    n_layer = max(layers) + 1 if layers else 0
    seen_layer = False
    xs, by_kind = {}, {}
    for name, value in rows:
        kind, il = split_name(name)
        seen_layer = seen_layer or il is not None
        x = il if il is not None else (n_layer if seen_layer else -1)
        xs[name] = x
        by_kind.setdefault(kind, []).append((x, value))
    return by_kind, xs, n_layer


def diff_chart(diff: dict, path) -> Path:
    """Per-layer NMSE (log) of each intermediate kind, the tolerance as a line, the first divergence circled."""
    import matplotlib.style

    with matplotlib.style.context("default"):
        return _save(_diff_figure(diff), path)


def _diff_figure(diff: dict):
    """Top: one line per kind over the layers (a layer's kinds spread left to right in evaluation order), the
    tolerance, the first divergence circled and annotated. Bottom: the same numbers as a kinds x layers heatmap,
    readable when the lines crowd; the first divergent cell outlined."""
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import FuncFormatter
    from matplotlib.patches import Rectangle

    rows = [(n, float(v)) for n, v in diff["rows"]]
    if not rows:
        raise ValueError("the diff compared no tensors: nothing to draw")
    tol, first = diff["tolerance"], diff.get("first_divergence")
    by_kind, xs, n_layer = diff_layout(rows)
    fed = diff.get("fed")
    # the fed curve: each layer's max NMSE over its taps when fed llama.cpp's input (the head at "out")
    fed_pts = [(n_layer if e["layer"] < 0 else e["layer"], e["max_nmse"]) for e in fed["layers"]] if fed else []
    extra = [v for _, v in fed_pts] + ([fed["tolerance"]] if fed else [])
    floor = _floor([v for _, v in rows] + [tol] + extra, min([tol] + extra) * 1e-6)
    ceiling = max([v for _, v in rows if math.isfinite(v)] + [tol] + [v for v in extra if math.isfinite(v)])
    kinds = list(by_kind)

    fig = _figure(12.0, 5.6 + 0.19 * len(kinds))
    ax, heat = fig.subplots(2, 1, sharex=True, height_ratios=[4.4, 0.19 * len(kinds) + 0.2])
    cmap = colormaps["tab20"]
    markers = "os^vD<>pPh*X"
    width = 0.6
    dodge = {kind: (i / max(len(kinds) - 1, 1) - 0.5) * width for i, kind in enumerate(kinds)}
    for i, (kind, pts) in enumerate(by_kind.items()):
        x = [p[0] + dodge[kind] for p in pts]
        y = [min(v, ceiling * 10) for v in _on_log([p[1] for p in pts], floor)]
        style = "-" if len(pts) > 1 else ""
        ax.plot(x, y, style, marker=markers[i % len(markers)], ms=4, lw=1.0, color=cmap(i % 20), label=kind)
    ax.axhline(tol, color=BAR_COLOR, ls="--", lw=1.3, label=f"tolerance {tol:.0e}")
    if fed:
        x, y = [p[0] for p in fed_pts], [min(v, ceiling * 10) for v in _on_log([p[1] for p in fed_pts], floor)]
        ax.plot(x, y, "-", color="black", lw=2.0, marker="D", ms=5, zorder=4, gid="fed", label="fed: layer max")
        ax.axhline(fed["tolerance"], color="black", ls=":", lw=1.3, label=f"fed tolerance {fed['tolerance']:.0e}")
    ax.set_yscale("log")
    lo, hi = floor / 3, ceiling * 3
    ax.set_ylim(lo, hi)
    ax.set_ylabel("NMSE vs llama.cpp\nΣ(ours − theirs)² / Σ theirs²")
    ticks = list(range(n_layer))
    names = [str(t) for t in ticks]
    if any(x == -1 for x in xs.values()):
        ticks, names = [-1] + ticks, ["in"] + names
    if any(x == n_layer for x in xs.values()):
        ticks, names = ticks + [n_layer], names + ["out"]
    step = max(1, math.ceil(len(ticks) / 30))
    heat.set_xticks(ticks[::step], names[::step])
    heat.set_xlabel("layer")
    ax.set_xlim(min(ticks) - 0.5, max(ticks) + 0.5)
    ax.grid(True, axis="y", which="major", alpha=0.3)
    for boundary in ticks[:-1]:
        ax.axvline(boundary + 0.5, color="0.85", lw=0.8, zorder=0)
    if any(v <= floor for _, v in rows):
        note = f"0 (bit-identical) drawn at {floor:.0e}"
        ax.text(0.995, 0.015, note, transform=ax.transAxes, ha="right", fontsize=8, color="0.4")

    verdict = f"first divergence: {first}" if first else f"no tensor over {tol:.0e}"
    if fed:
        fed_first, fed_tol = fed["first_divergence"], fed["tolerance"]
        # a second line: the long model names would run the title off the figure
        verdict += f"\nfed: first over {fed_tol:.0e}: {fed_first}" if fed_first else f"\nfed: all within {fed_tol:.0e}"
    fig.suptitle(
        f"alchemist diff: {diff.get('model', '?')} — {diff['backend']} backend — {verdict}",
        fontsize=13,
        fontweight="bold",
        color=FAIL_COLOR if first or (fed and fed["first_divergence"]) else PASS_COLOR,
    )
    detail = (
        f"{Path(diff.get('source_file', '')).name}; weights {', '.join(diff.get('weight_types', []))}; "
        f"numerics {diff.get('numerics', 'exact')}; prompt {diff.get('prompt_tokens', '?')} tokens; "
        f"{len(rows)} tensors in llama.cpp's evaluation order"
        + (
            f"; fed (black): each layer run on llama.cpp's own input ({fed['input']}, then l_out), the max NMSE "
            "over its taps"
            if fed
            else ""
        )
    )
    ax.set_title(_wrap([detail], 140), fontsize=9, loc="left")
    ax.legend(
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=8,
        title="tensor (llama.cpp name)",
        title_fontsize=8,
        ncol=1 if len(kinds) <= 24 else 2,
    )

    # the heatmap: kinds (evaluation order, top to bottom) x layers
    import numpy as np

    # colour: log10 NMSE on a diverging scale centred on the tolerance (blue below, red above); far-below
    # values share the darkest blue
    col = {t: j for j, t in enumerate(ticks)}
    grid = np.full((len(kinds), len(ticks)), np.nan)
    for i, kind in enumerate(kinds):
        for x, v in by_kind[kind]:
            grid[i, col[x]] = math.log10(min(max(v, floor), ceiling)) if math.isfinite(v) else math.log10(ceiling)
    center = math.log10(tol)
    norm = TwoSlopeNorm(vcenter=center, vmin=center - 4, vmax=max(math.log10(ceiling), center + 1))
    edges_x = [t - 0.5 for t in ticks] + [ticks[-1] + 0.5]
    mesh = heat.pcolormesh(edges_x, range(len(kinds) + 1), grid, cmap="RdBu_r", norm=norm)
    heat.set_ylim(len(kinds), 0)
    heat.set_yticks([i + 0.5 for i in range(len(kinds))], kinds, fontsize=7)
    # beside the heatmap, in the room the legend above keeps free anyway
    bar = fig.colorbar(mesh, cax=heat.inset_axes([1.012, 0.0, 0.014, 1.0]), extend="min")
    bar.set_label("NMSE", fontsize=8)
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"1e{v:.0f}" if float(v).is_integer() else ""))
    bar.ax.tick_params(labelsize=7)
    bar.ax.axhline(center, color="black", lw=1.5)

    if first:
        value = dict(rows)[first]
        kind, _ = split_name(first)
        x, y = xs[first] + dodge[kind], min(max(value, floor), ceiling * 10)
        ax.plot([x], [y], "o", ms=15, mfc="none", mec=FAIL_COLOR, mew=2.2, zorder=5, gid="first-divergence")
        for a in (ax, heat):
            a.axvspan(xs[first] - 0.5, xs[first] + 0.5, color=FAIL_COLOR, alpha=0.07, lw=0, zorder=0)
        heat.add_patch(Rectangle((xs[first] - 0.5, kinds.index(kind)), 1, 1, fill=False, ec="black", lw=2.2, zorder=5))
        order = [n for n, _ in rows]
        before = order[order.index(first) - 1] if order.index(first) > 0 else None
        note = f"first divergent op: {first}\nNMSE {value:.2e} > tolerance {tol:.0e}"
        if before:
            note += f"\nthe tensor before it, {before}: {dict(rows)[before]:.1e}"
        # the note goes into the emptier half, away from the circled point
        xfrac = (x - (min(ticks) - 0.5)) / (max(ticks) - min(ticks) + 1)
        yfrac = (math.log10(y) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
        right = xfrac > 0.6
        ax.annotate(
            note,
            xy=(x, y),
            xytext=(xfrac + (-0.04 if right else 0.04), 0.1 if yfrac > 0.5 else 0.9),
            textcoords="axes fraction",
            ha="right" if right else "left",
            va="bottom" if yfrac > 0.5 else "top",
            fontsize=9,
            color=FAIL_COLOR,
            bbox={"boxstyle": "round,pad=0.35", "fc": "white", "ec": FAIL_COLOR, "alpha": 0.95},
            arrowprops={"arrowstyle": "->", "color": FAIL_COLOR, "lw": 1.2},
            zorder=6,
        )
    return fig


# ---------------------------------------------------------------------------------------- redraw


def redraw(report_path) -> list[Path]:
    """Redraw the chart(s) of a saved validation or diff JSON report beside it; returns the PNG paths."""
    report_path = Path(report_path)
    report = json.loads(report_path.read_text())
    if "rows" in report:
        return [diff_chart(report, report_path.with_suffix(".png"))]
    return [
        validation_chart(report, b, report_path.with_name(f"{report_path.stem}_{b}.png")) for b in report["backends"]
    ]


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        for p in redraw(arg):
            print(p)
