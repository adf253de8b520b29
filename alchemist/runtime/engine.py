"""The compiled model: weights as shared variables, a fixed-capacity KV cache, compiled step functions.

One compiled function per (number of tokens, which logits) shape: decode (1 token) is compiled once and
reused for every position, because the position is a runtime input and the cache is a shared buffer
updated through `updates=` (in place on the C and Numba backends). Prefill pads the prompt to a length
bucket so that prompts of different lengths share a compiled function.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import numpy as np

from alchemist.errors import AlchemistError
import pytensor
import pytensor.tensor as pt

from alchemist.pytensor_ext import compile_progress, parallel_build, pytensor_internals
from alchemist.pytensor_ext.host import activated, one_blas_thread
from alchemist.runtime import graph_cache, sharding
from alchemist.runtime.backends import get_mode, static_shapes
from alchemist.runtime.numerics import primitives

PREFILL_BUCKETS = (8, 32, 128, 512)
SHORT_PROMPT = 8  # up to this many tokens, a prompt may go through the decode function (Engine._decode_is_quicker)


_AS_IMPORTED = "_alchemist_as_imported"
_SOURCE_SHA256 = "_alchemist_source_sha256"


def import_generated(path: str | Path, name_suffix: str = "") -> ModuleType:
    """Import a generated model module from its file (it is standalone, so no package is needed)."""
    path = Path(path)
    name = f"alchemist_generated_{path.stem}{name_suffix}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise AlchemistError(f"{path}: cannot import generated module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    # what the module held when imported: a step graph is cached only while nothing has been replaced (a
    # user's rebinding of one of its functions builds a different graph than its source says)
    module.__dict__[_AS_IMPORTED] = dict(vars(module))
    module.__dict__[_SOURCE_SHA256] = hashlib.sha256(path.read_bytes()).hexdigest()
    return module


def layer_caches(module: ModuleType) -> tuple:
    """The groups of caches the module's forward() reads and returns, each cache (kind, shape of one position's
    row): its LAYER_CACHES (a hybrid's, per layer: "k", "v" for attention, "conv" for a short convolution), else
    K and V of (N_KV_HEAD, HEAD_DIM) per KV cache (one per layer, fewer where layers share one: n_kv_caches)."""
    caches = getattr(module, "LAYER_CACHES", None)
    if caches is None:
        row = (module.N_KV_HEAD, module.HEAD_DIM)
        return ((("k", row), ("v", row)),) * n_kv_caches(module)
    return tuple(tuple((str(kind), tuple(int(n) for n in row)) for kind, row in layer) for layer in caches)


def state_kinds(module: ModuleType) -> frozenset:
    """The cache kinds that hold one state per sequence rather than a row per position (the module's STATE_KINDS:
    a Mamba-2 layer's convolution window and scan state); the module's forward() then takes n_valid."""
    return frozenset(str(kind) for kind in getattr(module, "STATE_KINDS", ()))


def cache_shape(kind: str, row: tuple, rows: int, states: frozenset) -> tuple:
    """The shape of one sequence's cache of `kind`: `rows` rows of shape `row`, or the state `row` itself."""
    return tuple(row) if kind in states else (rows, *row)


def regroup(flat: list, like: list) -> list:
    """`flat` cut into tuples as long as the tuples of `like` (per-layer caches flattened and rebuilt)."""
    out, i = [], 0
    for group in like:
        out.append(tuple(flat[i : i + len(group)]))
        i += len(group)
    return out


def is_as_imported(module: ModuleType) -> bool:
    """True when `module` came from import_generated and none of its names has been rebound since."""
    snapshot = getattr(module, _AS_IMPORTED, None)
    if snapshot is None:
        return False
    current = vars(module)
    return all(current.get(name) is value for name, value in snapshot.items())


def n_kv_caches(module: ModuleType) -> int:
    """How many (k, v) cache pairs forward() takes: one per layer, or N_KV_CACHE where the IR has layers that
    attend to an earlier layer's cache (gemma3n's KV sharing)."""
    return int(getattr(module, "N_KV_CACHE", module.N_LAYER))


@dataclass
class StepStats:
    compile_count: int = 0
    compile_seconds: float = 0.0
    graph_cache_hits: int = 0
    compiled_shapes: list = field(default_factory=list)


def rewrite_step(inputs, outputs, updates, mode):
    """What pytensor.function(inputs, outputs, updates=...) does before linking: the FunctionMaker holding the
    rewritten graph (its create() links it). On the C backend the graph's missing C modules start building with
    g++ in the background right away (alchemist.pytensor_ext.parallel_build), so another step can be rewritten
    meanwhile."""
    ins, outs = pytensor_internals.construct_function_ins_and_outs(inputs, outputs, updates=updates)
    maker = mode.function_maker(ins, outs, mode, accept_inplace=True, on_unused_input="ignore")
    maker.alchemist_prebuilt = parallel_build.prebuild(maker.fgraph) if _links_c_thunks(mode) else []
    return maker


def _links_c_thunks(mode) -> bool:
    """True for a mode whose linker builds C thunks (the C backend's CVM), not Numba's, JAX's or MLX's."""
    return isinstance(mode.linker, pytensor_internals.VMLinker) and mode.linker.c_thunks is not False


def link_step(maker, cache_key: str | None):
    """Link a rewritten step (waiting for its prebuilt C modules) and store its graph in the graph cache."""
    try:
        fn = maker.create()
    finally:
        parallel_build.discard_unused(getattr(maker, "alchemist_prebuilt", []))
    if cache_key:
        graph_cache.save(cache_key, fn)
    return fn


def cached_or_compiled(cache_key: str | None, shared: dict, mode, build):
    """(function, True) linked from the rewritten-graph cache, or (function, False) compiled from build() ->
    (inputs, outputs, updates) and saved there."""
    fn = graph_cache.load(cache_key, shared, mode) if cache_key else None
    if fn is not None:
        return fn, True
    return link_step(rewrite_step(*build(), mode), cache_key), False


def load_or_compile(stats, t0: float, cache_key: str | None, shared: dict, mode, build, label="", progress=None):
    """A step function linked from the rewritten-graph cache, or compiled from build() -> (inputs, outputs,
    updates) and saved there; counted in stats (time since t0, one compile). `progress` receives
    alchemist.pytensor_ext.compile_progress.CompileEvent's about `label` while it compiles."""
    with activated(), compile_progress.tracking(label, progress):
        fn, cached = cached_or_compiled(cache_key, shared, mode, build)
    stats.graph_cache_hits += cached
    stats.compile_seconds += time.perf_counter() - t0
    stats.compile_count += 1
    return fn


class Engine:
    """Runs a generated module's `forward` on one backend with a persistent KV cache, its primitives those of
    `numerics` (alchemist.runtime.numerics: "exact", the module's EXACT; "ggml", llama.cpp's loops)."""

    def __init__(
        self,
        module: ModuleType,
        weights: dict,
        backend: str,
        capacity: int,
        numerics: str = "exact",
        placement: sharding.Placement | None = None,
    ):
        """weights: numpy arrays, or (with a placement, on JAX) jax.Arrays already cut as it says."""
        if placement is not None and backend != "jax":
            raise AlchemistError(f"a model across devices runs on the jax backend, not {backend!r}")
        self.module = module
        self.placement = placement
        self.numerics = numerics
        self.ops = primitives(module, numerics)
        self.backend = backend
        self.mode = get_mode(backend)
        if backend == "c":
            one_blas_thread()  # at load, not at import: the C backend's sgemm shares the cores with our OpenMP
        self.capacity = int(capacity)
        self.static = static_shapes(backend)
        # Static shapes: rewrites and the JAX/MLX tracers see every weight and cache dimension as a constant.
        self.weights = {name: _shared_weight(name, arr) for name, arr in weights.items()}
        # per layer its caches (K and V; a convolution layer's B·X rows), a row per position, or a Mamba-2 layer's
        # states; the position the states have reached (a sequence continues from there or starts at 0)
        self.states = state_kinds(module)
        self.state_position = 0
        self.cache = [
            tuple(
                pytensor.shared(np.zeros(s, np.float32), name=f"{kind}_cache.{il}", shape=s)
                for kind, s in ((kind, cache_shape(kind, row, self.capacity, self.states)) for kind, row in layer)
            )
            for il, layer in enumerate(layer_caches(module))
        ]
        self.stats = StepStats()
        # called with CompileEvent's while a step function compiles (compile_progress.TqdmProgress draws a bar)
        self.compile_progress = None
        self._functions: dict[tuple[int, bool], object] = {}
        # held by every call that runs or compiles a step function: the cache is one shared buffer updated
        # in place, so two threads' steps must not interleave (re-entrant: inference() holds it around run())
        self.lock = threading.RLock()
        if backend in ("jax", "mlx"):
            self._place_on_device()

    def _place_on_device(self) -> None:
        """Put weights and cache into the framework's own arrays once.

        The JAX and MLX linkers hand a shared variable's storage to the compiled function as is, so a numpy
        value would be converted on every call (measured: 138 ms per 2048x8192 matvec on JAX vs 9 ms).
        Storing device arrays in the containers makes every call zero-copy; updated caches come back as
        device arrays too.
        """
        if self.placement is not None:
            self._place_on_devices()
            return
        if self.backend == "jax":
            import jax

            to_device = jax.device_put
        else:
            import mlx.core as mx

            to_device = mx.array
        shared = list(self.weights.values()) + [sv for caches in self.cache for sv in caches]
        for sv in shared:
            sv.container.storage[0] = to_device(sv.container.storage[0])

    def _place_on_devices(self) -> None:
        """Cut the weights and caches held as numpy over the placement's devices (weights loaded sharded already
        are jax.Arrays and stay as they are)."""
        put = self.placement
        for name, sv in self.weights.items():
            if isinstance(sv.container.storage[0], np.ndarray):
                sv.container.storage[0] = sharding.place(sv.container.storage[0], put.weight(name))
        for i, (kinds, caches) in enumerate(zip(layer_caches(self.module), self.cache)):
            for (kind, _), sv in zip(kinds, caches):
                sv.container.storage[0] = sharding.place(np.asarray(sv.container.storage[0]), put.cache(i, kind))

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Swap in new weights of identical names and shapes without recompiling anything."""
        if set(weights) != set(self.weights):
            raise AlchemistError("set_weights: tensor names differ from the compiled model's")
        for name, arr in weights.items():
            old = self.weights[name].get_value(borrow=True)
            # compare dtype names: on MLX the stored value is an mx.array whose dtype is mlx.core.float32
            if tuple(old.shape) != tuple(arr.shape) or _dtype_name(old) != _dtype_name(arr):
                raise AlchemistError(
                    f"set_weights: {name} is {arr.dtype} {arr.shape}, compiled for {old.dtype} {tuple(old.shape)}"
                )
            self.weights[name].set_value(arr, borrow=True)
        self.reset()

    # -- compilation -------------------------------------------------------------------------------
    def _build(self, n_tokens: int, all_logits: bool, taps: dict | None = None):
        tokens = pt.tensor("tokens", dtype="int64", shape=(n_tokens,))
        start_pos = pt.scalar("start_pos", dtype="int64")
        positions = start_pos + pt.arange(n_tokens, dtype="int64")
        n_valid = pt.scalar("n_valid", dtype="int64")
        if all_logits:
            # static-shape backends cannot build arange(n_valid): return every row, sliced in run()
            rows = None if self.static else pt.arange(n_valid)
        else:
            rows = (n_valid - 1)[None]
        logits, new_cache = self.module.forward(
            self.weights,
            tokens,
            positions,
            self.cache,
            attend_len=self.capacity if self.static else start_pos + n_tokens,
            output_rows=rows,
            taps=taps,
            ops=self.ops,
            **({"n_valid": n_valid} if self.states else {}),
        )
        if not self.static:
            logits, new_cache = self._cache_writes_as_slices(logits, new_cache, start_pos, n_tokens)
        if self.placement is not None:  # the ggml kernels on each device's part (kernels.sharded)
            flat = [logits] + [value for caches in new_cache for value in caches]
            logits, *flat = sharding.shard_kernels(flat, self.weights, self.placement.layout)
            new_cache = regroup(flat, new_cache)
        updates = []
        for caches, new in zip(self.cache, new_cache):
            updates += list(zip(caches, new))
        return [tokens, start_pos, n_valid], logits, updates

    @staticmethod
    def _cache_writes_as_slices(logits, new_cache, start_pos, n_tokens: int):
        """Lower each cache write `set_subtensor(cache[start_pos + arange(T)], rows)` to the same write through
        the slice cache[start_pos : start_pos + T].

        The generated module writes the rows at their positions, which every backend can compile (JAX and
        MLX need static slice bounds). On C that is an advanced-indexing write of a 3-d array, which has no
        C code: it ran in Python, and trying C for it opened PyTensor's whole compiledir index in every
        process (~0.5 s). The slice write is C code, in place. A write by any other index is left as it is.
        """
        from pytensor.graph.basic import equal_computations
        from pytensor.graph.fg import FunctionGraph
        from pytensor.tensor.subtensor import AdvancedIncSubtensor

        positions = start_pos + pt.arange(n_tokens, dtype="int64")  # as forward() computes them
        flat = [logits] + [value for caches in new_cache for value in caches]
        # a graph over the step's own variables (not cloned: the weights and the cache stay the shared
        # variables they are); in topological order, so each write's rows already read the lowered writes
        # of the layers before
        fgraph = FunctionGraph(outputs=flat, clone=False)
        for node in fgraph.toposort():
            if (
                isinstance(node.op, AdvancedIncSubtensor)
                and node.op.set_instead_of_inc
                and len(node.inputs) == 3
                and equal_computations([node.inputs[2]], [positions])
            ):
                cache, rows = node.inputs[:2]
                lowered = pt.set_subtensor(cache[start_pos : start_pos + n_tokens], rows)
                fgraph.replace(node.outputs[0], lowered, reason="cache_write_as_slice", import_missing=True)
        logits, *flat = fgraph.outputs
        return logits, regroup(flat, new_cache)

    def step_function(self, n_tokens: int, all_logits: bool = False):
        key = (n_tokens, all_logits)
        fn = self._functions.get(key)
        if fn is None:
            with self.lock:
                return self._compile_step(key)
        return fn

    def _compile_step(self, key: tuple[int, bool]):
        fn = self._functions.get(key)  # another thread may have compiled it while this one waited
        if fn is None:
            self.precompile([key])
            fn = self._functions[key]
        return fn

    @staticmethod
    def _label(key: tuple[int, bool]) -> str:
        n_tokens, all_logits = key
        return ("decode" if n_tokens == 1 else f"prefill {n_tokens}") + (" (all logits)" if all_logits else "")

    def precompile(self, keys) -> None:
        """Compile (or link from the graph cache) the step functions of `keys`, (n_tokens, all_logits) each.

        Several are compiled as a pipeline: every graph is rewritten first, each one's missing C modules
        building with g++ in the background while the next is rewritten; then each is linked. On a cold start
        that overlaps the rewrites (Python, one core) with g++ (the other cores)."""
        with self.lock, activated():
            pending = []
            for key in dict.fromkeys(tuple(k) for k in keys):
                if key in self._functions:
                    continue
                t0 = time.perf_counter()
                shared = self._shared_by_name()
                cache_key = self._graph_cache_key(*key, shared)
                with compile_progress.tracking(self._label(key), self.compile_progress):
                    fn = graph_cache.load(cache_key, shared, self.mode) if cache_key else None
                    if fn is None:
                        maker = rewrite_step(*self._build(*key), self.mode)
                if fn is not None:
                    self.stats.graph_cache_hits += 1
                    self._add_function(key, fn, t0)
                else:
                    pending.append((key, maker, cache_key, time.perf_counter() - t0))
            for key, maker, cache_key, rewrite_s in pending:
                t0 = time.perf_counter()
                with compile_progress.tracking(self._label(key), self.compile_progress):
                    fn = link_step(maker, cache_key)
                self._add_function(key, fn, t0 - rewrite_s)

    def _add_function(self, key: tuple[int, bool], fn, t0: float) -> None:
        self.stats.compile_seconds += time.perf_counter() - t0
        self.stats.compile_count += 1
        self.stats.compiled_shapes.append(key)
        self._functions[key] = fn

    def _shared_by_name(self) -> dict:
        shared = dict(self.weights)
        for caches in self.cache:
            shared.update((sv.name, sv) for sv in caches)
        return shared

    def _graph_cache_key(
        self, n_tokens: int, all_logits: bool, shared: dict | None = None, taps: bool = False
    ) -> str | None:
        """The rewritten-graph cache key of a step function (or, with `taps`, of taps_function's), or None when
        the cache is off or the module has been modified since import_generated."""
        if not graph_cache.enabled() or not is_as_imported(self.module):
            return None
        if self.backend == "numba":
            # the kernels' Numba implementations are registered by a rewrite, which a cached graph skips
            from alchemist.kernels import register_numba

            register_numba()
        spec = {
            "n_tokens": n_tokens,
            "all_logits": all_logits,
            "capacity": self.capacity,
            "static": self.static,
            "numerics": self.numerics,
        }
        if taps:
            spec["taps"] = True
        if self.placement is not None:  # the sharded kernels are in the graph
            spec["sharding"] = self.placement.layout.digest
        source_sha256 = getattr(self.module, _SOURCE_SHA256)
        shared = self._shared_by_name() if shared is None else shared
        return graph_cache.step_key(source_sha256, self.backend, self.mode, shared, spec)

    def taps_function(self, n_tokens: int):
        """A function returning every named intermediate (llama.cpp names) for a fresh sequence; its rewritten
        graph is kept in the graph cache as the step functions' are."""
        with activated():
            taps: dict = {}
            inputs, logits, _ = self._build(n_tokens, True, taps)
            names = list(taps)
            shared = self._shared_by_name()
            cache_key = self._graph_cache_key(n_tokens, True, shared, taps=True)
            fn, _ = cached_or_compiled(cache_key, shared, self.mode, lambda: (inputs, [taps[n] for n in names], None))
        return names, fn

    # -- running -----------------------------------------------------------------------------------
    def bucket(self, n: int, start: int) -> int:
        room = self.capacity - start
        for b in PREFILL_BUCKETS:
            if b >= n and b <= room:
                return b
        fitting = [b for b in PREFILL_BUCKETS if b <= room]
        if not fitting:
            return min(n, room)
        return fitting[-1]

    def run(self, token_ids, start_pos: int, all_logits: bool = False) -> np.ndarray:
        """Feed tokens at positions start_pos..; returns logits of the last token (or of all tokens)."""
        with self.lock, self._on_mesh():
            return self._run(token_ids, start_pos, all_logits)

    def _on_mesh(self):
        """Across devices, steps run (and JAX traces them) under the placement's mesh: the sharded kernels'
        shard_map takes it from there."""
        if self.placement is None:
            return contextlib.nullcontext()
        import jax

        return jax.set_mesh(self.placement.mesh)

    def _run(self, token_ids, start_pos: int, all_logits: bool) -> np.ndarray:
        token_ids = [int(t) for t in token_ids]
        if start_pos + len(token_ids) > self.capacity:
            raise AlchemistError(
                f"context overflow: {start_pos + len(token_ids)} positions needed, KV cache holds {self.capacity} "
                f"(pass a larger context= to load_llm)"
            )
        if not token_ids:
            raise AlchemistError("run() needs at least one token")
        if self.states and start_pos not in (0, self.state_position):
            held = (
                "is unknown after a failed step;"
                if self.state_position is None
                else f"holds positions 0..{self.state_position - 1}; continue at {self.state_position} or"
            )
            raise AlchemistError(f"run() at position {start_pos}: this model's recurrent state {held} start again at 0")
        self.state_position = None  # until the steps have run
        out = self._run_steps(token_ids, start_pos, all_logits)
        self.state_position = start_pos + len(token_ids)
        return out

    def _run_steps(self, token_ids: list[int], start_pos: int, all_logits: bool) -> np.ndarray:
        if len(token_ids) == 1:
            out = self.step_function(1, all_logits)(np.array(token_ids, np.int64), np.int64(start_pos), np.int64(1))
            return sharding.host(out)
        if not all_logits and self._decode_is_quicker(len(token_ids), start_pos):
            for i, token in enumerate(token_ids):
                out = self._functions[(1, False)](np.array([token], np.int64), np.int64(start_pos + i), np.int64(1))
            return sharding.host(out)
        outs = []
        pos, rest = start_pos, token_ids
        while rest:
            b = self.bucket(len(rest), pos)
            chunk, rest = rest[:b], rest[b:]
            padded = np.zeros(b, np.int64)
            padded[: len(chunk)] = chunk
            out = self.step_function(b, all_logits)(padded, np.int64(pos), np.int64(len(chunk)))
            out = sharding.host(out)
            outs.append(out[: len(chunk)] if all_logits else out)
            pos += len(chunk)
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    def _decode_is_quicker(self, n_tokens: int, start_pos: int) -> bool:
        """Whether a short prompt is better fed one token at a time through the decode function: on C and Numba,
        when that one is linked and the prompt's prefill function is not, a few decode steps (~15 ms each) cost
        less than linking another step function (~0.3 s): a new process reaches its first token sooner."""
        return (
            self.backend in ("c", "numba")
            and n_tokens <= SHORT_PROMPT
            and (1, False) in self._functions
            and (self.bucket(n_tokens, start_pos), False) not in self._functions
        )

    def reset(self) -> None:
        """Forget the sequence. Not needed for correctness (every position is written before it is read),
        but it keeps stale values out of debugging views of the cache."""
        with self.lock:
            self.state_position = 0
            for caches in self.cache:
                for sv in caches:
                    sv.set_value(np.zeros(sv.type.shape, np.float32), borrow=True)
            if self.backend in ("jax", "mlx"):
                self._place_on_device()


def _shared_weight(name: str, value):
    """A weight's shared variable. A jax.Array (sharded: parts on several devices, maybe several processes)
    goes into the container as it is, behind a zero-byte numpy stand-in of its dtype and shape: the
    variable's filter would otherwise gather the whole array into one host copy."""
    if isinstance(value, np.ndarray):
        return pytensor.shared(value, name=name, borrow=True, shape=value.shape)
    stand_in = np.broadcast_to(np.zeros((), _dtype_name(value)), value.shape)
    sv = pytensor.shared(stand_in, name=name, borrow=True, shape=value.shape)
    sv.container.storage[0] = value
    return sv


def _dtype_name(array) -> str:
    """'float32' for a numpy, JAX or MLX array alike."""
    return str(array.dtype).rsplit(".", 1)[-1]
