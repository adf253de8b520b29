"""`alchemist diff --fed`: every layer of our generated module fed llama.cpp's own input to that layer.

A whole-model diff lets errors accumulate: layer 5's output differs by layer 5's own error plus everything the
layers before it passed on. Here layer il computes from llama.cpp's tensor: its first block's input (`embd`,
or `inp_scaled` where the embeddings are scaled, as llama.cpp names it) for il == 0, its `l_out-{il-1}` after
that; the head from its last `l_out`. So each layer's taps against llama.cpp's measure that layer's own error
(issue #19's bar: NMSE <= 1e-10 per layer).

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

FED_TOL = 1e-10  # issue #19: a layer fed llama.cpp's input reproduces llama.cpp's output to this NMSE
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
    if params[:5] == ["w", "il", "x", "positions", "attend_len"]:
        if params[5:7] == ["k_cache", "v_cache"]:
            return "kv"
        if params[5:6] == ["cache"]:
            return "tuple"
    raise AlchemistError(
        f"fed-input diff is not available for {arch}: its block({', '.join(params)}) does not take one (T, N_EMBD) "
        "hidden state (e.g. gemma3n's AltUp streams)"
    )


def fed_function(engine, n_tokens: int):
    """(names, fn): fn(inputs, head_input) -> the taps of every layer run on its own input, each a
    (n_tokens, N_EMBD) float32 array; names are the taps' llama.cpp names (result_* from the head)."""
    import pytensor
    import pytensor.tensor as pt

    from alchemist.runtime.engine import Engine, layer_caches

    module = engine.module
    style = _cache_style(module)
    start_pos = pt.scalar("start_pos", dtype="int64")
    positions = start_pos + pt.arange(n_tokens, dtype="int64")  # as forward() builds them (a runtime input)
    attend_len = engine.capacity if engine.static else start_pos + n_tokens  # as Engine._build / forward()
    width = int(module.N_EMBD)
    xs = [pt.tensor(f"fed_in.{il}", dtype="float32", shape=(n_tokens, width)) for il in range(module.N_LAYER)]
    x_head = pt.tensor("fed_in.head", dtype="float32", shape=(n_tokens, width))
    caches = [
        tuple(
            pt.tensor(f"fed_{kind}_cache.{il}", dtype="float32", shape=(engine.capacity, *row)) for kind, row in layer
        )
        for il, layer in enumerate(layer_caches(module))
    ]
    taps: dict = {}
    for il, (x, cache) in enumerate(zip(xs, caches)):
        if style == "kv":
            module.block(engine.weights, il, x, positions, attend_len, *cache, taps)
        else:
            module.block(engine.weights, il, x, positions, attend_len, cache, taps)
    module.head(engine.weights, x_head, None, taps)
    names = list(taps)
    outputs = [taps[n] for n in names]
    if not engine.static:
        # the engine's own lowering of cache writes (same values; C code instead of a Python advanced write)
        first, rest = Engine._cache_writes_as_slices(outputs[0], [tuple(outputs[1:])], start_pos, n_tokens)
        outputs = [first, *rest[0]]
    inputs = [start_pos, *xs, x_head, *(c for layer in caches for c in layer)]
    fn = pytensor.function(inputs, outputs, mode=engine.mode, on_unused_input="ignore")
    zeros = [np.zeros(c.type.shape, np.float32) for layer in caches for c in layer]

    def run(layer_inputs: list, head_input) -> dict:
        values = fn(np.int64(0), *layer_inputs, head_input, *zeros)
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


def fed_taps(engine, theirs: dict, order: list[str], n_tokens: int) -> tuple[dict, dict]:
    """(our taps with every layer fed llama.cpp's input, facts: the input name, compile and run seconds)."""
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
    t0 = time.perf_counter()
    with engine.lock:
        _, run = fed_function(engine, n_tokens)
        t1 = time.perf_counter()
        ours = run(arrays[:n_layer], arrays[n_layer])
    t2 = time.perf_counter()
    return ours, {"input": source, "compile_s": round(t1 - t0, 2), "run_s": round(t2 - t1, 3)}


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


def compare_fed(ours: dict, theirs: dict, order: list[str], tol: float = FED_TOL) -> dict:
    """Per tensor (llama.cpp's evaluation order) the fed NMSE and differing elements; per layer the max NMSE
    over its taps, its worst tap, its l_out NMSE and its first tap over `tol` (evaluation order)."""
    rows = []
    for name in order:
        if name not in ours or name not in theirs:
            continue
        a, b = ours[name], theirs[name]
        value = float(nmse(a, b)) if np.size(a) == np.size(b) else float("inf")
        rows.append({"tensor": name, "nmse": value, "differing": differing(a, b), "size": int(np.size(b))})
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
    per_layer = sorted(layers.values(), key=lambda e: (e["layer"] == HEAD, e["layer"]))
    first = next((e["first_exceeding"] for e in per_layer if e["first_exceeding"]), None)
    return {"tolerance": tol, "rows": rows, "layers": per_layer, "first_divergence": first}


def print_fed(diff: dict) -> None:
    """The terminal table of `alchemist diff --fed`: both columns per tensor, then one line per layer."""
    fed, first = diff["fed"], diff["first_divergence"]
    accumulated = dict(diff["rows"])
    print(f"{'tensor':28} {'accumulated':>12} {'fed':>12} {'fed differing':>15}")
    for row in fed["rows"]:
        name = row["tensor"]
        marks = ["first divergence"] * (name == first) + ["first fed over tolerance"] * (
            name == fed["first_divergence"]
        )
        mark = f"  <-- {'; '.join(marks)}" if marks else ""
        diff_count = f"{row['differing']}/{row['size']}"
        print(f"{name:28} {accumulated.get(name, float('nan')):12.3e} {row['nmse']:12.3e} {diff_count:>15}{mark}")
    print(f"per layer, fed llama.cpp's input ({fed['input']}, then l_out-(il-1)); tolerance {fed['tolerance']:.0e}:")
    for e in fed["layers"]:
        layer = "head" if e["layer"] == HEAD else f"layer {e['layer']}"
        over = f"first over: {e['first_exceeding']}" if e["first_exceeding"] else "within"
        print(
            f"  {layer:9} max {e['max_nmse']:.2e} ({e['worst']}); {over}; "
            f"first not bit-identical: {e['first_differing'] or '-'}"
        )
