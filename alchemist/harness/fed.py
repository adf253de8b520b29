"""`alchemist diff --fed`: every layer of our generated module fed llama.cpp's own input to that layer.

A whole-model diff lets errors accumulate: layer 5's output differs by layer 5's own error plus everything the
layers before it passed on. Here layer il computes from llama.cpp's tensor: its first block's input (`embd`,
or `inp_scaled` where the embeddings are scaled, as llama.cpp names it) for il == 0, its `l_out-{il-1}` after
that; the head from its last `l_out`. So each layer's taps against llama.cpp's measure that layer's own error
(the bar: NMSE <= 1e-10 per layer).

All layers go into ONE compiled function (inputs: one (T, N_EMBD) row block per layer and one for the head),
each layer with a fresh zero cache of the shapes the engine's forward() reads, positions 0..T-1, built
with the engine's mode and shared weights, so it computes what the engine's step computes, op for op.
"""

from __future__ import annotations

import inspect
import time

import numpy as np

from alchemist.errors import AlchemistError
from alchemist.harness.metrics import nmse
from alchemist.pytensor_ext.host import activating

FED_TOL = 1e-10  # the bar: a layer fed llama.cpp's input reproduces llama.cpp's output to this NMSE
# what llama.cpp names the tensor its first block reads, latest in its graph wins (build_inp_embd's "embd";
# gemma's scaled "inp_scaled"; gpt2's "inpL" after the learned positions; lfm2 renames "embd" again)
INPUT_NAMES = ("embd", "inp_embd", "inp_scaled", "inpL", "model.embed_tokens")
HEAD = -1  # the "layer" of result_norm / result_output in the per-layer rows


def _cache_style(module) -> str:
    """How block() takes its layer's cache: "kv" (k_cache, v_cache), "tuple" (lfm2's per-layer `cache`); an
    AlchemistError for a block with another signature."""
    from alchemist.runtime.engine import n_kv_caches

    arch = getattr(module, "ARCHITECTURE", "?")
    block = getattr(module, "block", None)
    if block is None or not hasattr(module, "head"):
        raise AlchemistError(f"fed-input diff is not available for {arch}: the module has no block()/head()")
    params = list(inspect.signature(block).parameters)
    if n_kv_caches(module) != module.N_LAYER:
        raise AlchemistError(
            f"fed-input diff is not available for {arch}: layers share KV caches ({n_kv_caches(module)} caches "
            f"for {module.N_LAYER} layers), so a layer cannot be run on its own"
        )
    if params[:6] == ["ops", "w", "il", "x", "positions", "attend_len"]:
        if params[6:8] == ["k_cache", "v_cache"]:
            return "kv"
        if params[6:7] == ["cache"]:
            return "tuple"
    raise AlchemistError(
        f"fed-input diff is not available for {arch}: its block({', '.join(params)}) does not take one (T, N_EMBD) "
        "hidden state (e.g. gemma3n's AltUp streams)"
    )


def _fed_graph(engine, n_tokens: int):
    """(start_pos, layer inputs, head input, caches, taps): every layer's block() on an input of its own, each with
    a cache input of the shapes forward() reads, positions start_pos + 0..T-1 as forward() builds them."""
    import pytensor.tensor as pt

    from alchemist.runtime.engine import cache_shape, layer_caches, state_kinds

    module = engine.module
    style = _cache_style(module)
    states = state_kinds(module)
    start_pos = pt.scalar("start_pos", dtype="int64")
    positions = start_pos + pt.arange(n_tokens, dtype="int64")
    attend_len = engine.capacity if engine.static else start_pos + n_tokens  # as Engine._build / forward()
    width = int(module.N_EMBD)
    xs = [pt.tensor(f"fed_in.{il}", dtype="float32", shape=(n_tokens, width)) for il in range(module.N_LAYER)]
    x_head = pt.tensor("fed_in.head", dtype="float32", shape=(n_tokens, width))
    caches = [
        tuple(
            pt.tensor(f"fed_{kind}_cache.{il}", dtype="float32", shape=cache_shape(kind, row, engine.capacity, states))
            for kind, row in layer
        )
        for il, layer in enumerate(layer_caches(module))
    ]
    # a recurrent layer starts from zero states at position 0 and reads all T tokens
    n_valid = (n_tokens,) if states else ()
    taps: dict = {}
    for il, (x, cache) in enumerate(zip(xs, caches)):
        args = (*cache, taps) if style == "kv" else (cache, *n_valid, taps)
        module.block(engine.ops, engine.weights, il, x, positions, attend_len, *args)
    module.head(engine.ops, engine.weights, x_head, None, taps)
    return start_pos, xs, x_head, caches, taps


def _compile(engine, start_pos, n_tokens: int, inputs: list, outputs: list):
    """pytensor.function in the engine's mode, the cache writes lowered as the engine's step lowers them (the
    same values; C code instead of a Python advanced-indexing write)."""
    import pytensor

    from alchemist.runtime.engine import Engine

    if not engine.static:
        first, rest = Engine._cache_writes_as_slices(outputs[0], [tuple(outputs[1:])], start_pos, n_tokens)
        outputs = [first, *rest[0]]
    return pytensor.function([start_pos, *inputs], outputs, mode=engine.mode, on_unused_input="ignore")


@activating
def fed_function(engine, n_tokens: int):
    """(names, fn): fn(layer_inputs, head_input) -> the taps of every layer run on its own input, each input a
    (n_tokens, N_EMBD) float32 array; names are the taps' llama.cpp names (result_* from the head)."""
    start_pos, xs, x_head, caches, taps = _fed_graph(engine, n_tokens)
    names = list(taps)
    cache_inputs = [c for layer in caches for c in layer]
    fn = _compile(engine, start_pos, n_tokens, [*xs, x_head, *cache_inputs], [taps[n] for n in names])
    zeros = [np.zeros(c.type.shape, np.float32) for c in cache_inputs]

    def run(layer_inputs: list, head_input) -> dict:
        values = fn(np.int64(0), *layer_inputs, head_input, *zeros)
        return dict(zip(names, (np.asarray(v) for v in values)))

    return names, run


@activating
def op_fed_function(engine, n_tokens: int, names: list[str]):
    """(names, fn): every tap among `names` computed from llama.cpp's values of the taps before it (and of the
    layer inputs): the ops between two taps alone, e.g. ffn_out-3 = mlp(llama.cpp's ffn_norm-3), kqv_out-3 =
    attention(llama.cpp's Qcur-3, Kcur-3, Vcur-3). fn(layer_inputs, head_input, tensors) takes llama.cpp's
    tensors by name. A tap that differs here, from bit-identical inputs, is made by an op that is not."""
    import pytensor.tensor as pt
    from pytensor.graph.replace import graph_replace

    start_pos, xs, x_head, caches, taps = _fed_graph(engine, n_tokens)
    names = [n for n in names if n in taps and taps[n].owner is not None]
    fed_in = {n: pt.tensor(f"theirs.{n}", dtype="float32", shape=taps[n].type.shape) for n in names}
    # each tap's own op applied to its inputs, in which every tap is llama.cpp's value
    nodes = [taps[n].owner for n in names]
    flat = [i for node in nodes for i in node.inputs]
    replaced = graph_replace(flat, {taps[n]: fed_in[n] for n in names}, strict=False)
    outputs, k = [], 0
    for n, node in zip(names, nodes):
        new_inputs = replaced[k : k + len(node.inputs)]
        k += len(node.inputs)
        outputs.append(node.clone_with_new_inputs(new_inputs).outputs[node.outputs.index(taps[n])])
    cache_inputs = [c for layer in caches for c in layer]
    fn = _compile(engine, start_pos, n_tokens, [*xs, x_head, *cache_inputs, *fed_in.values()], outputs)
    zeros = [np.zeros(c.type.shape, np.float32) for c in cache_inputs]

    def run(layer_inputs: list, head_input, tensors: dict) -> dict:
        theirs = [np.asarray(tensors[n], np.float32).reshape(fed_in[n].type.shape) for n in names]
        values = fn(np.int64(0), *layer_inputs, head_input, *zeros, *theirs)
        return dict(zip(names, (np.asarray(v) for v in values)))

    return names, run


def first_block_input(theirs: dict, order: list[str], n_tokens: int, n_embd: int) -> str:
    """The name of llama.cpp's tensor that its first block reads (of INPUT_NAMES, the one it evaluated last)."""
    found = [n for n in order if n in INPUT_NAMES and n in theirs]
    if not found:
        raise AlchemistError(
            f"fed-input diff: llama.cpp evaluated none of {', '.join(INPUT_NAMES)} (its first block's input); "
            f"captured: {', '.join(order[:12])}"
        )
    name = found[-1]
    shape = tuple(np.asarray(theirs[name]).shape)
    if shape != (n_tokens, n_embd):
        raise AlchemistError(
            f"fed-input diff: llama.cpp's first block input {name!r} is {shape}, expected (n_tokens, n_embd) = "
            f"{(n_tokens, n_embd)}"
        )
    return name


def layer_of(name: str) -> int:
    """The layer of a tap name ("attn_norm-3" -> 3); HEAD for result_norm / result_output."""
    base, _, il = name.rpartition("-")
    return int(il) if base and il.isdigit() else HEAD


def fed_taps(
    engine, theirs: dict, order: list[str], n_tokens: int, ops: bool = False
) -> tuple[dict, dict | None, dict]:
    """(our taps with every layer fed llama.cpp's input; with ops=True also every tap computed from llama.cpp's
    taps before it (op_fed_function), else None; facts: the input name, compile and run seconds)."""
    module = engine.module
    _cache_style(module)  # a family whose block cannot be fed says so before any shape is checked
    n_layer, n_embd = int(module.N_LAYER), int(module.N_EMBD)
    source = first_block_input(theirs, order, n_tokens, n_embd)
    feeds = [source] + [f"l_out-{il}" for il in range(n_layer)]
    missing = [n for n in feeds if n not in theirs]
    if missing:
        raise AlchemistError(f"fed-input diff: llama.cpp evaluated no {', '.join(missing)} (layer inputs)")
    bad = [n for n in feeds if tuple(np.asarray(theirs[n]).shape) != (n_tokens, n_embd)]
    if bad:
        raise AlchemistError(
            f"fed-input diff: llama.cpp's {bad[0]} is {np.asarray(theirs[bad[0]]).shape}, expected {(n_tokens, n_embd)}"
        )
    arrays = [np.ascontiguousarray(theirs[n], dtype=np.float32) for n in feeds]
    facts = {"input": source}
    with engine.lock:
        t0 = time.perf_counter()
        _, run = fed_function(engine, n_tokens)
        t1 = time.perf_counter()
        ours = run(arrays[:n_layer], arrays[n_layer])
        facts.update(compile_s=round(t1 - t0, 2), run_s=round(time.perf_counter() - t1, 3))
        op_ours = None
        if ops:
            t0 = time.perf_counter()
            _, run_ops = op_fed_function(engine, n_tokens, [n for n in order if n in theirs])
            op_ours = run_ops(arrays[:n_layer], arrays[n_layer], theirs)
            facts["ops_s"] = round(time.perf_counter() - t0, 2)
    return ours, op_ours, facts


def differing(a, b) -> int:
    """How many elements of our tensor are not bit-for-bit llama.cpp's (same-size arrays, any layouts)."""
    a = np.asarray(a, np.float32).reshape(-1)
    b = np.asarray(b, np.float32).reshape(-1)
    if a.size != b.size:
        return max(a.size, b.size)
    return int(np.count_nonzero(a.view(np.uint32) != b.view(np.uint32)))


_EMPTY_LAYER = {
    "layer": None,
    "max_nmse": 0.0,  # over the layer's taps
    "worst": None,  # the tap of max_nmse
    "out_nmse": None,  # of l_out-il (result_output for the head)
    "first_exceeding": None,  # the layer's first tap (evaluation order) over the tolerance
    "first_exceeding_nmse": None,
    "first_differing": None,  # the layer's first tap not bit-identical to llama.cpp's
    "n_taps": 0,
}


def compare_fed(ours: dict, theirs: dict, order: list[str], tol: float = FED_TOL, ops: dict | None = None) -> dict:
    """Per tensor (llama.cpp's evaluation order) the fed NMSE and differing elements (and, given `ops` from
    op_fed_function, op_nmse / op_differing: the tap computed from llama.cpp's taps before it); per layer the max
    NMSE over its taps, its worst tap, its l_out NMSE, its first tap over `tol` and its first tap that is not
    bit-identical (and first_op_differing: the first whose own op is not bit-exact)."""
    rows = []
    for name in order:
        if name not in ours or name not in theirs:
            continue
        a, b = ours[name], theirs[name]
        value = float(nmse(a, b)) if np.size(a) == np.size(b) else float("inf")
        row = {"tensor": name, "nmse": value, "differing": differing(a, b), "size": int(np.size(b))}
        if ops is not None and name in ops:
            row["op_nmse"], row["op_differing"] = float(nmse(ops[name], b)), differing(ops[name], b)
        rows.append(row)
    layers: dict[int, dict] = {}
    for row in rows:
        il = layer_of(row["tensor"])
        entry = layers.setdefault(il, dict(_EMPTY_LAYER, layer=il))
        entry["n_taps"] += 1
        if entry["worst"] is None or not row["nmse"] <= entry["max_nmse"]:
            entry["max_nmse"], entry["worst"] = row["nmse"], row["tensor"]
        if row["tensor"] in (f"l_out-{il}", "result_output"):
            entry["out_nmse"] = row["nmse"]
        if entry["first_exceeding"] is None and not row["nmse"] <= tol:
            entry["first_exceeding"], entry["first_exceeding_nmse"] = row["tensor"], row["nmse"]
        if entry["first_differing"] is None and row["differing"]:
            entry["first_differing"] = row["tensor"]
        if row.get("op_differing") and not entry.get("first_op_differing"):
            entry["first_op_differing"] = row["tensor"]
    per_layer = sorted(layers.values(), key=lambda e: (e["layer"] == HEAD, e["layer"]))
    first = next((e["first_exceeding"] for e in per_layer if e["first_exceeding"]), None)
    return {"tolerance": tol, "rows": rows, "layers": per_layer, "first_divergence": first}


def print_fed(diff: dict) -> None:
    """The terminal table of `alchemist diff --fed`: both columns per tensor (and the op-fed one with --fed-ops),
    then one line per layer."""
    fed, first = diff["fed"], diff["first_divergence"]
    accumulated = dict(diff["rows"])
    ops = any("op_nmse" in row for row in fed["rows"])
    head = f"{'tensor':24} {'accumulated':>11} {'fed':>10} {'fed differing':>15}"
    print(head + (f" {'op-fed':>10} {'op differing':>15}" if ops else ""))
    for row in fed["rows"]:
        name, size = row["tensor"], row["size"]
        marks = ["first divergence"] * (name == first) + ["first fed over tolerance"] * (
            name == fed["first_divergence"]
        )
        line = f"{name:24} {accumulated.get(name, float('nan')):11.3e} {row['nmse']:10.3e} "
        line += f"{row['differing']:>7}/{size:<7}"
        if ops:
            line += f" {row.get('op_nmse', float('nan')):10.3e} {row.get('op_differing', '-'):>7}/{size:<7}"
        print(line + (f"  <-- {'; '.join(marks)}" if marks else ""))
    print(f"per layer, fed llama.cpp's input ({fed['input']}, then l_out-(il-1)); tolerance {fed['tolerance']:.0e}:")
    for e in fed["layers"]:
        layer = "head" if e["layer"] == HEAD else f"layer {e['layer']}"
        over = f"first over: {e['first_exceeding']}" if e["first_exceeding"] else "within"
        line = f"  {layer:9} max {e['max_nmse']:.2e} ({e['worst']}); {over}; first not bit-identical: "
        line += e["first_differing"] or "-"
        if ops:
            line += f"; first op not bit-exact: {e.get('first_op_differing') or '-'}"
        print(line)
