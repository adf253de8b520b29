"""Each PyTensor / Numba internal alchemist uses (alchemist.pytensor_ext.pytensor_internals) exists and takes the
arguments alchemist passes; no other module reaches around that list. Run this file first on a new PyTensor."""

import ast
import inspect
import warnings
from pathlib import Path

import numpy as np
import pytest

import alchemist.runtime.engine  # noqa: F401 - configures PyTensor as alchemist runs it
from alchemist.pytensor_ext import pytensor_internals as internals

ALCHEMIST = Path(internals.__file__).resolve().parents[1]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _c_function():
    """A tiny compiled C function (what fast_link, parallel_build and the graph cache see)."""
    import pytensor
    import pytensor.tensor as pt

    x = pt.vector("x")
    return pytensor.function([x], pt.exp(x) + 1, mode=pytensor.compile.mode.Mode(linker="cvm", optimizer="fast_run"))


def test_the_installed_pytensor_is_the_tested_series():
    import pytensor

    assert pytensor.__version__.split(".")[:2] == internals.TESTED_PYTENSOR.split(".")
    assert internals.tested()
    pin = next(line for line in (ALCHEMIST.parent / "pyproject.toml").read_text().splitlines() if '"pytensor' in line)
    assert f">={internals.TESTED_PYTENSOR}" in pin, pin


def test_another_pytensor_series_warns_once_and_is_not_tested(monkeypatch):
    import pytensor

    monkeypatch.setattr(pytensor, "__version__", "9.1.0")
    internals.tested.cache_clear()
    try:
        with pytest.warns(UserWarning, match="tested with PyTensor 3.3.x, this is 9.1.0"):
            assert not internals.tested()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not internals.tested()  # remembered: no second warning
    finally:
        internals.tested.cache_clear()


@pytest.mark.parametrize("name", sorted(internals.SYMBOLS))
def test_symbol_exists(name):
    for package in ("numba", "jax", "mlx"):
        if internals.SYMBOLS[name][0].startswith((package, f"pytensor.link.{package}")):
            pytest.importorskip(package)
    assert getattr(internals, name) is not None


def test_a_name_outside_the_list_is_an_attribute_error():
    with pytest.raises(AttributeError):
        internals.no_such_symbol  # noqa: B018


def test_clinker_methods_alchemist_wraps_and_calls():
    from pytensor.graph.fg import FunctionGraph

    CLinker = internals.CLinker
    assert _params(CLinker.cthunk_factory)[:6] == [
        "self",
        "error_storage",
        "in_storage",
        "out_storage",
        "storage_map",
        "cache",
    ]
    assert _params(CLinker.compile_cmodule)[:2] == ["self", "location"]
    fn = _c_function()
    node = fn.maker.fgraph.toposort()[0]
    linker = CLinker().accept(FunctionGraph(node.inputs, node.outputs))
    for attr in ("node_order", "inputs", "outputs", "orphans"):
        assert isinstance(getattr(linker, attr), list), attr
    key = linker.cmodule_key()
    module = linker.get_dynamic_module()
    assert isinstance(module.code(), str) and module.code_hash
    for method in ("header_dirs", "lib_dirs", "libraries", "compile_args"):
        assert isinstance(getattr(linker, method)(), list), method
    compiler = linker.c_compiler()
    assert {"location", "py_module", "module_name", "src_code", "include_dirs", "lib_dirs", "libs", "preargs"} <= set(
        _params(compiler.compile_str)
    )
    cache = internals.get_module_cache()
    assert key in cache.entry_from_key  # compiled above
    assert isinstance(cache.module_hash_to_key_data, dict)
    assert isinstance(internals.get_module_hash(module.code(), key), str)
    path = cache.entry_from_key[key]
    assert internals.dlimport(path) is not None and path.endswith("." + internals.get_lib_extension())


def test_c_thunk_and_make_c_thunk():
    assert _params(internals.COp.make_c_thunk) == ["self", "node", "storage_map", "compute_map", "no_recycling"]
    assert _params(internals.CThunk.__init__)[:6] == [
        "self",
        "cthunk",
        "init_tasks",
        "tasks",
        "error_storage",
        "module",
    ]
    assert _params(internals.CThunk.find_task) == ["self", "failure_code"]
    fn = _c_function()
    assert fn.vm.nodes and all(hasattr(n, "op") for n in fn.vm.nodes)  # the graph cache records these
    np.testing.assert_allclose(fn(np.zeros(3, np.float32)), 2.0)


def test_function_maker_as_the_graph_cache_and_views_use_it():
    FunctionMaker = internals.FunctionMaker
    assert {"inputs", "outputs", "mode", "fgraph", "accept_inplace", "no_fgraph_prep", "on_unused_input"} <= set(
        _params(FunctionMaker.__init__)
    )
    assert _params(FunctionMaker.create)[:2] == ["self", "input_storage"]
    assert isinstance(inspect.getattr_static(FunctionMaker, "create_fgraph"), staticmethod)
    assert _params(FunctionMaker.prepare_fgraph)[:6] == [
        "inputs",
        "outputs",
        "additional_outputs",
        "fgraph",
        "mode",
        "profile",
    ]
    maker = _c_function().maker
    for attr in ("fgraph", "inputs", "outputs", "unpack_single", "return_none"):
        assert hasattr(maker, attr), attr
    assert isinstance(maker.fgraph.update_mapping, dict)


def test_rewrite_then_link_like_the_engine():
    import pytensor.tensor as pt

    from alchemist.runtime.backends import get_mode

    x = pt.vector("x")
    ins, outs = internals.construct_function_ins_and_outs([x], [x * 2], updates=None)
    mode = get_mode("c")
    maker = mode.function_maker(ins, outs, mode, accept_inplace=True, on_unused_input="ignore")
    assert isinstance(mode.linker, internals.VMLinker) and hasattr(mode.linker, "c_thunks")
    np.testing.assert_array_equal(maker.create()(np.ones(2, np.float32)), 2.0)


def test_compiler_and_blas_flags():
    gcc = internals.GCC_compiler
    assert hasattr(gcc, "march_flags")
    assert isinstance(gcc.compile_args(), list)
    assert _params(gcc.try_flags)[:1] == ["flag_list"]
    import pytensor

    if pytensor.config.blas__ldflags:
        assert isinstance(internals.blas_ldflags(), list)
        for which in ("flags", "include_dir", "libs_dir"):
            assert isinstance(internals.blas_ldflags(libs=False, **{which: True}), list), which
    assert "cblas" in internals.blas_header_text() or "sgemm" in internals.blas_header_text()
    assert internals.blas_header_version()


def test_numba_internals():
    pytest.importorskip("numba")
    from numba import types

    assert callable(internals.register_funcify_default_op_cache_key) and callable(internals.numba_launch_threads)
    internals.numba_launch_threads()  # idempotent

    @internals.numba_njit  # as the kernels' graph wrappers are: callable from Numba code only
    def twice(a):
        return a * 2

    @internals.numba_njit(final_function=True)
    def call(a):
        return twice(a)

    assert call(np.int64(3)) == 6
    fn = internals.numba_external_function("alchemist_no_such_symbol", types.int32(types.int32))
    assert fn.symbol == "alchemist_no_such_symbol"


def test_mlx_linker_as_mlx_host_subclasses_it():
    """kernels.mlx_host's linker turns `use_compile` off in `jit_compile(fn)` for a graph calling C; PyTensor
    makes a linker per function with `type(self)(allow_gc=...)` and keeps the graph in `fgraph`."""
    pytest.importorskip("mlx")
    import pytensor
    import pytensor.tensor as pt

    from alchemist.kernels import mlx_host
    from alchemist.kernels.silu import silu_ggml
    from alchemist.runtime.backends import get_mode

    assert _params(internals.MLXLinker.jit_compile) == ["self", "fn"]
    assert _params(internals.MLXLinker.__init__)[:2] == ["self", "use_compile"]
    assert internals.MLXLinker(allow_gc=False).use_compile
    x = pt.vector("x", dtype="float32")
    plain = pytensor.function([x], pt.exp(x), mode=get_mode("mlx"))
    assert plain.maker.linker.use_compile and plain.maker.linker.fgraph is plain.maker.fgraph
    if mlx_host.available():
        calling_c = pytensor.function([x], silu_ggml(x), mode=get_mode("mlx"))
        assert not calling_c.maker.linker.use_compile
        assert np.asarray(calling_c(np.float32([0.5, -2.0])))[1] < 0


def test_jax_and_mlx_dispatch_registration():
    for package, name in (("jax", "jax_funcify"), ("mlx", "mlx_funcify")):
        if __import__("importlib").util.find_spec(package) is None:
            continue
        assert hasattr(getattr(internals, name), "register"), name  # a functools.singledispatch


# the modules and private names alchemist may import only in pytensor_internals.py
PRIVATE = {(module, attr) for module, attr, _ in internals.SYMBOLS.values()}


def test_no_module_imports_an_internal_around_the_list():
    offenders = []
    for path in ALCHEMIST.rglob("*.py"):
        if path.name == "pytensor_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {a.name for a in node.names}
                hits = [(node.module, n) for n in names if (node.module, n) in PRIVATE and n != "COp"]
                hits += [(node.module, n) for n in names if f"{node.module}.{n}" in {m for m, _ in PRIVATE}]
                if hits:
                    offenders.append(f"{path.relative_to(ALCHEMIST)}:{node.lineno} {hits}")
    assert not offenders, offenders


def _validation_outcomes() -> list[str]:
    """Replace nodes of a small graph by in-place ones under a Supervisor protecting input x and the outputs:
    each replacement's outcome ("accepted" or the refusal's text)."""
    import pytensor.tensor as pt
    from pytensor.graph.features import ReplaceValidate
    from pytensor.graph.fg import FunctionGraph

    def in_place(var, *inputs):  # var's elementwise op, writing its output over input 0
        op = var.owner.op
        return type(op)(op.scalar_op, {0: 0})(*inputs)

    x, y = pt.vector("x"), pt.vector("y")
    e = pt.exp(x)
    s = e + y
    out = pt.log(s)
    fgraph = FunctionGraph([x, y], [out, e], clone=False)
    fgraph.attach_feature(internals.DestroyHandler())
    fgraph.attach_feature(internals.Supervisor([x]))
    fgraph.attach_feature(ReplaceValidate())
    outcomes = []
    for old, new in [
        (e, in_place(e, x)),  # destroys the protected input x
        (s, in_place(s, e, y)),  # destroys e, an output
        (s, in_place(s, y, e)),  # destroys y, which is not protected
        (out, in_place(out, fgraph.outputs[0].owner.inputs[0])),  # destroys the sum
    ]:
        try:
            fgraph.replace_all_validate([(old, new)], reason="test")
            outcomes.append("accepted")
        except internals.InconsistencyError as err:
            outcomes.append(str(err).split(":")[0])
    return outcomes


def test_fast_supervisor_refuses_and_accepts_what_pytensors_does(monkeypatch):
    """alchemist.pytensor_ext.fast_supervisor's check against PyTensor's own Supervisor.on_validate, replacement by
    replacement, on a graph where it must refuse (an in-place op on a protected input) and accept."""
    from alchemist.pytensor_ext.host import activated

    with activated():
        ours = internals.Supervisor.on_validate
        assert ours is not ours.pytensor_on_validate
        outcomes = _validation_outcomes()
    assert internals.Supervisor.on_validate is ours.pytensor_on_validate  # PyTensor's own again outside
    assert _validation_outcomes() == outcomes
    assert outcomes == ["Trying to destroy a protected variable"] * 2 + ["accepted"] * 2


def test_fast_cycle_check_answers_what_pytensors_does():
    """alchemist.pytensor_ext.fast_cycles.contains_cycle against PyTensor's destroyhandler._contains_cycle on a
    random graph with random orderings (some closing cycles through the graph's edges, some not) and an ordering on
    a node outside the graph; activated() puts it in DestroyHandler.validate's module and takes it out again."""
    import random

    import pytensor.tensor as pt
    from pytensor.graph.fg import FunctionGraph

    from alchemist.pytensor_ext import fast_cycles
    from alchemist.pytensor_ext.host import activated

    pytensor_check, ours = internals.contains_cycle, fast_cycles.contains_cycle
    rng = random.Random(0)
    x, y = pt.vector("x"), pt.vector("y")
    vars_ = [x, y]
    for i in range(60):
        a, b = rng.choice(vars_), rng.choice(vars_)
        vars_.append(pt.exp(a) + b if i % 3 else a * b)
    fgraph = FunctionGraph([x, y], vars_[-3:], clone=False)
    nodes = list(fgraph.toposort())
    answers = []
    for _ in range(300):
        orderings = {}
        for _ in range(rng.randint(1, 3)):
            after, before = rng.sample(nodes, 2)  # `before` must run first: a cycle when `after` precedes it
            orderings.setdefault(after, []).append(before)
        answers.append(pytensor_check(fgraph, orderings))
        assert ours(fgraph, orderings) == answers[-1], orderings
    assert 50 < sum(answers) < 250  # both kinds, many of each
    stray = pt.exp(pt.vector("z")).owner  # not in the graph: never visited, a cycle to PyTensor
    assert pytensor_check(fgraph, {nodes[-1]: [stray]}) and ours(fgraph, {nodes[-1]: [stray]})
    module = fast_cycles.destroyhandler_module()
    with activated():
        assert module._contains_cycle is ours and ours.pytensor_contains_cycle is pytensor_check
    assert module._contains_cycle is pytensor_check


def test_the_rewrites_the_modes_leave_out_are_pytensors():
    """backends.UNUSED_REWRITES name PyTensor rewrites (a renamed one would silently run again): PyTensor's
    fast_run turns a product with a diagonal matrix into an elementwise one, alchemist's C mode keeps the Dot."""
    import pytensor
    import pytensor.tensor as pt
    from pytensor.compile.mode import Mode

    from alchemist.runtime.backends import UNUSED_REWRITES, get_mode

    v, m = pt.vector("v"), pt.matrix("m")
    out = pt.dot(pt.diag(v), m)

    def ops(mode):
        fn = pytensor.function([v, m], out, mode=Mode(linker="py", optimizer=mode.provided_optimizer))
        return {type(node.op).__name__ for node in fn.maker.fgraph.apply_nodes}

    assert "dot_diag_to_elemwise" in UNUSED_REWRITES
    assert not ops(Mode(linker="py", optimizer="fast_run")) & {"Dot", "Dot22", "Gemm", "Gemv", "CGemv"}
    assert ops(get_mode("c")) & {"Dot", "Dot22", "Gemm", "Gemv", "CGemv"}
