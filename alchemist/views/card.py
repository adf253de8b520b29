"""`alchemist card`: a model's architecture as a block diagram and a component summary, from its IR only.

The IR (read_gguf + build_model_ir) is all a card needs, so it is quick even for a large file: no weights are
read and nothing is compiled. A card is a list of facts (component, label, value); the text summary prints
them, the diagram draws one box per component with the facts as its lines, and two models are compared
fact by fact. A property that varies by layer (sliding windows, per-layer RoPE) is one fact summarized over
the layers ("5 local : 1 global, window 512"), never one box per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from alchemist.errors import AlchemistError
from alchemist.ir import Activation, LayerSpec, MLPKind, ModelIR, NormSpec, RopeScaling, RopeStyle, Wiring

FORMATS = (".png", ".svg")


@dataclass(frozen=True)
class Fact:
    component: str  # the box it belongs to: embedding, attn_norm, attention, mlp, ...
    label: str
    value: str


# ---------------------------------------------------------------------------------------------------
# facts
# ---------------------------------------------------------------------------------------------------
def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else f"{x:g}"


def _norm(spec: NormSpec | None) -> str:
    if spec is None:
        return "none"
    name = {"rms": "RMSNorm", "layer": "LayerNorm"}[spec.kind.value]
    if spec.weight is None:
        name += " (no scale)"
    return name + (" + bias" if spec.bias else "")


ACTIVATIONS = {Activation.SILU: "SiLU", Activation.GELU_TANH: "GELU-tanh"}
GLU_NAMES = {Activation.SILU: "SwiGLU", Activation.GELU_TANH: "GeGLU"}


def _layer_facts(lay: LayerSpec, ir: ModelIR) -> list[Fact]:
    """The facts of one layer (summarized over all layers by card_facts)."""
    att, mlp, rope = lay.attention, lay.mlp, lay.attention.rope
    parallel = lay.wiring == Wiring.PARALLEL
    wiring = "parallel: attention + MLP read one norm" if parallel else "sequential: attention, then MLP"
    if lay.residual_scale != 1.0:
        wiring += f"; branches ×{lay.residual_scale:g}"
    pre = "none"
    if lay.attn_norm is not None or lay.ffn_norm is not None:
        names = {_norm(lay.attn_norm), _norm(lay.ffn_norm)} - ({"none"} if parallel else set())
        pre = " / ".join(sorted(names)) + (" (shared)" if parallel else "")
    post = "none"
    if lay.attn_post_norm is not None or lay.ffn_post_norm is not None:
        where = [w for w, s in (("attention", lay.attn_post_norm), ("MLP", lay.ffn_post_norm)) if s is not None]
        kinds = sorted({_norm(s) for s in (lay.attn_post_norm, lay.ffn_post_norm) if s is not None})
        post = f"{' / '.join(kinds)} after {' and '.join(where)}"
        post += " (sandwich)" if pre != "none" else " (no pre-norms)"

    if att.n_kv_head == att.n_head:
        sharing = "MHA"
    elif att.n_kv_head == 1:
        sharing = "MQA"
    else:
        sharing = f"GQA {att.group_size}:1"
    heads = f"{att.n_head} query, {att.n_kv_head} KV ({sharing})"
    head_dim = str(att.head_dim) + (f" (values {att.head_dim_v})" if att.head_dim_v != att.head_dim else "")
    proj = "fused QKV" if att.qkv else "separate Q, K, V"
    if att.qkv_bias or att.q_bias:
        proj += " + bias"
    if att.out_bias:
        proj += ", output bias"
    qk = "none"
    if att.q_norm is not None:
        qk = f"{_norm(att.q_norm)} " + ("per head" if att.qk_norm_scope.value == "head" else "over the projection")
    if math.isclose(att.score_scale, 1 / math.sqrt(att.head_dim), rel_tol=1e-5):
        scale = "1/√head_dim"
    else:
        scale = f"{att.score_scale:.6g}"

    if rope.style == RopeStyle.NONE:
        rope_kind, base, scaling = "none (NoPE)", "–", "–"
    else:
        rope_kind = f"{rope.style.value} ({'rotate halves' if rope.style == RopeStyle.NEOX else 'adjacent pairs'})"
        if rope.dim != att.head_dim:
            rope_kind += f", {rope.dim} of {att.head_dim} dims"
        base = _num(rope.base)
        factor = _num(round(1 / rope.freq_scale, 6)) if rope.freq_scale else "?"
        scaling = {
            RopeScaling.NONE: "none",
            RopeScaling.LINEAR: f"linear ×{factor}",
            RopeScaling.LLAMA3: "llama3 (per-frequency factors)",
            RopeScaling.YARN: f"YaRN ×{factor}, original context {rope.n_ctx_orig}",
            RopeScaling.LONGROPE: f"LongRoPE (short/long factors), original context {rope.n_ctx_orig}",
        }[rope.scaling]

    act = ACTIVATIONS[mlp.activation]
    if mlp.kind == MLPKind.PLAIN:
        kind = f"plain {act}"
    else:
        kind = f"gated {act} ({GLU_NAMES[mlp.activation]})" + (
            ", fused gate|up" if mlp.kind == MLPKind.FUSED_GATED else ""
        )
    if mlp.up_bias:
        kind += " + biases"

    return [
        Fact("block", "wiring", wiring),
        Fact("attn_norm", "pre norms", pre),
        Fact("post_norm", "post norms", post),
        Fact("attention", "heads", heads),
        Fact("attention", "head dim", head_dim),
        Fact("attention", "projections", proj),
        Fact("attention", "q/k norm", qk),
        Fact("attention", "score scale", scale),
        Fact("attention", "attn softcap", _num(att.logit_softcap) if att.logit_softcap else "none"),
        Fact("attention", "sliding window", str(att.sliding_window)),  # summarized by _windows
        Fact("rope", "RoPE", rope_kind),
        Fact("rope", "RoPE base", base),
        Fact("rope", "RoPE scaling", scaling),
        Fact("mlp", "MLP", kind),
        Fact("mlp", "n_ff", str(mlp.n_ff)),
    ]


def _period(values: list) -> int:
    """The smallest p such that values[i] == values[i % p] for every layer and the pattern shows at least twice
    (else the number of layers: no repeating pattern)."""
    n = len(values)
    return next((p for p in range(1, n // 2 + 1) if all(values[i] == values[i % p] for i in range(n))), n)


def _runs(values: list) -> list[tuple[object, int]]:
    runs: list[list] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return [(v, k) for v, k in runs]


def _windows(windows: list[int]) -> str:
    """A compact summary of the per-layer sliding windows (0: global)."""
    n = len(windows)
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return "none (every layer global)"
    size = f"window {', '.join(map(str, sizes))}"
    n_local = sum(1 for w in windows if w)
    if n_local == n:
        return f"every layer, {size}"
    kinds = ["local" if w else "global" for w in windows]
    period = kinds[: _period(kinds)]
    runs = _runs(period)
    if len(runs) <= 2:
        pattern = " : ".join(f"{k} {v}" for v, k in runs)
    else:
        pattern = "pattern " + "".join("L" if k == "local" else "G" for k in period) + " (L local, G global)"
    return f"{pattern}, {size} ({n_local} local, {n - n_local} global)"


def _over_layers(values: list[str], local: list[bool]) -> str:
    """One value for a fact over all layers: the value, 'A (local) / B (global)', or a repeating pattern."""
    if len(set(values)) == 1:
        return values[0]
    groups = {True: {v for v, is_local in zip(values, local) if is_local}, False: set()}
    groups[False] = {v for v, is_local in zip(values, local) if not is_local}
    if len(groups[True]) == 1 and len(groups[False]) == 1:
        return f"local {groups[True].pop()}; global {groups[False].pop()}"
    period = values[: _period(values)]
    runs = _runs(period)
    if len(runs) <= 3:
        text = " : ".join(f"{k}× {v}" for v, k in runs)
        return text + (", repeating" if len(period) < len(values) else "")
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return ", ".join(f"{v} ×{k} layers" for v, k in counts.items())


def card_facts(ir: ModelIR) -> list[Fact]:
    """Every fact of the card, in drawing order (model, embedding, block components, final norm, output)."""
    if len(ir.attention_layers) != ir.n_layer:
        raise AlchemistError(
            f"{ir.source_file}: the card draws attention blocks only, not a hybrid's convolution layers"
        )
    emb, out = ir.embedding, ir.output
    if emb.scale == 1.0:
        scale = "none"
    elif math.isclose(emb.scale, math.sqrt(ir.n_embd), rel_tol=1e-5):
        scale = f"×√n_embd = {emb.scale:.4g}"
    else:
        scale = f"×{emb.scale:g}"
    rotating = any(lay.attention.rope.style != RopeStyle.NONE for lay in ir.layers)
    positions = "learned absolute" if emb.positions else ("RoPE (in attention)" if rotating else "none")
    facts = [
        Fact("model", "family", ir.architecture),
        Fact("model", "layers", str(ir.n_layer)),
        Fact("model", "n_embd", str(ir.n_embd)),
        Fact("model", "vocab", str(ir.n_vocab)),
        Fact("model", "context", str(ir.n_ctx_train)),
        Fact("embedding", "embedding scale", scale),
        Fact("embedding", "positions", positions),
    ]
    per_layer = [_layer_facts(lay, ir) for lay in ir.layers]
    windows = [lay.attention.sliding_window for lay in ir.layers]
    local = [w > 0 for w in windows]
    for i, first in enumerate(per_layer[0]):
        if first.label == "sliding window":
            value = _windows(windows)
        else:
            value = _over_layers([layer[i].value for layer in per_layer], local)
        facts.append(Fact(first.component, first.label, value))
    facts += [
        Fact("final_norm", "final norm", _norm(out.norm)),
        Fact("output", "output", "tied to the token embedding" if out.tied else f"separate {out.weight}"),
        Fact("output", "logit softcap", _num(out.final_softcap) if out.final_softcap else "none"),
        Fact("output", "logit scale", f"×{out.logit_scale:g}" if out.logit_scale != 1.0 else "none"),
    ]
    return facts


def card_text(ir: ModelIR, title: str) -> str:
    facts = card_facts(ir)
    width = max(len(f.label) for f in facts) + 2
    lines = [f"{title}  ({ir.architecture}, {ir.model_name!r})"]
    lines += [f"  {f.label:{width}}{f.value}" for f in facts]
    return "\n".join(lines)


def diff_facts(a: ModelIR, b: ModelIR) -> list[tuple[Fact, Fact]]:
    """The facts whose values differ between two models, in card order."""
    return [(x, y) for x, y in zip(card_facts(a), card_facts(b)) if x.value != y.value]


def diff_text(a: ModelIR, b: ModelIR, title_a: str, title_b: str) -> str:
    pairs = diff_facts(a, b)
    if not pairs:
        return f"{title_a} and {title_b}: no differences in the card's components"
    width = max(len(x.label) for x, _ in pairs) + 2
    left = max(len(title_a), *(len(x.value) for x, _ in pairs)) + 3
    lines = [f"{len(pairs)} differences", f"  {'':{width}}{title_a:{left}}{title_b}"]
    lines += [f"  {x.label:{width}}{x.value:{left}}{y.value}" for x, y in pairs]
    same = [x.label for x, y in zip(card_facts(a), card_facts(b)) if x.value == y.value]
    if same:
        lines.append("same: " + ", ".join(same))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# the diagram
# ---------------------------------------------------------------------------------------------------
FILL = {
    "io": "#f2f2f2",
    "embedding": "#e6f2e6",
    "output": "#e6f2e6",
    "norm": "#fff5d6",
    "attention": "#e3eeff",
    "mlp": "#ffead9",
}
HIGHLIGHT = "#d62728"
BOX_W = 7.6  # data units; the axes span 0..10 horizontally
FIG_W = 7.2  # inches per model: 10.4 data units
LINE_H = 0.42
TITLE_H = 0.55
WRAP = 68  # characters per line in a box of width BOX_W (bold text is the widest)


@dataclass
class Box:
    key: str  # component
    title: str
    lines: list[tuple[tuple[str, ...], str]]  # (the fact labels a line shows, its text)
    fill: str
    tag: str = ""  # what a one-line box is, after its title ("pre-norm")
    small: bool = False  # a one-line box: the title only

    def wrapped(self, width: float) -> list[tuple[tuple[str, ...], str]]:
        """The lines wrapped to a box `width` data units wide."""
        import textwrap

        chars = int(WRAP * width / BOX_W)
        return [
            (labels, part) for labels, text in self.lines for part in textwrap.wrap(text, chars, subsequent_indent="  ")
        ]

    def height(self, width: float) -> float:
        return 0.55 if self.small else TITLE_H + LINE_H * len(self.wrapped(width)) + 0.2

    def labels(self) -> set[str]:
        return {lab for labels, _ in self.lines for lab in labels}


def _boxes(ir: ModelIR) -> dict[str, Box]:
    f = {x.label: x.value for x in card_facts(ir)}

    def lines(*labels, bare=("output", "MLP")):
        return [
            ((lab,), f[lab] if lab in bare else f"{lab}: {f[lab]}")
            for lab in labels
            if f[lab] != "none" or lab == "q/k norm"
        ]

    def norm_box(key, label, tag):
        value = f[label]
        return Box(key, value.split(" (")[0].split(" after")[0], [((label,), value)], FILL["norm"], tag, small=True)

    emb = [(("vocab", "n_embd"), f"{f['vocab']} tokens × {f['n_embd']}")] + lines("embedding scale", "positions")
    att = lines("heads", "head dim", "projections", "q/k norm", "sliding window", "RoPE", "RoPE base", "RoPE scaling")
    att += lines("score scale", "attn softcap")
    post = f["post norms"]
    return {
        "tokens": Box("io", "tokens", [], FILL["io"], small=True),
        "embedding": Box("embedding", "Token embedding", emb, FILL["embedding"]),
        "attn_norm": norm_box(
            "attn_norm", "pre norms", "pre-norm" + (", shared" if "shared" in f["pre norms"] else "")
        ),
        "attention": Box("attention", "Attention", att, FILL["attention"]),
        "post_norm": norm_box("post_norm", "post norms", "post-norm" + (", sandwich" if "sandwich" in post else "")),
        "mlp": Box("mlp", "MLP", lines("MLP", "n_ff"), FILL["mlp"]),
        "final_norm": Box("final_norm", f["final norm"], [(("final norm",), "")], FILL["norm"], "final norm", True),
        "output": Box("output", "Output projection", lines("output", "logit softcap", "logit scale"), FILL["output"]),
        "logits": Box("io", f"logits ({f['vocab']})", [(("vocab",), "")], FILL["io"], small=True),
    }


def _draw_box(ax, box: Box, x: float, top: float, width: float, changed: set[str]) -> tuple[float, float]:
    """Draw `box` with its top edge at `top`, centred on x; returns (top, bottom)."""
    from matplotlib.patches import FancyBboxPatch

    hit = bool(box.labels() & changed)
    h = box.height(width)
    ax.add_patch(
        FancyBboxPatch(
            (x - width / 2, top - h),
            width,
            h,
            boxstyle="round,pad=0,rounding_size=0.15",
            facecolor="#fde8e8" if hit else box.fill,
            edgecolor=HIGHLIGHT if hit else "#555555",
            linewidth=2.2 if hit else 1.0,
            zorder=2,
        )
    )
    if box.small:
        title = box.title + (f"   ({box.tag})" if box.tag else "")
        weight = "bold" if box.tag else "normal"
        ax.text(
            x,
            top - h / 2,
            title,
            ha="center",
            va="center",
            fontsize=10,
            fontweight=weight,
            zorder=3,
            color=HIGHLIGHT if hit else "#222222",
        )
        return top, top - h
    ax.text(x, top - 0.32, box.title, ha="center", va="center", fontsize=11, fontweight="bold", zorder=3)
    y = top - TITLE_H - 0.12
    for labels, text in box.wrapped(width):
        red = bool(set(labels) & changed)
        ax.text(
            x - width / 2 + 0.25,
            y,
            text,
            ha="left",
            va="center",
            fontsize=8.6,
            color=HIGHLIGHT if red else "#222222",
            fontweight="bold" if red else "normal",
            zorder=3,
        )
        y -= LINE_H
    return top, top - h


def _arrow(ax, x0, y0, x1, y1):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="-|>", color="#444444", lw=1.2), zorder=1)


def _add(ax, x, y):
    """The residual add: a circled plus (a marker, so that it stays round whatever the axes' aspect)."""
    ax.plot([x], [y], marker="o", markersize=15, markerfacecolor="white", markeredgecolor="#444444", mew=1.2, zorder=3)
    ax.plot([x], [y], marker="+", markersize=10, markeredgecolor="#222222", mew=1.3, zorder=4)


def draw(ax, ir: ModelIR, title: str, changed: set[str]) -> float:
    """Draw the card of `ir` into ax (data coordinates, x in 0..10.4, y downwards from 0); returns the depth."""
    from matplotlib.patches import FancyBboxPatch

    boxes = _boxes(ir)
    facts = {x.label: x.value for x in card_facts(ir)}
    parallel = ir.layers[0].wiring == Wiring.PARALLEL
    has_pre, has_post = facts["pre norms"] != "none", facts["post norms"] != "none"
    cx, gap = 5.6, 0.45
    skip_x = cx - BOX_W / 2 - 0.55  # the residual stream's skip line, left of the boxes
    line = dict(color="#444444", lw=1.2, zorder=1)
    ax.text(cx, -0.1, title, ha="center", va="top", fontsize=13, fontweight="bold")
    ax.text(cx, -0.62, f"{ir.architecture}  ·  {ir.model_name}", ha="center", va="top", fontsize=9.5, color="#555555")
    y = -1.3

    def stack(name, width=BOX_W, x=cx, arrow=True):
        nonlocal y
        if arrow:
            _arrow(ax, x, y, x, y - gap)
            y -= gap
        y = _draw_box(ax, boxes[name], x, y, width, changed)[1]

    def residual(fork_y, branch_bottom):
        """The skip from fork_y down the left side into a + under the branch that ends at branch_bottom."""
        nonlocal y
        add_y = branch_bottom - gap - 0.1
        _arrow(ax, cx, branch_bottom, cx, add_y + 0.22)
        ax.plot([cx, skip_x, skip_x], [fork_y, fork_y, add_y], **line)
        _arrow(ax, skip_x, add_y, cx - 0.22, add_y)
        _add(ax, cx, add_y)
        y = add_y - 0.22

    stack("tokens", width=3.0, arrow=False)
    stack("embedding")
    _arrow(ax, cx, y, cx, y - gap)
    y -= gap
    block_top = y
    frame_x0, frame_x1 = skip_x - 0.35, cx + BOX_W / 2 + 0.3
    hit = "wiring" in changed
    for label, text, x, ha in (
        ("layers", f"× {ir.n_layer} layers", frame_x0 + 0.2, "left"),
        (
            "wiring",
            facts["wiring"].split(":")[0] + (facts["wiring"].split(";")[1:] or [""])[0],
            frame_x1 - 0.2,
            "right",
        ),
    ):
        red = label in changed
        ax.text(
            x,
            block_top - 0.12,
            text,
            ha=ha,
            va="top",
            fontsize=9,
            color=HIGHLIGHT if red else "#444444",
            fontweight="bold" if red or label == "layers" else "normal",
        )
    y = block_top - 0.55
    ax.plot([cx, cx], [block_top, y], **line)
    if parallel:
        fork = y - 0.1
        ax.plot([cx, cx], [y, fork], **line)
        y = fork
        if has_pre:
            stack("attn_norm")
        w_att, w_mlp = BOX_W * 0.62, BOX_W * 0.35  # attention has the most to say
        left, right = cx - BOX_W / 2 + w_att / 2, cx + BOX_W / 2 - w_mlp / 2
        split = y - 0.25
        ax.plot([cx, cx], [y, split], **line)
        ax.plot([left, right], [split, split], **line)
        top = split - gap
        _arrow(ax, left, split, left, top)
        _arrow(ax, right, split, right, top)
        b1 = _draw_box(ax, boxes["attention"], left, top, w_att, changed)[1]
        b2 = _draw_box(ax, boxes["mlp"], right, top, w_mlp, changed)[1]
        join = min(b1, b2) - 0.25
        for x, b in ((left, b1), (right, b2)):
            ax.plot([x, x], [b, join], **line)
        ax.plot([left, right], [join, join], **line)
        residual(fork, join)
    else:
        for branch in ("attention", "mlp"):
            fork = y - 0.05
            ax.plot([cx, cx], [y, fork], **line)
            y = fork
            if has_pre:
                stack("attn_norm")
            stack(branch)
            if has_post:
                stack("post_norm")
            residual(fork, y)
            y -= 0.15
    block_bottom = y - 0.3
    ax.add_patch(
        FancyBboxPatch(
            (frame_x0, block_bottom),
            frame_x1 - frame_x0,
            block_top - block_bottom,
            boxstyle="round,pad=0,rounding_size=0.2",
            facecolor="none",
            edgecolor=HIGHLIGHT if hit else "#888888",
            linestyle="--",
            linewidth=1.8 if hit else 1.0,
            zorder=0,
        )
    )
    y = block_bottom
    stack("final_norm")
    stack("output")
    stack("logits", width=3.6)
    return y


def write_card(irs: list[ModelIR], titles: list[str], out: Path) -> Path:
    """Draw the card(s) into out (.png or .svg); with two models, side by side with differences in red."""
    out = Path(out)
    if out.suffix.lower() not in FORMATS:
        raise AlchemistError(f"-o {out}: a card is written as .png or .svg, not {out.suffix or 'no extension'!r}")
    import matplotlib

    from alchemist.pictures import figure, save

    changed = {a.label for a, _ in diff_facts(*irs)} if len(irs) == 2 else set()
    with matplotlib.rc_context({"font.family": "DejaVu Sans"}):
        fig = figure(FIG_W * len(irs), 12)
        axes = fig.subplots(1, len(irs), squeeze=False)
        depth = min(draw(ax, ir, title, changed) for ax, ir, title in zip(axes[0], irs, titles))
        for ax in axes[0]:
            ax.set_xlim(0, 10.4)
            ax.set_ylim(depth - 0.2, 0.1)
            ax.axis("off")
        fig.set_size_inches(FIG_W * len(irs), (0.3 - depth) * 0.47)
        fig.subplots_adjust(left=0, right=1, top=1, bottom=0, wspace=0.02)
        if changed:
            fig.text(0.5, 0.0, "red: differs between the two models", ha="center", va="top", color=HIGHLIGHT)
        return save(fig, out, bbox_inches="tight", pad_inches=0.15)


# ---------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------
def load_ir(model: str) -> ModelIR:
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.models import resolve_model

    path = resolve_model(model)
    if not Path(path).is_file():
        raise AlchemistError(f"{model}: no such file (and not a reference model name)")
    return build_model_ir(read_gguf(path))


def run_card(models: list[str], output: str | None) -> str:
    """The card text (and the drawing when output is given) of one model, or the comparison of two."""
    if not 1 <= len(models) <= 2:
        raise AlchemistError(f"card takes one model, or two to compare; got {len(models)}")
    if output is not None and Path(output).suffix.lower() not in FORMATS:
        raise AlchemistError(f"-o {output}: a card is written as .png or .svg")
    irs = [load_ir(m) for m in models]
    titles = [Path(m).name.removesuffix(".gguf") for m in models]
    if len(titles) == 2 and titles[0] == titles[1]:
        titles = [str(m) for m in models]
    parts = [card_text(irs[0], titles[0])] if len(irs) == 1 else [diff_text(*irs, *titles)]
    if output is not None:
        parts.append(f"wrote {write_card(irs, titles, Path(output))}")
    return "\n\n".join(parts)
