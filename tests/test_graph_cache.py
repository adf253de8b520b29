"""The rewritten-graph disk cache (alchemist.runtime.graph_cache) and the load-path caches.

A cached step function must compute exactly what a freshly compiled one computes (same logits, same KV
cache updates), in this process and in a new one; anything that would change the graph must miss; a
damaged entry must fall back to compiling with a warning, never stop a model from loading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from alchemist.runtime import graph_cache
from alchemist.runtime.engine import Engine, import_generated

PROMPT = [2, 7, 11, 5, 3]
DECODE = [9, 4, 13, 6]


@pytest.fixture
def graph_dir(tmp_path, monkeypatch):
    """A private, empty graph cache (models stay where they are: only the graph directory moves)."""
    target = tmp_path / "graphs"
    monkeypatch.setattr(graph_cache, "cache_dir", lambda: target)
    monkeypatch.delenv("ALCHEMIST_GRAPH_CACHE", raising=False)
    return target


@pytest.fixture(scope="module")
def q8_module(tiny_gguf, tmp_path_factory):
    """A Q8_0 fixture (llama.cpp's quantizer), so the quantized-matmul kernel Ops are in the cached graph."""
    pytest.importorskip("llama_cpp")
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf
    from alchemist.harness import quantize_fixture
    from alchemist.runtime.api import write_generated

    root = tmp_path_factory.mktemp("graph_cache")
    path = root / "qwen2-Q8_0.gguf"
    quantize_fixture(tiny_gguf("qwen2"), path, "Q8_0", nthread=1)
    return import_generated(write_generated(build_model_ir(read_gguf(path)), root)), path


def _generate(engine: Engine) -> np.ndarray:
    """Prefill logits of every prompt position, then four decode steps (each reads the updated cache)."""
    engine.reset()
    rows = [engine.run(PROMPT, 0, all_logits=True)]
    rows += [engine.run([t], len(PROMPT) + i) for i, t in enumerate(DECODE)]
    return np.concatenate(rows)


@pytest.mark.parametrize("backend", ["c", "numba"])
def test_cached_graph_computes_what_a_compiled_one_does(q8_module, graph_dir, backend):
    mod, path = q8_module
    weights = mod.load_weights(str(path), quantized=True)
    fresh = Engine(mod, weights, backend, 32)
    expected = _generate(fresh)
    assert fresh.stats.graph_cache_hits == 0 and fresh.stats.compile_count == 2
    assert len(list(graph_dir.glob("*.pkl"))) == 2  # prefill bucket and decode step

    cached = Engine(mod, weights, backend, 32)
    got = _generate(cached)
    assert cached.stats.graph_cache_hits == 2
    np.testing.assert_array_equal(got, expected)
    # the cached function updated this engine's own KV cache, not the first engine's
    k_fresh, k_cached = fresh.cache[0][0].get_value(), cached.cache[0][0].get_value()
    np.testing.assert_array_equal(k_cached, k_fresh)
    assert np.abs(k_cached[: len(PROMPT) + len(DECODE) - 1]).max() > 0


def test_taps_function_is_cached_and_computes_the_same(tiny_module, graph_dir, monkeypatch):
    """The validation harness's every-intermediate function (Engine.taps_function) links from the graph cache in a
    second engine: the same names, the same values, and its own key (not a step function's)."""
    mod, path = tiny_module("qwen2")
    weights = mod.load_weights(str(path))
    fresh = Engine(mod, weights, "c", 32)
    names, fn = fresh.taps_function(len(PROMPT))
    expected = fn(np.array(PROMPT, np.int64), np.int64(0), np.int64(len(PROMPT)))
    assert len(list(graph_dir.glob("*.pkl"))) == 1
    assert fresh._graph_cache_key(len(PROMPT), True, taps=True) != fresh._graph_cache_key(len(PROMPT), True)

    loads = []
    real_load = graph_cache.load

    def spy(key, shared, mode):
        loads.append(real_load(key, shared, mode))
        return loads[-1]

    monkeypatch.setattr(graph_cache, "load", spy)
    cached_names, cached_fn = Engine(mod, weights, "c", 32).taps_function(len(PROMPT))
    assert len(loads) == 1 and loads[0] is cached_fn  # linked from the cache, not rewritten
    assert cached_names == names and len(names) > 10
    got = cached_fn(np.array(PROMPT, np.int64), np.int64(0), np.int64(len(PROMPT)))
    for name, a, b in zip(names, expected, got, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def _generate_in_a_new_process(module_file: str, gguf_path, graph_dir, out) -> dict:
    """_generate on the C backend in a fresh Python process; returns what the child saw of the caches."""
    script = textwrap.dedent(f"""
        import json
        import numpy as np
        from pathlib import Path
        from alchemist.runtime import graph_cache
        from alchemist.pytensor_ext import fast_link
        graph_cache.cache_dir = lambda: Path({str(graph_dir)!r})
        from alchemist.runtime.engine import Engine, import_generated
        import pytensor.link.c.cmodule as cmodule
        mod = import_generated({module_file!r})
        engine = Engine(mod, mod.load_weights({str(gguf_path)!r}), "c", 32)
        rows = [engine.run({PROMPT!r}, 0, all_logits=True)]
        rows += [engine.run([t], {len(PROMPT)} + i) for i, t in enumerate({DECODE!r})]
        np.save({str(out)!r}, np.concatenate(rows))
        seen = {{"hits": engine.stats.graph_cache_hits, "preferred": fast_link.stats["preferred"],
                 "compiledir_index_opened": cmodule._module_cache is not None}}
        print(json.dumps(seen))
        """)
    env = {k: v for k, v in os.environ.items() if k != "ALCHEMIST_GRAPH_CACHE"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_links_the_cached_graph(tiny_module, graph_dir, tmp_path):
    mod, path = tiny_module("qwen2")
    expected = _generate(Engine(mod, mod.load_weights(str(path)), "c", 32))
    out = tmp_path / "child.npy"
    seen = _generate_in_a_new_process(mod.__file__, path, graph_dir, out)
    np.testing.assert_array_equal(np.load(out), expected)
    assert seen["hits"] == 2
    # every node's compiled module came from the entry's record: PyTensor's compiledir index (unpickling
    # every key.pkl in it, ~0.5 s) was never opened, and no node tried C code it does not have
    assert seen["preferred"] > 0 and not seen["compiledir_index_opened"], seen


def test_a_stale_module_record_is_looked_up_and_rewritten(tiny_module, graph_dir, tmp_path):
    """The record of which compiled module linked each node is only a hint: rows naming a file that changed,
    vanished or lies outside the compiledir are looked up the usual way, and the record is rewritten."""
    mod, path = tiny_module("qwen2")
    expected = _generate(Engine(mod, mod.load_weights(str(path)), "c", 32))
    records = sorted(graph_dir.glob("*.modules.json"))
    assert len(records) == 2
    good = {r: json.loads(r.read_text()) for r in records}
    for record, data in good.items():
        rows = [list(row) for row in data["modules"]]
        rows[0][3] += 1  # another mtime: the compiledir entry was rebuilt
        rows[1][1] = "../../" + rows[1][1].split("/")[-1]  # escapes the compiledir
        rows[2][1] = "tmpgone/m0.so"  # vanished
        record.write_text(json.dumps({**data, "modules": rows}))
    out = tmp_path / "child.npy"
    seen = _generate_in_a_new_process(mod.__file__, path, graph_dir, out)
    np.testing.assert_array_equal(np.load(out), expected)
    assert seen["hits"] == 2 and seen["compiledir_index_opened"], seen
    for record, data in good.items():
        assert json.loads(record.read_text()) == data  # rewritten from what linked
    seen = _generate_in_a_new_process(mod.__file__, path, graph_dir, out)
    np.testing.assert_array_equal(np.load(out), expected)
    assert not seen["compiledir_index_opened"], seen


def test_c_step_functions_run_every_node_in_c(q8_module, graph_dir):
    """No node of a C-backend step falls back to Python (the KV-cache write used to: an advanced-indexing
    write has no C code, and trying it opened PyTensor's compiledir index in every process)."""
    mod, path = q8_module
    engine = Engine(mod, mod.load_weights(str(path), quantized=True), "c", 32)
    for n_tokens in (1, 8):
        fn = engine.step_function(n_tokens)
        python = [str(node) for node, thunk in zip(fn.vm.nodes, fn.vm.thunks) if not hasattr(thunk, "cthunk")]
        assert not python, python[:5]


def test_anything_that_changes_the_graph_misses(tiny_module, graph_dir):
    mod, path = tiny_module("qwen2")
    weights = mod.load_weights(str(path))
    engine = Engine(mod, weights, "c", 32)
    key = engine._graph_cache_key(1, False)
    assert key == Engine(mod, weights, "c", 32)._graph_cache_key(1, False)  # stable
    assert key != engine._graph_cache_key(8, False)
    assert key != engine._graph_cache_key(1, True)
    assert key != Engine(mod, weights, "c", 64)._graph_cache_key(1, False)  # capacity
    assert key != Engine(mod, weights, "numba", 32)._graph_cache_key(1, False)
    other = dict(weights)
    name = next(iter(other))
    other[name] = other[name].astype(np.float64)
    assert key != Engine(mod, other, "c", 32)._graph_cache_key(1, False)  # a weight's dtype
    assert key != Engine(mod, weights, "c", 32, numerics="ggml")._graph_cache_key(1, False)  # the primitives

    # a module a user rebinds a function of builds another graph than its source says: never cached
    patched = import_generated(mod.__file__, name_suffix="_patched")
    assert Engine(patched, weights, "c", 32)._graph_cache_key(1, False) == key
    patched.rms_norm = lambda x, w: x
    assert Engine(patched, weights, "c", 32)._graph_cache_key(1, False) is None


def test_cache_can_be_turned_off(tiny_module, graph_dir, monkeypatch):
    mod, path = tiny_module("qwen2")
    monkeypatch.setenv("ALCHEMIST_GRAPH_CACHE", "0")
    engine = Engine(mod, mod.load_weights(str(path)), "c", 32)
    engine.run([1], 0)
    assert engine._graph_cache_key(1, False) is None
    assert not graph_dir.exists() or not list(graph_dir.iterdir())


def test_damaged_entry_warns_and_recompiles(tiny_module, graph_dir):
    mod, path = tiny_module("qwen2")
    weights = mod.load_weights(str(path))
    expected = Engine(mod, weights, "c", 32).run(PROMPT, 0, all_logits=True)
    (entry,) = graph_dir.glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[:1000])
    engine = Engine(mod, weights, "c", 32)
    with pytest.warns(UserWarning, match="graph cache: .* unusable"):
        got = engine.run(PROMPT, 0, all_logits=True)
    np.testing.assert_array_equal(got, expected)
    assert engine.stats.graph_cache_hits == 0
    # the recompiled function replaced the damaged entry
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = Engine(mod, weights, "c", 32)
        np.testing.assert_array_equal(again.run(PROMPT, 0, all_logits=True), expected)
    assert again.stats.graph_cache_hits == 1


def test_an_unusable_cache_directory_only_costs_compiling(tiny_module, tmp_path, monkeypatch):
    from alchemist.paths import cache_subdir

    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("ALCHEMIST_CACHE", str(blocker))  # cache_subdir cannot mkdir below a file
    monkeypatch.setattr(graph_cache, "cache_dir", lambda: cache_subdir("graphs"))
    mod, path = tiny_module("qwen2")
    weights = mod.load_weights(str(path))
    with pytest.warns(UserWarning, match="graph cache: cannot use"):
        first = Engine(mod, weights, "c", 32).run([1, 2], 0)
    with pytest.warns(UserWarning, match="graph cache: cannot use"):
        second = Engine(mod, weights, "c", 32)
        np.testing.assert_array_equal(second.run([1, 2], 0), first)
    assert second.stats.graph_cache_hits == 0 and second.stats.compile_count == 1


def test_entries_hold_the_graph_not_the_weights(tiny_module, graph_dir):
    mod, path = tiny_module("qwen2")
    weights = mod.load_weights(str(path))
    Engine(mod, weights, "c", 32).run([1], 0)
    (entry,) = graph_dir.glob("*.pkl")
    biggest = max(w.nbytes for w in weights.values())
    assert entry.stat().st_size < biggest  # shared variables were replaced by placeholders


def test_file_sha256_is_remembered_until_the_file_changes(tmp_path):
    import hashlib

    from alchemist.gguf_io.reader import _cached_file_sha256

    f = tmp_path / "blob.bin"
    f.write_bytes(b"a" * 1000)
    assert _cached_file_sha256(str(f)) == hashlib.sha256(b"a" * 1000).hexdigest()
    assert _cached_file_sha256(str(f)) == hashlib.sha256(b"a" * 1000).hexdigest()
    f.write_bytes(b"b" * 1001)  # new size and mtime: hashed again
    assert _cached_file_sha256(str(f)) == hashlib.sha256(b"b" * 1001).hexdigest()


def test_fast_link_reuses_modules_and_changes_nothing(tiny_module, tmp_path):
    """alchemist.pytensor_ext.fast_link on (the default) vs off in a fresh process: bit-identical logits."""
    from alchemist.pytensor_ext import fast_link

    mod, path = tiny_module("gemma3")
    before = dict(fast_link.stats)
    with_fast_link = _generate(Engine(mod, mod.load_weights(str(path)), "c", 32))
    # the layers' repeated nodes reused their modules, both ways (a signature error would fall back silently)
    assert fast_link.stats["instantiated"] > before["instantiated"]
    assert fast_link.stats["reused"] > before["reused"]

    out = tmp_path / "plain.npy"
    script = textwrap.dedent(f"""
        import numpy as np
        from alchemist.pytensor_ext import fast_link
        from alchemist.runtime.engine import Engine, import_generated
        assert not fast_link._enabled
        mod = import_generated({mod.__file__!r})
        engine = Engine(mod, mod.load_weights({str(path)!r}), "c", 32)
        rows = [engine.run({PROMPT!r}, 0, all_logits=True)]
        rows += [engine.run([t], {len(PROMPT)} + i) for i, t in enumerate({DECODE!r})]
        np.save({str(out)!r}, np.concatenate(rows))
        """)
    env = dict(os.environ, ALCHEMIST_FAST_LINK="0", ALCHEMIST_GRAPH_CACHE="0")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    np.testing.assert_array_equal(np.load(out), with_fast_link)
