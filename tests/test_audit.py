"""The static auditor: good modules pass every check; each seeded defect fails exactly its own check.

Modules are only ever parsed by the auditor, never imported: a mutant that would exit the interpreter at
import time is audited like any other (test_audit_never_executes_the_module).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import black
import pytest

from alchemist.arch import build_model_ir
from alchemist.audit import CHECK_NAMES, audit_module, write_reports
from alchemist.audit.cli import register
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
    """A generated module per family from a tiny GGUF (F16 weights for two of them, F32 for the others)."""
    d = tmp_path_factory.mktemp("audit_fixtures")
    out = {}
    for fam in FAMILIES:
        gguf_path = write_fixture(
            d / f"tiny-{fam}.gguf", fam, weight_type="F16" if fam in ("llama", "qwen3") else "F32"
        )
        ir = build_model_ir(read_gguf(gguf_path))
        out[fam] = (write_generated(ir, d / "generated"), gguf_path, ir)
    return out


def mutant(tmp_path: Path, module: Path, replacements, reformat: bool = False) -> Path:
    """The module with text substitutions applied (each must match), black-formatted if asked."""
    text = module.read_text()
    for old, new in replacements:
        assert old in text, f"mutation anchor not found: {old!r}"
        text = text.replace(old, new, 1)
    if reformat:
        text = black.format_str(text, mode=BLACK_MODE)
    path = tmp_path / module.name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------
# good modules
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", sorted(REFERENCE))
def test_reference_modules_pass_every_check(reference_reports, key):
    report = reference_reports[key]
    assert [c.name for c in report.checks] == list(CHECK_NAMES)
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
        data = json.loads(paths[0].read_text())
        assert data["passed"] is True and data["module"] == f"{stem}.py"
        text = paths[0].read_text() + paths[1].read_text()
        assert str(ROOT) not in text and str(Path.home()) not in text  # no absolute paths


@pytest.mark.parametrize("fam", FAMILIES)
def test_fixture_modules_pass_every_check(fixture_modules, fam):
    module, gguf_path, _ = fixture_modules[fam]
    report = audit_module(module, gguf_path=gguf_path)
    assert report.passed, report.table()


def test_static_only_and_ir_only_audits(fixture_modules):
    module, _, ir = fixture_modules["qwen3"]
    static = audit_module(module)
    assert static.passed, static.table()
    assert static.gguf is None and "no GGUF" in static.check("provenance").why
    with_ir = audit_module(module, ir=ir)
    assert with_ir.passed, with_ir.table()
    assert "agree with the IR" in with_ir.check("config").why


def test_wrong_gguf_fails_provenance(fixture_modules):
    module, _, _ = fixture_modules["qwen2"]
    report = audit_module(module, gguf_path=fixture_modules["qwen3"][1])
    assert not report.passed
    assert {"provenance", "coverage", "config"} <= set(report.failed)


# ---------------------------------------------------------------------------------------------------
# seeded defects: each fails exactly its own check
# ---------------------------------------------------------------------------------------------------
MUTATIONS = [
    pytest.param(
        "gemma",
        [("values = dequantize(rows, GGMLQuantizationType[ggml_type])", "values = rows.view(np.float32)")],
        {"dequantization"},
        id="dequantize-call-dropped",
    ),
    pytest.param(
        "qwen",
        [
            (
                "weights[name] = dequantize_tensor(data[start : start + nbytes], ggml_type, shape)",
                "weights[name] = data[start : start + nbytes]",
            )
        ],
        {"dequantization"},
        id="loader-skips-dequantize_tensor",
    ),
    pytest.param(
        "gemma",
        [
            (
                "weights[name] = dequantize_tensor(data[start : start + nbytes], ggml_type, shape)",
                'weights[name] = dequantize_tensor(data[start : start + nbytes], "F32", shape)',
            )
        ],
        {"dequantization"},
        id="loader-forces-f32-path",
    ),
    pytest.param(
        "gemma",
        [("GGMLQuantizationType[ggml_type]", "GGMLQuantizationType.Q8_0")],
        {"dequantization"},
        id="dequantize-fixed-type",
    ),
    pytest.param(
        "gemma",
        [('"blk.3.ffn_up.weight": ("Q5_0",', '"blk.3.ffn_up.weight": ("F32",')],
        {"dequantization"},
        id="quantized-tensor-claims-f32",
    ),
    pytest.param(
        "llama", [("y = pt.dot(weight, x.T).T", "y = pt.dot(x, weight)")], {"orientation"}, id="linear-without-transpose"
    ),
    pytest.param(
        "llama", [("y = pt.dot(weight, x.T).T", "y = pt.dot(weight, x.T)")], {"orientation"}, id="linear-missing-outer-T"
    ),
    pytest.param(
        "llama", [("y = pt.dot(weight, x.T).T", "y = pt.dot(weight.T, x.T).T")], {"orientation"}, id="linear-weight-transposed"
    ),
    pytest.param(
        "qwen",
        [('"blk.3.ffn_up.weight": ("Q5_0", (4864, 896),', '"blk.3.ffn_up.weight": ("Q5_0", (896, 4864),')],
        {"orientation"},
        id="tensors-shape-transposed",
    ),
    pytest.param(
        "gemma",
        [("k = k.reshape((n_tokens, N_KV_HEAD, HEAD_DIM))", "k = k.reshape((n_tokens, N_HEAD, HEAD_DIM))")],
        {"heads"},
        id="kv-split-uses-n_head",
    ),
    pytest.param(
        "qwen3",
        [("v = v.reshape((n_tokens, N_KV_HEAD, HEAD_DIM))", "v = v.reshape((n_tokens, N_HEAD, HEAD_DIM))")],
        {"heads"},
        id="v-split-uses-n_head-fixture",
    ),
    pytest.param(
        "qwen",
        [("q = q.reshape((n_tokens, N_HEAD, HEAD_DIM))", "q = q.reshape((n_tokens, 14, HEAD_DIM))")],
        {"heads"},
        id="literal-head-count",
    ),
    pytest.param(
        "gemma3",
        [("return out.reshape((n_tokens, N_HEAD * HEAD_DIM))", "return out.reshape((n_tokens, N_KV_HEAD * HEAD_DIM))")],
        {"heads"},
        id="head-merge-uses-n_kv_head",
    ),
    pytest.param(
        "llama",
        [
            (
                "q = q.reshape((n_tokens, N_KV_HEAD, GROUP_SIZE, HEAD_DIM))",
                "q = q.reshape((n_tokens, GROUP_SIZE, N_KV_HEAD, HEAD_DIM))",
            )
        ],
        {"heads"},
        id="gqa-group-order-swapped",
    ),
    pytest.param("qwen", [("import numpy as np\n", "import os\nimport numpy as np\n")], {"safety"}, id="import-os"),
    pytest.param(
        "qwen3", [("    return x * scale * weight\n", '    return eval("x * scale * weight")\n')], {"safety"}, id="eval"
    ),
    pytest.param(
        "gemma3",
        [("    n_tokens = tokens.type.shape[0]\n", '    n_tokens = tokens.type.shape[0]\n    open("/etc/passwd")\n')],
        {"safety"},
        id="open-outside-loader",
    ),
    pytest.param(
        "llama", [("return x * scale * weight", "return x * scale * weight.__class__")], {"safety"}, id="dunder"
    ),
    pytest.param(
        "gemma",
        [('"source_sha256": "a5fd3b', '"source_sha256": "b5fd3b')],
        {"provenance"},
        id="provenance-hash-altered",
    ),
    pytest.param(
        "qwen",
        [
            (
                'q = project(x, w, p + "attn_q.weight", w[p + "attn_q.bias"])',
                'q = project(x, w, p + "attn_q.weight")',
            )
        ],
        {"coverage"},
        id="tensor-usage-removed",
    ),
    pytest.param(
        "gemma",
        [('logits = project(x, w, "token_embd.weight")', 'logits = project(x, w, "output.weight")')],
        {"coverage"},
        id="tensor-not-in-file",
    ),
    pytest.param("qwen", [("CONTEXT_LENGTH = 32768", "CONTEXT_LENGTH = 65536")], {"config"}, id="config-constant"),
    pytest.param("gemma3", [("ROPE_DIM = 64", "ROPE_DIM = 32")], {"config"}, id="rope-dim"),
    pytest.param("qwen2", [("SCORE_SCALE = 0.125", "SCORE_SCALE = 0.25")], {"config"}, id="score-scale"),
]


@pytest.mark.parametrize("key,replacements,expected", MUTATIONS)
def test_mutation_fails_exactly_its_check(request, tmp_path, key, replacements, expected):
    """key: a reference model ("gemma", "qwen") or a fixture family (cheaper to audit)."""
    if key in REFERENCE:
        module, gguf_path = (
            ROOT / "generated" / f"{REFERENCE[key][1]}.py",
            request.getfixturevalue("reference_ggufs")[key],
        )
    else:
        module, gguf_path, _ = request.getfixturevalue("fixture_modules")[key]
    report = audit_module(mutant(tmp_path, module, replacements), gguf_path=gguf_path)
    assert set(report.failed) == expected, report.table()
    for name in expected:
        failed = report.check(name)
        assert failed.details and failed.why


def test_altered_ir_hash_fails_only_provenance(reference_ggufs, tmp_path):
    module = ROOT / "generated" / "qwen2_5_coder_0_5b_instruct_q4_k_m.py"
    text = module.read_text()
    start = text.index('"ir_sha256": "') + len('"ir_sha256": "')
    digest = text[start : start + 64]
    path = mutant(tmp_path, module, [(digest, "0" + digest[:-1])])  # still a well-formed sha256
    report = audit_module(path, gguf_path=reference_ggufs["qwen"])
    assert report.failed == ["provenance"], report.table()
    assert "ir_sha256" in report.check("provenance").why


def test_unformatted_module_fails_only_format(reference_ggufs, tmp_path):
    module = ROOT / "generated" / "qwen2_5_coder_0_5b_instruct_q4_k_m.py"
    path = mutant(tmp_path, module, [("import numpy as np\n", "import numpy  as np\n")])
    report = audit_module(path, gguf_path=reference_ggufs["qwen"])
    assert report.failed == ["format"], report.table()
    assert "line 13" in report.check("format").why


def test_unparseable_module_fails_syntax_and_checks_nothing_else(fixture_modules, tmp_path):
    module, gguf_path, _ = fixture_modules["llama"]
    report = audit_module(mutant(tmp_path, module, [("def linear(x", "def linear(x,,")]), gguf_path)
    assert report.failed == list(CHECK_NAMES)
    assert report.check("syntax").why.startswith("does not parse")
    assert all(c.why == "not checked: the module does not parse" for c in report.checks if c.name != "syntax")


def test_audit_never_executes_the_module(fixture_modules, tmp_path):
    module, gguf_path, _ = fixture_modules["gemma3"]
    path = mutant(tmp_path, module, [("\nPROVENANCE = {", '\nraise SystemExit("executed")\nPROVENANCE = {')])
    report = audit_module(path, gguf_path)
    assert report.failed == ["safety"], report.table()
    assert "runs at import time" in report.check("safety").why


# ---------------------------------------------------------------------------------------------------
# the quantized-kernel path: weights kept in GGUF blocks and multiplied by alchemist.kernels
# ---------------------------------------------------------------------------------------------------
PROJECT_KERNEL_BRANCH = """    if weight.dtype == "uint8":
        ggml_type, (n_out, n_in) = TENSORS[name][0], TENSORS[name][1]
        y = quantized_linear(x, weight, ggml_type, n_out, n_in)
        return y if bias is None else y + bias
"""
LOADER_KERNEL_STORE = """        if quantized and name in KERNEL_WEIGHTS:
            weights[name] = as_blocks(data[start : start + nbytes], ggml_type, shape)
        else:
            weights[name] = dequantize_tensor(data[start : start + nbytes], ggml_type, shape)
"""
DIRECT_UP = 'up = quantized_linear(x, w[p + "ffn_up.weight"], TENSORS[p + "ffn_up.weight"][0], {})'

# Each seeded defect in the quantized-kernel path (weights kept in GGUF blocks by load_weights(quantized=True)
# and multiplied by alchemist.kernels in project()/embed()) fails exactly its own check.
KERNEL_MUTATIONS = [
    # (a) no dtype guard in project(): GGUF blocks would reach linear()'s pt.dot
    pytest.param("gemma", [(PROJECT_KERNEL_BRANCH, "")], {"dequantization"}, "may be stored undequantized", id="a"),
    # (b) the blocks multiplied by the float linear() inside the uint8 branch
    pytest.param(
        "qwen",
        [("y = quantized_linear(x, weight, ggml_type, n_out, n_in)", "y = linear(x, weight)")],
        {"dequantization"},
        'inside `if weight.dtype == "uint8":` project() uses `weight` as `linear(x, weight)`',
        id="b",
    ),
    # (c) n_out/n_in swapped in project()'s kernel call
    pytest.param(
        "qwen",
        [
            (
                "quantized_linear(x, weight, ggml_type, n_out, n_in)",
                "quantized_linear(x, weight, ggml_type, n_in, n_out)",
            )
        ],
        {"orientation"},
        "n_out is `n_in` = TENSORS[name][1][1]",
        id="c",
    ),
    # (d) embed()'s kernel told the table is (N_EMBD, N_VOCAB)
    pytest.param(
        "gemma",
        [('TENSORS["token_embd.weight"][0], N_VOCAB, N_EMBD)', 'TENSORS["token_embd.weight"][0], N_EMBD, N_VOCAB)')],
        {"orientation"},
        "n_rows is N_EMBD but token_embd.weight is stored (N_VOCAB, N_EMBD)",
        id="d",
    ),
    # (e) a tensor load_weights may keep in blocks read outside the helpers, by a plain row gather
    pytest.param(
        "gemma",
        [("x = embed(w, tokens)", 'x = w["token_embd.weight"][tokens]')],
        {"dequantization"},
        'token_embd.weight (Q8_0) may be stored undequantized by load_weights, but forward() uses it as `w["token_embd',
        id="e",
    ),
    # (e') every entry raw (not as_blocks) when quantized, and token_embd read outside the helpers
    pytest.param(
        "qwen",
        [
            (
                LOADER_KERNEL_STORE,
                LOADER_KERNEL_STORE.replace("quantized and name in KERNEL_WEIGHTS", "quantized").replace(
                    "as_blocks(data[start : start + nbytes], ggml_type, shape)", "data[start : start + nbytes]"
                ),
            ),
            ("x = embed(w, tokens)", 'x = w["token_embd.weight"][tokens]'),
        ],
        {"dequantization"},
        "not as uint8 GGUF blocks (as_blocks)",
        id="e-raw-everything",
    ),
    # the kernel decodes with a ggml type that is not the tensor's
    pytest.param(
        "gemma",
        [
            (
                "ggml_type, (n_out, n_in) = TENSORS[name][0], TENSORS[name][1]",
                'ggml_type, (n_out, n_in) = "Q4_K", TENSORS[name][1]',
            )
        ],
        {"dequantization"},
        'ggml_type is `ggml_type` (= `"Q4_K"`), not TENSORS[name][0]',
        id="kernel-type-fixed",
    ),
    # the uint8 branch falls through into linear()
    pytest.param(
        "gemma",
        [
            (
                "        return y if bias is None else y + bias\n    return linear",
                "        y = y if bias is None else y + bias\n    return linear",
            )
        ],
        {"dequantization"},
        "branch does not end in a return",
        id="kernel-branch-falls-through",
    ),
    # a blocks weight multiplied by the float linear() outside the helpers
    pytest.param(
        "gemma",
        [('gate = project(x, w, p + "ffn_gate.weight")', 'gate = linear(x, w[p + "ffn_gate.weight"])')],
        {"dequantization"},
        'mlp_block() uses it as `linear(x, w[p + "ffn_gate.weight"])`',
        id="raw-into-linear",
    ),
    # a kernel called straight on w[...]: load_weights(quantized=False) would hand it float32
    pytest.param(
        "gemma",
        [('up = project(x, w, p + "ffn_up.weight")', DIRECT_UP.format("N_FF, N_EMBD"))],
        {"dequantization"},
        "load_weights may store it as float32",
        id="direct-kernel-gets-float32",
    ),
    # ... which is fine when load_weights always keeps those in blocks, unless the sizes are swapped
    pytest.param(
        "gemma",
        [
            ('up = project(x, w, p + "ffn_up.weight")', DIRECT_UP.format("N_FF, N_EMBD")),
            ("if quantized and name in KERNEL_WEIGHTS:", "if name in KERNEL_WEIGHTS:"),
        ],
        set(),
        "",
        id="direct-kernel-ok",
    ),
    pytest.param(
        "gemma",
        [
            ('up = project(x, w, p + "ffn_up.weight")', DIRECT_UP.format("N_EMBD, N_FF")),
            ("if quantized and name in KERNEL_WEIGHTS:", "if name in KERNEL_WEIGHTS:"),
        ],
        {"orientation"},
        "n_out is `N_EMBD` = 640, but blk.0.ffn_up.weight is stored (2048, 640)",
        id="direct-kernel-sizes-swapped",
    ),
]


@pytest.mark.parametrize("key,replacements,expected,why", KERNEL_MUTATIONS)
def test_kernel_path_mutation_fails_exactly_its_check(reference_ggufs, tmp_path, key, replacements, expected, why):
    module = ROOT / "generated" / f"{REFERENCE[key][1]}.py"
    report = audit_module(mutant(tmp_path, module, replacements, reformat=True), gguf_path=reference_ggufs[key])
    assert set(report.failed) == expected, report.table()
    for name in expected:
        assert why in " ".join(report.check(name).details), report.check(name).details[:3]


@pytest.mark.parametrize("key", sorted(REFERENCE))
def test_reference_reports_describe_the_kernel_path(reference_reports, key):
    report = reference_reports[key]
    deq, orient = report.check("dequantization").why, report.check("orientation").why
    assert "quantized KERNEL_WEIGHTS tensors stay in GGUF blocks" in deq
    assert "`if quantized and name in KERNEL_WEIGHTS:`" in deq
    assert "only through embed()/project()" in deq and "quantized_embedding/quantized_linear" in deq
    assert "project(): quantized_linear(…, n_out, n_in) from TENSORS[name][1]" in orient
    assert "embed(): quantized_embedding(…, N_VOCAB, N_EMBD)" in orient
    assert "through the weight-name helper project()" in report.check("coverage").why


# ---------------------------------------------------------------------------------------------------
# renderings and the CLI
# ---------------------------------------------------------------------------------------------------
def test_report_renderings(fixture_modules, tmp_path):
    module, gguf_path, _ = fixture_modules["llama"]
    path = mutant(tmp_path, module, [("y = pt.dot(weight, x.T).T", "y = pt.dot(x, weight)")])
    report = audit_module(path, gguf_path)
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
    assert "## orientation: all findings" in md or len(report.check("orientation").details) == 1


def test_cli_audit_subcommand(fixture_modules, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="alchemist")
    register(parser.add_subparsers(dest="command", required=True))
    module, gguf_path, _ = fixture_modules["qwen2"]
    args = parser.parse_args(["audit", str(module), "--gguf", str(gguf_path), "-o", str(tmp_path / "out")])
    assert args.fn(args) == 0
    out = capsys.readouterr().out
    assert "overall" in out and "PASS" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{module.stem}.json", f"{module.stem}.md"]

    bad = mutant(tmp_path, module, [("import numpy as np\n", "import os\nimport numpy as np\n")])
    args = parser.parse_args(["audit", str(bad), "--gguf", str(gguf_path), "-o", str(tmp_path / "out2")])
    assert args.fn(args) == 1
    assert "safety" in capsys.readouterr().err
