"""The auditor: good modules pass every check; each seeded defect is caught by its check, on every family.

The mutations are edits of the generated source that rely only on the module contract (forward(w, ...),
TENSORS, the imports of gguf's dequantizer and of alchemist.kernels) and on the IR, never on the template's
helper names; each asserts that it applied, so a template change that makes one inexpressible fails here
instead of being skipped.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import black
import libcst as cst
import pytest

from alchemist.arch import build_model_ir
from alchemist.audit import CHECK_NAMES, audit_module, write_reports
from alchemist.audit.cli import register
from alchemist.audit.source import ModuleSource
from alchemist.codegen import BLACK_MODE
from alchemist.errors import AlchemistError
from alchemist.fixtures import FAMILIES, write_fixture
from alchemist.gguf_io import read_gguf
from alchemist.runtime.api import write_generated

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = {
    "gemma": ("gemma-3-270m", "gemma_3_270m_q4_k_m"),
    "qwen": ("qwen2.5-coder-0.5b", "qwen2_5_coder_0_5b_instruct_q4_k_m"),
}
SOURCE_CHECKS = ("provenance", "syntax", "format", "safety", "config")


@pytest.fixture(scope="session")
def reference_ggufs() -> dict[str, Path]:
    from alchemist.models import reference_model_path

    try:
        return {key: reference_model_path(ref) for key, (ref, _) in REFERENCE.items()}
    except AlchemistError as e:
        pytest.skip(f"reference models unavailable: {e}")


@pytest.fixture(scope="session")
def reference_reports(reference_ggufs):
    return {
        key: audit_module(ROOT / "generated" / f"{stem}.py", gguf_path=reference_ggufs[key])
        for key, (_, stem) in REFERENCE.items()
    }


@pytest.fixture(scope="session")
def fixture_modules(tmp_path_factory) -> dict[str, tuple[Path, Path, object]]:
    """A generated module per family from a tiny GGUF quantized to Q8_0 by llama.cpp (float32 norms, Q8_0
    matrices that the module keeps in GGUF blocks with quantized=True: both graph paths exist)."""
    from alchemist.harness.quantize import quantize_fixture

    d = tmp_path_factory.mktemp("audit_fixtures")
    out = {}
    for fam in FAMILIES:
        f16 = write_fixture(d / f"tiny-{fam}-f16.gguf", fam, weight_type="F16")
        gguf_path = quantize_fixture(f16, d / f"tiny-{fam}.gguf", "Q8_0").path
        ir = build_model_ir(read_gguf(gguf_path))
        assert any(t.kernel for t in ir.tensors), f"{fam}: the Q8_0 fixture has no kernel tensors"
        out[fam] = (write_generated(ir, d / "generated"), gguf_path, ir)
    return out


def write_mutant(tmp_path: Path, module: Path, text: str) -> Path:
    path = tmp_path / module.name
    path.write_text(black.format_str(text, mode=BLACK_MODE))
    return path


# ---------------------------------------------------------------------------------------------------
# mutations: source edits that need only the module contract and the IR
# ---------------------------------------------------------------------------------------------------
def _forward_prologue(text: str, lines: list[str]) -> str:
    """Insert statements at the top of forward()'s body (after its docstring)."""
    tree = cst.parse_module(text)
    (fn,) = [s for s in tree.body if isinstance(s, cst.FunctionDef) and s.name.value == "forward"]
    body = list(fn.body.body)
    at = 1 if body and isinstance(body[0], cst.SimpleStatementLine) and isinstance(body[0].body[0], cst.Expr) else 0
    new = [cst.parse_statement(line) for line in lines]
    fn2 = fn.with_changes(body=fn.body.with_changes(body=body[:at] + new + body[at:]))
    return tree.with_changes(body=[fn2 if s is fn else s for s in tree.body]).code


class _ReplaceCalls(cst.CSTTransformer):
    """Replace every call of an imported function (by qualified name) with `make(args)`."""

    def __init__(self, src: ModuleSource, qualnames: dict):
        self.src, self.qualnames, self.count = src, qualnames, 0

    def leave_Call(self, original, updated):
        make = self.qualnames.get(self.src.qualname(original.func))
        if make is None:
            return updated
        self.count += 1
        return cst.parse_expression(make([self.src.code(a.value) for a in original.args]))


def _replace_calls(text: str, qualnames: dict) -> str:
    src = ModuleSource.parse(text, "m.py")
    t = _ReplaceCalls(src, qualnames)
    new = src.module.visit(t).code
    assert t.count, f"mutation not expressible: the module calls none of {sorted(qualnames)}"
    return new


def mutate_loader_dequantize_removed(text: str, ir) -> str:
    """gguf's dequantizer replaced by its input: raw bytes instead of values."""
    return _replace_calls(text, {q: (lambda a: a[0]) for q in ("gguf.quants.dequantize", "gguf.dequantize")})


def mutate_kernels_removed(text: str, ir) -> str:
    """The quantized kernels replaced by plain products / row gathers of the (uint8) blocks."""
    return _replace_calls(
        text,
        {
            "alchemist.kernels.quantized_linear": lambda a: f"({a[0]}) @ ({a[1]}).T",
            "alchemist.kernels.quantized_embedding": lambda a: f"({a[0]})[{a[1]}]",
        },
    )


def mutate_orientation_flipped(text: str, ir) -> str:
    """A square float32 linear weight applied transposed (x @ W instead of x @ W.T)."""
    square = [t.name for t in ir.tensors if t.role == "linear" and len(t.shape) == 2 and t.shape[0] == t.shape[1]]
    assert square, "mutation not expressible: no square linear weight (a transposed other one fails to build)"
    name = square[0]
    return _forward_prologue(
        text, [f'w = {{**w, {name!r}: w[{name!r}].T if w[{name!r}].dtype == "float32" else w[{name!r}]}}']
    )


def swap_reshape(text: str, pair: tuple[int, int]) -> str:
    """The first `.reshape((..., a, b, ...))` with adjacent sizes that evaluate to `pair` made
    `.reshape((..., b, a, ...))` and transposed back: the same shapes downstream, the values regrouped."""
    from alchemist.audit.graph import load_isolated

    src = ModuleSource.parse(text, "m.py")
    # the constants, and layer 0's sizes where the module has them per layer (N_HEAD[il])
    namespace, done = {**vars(load_isolated(text, "m.py")), "il": 0}, []

    def value(node):
        try:
            return eval(src.code(node), dict(namespace))  # noqa: S307 - the constants of our own module
        except Exception:  # noqa: BLE001 - a local size such as n_tokens
            return None

    class Swap(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            f, args = original.func, original.args
            if done or not (isinstance(f, cst.Attribute) and f.attr.value == "reshape" and len(args) == 1):
                return updated
            shape = args[0].value
            dims = [e.value for e in shape.elements] if isinstance(shape, cst.Tuple) else []
            at = [j for j in range(1, len(dims) - 1) if (value(dims[j]), value(dims[j + 1])) == pair]
            if not at:
                return updated
            done.append(src.code(original))
            j = at[0]
            dims[j], dims[j + 1] = dims[j + 1], dims[j]
            order = list(range(len(dims)))
            order[j], order[j + 1] = j + 1, j
            code = ", ".join(src.code(x) for x in dims)
            return cst.parse_expression(
                f"{src.code(f.value)}.reshape(({code})).dimshuffle({', '.join(map(str, order))})"
            )

    new = src.module.visit(Swap()).code
    assert done, f"mutation not expressible: no .reshape((..., {pair[0]}, {pair[1]}, ...)) found"
    return new


def mutate_head_split_transposed(text: str, ir) -> str:
    """The split into (..., n_head, head_dim) made dim-major (without attention: Mamba-2's heads)."""
    if not ir.attention_layers:
        ssm = ir.layers[0].ssm
        return swap_reshape(text, (ssm.n_head, ssm.head_dim))
    att = ir.attention_layers[0].attention
    return swap_reshape(text, (att.n_head, att.head_dim))


def mutate_tensor_unread(text: str, ir) -> str:
    """A 1-D weight the model applies replaced by zeros of its shape before anything reads it (a tensor llama.cpp
    loads and never applies, a multi-token-prediction layer's, would not be missed)."""
    name = [t.name for t in ir.tensors if len(t.shape) == 1 and t.read][-1]
    alias = {q: local for local, q in ModuleSource.parse(text, "m.py").imports.items()}["pytensor.tensor"]
    return _forward_prologue(
        text, [f'w = {{**w, {name!r}: {alias}.zeros({tuple(ir.tensor(name).shape)}, dtype="float32")}}']
    )


def mutate_injected_import(text: str, ir) -> str:
    new, n = re.subn(r"^(import |from )", r"import os\n\1", text, count=1, flags=re.M)
    assert n == 1, "mutation not expressible: no import line"
    return new


MUTATIONS = {
    "dequantize-removed": (mutate_loader_dequantize_removed, "dequantization"),
    "kernels-removed": (mutate_kernels_removed, "dequantization"),
    "orientation-flipped": (mutate_orientation_flipped, "orientation"),
    "head-split-transposed": (mutate_head_split_transposed, "heads"),
    "tensor-unread": (mutate_tensor_unread, "coverage"),
    "injected-import": (mutate_injected_import, "safety"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("fam", FAMILIES)
def test_mutation_is_caught(fixture_modules, tmp_path, fam, mutation):
    module, gguf_path, ir = fixture_modules[fam]
    mutate, check = MUTATIONS[mutation]
    report = audit_module(write_mutant(tmp_path, module, mutate(module.read_text(), ir)), gguf_path=gguf_path)
    assert check in report.failed, report.table()
    assert report.check(check).details
    if check != "safety":  # the source is as sound as before: only graph checks may fail
        assert not set(report.failed) & set(SOURCE_CHECKS), report.table()


@pytest.fixture(scope="session")
def ambiguous_head_modules(tmp_path_factory) -> dict[str, tuple[Path, Path, object]]:
    """llama fixtures whose head layouts shapes alone cannot check: n_head == head_dim (8 heads of 8), and
    grouped-query heads with n_kv_head != group (6 heads, 2 KV heads: groups of 3)."""
    from alchemist.fixtures import FixtureConfig

    d = tmp_path_factory.mktemp("audit_heads")
    configs = {
        "square": FixtureConfig("llama", n_embd=64, n_head=8, n_kv_head=4, head_dim=8, n_ff=128),
        "gqa": FixtureConfig("llama", n_embd=96, n_head=6, n_kv_head=2, head_dim=16, n_ff=128),
    }
    out = {}
    for key, cfg in configs.items():
        gguf_path = write_fixture(d / f"tiny-{key}.gguf", "llama", config=cfg)
        ir = build_model_ir(read_gguf(gguf_path))
        out[key] = (write_generated(ir, d / key), gguf_path, ir)
    return out


def test_dim_major_head_split_caught_when_n_head_equals_head_dim(ambiguous_head_modules, tmp_path):
    module, gguf_path, ir = ambiguous_head_modules["square"]
    assert audit_module(module, gguf_path).passed
    report = audit_module(write_mutant(tmp_path, module, swap_reshape(module.read_text(), (8, 8))), gguf_path)
    assert report.failed == ["heads"], report.table()
    assert "sums over an axis holding kv 4" in report.check("heads").why


def test_group_major_query_heads_caught(ambiguous_head_modules, tmp_path):
    module, gguf_path, ir = ambiguous_head_modules["gqa"]
    assert audit_module(module, gguf_path).passed
    report = audit_module(write_mutant(tmp_path, module, swap_reshape(module.read_text(), (2, 3))), gguf_path)
    assert report.failed == ["heads"], report.table()
    assert "splits 6 head into (3, 2), not kv-major (2, 3)" in report.check("heads").why


def test_blocks_reaching_anything_but_a_kernel_fail_dequantization(fixture_modules, tmp_path):
    module, gguf_path, ir = fixture_modules["qwen3"]
    name = sorted(t.name for t in ir.tensors if t.kernel and t.role == "linear")[0]
    text = _forward_prologue(
        module.read_text(),
        [f"w = {{**w, {name!r}: (w[{name!r}] + 0).astype('uint8') if w[{name!r}].dtype == 'uint8' else w[{name!r}]}}"],
    )
    report = audit_module(write_mutant(tmp_path, module, text), gguf_path)
    assert report.failed == ["dequantization"], report.table()
    assert f"the uint8 blocks of {name} (Q8_0) reach Add" in report.check("dequantization").why


def test_a_2d_tensor_of_a_role_without_an_orientation_rule_fails_closed(fixture_modules):
    import dataclasses

    module, _, ir = fixture_modules["llama"]
    name = "blk.0.attn_q.weight"
    tensors = tuple(dataclasses.replace(t, role="mystery") if t.name == name else t for t in ir.tensors)
    report = audit_module(module, ir=dataclasses.replace(ir, tensors=tensors))
    assert f"{name} is a 2-D tensor of role 'mystery'" in report.check("orientation").why


def test_a_group_norm_applied_transposed_fails_orientation(fixture_modules, tmp_path):
    """Mamba-2's grouped norm scale (groups, width) multiplying activations laid out (…, width, groups)."""
    module, gguf_path, _ = fixture_modules["granitehybrid"]
    text = module.read_text()
    right = 'y = ops.rms_norm(y.reshape((n_seq * n_tok, SSM_GROUP, SSM_INNER // SSM_GROUP))) * w[p + "ssm_norm.weight"]'
    wrong = (
        "y = ops.rms_norm(y.reshape((n_seq * n_tok, SSM_GROUP, SSM_INNER // SSM_GROUP)))"
        '.reshape((n_seq * n_tok, SSM_INNER // SSM_GROUP, SSM_GROUP)) * w[p + "ssm_norm.weight"].T'
    )
    assert right in text
    report = audit_module(write_mutant(tmp_path, module, text.replace(right, wrong)), gguf_path)
    assert report.failed == ["orientation"], report.table()
    assert "blk.0.ssm_norm.weight (norm, stored (rows, width) = (2, 256))" in report.check("orientation").why


# ---------------------------------------------------------------------------------------------------
# good modules
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", FAMILIES)
def test_fixture_modules_pass_every_check(fixture_modules, fam):
    module, gguf_path, _ = fixture_modules[fam]
    report = audit_module(module, gguf_path=gguf_path)
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
    assert report.passed, report.table()


@pytest.mark.parametrize("key", sorted(REFERENCE))
def test_reference_modules_pass_every_check(reference_reports, key):
    report = reference_reports[key]
    assert report.passed, report.table()
    assert report.gguf.endswith(".gguf") and report.module == f"{REFERENCE[key][1]}.py"


def test_committed_audit_reports_regenerate_byte_identically(reference_reports, tmp_path):
    committed = ROOT / "audits"
    for key, (_, stem) in REFERENCE.items():
        paths = write_reports(reference_reports[key], tmp_path)
        assert [p.name for p in paths] == [f"{stem}.json", f"{stem}.md"]
        for p in paths:
            assert (committed / p.name).exists(), f"audits/{p.name} is not committed"
            assert (
                p.read_bytes() == (committed / p.name).read_bytes()
            ), f"audits/{p.name} is stale: regenerate with `alchemist audit generated/{stem}.py --gguf ...`"
        text = paths[0].read_text() + paths[1].read_text()
        assert str(ROOT) not in text and str(Path.home()) not in text  # no absolute paths


def _write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def test_ir_only_and_module_only_audits(fixture_modules, tmp_path):
    """Given only the module, the auditor rebuilds the IR from its METADATA and TENSORS and runs every check;
    metadata edited after generation no longer hashes to PROVENANCE's IR, and a module without METADATA cannot
    have its roles and head sizes checked."""
    module, _, ir = fixture_modules["qwen3"]
    with_ir = audit_module(module, ir=ir)
    assert with_ir.passed, with_ir.table()
    alone = audit_module(module)
    assert alone.passed, alone.table()
    assert "matches the IR rebuilt from the module's METADATA and TENSORS" in alone.check("provenance").why
    text = Path(module).read_text()
    base = '    "qwen3.rope.freq_base": 10000.0,\n'
    assert text.count(base) == 1
    report = audit_module(_write(tmp_path, "base.py", text.replace(base, base.replace("10000.0", "20000.0"))))
    assert {"provenance", "config"} <= set(report.failed), report.table()  # ROPE_BASE no longer the IR's either
    assert "hash of the IR rebuilt from the module's METADATA" in report.check("provenance").why
    heads = '    "qwen3.attention.head_count": 4,\n'
    report = audit_module(_write(tmp_path, "heads.py", text.replace(heads, heads.replace("4", "8"))))
    assert "cannot be rebuilt" in report.check("provenance").why and "attn_q.weight" in report.check("provenance").why
    start, end = text.index("METADATA = {"), text.index("}\n", text.index("METADATA = {")) + 2
    bare = audit_module(_write(tmp_path, "bare.py", text[:start] + text[end:]))
    assert {"provenance", "orientation", "heads"} <= set(bare.failed), bare.table()
    assert "METADATA is missing" in bare.check("provenance").why and "needs the IR" in bare.check("heads").why


def test_a_longrope_model_trained_at_its_original_context_passes(tmp_path):
    """LongRoPE reads its long factors only past the original context; a model trained at exactly that context
    (phi3's "short" fixture) still reads them when a user asks for a longer cache, and coverage sees that."""
    path = write_fixture(tmp_path / "phi3-short.gguf", "phi3:short")
    ir = build_model_ir(read_gguf(path))
    report = audit_module(write_generated(ir, tmp_path / "generated"))
    assert report.passed, report.table()


def test_wrong_gguf_fails_provenance_and_config(fixture_modules):
    module, _, _ = fixture_modules["qwen2"]
    report = audit_module(module, gguf_path=fixture_modules["qwen3"][1])
    assert {"provenance", "config"} <= set(report.failed)


# ---------------------------------------------------------------------------------------------------
# each source check fed a broken module
# ---------------------------------------------------------------------------------------------------
def _edit(text: str, old: str, new: str) -> str:
    assert old in text, f"anchor not found: {old!r}"
    return text.replace(old, new, 1)


SOURCE_DEFECTS = [
    (
        "provenance",
        lambda t, ir: re.sub(
            r'("source_sha256": ")([0-9a-f])', lambda m: m[1] + "0123456789abcdef"[(int(m[2], 16) + 1) % 16], t, count=1
        ),
    ),
    ("syntax", lambda t, ir: _edit(t, "\ndef load_weights(", "\ndef load_weights_renamed(")),
    ("config", lambda t, ir: _edit(t, f"N_LAYER = {ir.n_layer}\n", f"N_LAYER = {ir.n_layer + 1}\n")),
    (
        "config",
        lambda t, ir: re.sub(
            r"^KERNEL_WEIGHTS = \{\n    \"[^\"]+\",\n", "KERNEL_WEIGHTS = {\n", t, count=1, flags=re.M
        ),
    ),
    ("safety", lambda t, ir: _edit(t, "\nPROVENANCE = {", '\nraise SystemExit("executed")\nPROVENANCE = {')),
    ("safety", lambda t, ir: _edit(t, "\ndef forward(w,", "\ndef forward(w, _=open('/etc/passwd'),")),
    ("safety", lambda t, ir: _forward_prologue(t, ['eval("1")'])),
    ("safety", lambda t, ir: _forward_prologue(t, ["_ = w.__class__"])),
]


@pytest.mark.parametrize("check,defect", SOURCE_DEFECTS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(SOURCE_DEFECTS)])
def test_source_defect_is_caught(fixture_modules, tmp_path, check, defect):
    module, gguf_path, ir = fixture_modules["llama"]
    report = audit_module(write_mutant(tmp_path, module, defect(module.read_text(), ir)), gguf_path=gguf_path)
    assert check in report.failed, report.table()
    if check == "safety":  # never imported: the graph checks say why
        assert all(report.check(n).why.startswith("not checked") for n in ("coverage", "heads"))


def test_unformatted_module_fails_only_format(fixture_modules, tmp_path):
    module, gguf_path, _ = fixture_modules["gemma3"]
    path = tmp_path / module.name
    path.write_text(_edit(module.read_text(), "import numpy as np\n", "import numpy  as np\n"))
    report = audit_module(path, gguf_path)
    assert report.failed == ["format"], report.table()


def test_unparseable_module_fails_syntax_and_checks_nothing_else(fixture_modules, tmp_path):
    module, gguf_path, _ = fixture_modules["llama"]
    path = tmp_path / module.name
    path.write_text(_edit(module.read_text(), "def forward(w", "def forward(w,,"))
    report = audit_module(path, gguf_path)
    assert report.failed == list(CHECK_NAMES)
    assert report.check("syntax").why.startswith("does not parse")


def test_forward_reading_a_name_outside_tensors_fails_coverage(fixture_modules, tmp_path):
    module, gguf_path, ir = fixture_modules["qwen2"]
    text = _forward_prologue(module.read_text(), ['_ = w["blk.99.attn_q.weight"]'])
    report = audit_module(write_mutant(tmp_path, module, text), gguf_path)
    assert "blk.99.attn_q.weight" in report.check("coverage").why


# ---------------------------------------------------------------------------------------------------
# renderings and the CLI
# ---------------------------------------------------------------------------------------------------
def test_report_renderings(fixture_modules, tmp_path):
    module, gguf_path, ir = fixture_modules["llama"]
    report = audit_module(write_mutant(tmp_path, module, mutate_orientation_flipped(module.read_text(), ir)), gguf_path)
    lines = report.table().splitlines()
    assert lines[1].split() == ["check", "result", "why"]
    assert [line.split()[:2] for line in lines if line.startswith("orientation")] == [["orientation", "FAIL"]]
    assert lines[-1].split()[:2] == ["overall", "FAIL"]
    data = json.loads(report.to_json())
    assert data["passed"] is False and [c["name"] for c in data["checks"]] == list(CHECK_NAMES)
    md = report.to_markdown()
    assert "| orientation | **FAIL** |" in md
    assert str(tmp_path) not in report.to_json() + md
    first = [p.read_bytes() for p in write_reports(report, tmp_path / "a")]
    assert first == [report.to_json().encode(), report.to_markdown().encode()]


def test_cli_audit_subcommand(fixture_modules, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="alchemist")
    register(parser.add_subparsers(dest="command", required=True))
    module, gguf_path, ir = fixture_modules["qwen2"]
    args = parser.parse_args(["audit", str(module), "--gguf", str(gguf_path), "-o", str(tmp_path / "out")])
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    assert "overall" in out and "PASS" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{module.stem}.json", f"{module.stem}.md"]

    bad = write_mutant(tmp_path, module, mutate_injected_import(module.read_text(), ir))
    args = parser.parse_args(["audit", str(bad), "--gguf", str(gguf_path), "-o", str(tmp_path / "out2")])
    assert args.fn(args) == 1
    assert "safety" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# load_llm audits what it imports
# ---------------------------------------------------------------------------------------------------
def test_require_passing_audit_remembers_and_refuses(fixture_modules, tmp_path, monkeypatch):
    from alchemist.audit import require_passing_audit
    from alchemist.errors import AuditError

    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path / "cache"))
    module, _, ir = fixture_modules["gemma3"]
    assert require_passing_audit(module, ir).passed
    memo = list((tmp_path / "cache" / "audits").iterdir())
    assert len(memo) == 1
    assert require_passing_audit(module, ir).passed  # from the memo
    bad = write_mutant(tmp_path, module, mutate_tensor_unread(module.read_text(), ir))
    for _ in range(2):  # audited, then remembered: refused both times with the findings
        with pytest.raises(AuditError, match=r"fails its audit.*coverage: .* is never read by forward"):
            require_passing_audit(bad, ir)
    assert len(list((tmp_path / "cache" / "audits").iterdir())) == 2


def test_load_llm_refuses_a_module_that_fails_its_audit(fixture_modules, tmp_path, monkeypatch):
    import alchemist.runtime.api as api
    from alchemist.errors import AuditError

    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path / "cache"))
    module, gguf_path, ir = fixture_modules["llama"]
    bad = write_mutant(tmp_path, module, mutate_injected_import(module.read_text(), ir))
    monkeypatch.setattr(api, "write_generated", lambda ir, out_dir: bad)
    with pytest.raises(AuditError, match="safety: import of 'os'"):
        api.load_llm(gguf_path, backend="c", progress=False, compile_now=False)


def test_the_default_numerics_graph_is_audited_too(fixture_modules):
    """Dequantization and coverage also walk forward built with the "ggml" primitives load_llm uses by default:
    there every uint8 weight goes to a kernel Op computing with numerics="ggml", and the attention is ggml's Op."""
    from alchemist.audit.checks import Context
    from alchemist.audit.graph import graph_audit
    from alchemist.kernels.attention import CausalAttentionGgml
    from alchemist.kernels.op import QuantizedMatmul

    module, _, ir = fixture_modules["qwen3"]
    ctx = Context(src=ModuleSource.parse(module.read_text(), module.name), ir=ir, safe=True)
    g = graph_audit(ctx)
    assert [b.numerics for b in g.ggml_builds] == ["ggml"] and not g.ggml_builds[0].error
    ops = [node.op for node in g.ggml_builds[0].nodes]
    matmuls = [op for op in ops if isinstance(op, QuantizedMatmul)]
    assert matmuls and all(op.numerics == "ggml" for op in matmuls)
    assert any(isinstance(op, CausalAttentionGgml) for op in ops)
    assert all(
        op.numerics == "exact" for b in g.builds for node in b.nodes if isinstance(op := node.op, QuantizedMatmul)
    )
    report = audit_module(module, ir=ir)
    assert "with numerics='ggml'" in report.check("coverage").why and report.passed
