"""`alchemist graph`: one layer's PyTensor graph, as the generated module builds it and after a backend's rewrites.

The layer is the generated module's `block(w, il, x, positions, attend_len, k_cache, v_cache, taps)` called on
symbolic inputs, no weights loaded: x (T, n_embd) float32, a start position, a KV cache of a few rows, and one
input per weight the block reads, of the dtype and shape the backend gets from load_weights (uint8 GGUF blocks
for the KERNEL_WEIGHTS on C and Numba, float32 otherwise). The cache write is lowered as the Engine lowers it,
so the graph is the one a decode step runs. Rewriting applies the backend mode's optimizer to a FunctionGraph
as pytensor.function would, without linking (no C compilation).

Formats: a listing (one line per node, weights by their GGUF names), Graphviz DOT, or PNG/SVG drawn by `dot`.
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from alchemist.errors import AlchemistError
from alchemist.pytensor_ext.host import activating

FORMATS = ("text", "dot", "png", "svg")
SUFFIX_FORMAT = {".txt": "text", ".dot": "dot", ".gv": "dot", ".png": "png", ".svg": "svg"}


@dataclass
class LayerGraph:
    title: str
    architecture: str
    n_layer: int
    layer: int
    backend: str
    n_tokens: int
    capacity: int
    inputs: list  # x, start_pos, k cache, v cache, then the weights in the order the block reads them
    outputs: list  # the layer's output x, the updated k and v caches
    output_names: list
    ggml_types: dict = field(default_factory=dict)  # weight name -> GGUF type

    def header(self) -> str:
        t = f"{self.n_tokens} token{'s' if self.n_tokens != 1 else ''}"
        return (
            f"{self.title}: layer {self.layer} of {self.n_layer} ({self.architecture}), backend {self.backend}, "
            f"{t}, KV cache of {self.capacity} rows"
        )


class _Weights(dict):
    """The weights as symbolic inputs, made on first read (so the block's reads are exactly what it uses)."""

    def __init__(self, module, quantized: bool):
        super().__init__()
        self.module, self.quantized = module, quantized
        self.kernel = set(getattr(module, "KERNEL_WEIGHTS", ()))

    def __missing__(self, name):
        import pytensor.tensor as pt

        if name not in self.module.TENSORS:
            raise KeyError(name)
        _, shape, _, nbytes = self.module.TENSORS[name]
        if self.quantized and name in self.kernel:
            var = pt.tensor(name, dtype="uint8", shape=(shape[0], nbytes // shape[0]))
        else:
            var = pt.tensor(name, dtype="float32", shape=tuple(shape))
        self[name] = var
        return var


@activating
def build_layer_graph(model: str, layer: int, backend: str = "c", n_tokens: int = 1, capacity: int = 16) -> LayerGraph:
    """The graph of layer `layer` of a GGUF model (path or reference name) for `backend`, before rewrites."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.models import resolve_model
    from alchemist.runtime.backends import require_backend, static_shapes, uses_quantized_kernels

    require_backend(backend)
    path = resolve_model(model)
    if not Path(path).is_file():
        raise AlchemistError(f"{model}: no such file (and not a reference model name)")
    if n_tokens < 1 or capacity < n_tokens:
        raise AlchemistError(f"--tokens {n_tokens} --capacity {capacity}: need 1 <= tokens <= capacity")
    ir = build_model_ir(read_gguf(path))
    if not 0 <= layer < ir.n_layer:
        raise AlchemistError(f"--layer {layer}: {Path(path).name} has {ir.n_layer} layers (0 to {ir.n_layer - 1})")
    if ir.layers[layer].attention is None:
        raise AlchemistError(f"--layer {layer}: a short-convolution layer; the layer graph draws attention layers")

    import pytensor
    import pytensor.tensor as pt

    from alchemist.audit import require_passing_audit
    from alchemist.runtime.api import generated_cache_dir, write_generated
    from alchemist.runtime.engine import Engine, import_generated

    module_path = write_generated(ir, generated_cache_dir())
    require_passing_audit(module_path, ir)  # as load_llm: a module is imported only once it passed its audit
    module = import_generated(module_path)

    att = ir.layers[layer].attention
    weights = _Weights(module, uses_quantized_kernels(backend))
    x = pt.tensor("x", dtype="float32", shape=(n_tokens, ir.n_embd))
    start_pos = pt.scalar("start_pos", dtype="int64")
    positions = start_pos + pt.arange(n_tokens, dtype="int64")  # as forward() computes them
    attend = capacity if static_shapes(backend) else start_pos + n_tokens
    cache = [
        pt.tensor(f"{kv}_cache.{layer}", dtype="float32", shape=(capacity, att.n_kv_head, att.head_dim)) for kv in "kv"
    ]
    with pytensor.config.change_flags(traceback__limit=0):
        out, k_new, v_new = module.block(module.EXACT, weights, layer, x, positions, attend, *cache, None)
        if not static_shapes(backend):  # the cache writes as the Engine compiles them
            out, [(k_new, v_new)] = Engine._cache_writes_as_slices(out, [(k_new, v_new)], start_pos, n_tokens)
    return LayerGraph(
        title=Path(path).name,
        architecture=ir.architecture,
        n_layer=ir.n_layer,
        layer=layer,
        backend=backend,
        n_tokens=n_tokens,
        capacity=capacity,
        inputs=[x, start_pos, *cache, *weights.values()],
        outputs=[out, k_new, v_new],
        output_names=["x_out", f"k_cache.{layer}'", f"v_cache.{layer}'"],
        ggml_types={name: module.TENSORS[name][0] for name in weights},
    )


def nodes_before(g: LayerGraph) -> list:
    from pytensor.graph.traversal import io_toposort

    return list(io_toposort(g.inputs, g.outputs))


@activating
def rewrite(g: LayerGraph):
    """The FunctionGraph after the backend mode's rewrites (as pytensor.function prepares it, without linking)."""
    from pytensor.compile.io import In, Out

    from alchemist.runtime.backends import get_mode
    from alchemist.pytensor_ext.pytensor_internals import FunctionMaker

    mode = get_mode(g.backend)
    # the caches are mutable: in the Engine they are shared variables updated in place by the step
    ins = [In(v, mutable=i in (2, 3)) for i, v in enumerate(g.inputs)]
    outs = [Out(v) for v in g.outputs]
    fgraph, updates = FunctionMaker.create_fgraph(ins, outs, accept_inplace=True)
    FunctionMaker.prepare_fgraph(ins, outs, updates, fgraph, mode, None)
    return fgraph


# ---------------------------------------------------------------------------------------------------
# naming ops and variables
# ---------------------------------------------------------------------------------------------------
def _composite(scalar_op):
    from pytensor.scalar.basic import Composite

    return scalar_op if isinstance(scalar_op, Composite) else None


def composite_formula(scalar_op) -> str:
    from pytensor.printing import pprint

    return "; ".join(pprint(o) for o in scalar_op.fgraph.outputs)


def op_label(op) -> str:
    """A readable op name: pytensor's, with a fused expression written out and in-place ops marked."""
    from pytensor.tensor.elemwise import CAReduce, Elemwise

    inner = getattr(op, "scalar_op", None)
    if isinstance(op, Elemwise) and _composite(inner):
        label = f"Composite{{{composite_formula(inner)}}}"
    elif isinstance(op, CAReduce) and _composite(inner):
        label = str(op).replace(str(inner), f"Composite{{{composite_formula(inner)}}}")
    else:
        label = str(op)
    return label + (" [inplace]" if getattr(op, "destroy_map", None) else "")


def op_type(op) -> str:
    """The op's kind for counting: its class, with Elemwise split into single ops and fused Composites."""
    from pytensor.tensor.blockwise import Blockwise
    from pytensor.tensor.elemwise import CAReduce, Elemwise

    if isinstance(op, Elemwise):
        return "Composite" if _composite(op.scalar_op) else "Elemwise"
    if isinstance(op, Blockwise):
        return f"Blockwise({type(op.core_op).__name__})"
    if type(op) is CAReduce:
        return "CAReduce(fused)" if _composite(op.scalar_op) else f"CAReduce({type(op.scalar_op).__name__})"
    name = type(op).__name__
    if getattr(op, "set_instead_of_inc", False):
        name = name.replace("Inc", "Set")
    return name


def _shape(var) -> str:
    shape = getattr(var.type, "shape", ())
    return "(" + ", ".join("?" if s is None else str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _type(var) -> str:
    return f"{var.type.dtype} {_shape(var)}"


def _constant(var) -> str | None:
    """A constant's value if it is small enough to print inline, else its type."""
    from pytensor.graph.basic import Constant

    if not isinstance(var, Constant):
        return None
    data = var.data
    if getattr(data, "size", 1) <= 4:
        flat = getattr(data, "ravel", lambda: [data])()
        text = ", ".join(
            f"{v:g}" if isinstance(v, float) or hasattr(v, "dtype") and v.dtype.kind == "f" else str(v) for v in flat
        )
        return text if getattr(data, "ndim", 0) == 0 else f"[{text}]"
    return f"const {_type(var)}"


class Names:
    """%N for the N-th node's output, input names as given, constants by value."""

    def __init__(self, nodes):
        self.of = {}
        for i, node in enumerate(nodes):
            for j, out in enumerate(node.outputs):
                self.of[out] = f"%{i}" + (f".{j}" if len(node.outputs) > 1 else "")

    def __call__(self, var) -> str:
        if var in self.of:
            return self.of[var]
        c = _constant(var)
        return c if c is not None else (var.name or f"<{_type(var)}>")


# ---------------------------------------------------------------------------------------------------
# the listing and the rewrite summary
# ---------------------------------------------------------------------------------------------------
def listing(g: LayerGraph, nodes, outputs) -> str:
    names = Names(nodes)
    lines = []
    for i, node in enumerate(nodes):
        lhs = ", ".join(names(o) for o in node.outputs)
        call = f"{op_label(node.op)}({', '.join(names(v) for v in node.inputs)})"
        types = ", ".join(_type(o) for o in node.outputs)
        lines.append(f"  {lhs:>5} = {call}    : {types}")
    lines.append("outputs: " + ", ".join(f"{n} = {names(v)}" for n, v in zip(g.output_names, outputs)))
    return "\n".join(lines)


def inputs_text(g: LayerGraph) -> str:
    plain = [v for v in g.inputs if v.name not in g.ggml_types]
    lines = ["inputs:  " + "; ".join(f"{v.name} {_type(v)}" for v in plain)]
    lines.append(f"weights: {len(g.ggml_types)}")
    for v in g.inputs:
        if v.name in g.ggml_types:
            kind = g.ggml_types[v.name]
            as_ = " blocks" if v.type.dtype == "uint8" else ""
            lines.append(f"  {v.name:34} {kind:5} as {v.type.dtype}{as_} {_shape(v)}")
    return "\n".join(lines)


@dataclass
class RewriteSummary:
    before: Counter  # op type -> count
    after: Counter
    n_before: int
    n_after: int
    elemwise_before: Counter  # scalar op -> count (single elementwise nodes)
    elemwise_after: Counter
    fused_nodes: int  # Composite nodes after
    fused_reductions: int  # reductions of a fused expression after (CAReduce{Composite})
    fused_loops: int  # inner-graph ops after (Numba's FusedElemwise: a loop over an elementwise subgraph)
    fused_scalar_ops: int  # scalar ops inside all of them
    inplace: Counter  # op type -> nodes that write into an input, after

    @property
    def introduced(self) -> dict:
        return {k: v for k, v in self.after.items() if k not in self.before}

    @property
    def removed(self) -> dict:
        return {k: v for k, v in self.before.items() if k not in self.after}

    def text(self) -> str:
        keys = sorted(set(self.before) | set(self.after), key=lambda k: (-self.before.get(k, 0), -self.after[k], k))
        width = max(len(k) for k in keys) + 2
        lines = [f"rewrites: {self.n_before} nodes before, {self.n_after} after", f"  {'op type':{width}}before  after"]
        lines += [f"  {k:{width}}{self.before.get(k, 0):6} {self.after.get(k, 0):6}" for k in keys]
        n_elem = sum(self.elemwise_before.values())
        singles = sum(self.elemwise_after.values())
        parts = [f"{self.fused_nodes} Composite", f"{self.fused_reductions} fused reductions"]
        parts += [f"{self.fused_loops} fused loops (inner graphs)"] if self.fused_loops else []
        total = self.fused_nodes + self.fused_reductions + self.fused_loops + singles
        lines.append(
            f"fusion: {n_elem} elementwise nodes became {total}: {', '.join(parts)}, {singles} single; "
            f"the fused ones hold {self.fused_scalar_ops} scalar ops"
        )
        lines.append("  elementwise before: " + _counts(self.elemwise_before))
        lines.append("  single after:       " + (_counts(self.elemwise_after) or "none"))
        lines.append(
            f"in place: {sum(self.inplace.values())} nodes write into an input: " + (_counts(self.inplace) or "none")
        )
        lines.append("introduced: " + (_counts(self.introduced) or "none"))
        lines.append("removed: " + (_counts(self.removed) or "none"))
        return "\n".join(lines)


def _counts(c) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def _scalar_ops(node) -> int:
    """Scalar ops inside a fused node: a Composite's, or those of every elementwise node of an inner graph."""
    from pytensor.tensor.elemwise import CAReduce, Elemwise

    op = node.op
    if isinstance(op, (Elemwise, CAReduce)):
        inner = _composite(op.scalar_op)
        return len(inner.fgraph.apply_nodes) if inner else int(isinstance(op, Elemwise))
    fgraph = getattr(op, "fgraph", None)
    return sum(_scalar_ops(n) for n in fgraph.apply_nodes) if fgraph is not None else 0


def summarize(before: list, after: list) -> RewriteSummary:
    from pytensor.tensor.elemwise import CAReduce, Elemwise

    def singles(nodes):
        return Counter(
            type(n.op.scalar_op).__name__.lower()
            for n in nodes
            if isinstance(n.op, Elemwise) and not _composite(n.op.scalar_op)
        )

    fused = [n for n in after if isinstance(n.op, (Elemwise, CAReduce)) and _composite(n.op.scalar_op)]
    loops = [n for n in after if hasattr(n.op, "fgraph") and not isinstance(n.op, (Elemwise, CAReduce))]
    return RewriteSummary(
        before=Counter(op_type(n.op) for n in before),
        after=Counter(op_type(n.op) for n in after),
        n_before=len(before),
        n_after=len(after),
        elemwise_before=singles(before),
        elemwise_after=singles(after),
        fused_nodes=sum(1 for n in fused if isinstance(n.op, Elemwise)),
        fused_reductions=sum(1 for n in fused if not isinstance(n.op, Elemwise)),
        fused_loops=len(loops),
        fused_scalar_ops=sum(_scalar_ops(n) for n in fused + loops),
        inplace=Counter(
            type(n.op.scalar_op).__name__ if op_type(n.op) == "Elemwise" else op_type(n.op)
            for n in after
            if getattr(n.op, "destroy_map", None)
        ),
    )


# ---------------------------------------------------------------------------------------------------
# Graphviz
# ---------------------------------------------------------------------------------------------------
KERNELS = (
    "QuantizedMatmul",
    "QuantizedEmbedding",
    "Dot",
    "Dot22",
    "Dot22Scalar",
    "Gemv",
    "CGemv",
    "Gemm",
    "CGemm",
    "Ger",
    "CGer",
    "BatchedDot",
)
SHAPE_OPS = (
    "DimShuffle", "Reshape", "Shape", "Shape_i", "SpecifyShape", "ScalarFromTensor", "TensorFromScalar", "MakeVector",
    "ARange", "Alloc", "Squeeze", "Subtensor", "Join", "Split", "DeepCopyOp", "Cast",
)  # fmt: skip


LEGEND = (
    "orange: matmuls (quantized kernels, BLAS)   purple: fused elementwise (Composite)   blue: elementwise\n"
    "green: reductions   grey: shapes and indexing   yellow: weights   bold border: writes in place"
)


def _style(node) -> dict:
    from pytensor.tensor.elemwise import CAReduce
    from pytensor.tensor.special import Softmax

    kind = op_type(node.op)
    core = kind[len("Blockwise(") : -1] if kind.startswith("Blockwise(") else kind
    if core in KERNELS:
        style = {"fillcolor": "#ffc58a"}
    elif kind == "Composite" or kind == "CAReduce(fused)":
        style = {"fillcolor": "#dccbf5"}
    elif kind == "Elemwise":
        style = {"fillcolor": "#d3e4ff"}
    elif isinstance(node.op, (CAReduce, Softmax)):
        style = {"fillcolor": "#cdeed9"}
    elif kind in SHAPE_OPS:
        style = {"fillcolor": "#efefef", "fontsize": "9"}
    else:
        style = {"fillcolor": "#ffffff"}
    if getattr(node.op, "destroy_map", None):
        style["penwidth"] = "2.2"
    return style


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attrs(d: dict) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in d.items()) + "]"


def to_dot(g: LayerGraph, nodes, outputs, rewritten: bool) -> str:
    """Graphviz DOT of a node list: ops as boxes (op, output shape), weights by name, scalars folded in."""
    from pytensor.graph.basic import Constant

    ids = {}
    stage = f"after the {g.backend} backend's rewrites" if rewritten else "before rewrites"
    head = f"{g.header()}\n{stage}: {len(nodes)} nodes\n{LEGEND}"
    lines = [
        "digraph layer {",
        f"  graph [rankdir=TB, nodesep=0.25, ranksep=0.35, fontname=Helvetica, labelloc=t, fontsize=14, label={_q(head)}];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, margin="0.12,0.04"];',
        '  edge [color="#555555", arrowsize=0.6];',
    ]
    for v in g.inputs:
        if v.name in g.ggml_types:
            dtype = f"{g.ggml_types[v.name]} → uint8 blocks" if v.type.dtype == "uint8" else g.ggml_types[v.name]
            attrs = {
                "label": f"{v.name}\n{dtype} {_shape(v)}",
                "shape": "note",
                "style": "filled",
                "fillcolor": "#fff2a8",
            }
        else:
            attrs = {"label": f"{v.name}\n{_type(v)}", "shape": "ellipse", "style": "filled", "fillcolor": "#c9ebc9"}
        ids[v] = f"in{len(ids)}"
        lines.append(f"  {ids[v]} {_attrs(attrs)};")
    for i, node in enumerate(nodes):
        label = op_label(node.op)
        label = "\n".join(textwrap.wrap(label, 42, break_long_words=True)[:4])
        consts = [_constant(v) for v in node.inputs if isinstance(v, Constant) and getattr(v.data, "size", 1) <= 4]
        if consts:
            label += "\nwith " + ", ".join(consts)
        label += "\n" + ", ".join(_type(o) for o in node.outputs)
        lines.append(f"  n{i} {_attrs({'label': label, **_style(node)})};")
        for o in node.outputs:
            ids[o] = f"n{i}"
    n_const = 0
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if isinstance(v, Constant):
                if getattr(v.data, "size", 1) <= 4:
                    continue
                n_const += 1
                cid = f"c{n_const}"
                lines.append(
                    f"  {cid} {_attrs({'label': _constant(v), 'shape': 'plaintext', 'style': '', 'fontsize': '9'})};"
                )
                lines.append(f"  {cid} -> n{i};")
            elif v in ids:
                lines.append(f"  {ids[v]} -> n{i};")
    for name, v in zip(g.output_names, outputs):
        oid = f"out_{len(lines)}"
        attrs = {"label": f"{name}\n{_type(v)}", "shape": "ellipse", "style": "filled,bold", "fillcolor": "#c9ebc9"}
        lines.append(f"  {oid} {_attrs(attrs)};")
        if v in ids:
            lines.append(f"  {ids[v]} -> {oid};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def render(dot_text: str, fmt: str, out: Path) -> Path:
    exe = shutil.which("dot")
    if exe is None:
        raise AlchemistError(
            f"--format {fmt} needs Graphviz's `dot` program, which is not on PATH: install graphviz "
            "(apt-get install graphviz, brew install graphviz), or write --format dot and render it elsewhere"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    args = [exe, f"-T{fmt}", "-o", str(out)] + (["-Gdpi=80"] if fmt == "png" else [])
    proc = subprocess.run(args, input=dot_text.encode(), capture_output=True, timeout=300)
    if proc.returncode != 0:
        raise AlchemistError(f"dot failed to render {out}: {proc.stderr.decode(errors='replace').strip()[:500]}")
    return out


# ---------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------
def output_format(fmt: str | None, output: str | None) -> str:
    if fmt is None:
        fmt = SUFFIX_FORMAT.get(Path(output).suffix.lower(), "text") if output else "text"
    if fmt not in FORMATS:
        raise AlchemistError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if fmt in ("png", "svg") and not output:
        raise AlchemistError(f"--format {fmt} writes a file: give it with -o")
    return fmt


def run_graph(
    model: str,
    layer: int,
    rewrites: bool = False,
    backend: str = "c",
    fmt: str | None = None,
    output: str | None = None,
    n_tokens: int = 1,
    capacity: int = 16,
) -> str:
    """What `alchemist graph` prints (the listing or DOT text, or the line naming the file it wrote)."""
    fmt = output_format(fmt, output)
    g = build_layer_graph(model, layer, backend, n_tokens, capacity)
    before = nodes_before(g)
    nodes, outputs = before, g.outputs
    summary = None
    if rewrites:
        fgraph = rewrite(g)
        nodes, outputs = fgraph.toposort(), fgraph.outputs
        summary = summarize(before, nodes)
    if fmt == "text":
        stage = f"after the {backend} backend's rewrites" if rewrites else "before rewrites"
        parts = [g.header(), inputs_text(g), f"graph {stage}: {len(nodes)} nodes", listing(g, nodes, outputs)]
        if summary:
            parts.append(summary.text())
        text = "\n".join(parts)
    else:
        text = to_dot(g, nodes, outputs, rewrites)
    if fmt in ("png", "svg"):
        path = render(text, fmt, Path(output))
        return f"wrote {path} ({len(nodes)} nodes)" + (f"\n{summary.text()}" if summary else "")
    if output:
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        Path(output).write_text(text + ("" if text.endswith("\n") else "\n"))
        return f"wrote {output} ({len(nodes)} nodes)" + (f"\n{summary.text()}" if summary else "")
    return text
