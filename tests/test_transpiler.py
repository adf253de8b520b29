"""GGUF reader -> ModelIR -> codegen: exact hyperparameters, clear errors, determinism, inert metadata."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import black
import gguf
import libcst
import numpy as np
import pytest

from alchemist.arch import build_model_ir
from alchemist.codegen import BLACK_MODE, module_slug, py_literal, render_module
from alchemist.errors import AlchemistError, GGUFError, UnsupportedModelError
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.gguf_io import read_gguf
from alchemist.ir import MLPKind, RopeStyle
from alchemist.runtime.api import write_generated
from gguf_copy import rewrite_gguf

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ reader


def test_reader_matches_gguf_py(reference_models):
    """Our fast reader agrees with gguf-py's GGUFReader on metadata and every tensor's bytes."""
    path = reference_models["qwen2.5-coder-0.5b"]
    facts = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    assert facts.data_offset == ref.data_offset
    assert len(facts.tensors) == len(ref.tensors)
    for t in ref.tensors:
        info = facts.tensors[t.name]
        assert info.ggml_type == t.tensor_type.name
        assert info.ne == tuple(int(x) for x in t.shape)
        assert info.nbytes == t.n_bytes
        assert np.array_equal(facts.tensor_bytes(t.name), np.asarray(t.data).reshape(-1).view(np.uint8))
    assert facts.metadata["qwen2.block_count"] == ref.fields["qwen2.block_count"].contents()
    tokens = ref.fields["tokenizer.ggml.tokens"].contents()
    assert facts.metadata["tokenizer.ggml.tokens"].to_list() == tokens
    assert facts.metadata["tokenizer.chat_template"] == ref.fields["tokenizer.chat_template"].contents()


def test_reader_is_fast_on_a_large_vocabulary(reference_models):
    import time

    t0 = time.perf_counter()
    facts = read_gguf(reference_models["gemma-3-270m"])
    build_model_ir(facts)
    elapsed = time.perf_counter() - t0
    # gguf.GGUFReader takes ~18 s here; we only need to be far from that, not to time precisely.
    assert elapsed < 6.0, elapsed
    assert len(facts.metadata["tokenizer.ggml.tokens"]) == 262144


# ------------------------------------------------------------------------------ IR per family


def test_gemma3_reference_ir(reference_models):
    ir = build_model_ir(read_gguf(reference_models["gemma-3-270m"]))
    assert (ir.architecture, ir.n_layer, ir.n_embd, ir.n_vocab) == ("gemma3", 18, 640, 262144)
    att, mlp = ir.layers[0].attention, ir.layers[0].mlp
    assert (att.n_head, att.n_kv_head, att.head_dim, att.rope.dim) == (4, 1, 256, 256)
    assert mlp.n_ff == 2048 and mlp.activation.value == "gelu_tanh" and mlp.kind is MLPKind.GATED
    assert att.score_scale == 1 / 16 and att.q_norm and att.k_norm and not att.q_bias
    assert att.rope.style is RopeStyle.NEOX and ir.output.tied and ir.embedding.scale == math.sqrt(640)
    # pattern 6: layers 5, 11, 17 are global with the 1e6 base; the rest local (window 512, base 1e4)
    assert [lay.attention.sliding_window for lay in ir.layers] == [0 if i % 6 == 5 else 512 for i in range(18)]
    assert [lay.attention.rope.base for lay in ir.layers] == [1e6 if i % 6 == 5 else 1e4 for i in range(18)]
    assert ir.layers[0].attn_post_norm and ir.layers[0].ffn_post_norm
    assert ir.norm_eps == pytest.approx(1e-6) and ir.output.final_softcap == 0.0


def test_qwen2_reference_ir(reference_models):
    ir = build_model_ir(read_gguf(reference_models["qwen2.5-coder-0.5b"]))
    assert (ir.architecture, ir.n_layer, ir.n_embd, ir.n_vocab, ir.n_ctx_train) == ("qwen2", 24, 896, 151936, 32768)
    att, mlp = ir.layers[0].attention, ir.layers[0].mlp
    assert (att.n_head, att.n_kv_head, att.head_dim, att.group_size) == (14, 2, 64, 7)
    assert att.q_bias and att.k_bias and att.v_bias and not att.out_bias
    assert not att.q_norm and att.score_scale == 0.125 and att.rope.base == 1e6
    assert mlp.n_ff == 4864 and mlp.activation.value == "silu"
    assert att.rope.style is RopeStyle.NEOX and not ir.output.tied and ir.embedding.scale == 1.0
    assert all(lay.attention.sliding_window == 0 for lay in ir.layers)
    types = {t.name: t.ggml_type for t in ir.tensors}
    assert types["output.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "Q6_K"
    assert ir.tensor("blk.0.attn_q.weight").shape == (896, 896)
    assert ir.tensor("blk.0.attn_k.weight").shape == (128, 896)


@pytest.mark.parametrize(
    "arch, style, tied, qk_norm, bias, windows",
    [
        ("llama", RopeStyle.NORM, True, False, False, [0, 0]),
        ("qwen2", RopeStyle.NEOX, False, False, True, [0, 0]),
        ("qwen3", RopeStyle.NEOX, False, True, False, [0, 0]),
        ("gemma3", RopeStyle.NEOX, True, True, False, [8, 0]),
    ],
)
def test_fixture_ir_per_family(tiny_gguf, arch, style, tied, qk_norm, bias, windows):
    cfg = FixtureConfig(arch=arch)
    ir = build_model_ir(read_gguf(tiny_gguf(arch)))
    att = ir.layers[0].attention
    assert (ir.architecture, ir.n_layer, ir.n_embd, ir.n_vocab) == (arch, 2, cfg.n_embd, cfg.n_vocab)
    assert (att.n_head, att.n_kv_head, att.head_dim, ir.layers[0].mlp.n_ff) == (4, 2, 64, cfg.n_ff)
    assert att.rope.style is style and ir.output.tied is tied
    assert (att.q_norm is not None) is qk_norm and (att.q_bias is not None) is bias
    assert [lay.attention.sliding_window for lay in ir.layers] == windows
    assert att.score_scale == pytest.approx(1 / 8)
    assert ir.embedding.scale == (16.0 if arch == "gemma3" else 1.0)
    # IR JSON round-trips and hashes deterministically
    assert json.loads(ir.to_json())["architecture"] == arch
    assert ir.ir_hash() == build_model_ir(read_gguf(tiny_gguf(arch))).ir_hash()


# ------------------------------------------------------------------------------ clear errors


def test_unknown_architecture_is_a_clear_error(tiny_gguf, tmp_path):
    p = rewrite_gguf(tiny_gguf("llama"), tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match=r"architecture 'mamba' is not supported \(supported: cohere2, command-r, deepseek2, exaone"):
        build_model_ir(read_gguf(p))


def test_missing_tensor_lists_what_is_missing(tiny_gguf, tmp_path):
    p = rewrite_gguf(tiny_gguf("qwen2"), tmp_path / "q.gguf", drop={"blk.1.ffn_up.weight", "output_norm.weight"})
    with pytest.raises(UnsupportedModelError, match="missing tensors") as e:
        build_model_ir(read_gguf(p))
    assert "blk.1.ffn_up.weight" in str(e.value) and "output_norm.weight" in str(e.value)


def test_unexpected_tensor_is_named(tiny_gguf, tmp_path):
    p = rewrite_gguf(tiny_gguf("qwen3"), tmp_path / "q.gguf", extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModelError, match=r"does not know: 'blk.0.mystery.weight'"):
        build_model_ir(read_gguf(p))


def test_wrong_tensor_shape_is_named(tiny_gguf, tmp_path):
    bad = np.zeros((64, 256), np.float32)  # attn_k should be (n_kv_head * head_dim = 128, 256)
    p = rewrite_gguf(tiny_gguf("llama"), tmp_path / "l.gguf", drop={"blk.0.attn_k.weight"}, extra={"blk.0.attn_k.weight": bad})
    with pytest.raises(GGUFError, match=r"blk.0.attn_k.weight.*expected \[128, 256\]"):
        build_model_ir(read_gguf(p))


def test_cli_reports_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 40)
    proc = subprocess.run(
        [sys.executable, "-m", "alchemist.cli", "inspect", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "bad.gguf" in proc.stderr and "version" in proc.stderr


# ------------------------------------------------------------------------------ codegen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_generated_module_is_valid_formatted_and_deterministic(tiny_gguf, arch):
    ir = build_model_ir(read_gguf(tiny_gguf(arch)))
    src = render_module(ir)
    assert src == render_module(build_model_ir(read_gguf(tiny_gguf(arch))))
    assert black.format_str(src, mode=BLACK_MODE) == src
    libcst.parse_module(src)
    tree = ast.parse(src)
    imports = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imports |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imports <= {"numpy", "pytensor.tensor", "gguf", "gguf.quants", "alchemist.kernels"}
    assert f'"ir_sha256": "{ir.ir_hash()}"' in src


def test_rendered_modules_are_remembered_by_their_ir(tiny_gguf, tmp_path, monkeypatch):
    """render_module reads a module it rendered before back from the cache (a new process opening a model
    does not render the template again); an IR differing in any field renders afresh."""
    import dataclasses

    from alchemist.codegen import render

    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path / "cache"))
    ir = build_model_ir(read_gguf(tiny_gguf("qwen2")))
    src = render_module(ir)
    assert len(list((tmp_path / "cache" / "rendered").glob("*.py"))) == 1

    def no_render():
        raise AssertionError("rendered again instead of read from the cache")

    with monkeypatch.context() as m:
        m.setattr(render, "_environment", no_render)
        assert render_module(build_model_ir(read_gguf(tiny_gguf("qwen2")))) == src
        with pytest.raises(AssertionError, match="rendered again"):
            render_module(dataclasses.replace(ir, model_name=ir.model_name + " v2"))
    renamed = render_module(dataclasses.replace(ir, model_name=ir.model_name + " v2"))
    assert renamed != src and ir.model_name + " v2" in renamed


def test_generated_module_is_standalone(tiny_module):
    module, path = tiny_module("qwen2")
    weights = module.load_weights(str(path))
    assert set(weights) == set(module.TENSORS)
    w = weights["blk.0.attn_q.weight"]
    assert w.dtype == np.float32 and w.shape == (module.N_HEAD * module.HEAD_DIM, module.N_EMBD)
    ref = gguf.GGUFReader(str(path))
    t = next(t for t in ref.tensors if t.name == "blk.0.attn_q.weight")
    assert np.array_equal(w, np.asarray(t.data))


def test_committed_generated_modules_regenerate_byte_identically(reference_models, tmp_path):
    for path in reference_models.values():
        ir = build_model_ir(read_gguf(path))
        fresh = write_generated(ir, tmp_path)
        committed = REPO / "generated" / fresh.name
        assert committed.exists(), f"generated/{fresh.name} is not committed"
        assert fresh.read_text() == committed.read_text(), f"generated/{fresh.name} is stale: run `alchemist gen`"


def test_module_slug_is_a_safe_identifier():
    assert module_slug("gemma-3-270m-q4_k_m.gguf") == "gemma_3_270m_q4_k_m"
    assert module_slug("3b.GGUF") == "model_3b"
    assert module_slug("'; import os; '.gguf").isidentifier()
    assert module_slug("../../etc/passwd.gguf") == "etc_passwd"


def test_py_literal_only_emits_plain_data():
    assert py_literal("a'\"\n__import__('os')") == repr("a'\"\n__import__('os')")
    assert py_literal((1, 2.5, "x")) == "(1, 2.5, 'x')"
    with pytest.raises(TypeError):
        py_literal(object())
    with pytest.raises(AlchemistError):
        py_literal(float("nan"))


PAYLOAD = "x\"\"\"'); import os; os.environ['ALCHEMIST_PWNED']='1' #\n{{ 7*7 }}{% raw %}__import__('os'){% endraw %}"


def test_malicious_metadata_is_inert(tiny_gguf, tmp_path):
    p = rewrite_gguf(tiny_gguf("qwen2"), tmp_path / "evil.gguf", name=PAYLOAD)
    ir = build_model_ir(read_gguf(p))
    assert ir.model_name == PAYLOAD
    target = write_generated(ir, tmp_path / "gen")
    src = target.read_text()
    tree = ast.parse(src)
    provenance = next(
        n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "PROVENANCE"
    )
    assert ast.literal_eval(provenance)["model_name"] == PAYLOAD  # survives as data, exactly
    assert "49" not in src.split("PROVENANCE")[0]  # jinja syntax in metadata was not evaluated
    env = {k: v for k, v in __import__("os").environ.items() if k != "ALCHEMIST_PWNED"}
    code = f"import runpy; m = runpy.run_path({str(target)!r}); import os; print(os.environ.get('ALCHEMIST_PWNED'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_malicious_tensor_name_is_refused_not_emitted(tiny_gguf, tmp_path):
    evil = "blk.0.x'); __import__('os').system('echo pwned'); ('"
    p = rewrite_gguf(tiny_gguf("qwen2"), tmp_path / "evil.gguf", extra={evil: np.zeros(4, np.float32)})
    with pytest.raises(UnsupportedModelError) as e:
        build_model_ir(read_gguf(p))
    assert repr(evil) in str(e.value)


def test_cli_gen_and_inspect(tiny_gguf, tmp_path):
    path = tiny_gguf("gemma3")
    out = subprocess.run(
        [sys.executable, "-m", "alchemist.cli", "gen", str(path), "-o", str(tmp_path / "g"), "--no-audit"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "g" / "gemma3_f32.py").exists()
    out = subprocess.run([sys.executable, "-m", "alchemist.cli", "inspect", str(path), "--ir"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and json.loads(out.stdout)["n_layer"] == 2
