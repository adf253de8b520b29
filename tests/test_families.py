"""The family registry, the architecture table and its provenance (fast: no compilation, no oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alchemist.arch import FAMILIES as FAMILY_VALUES
from alchemist.arch import build_model_ir
from alchemist.codegen import render_module
from alchemist.fixtures import FAMILIES, FIXTURES, fixture_spec, write_fixture
from alchemist.gguf_io import read_gguf
from alchemist.harness.families import (
    TABLE_BEGIN,
    TABLE_END,
    architecture_markdown,
    fixture_module_sha256,
    merge_results,
    quirks,
    write_results,
)

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "architectures.json"


@pytest.fixture(scope="module")
def fixture_irs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        case: build_model_ir(read_gguf(write_fixture(root / f"{case.replace(':', '_')}.gguf", case)))
        for case in FIXTURES
    }


def test_every_family_has_a_fixture_and_the_issue_list_is_covered():
    wanted = {
        "llama", "qwen2", "qwen3", "gemma3", "gemma", "gemma2", "phi3", "granite", "olmo2", "smollm3",
        "starcoder2", "gpt2", "stablelm", "internlm2", "exaone", "exaone4", "command-r", "cohere2", "lfm2",
        "qwen3moe", "gpt-oss", "gemma3n", "mistral3", "lfm2moe", "glm4moe", "llama4", "granitehybrid",
        "qwen35", "qwen35moe", "qwen3next", "nemotron_h", "deepseek2", "mamba2", "falcon-h1", "gemma4",
    }  # fmt: skip
    assert set(FAMILIES) == set(FAMILY_VALUES) == wanted
    for case in FIXTURES:
        family, spec = fixture_spec(case)
        assert family.name == case.partition(":")[0]
    with pytest.raises(ValueError, match="no fixture variant"):
        fixture_spec("llama:nope")


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn", "longrope"])
def test_each_rope_scaling_kind_has_a_fixture(fixture_irs, kind):
    scalings = {lay.attention.rope.scaling.value for ir in fixture_irs.values() for lay in ir.attention_layers}
    assert kind in scalings


def test_fixture_modules_render_and_differ_by_component(fixture_irs):
    sources = {case: render_module(ir) for case, ir in fixture_irs.items()}
    for case, src in sources.items():
        assert "gemma" not in src.split("# The model")[1].split("# Weights")[0].lower() or case.startswith("gemma")
    assert "def layer_norm(" in sources["gpt2"] and "def rms_norm(" not in sources["gpt2"]
    assert (
        'embed(w, "position_embd.weight", positions.reshape((-1,)))' in sources["gpt2"]
        and "def rope(" not in sources["gpt2"]
    )
    assert "attn_out + ffn_out" in sources["command-r"]
    assert "gate_up[:, :N_FF]" in sources["phi3"] and 'p + "attn_qkv.weight"' in sources["phi3"]
    assert "ROPE_LAYERS = (True, True, True, False)" in sources["smollm3"]
    assert "ROPE_LAYERS = (True, True, True, False)" in sources["cohere2"]
    assert "ATTN_LOGIT_SOFTCAP" in sources["gemma2"] and "FINAL_LOGIT_SOFTCAP" in sources["gemma2"]
    assert "def yarn_frequency_scale(" in sources["qwen2:yarn"]
    assert 'w["rope_factors_long.weight"] if n_ctx > ROPE_ORIG_CTX' in sources["phi3"]
    assert "def short_conv(" in sources["lfm2"] and "CONV_LAYERS = (True, False, False, True)" in sources["lfm2"]
    assert all("def short_conv(" not in src for c, src in sources.items() if not c.startswith("lfm2"))
    assert {c for c, src in sources.items() if "def attention_temperature(" in src} == {
        "mistral3",
        "mistral3:yarn",
        "llama4",
    }
    assert "ROPE_GGML_ATTN_FACTOR" in sources["mistral3:yarn"] and "ROPE_GGML_ATTN_FACTOR" not in sources["qwen2:yarn"]
    # llama.cpp's own names for some intermediates: only where the family's graph names them its own way
    assert {c for c, src in sources.items() if "TAP_NAMES" in src} == {
        "lfm2", "lfm2:swa", "lfm2moe", "gpt-oss", "glm4moe", "llama4", "qwen35", "qwen35moe", "qwen3next",
        "qwen3next:fused", "nemotron_h", "falcon-h1",
    }  # fmt: skip
    # dense layers beside expert layers: both MLPs, chosen per layer
    assert "def moe(" in sources["lfm2moe"] and "if MOE_LAYERS[il] else mlp(" in sources["lfm2moe"]
    assert {c for c, src in sources.items() if "MOE_LAYERS" in src} == {
        "lfm2moe", "glm4moe", "llama4", "deepseek2", "deepseek2:lite", "deepseek2:yarn"
    }  # fmt: skip
    # latent attention: its own attention and per-head products; group-limited routing
    assert {c for c, src in sources.items() if "def project_heads(" in src} == {
        "deepseek2", "deepseek2:lite", "deepseek2:yarn"
    }  # fmt: skip
    assert "attn_q_a.weight" in sources["deepseek2"] and "attn_q_a.weight" not in sources["deepseek2:lite"]
    assert {c for c, src in sources.items() if "def limit_groups(" in src} == {"deepseek2"}
    assert {c for c, src in sources.items() if "ATTENTION_CHUNK" in src} == {"llama4"}
    # recurrent states: only the Mamba-2 hybrid's forward() takes n_valid
    assert {c for c, src in sources.items() if "STATE_KINDS" in src} == {
        "granitehybrid", "granitehybrid:moe", "qwen35", "qwen35moe", "qwen3next", "qwen3next:fused", "nemotron_h",
        "mamba2", "falcon-h1",
    }  # fmt: skip
    # attention and Mamba-2 side by side, summed
    assert "out = attn_out + ssm_out" in sources["falcon-h1"] and "attn_out + ssm_out" not in sources["granitehybrid"]
    # without attention: no attention, cache step or RoPE in the module, and no MLP
    assert {c for c, src in sources.items() if "def causal_attention(" not in src} == {"mamba2"}
    assert "def cache_step(" not in sources["mamba2"] and "def mlp(" not in sources["mamba2"]
    assert (
        "FFN_LAYERS = (False, False, True, False)" in sources["nemotron_h"] and "def relu_sqr(" in sources["nemotron_h"]
    )
    assert "def mamba2(" in sources["granitehybrid"] and "slots=None, n_valid=None\n" in sources["granitehybrid"]
    assert "def delta_net(" in sources["qwen35"] and "def mamba2(" not in sources["qwen35"]
    assert {c for c, src in sources.items() if "pt.sigmoid(gate.reshape(" in src} == {
        "qwen35", "qwen35moe", "qwen3next", "qwen3next:fused"
    }  # fmt: skip
    assert "// (DELTA_V_HEAD // DELTA_K_HEAD)" in sources["qwen3next"] and "ssm_in.weight" in sources["qwen3next:fused"]


def test_quirks_name_what_differs_from_llama(fixture_irs):
    assert quirks(fixture_irs["llama"]) == ["NORM RoPE", "tied output"]
    assert "learned positions" in quirks(fixture_irs["gpt2"]) and "no RoPE" in quirks(fixture_irs["gpt2"])
    assert "parallel block" in quirks(fixture_irs["stablelm:parallel"])
    assert "parallel block" not in quirks(fixture_irs["stablelm"])
    assert "post-norm only" in quirks(fixture_irs["olmo2"])
    assert quirks(fixture_irs["lfm2"])[:2] == ["short-conv layers (2 of 4)", "q/k rms norm per head"]
    assert quirks(fixture_irs["granitehybrid"])[0] == "Mamba-2 layers (3 of 4)"
    assert quirks(fixture_irs["qwen35"])[:2] == ["delta-net layers (3 of 4)", "gated attention"]
    deepseek = quirks(fixture_irs["deepseek2"])
    assert deepseek[0] == "latent attention (one cached row of 288, low-rank queries)"
    assert "partial rotary" not in deepseek
    assert any("best 2 of 4 groups, selection bias, shared expert" in q for q in deepseek)
    assert quirks(fixture_irs["deepseek2:lite"])[0] == "latent attention (one cached row of 288)"
    assert quirks(fixture_irs["mamba2"]) == ["Mamba-2 layers (3 of 3)", "no attention", "no MLP", "untied output"]
    assert quirks(fixture_irs["falcon-h1"])[:2] == ["attention and Mamba-2 side by side in every layer", "NEOX RoPE"]
    assert {"RoPE frequency factors on some layers", "head sizes and KV heads per layer", "MLP widths per layer",
            "gated per-layer inputs", "layer output scale", "shared KV caches"} <= set(quirks(fixture_irs["gemma4"]))  # fmt: skip


def test_readme_table_is_generated_from_current_results(fixture_irs):
    """docs/architectures.md's table is architecture_markdown(docs/architectures.json), and those results
    were measured on exactly the modules the code generates today for every fixture."""
    rows = json.loads(RESULTS.read_text())
    recorded = {r["case"]: r for r in rows if "quirks" in r}
    assert set(recorded) == set(FIXTURES), "run `alchemist families --validate --table docs/architectures.md`"
    for case, ir in fixture_irs.items():
        assert recorded[case]["module_sha256"] == fixture_module_sha256(
            ir
        ), f"{case}: docs/architectures.json was measured on other code; rerun `alchemist families --validate`"
    page = (REPO / "docs" / "architectures.md").read_text()
    table = page[page.index(TABLE_BEGIN) + len(TABLE_BEGIN) : page.index(TABLE_END)].strip()
    assert table == architecture_markdown(rows), "run `alchemist families --validate --table docs/architectures.md`"


def test_validating_some_cases_replaces_only_their_rows():
    def rows(case, tag):
        return [{"case": case, "backend": "c", "tag": tag}, {"case": case, "quirks": [], "tag": tag}]

    old = rows("a", "old") + rows("b", "old") + rows("gone", "old")
    merged = merge_results(old, rows("b", "new") + rows("c", "new"), ["a", "b", "c"])
    assert [(r["case"], r["tag"]) for r in merged] == [("a", "old")] * 2 + [("b", "new")] * 2 + [("c", "new")] * 2


def test_new_weight_types_join_the_rows_of_an_unchanged_module():
    def rows(sha, tag, *types):
        results = [{"case": "a", "backend": "c", "weight_type": t, "tag": tag} for t in types]
        return results + [{"case": "a", "quirks": [], "module_sha256": sha, "tag": tag}]

    old = rows("s1", "old", "F32", "Q8_0")
    merged = merge_results(old, rows("s1", "new", "Q8_0", "IQ4_NL"), ["a"])
    assert [(r.get("weight_type"), r["tag"]) for r in merged] == [
        ("F32", "old"), ("Q8_0", "new"), ("IQ4_NL", "new"), (None, "new")
    ]  # fmt: skip
    # another module: the old measurements no longer describe it
    merged = merge_results(old, rows("s2", "new", "IQ4_NL"), ["a"])
    assert [(r.get("weight_type"), r["tag"]) for r in merged] == [("IQ4_NL", "new"), (None, "new")]


def test_table_option_rewrites_only_the_marked_table(tmp_path):
    from alchemist.cli import build_parser

    rows = [
        {"case": "llama", "quirks": ["tied output"]},
        {"case": "llama", "backend": "c", "weight_type": "F32", "passed": True},
    ]
    page = tmp_path / "page.md"
    page.write_text(f"# before\n\n{TABLE_BEGIN}\nold\n{TABLE_END}\n\nafter\n")
    write_results(rows, tmp_path / "results.json", page)
    assert page.read_text() == f"# before\n\n{TABLE_BEGIN}\n{architecture_markdown(rows)}\n{TABLE_END}\n\nafter\n"
    parser = build_parser()
    assert parser.parse_args(["families", "--table", "docs/architectures.md"]).table == "docs/architectures.md"
    assert parser.parse_args(["families", "--readme", "x.md"]).table == "x.md"  # the deprecated spelling
    assert parser.parse_args(["families"]).table is None


def test_a_failing_backend_is_listed_and_does_not_hide_the_types_that_pass():
    rows = [{"case": "gemma3n", "quirks": ["AltUp"]}] + [
        {"case": "gemma3n", "backend": b, "weight_type": t, "passed": b != "jax"}
        for t in ("F32", "Q8_0")
        for b in ("c", "jax")
    ]
    line = architecture_markdown(rows).splitlines()[-1]
    assert line == "| `gemma3n` | GGUF, snapshot (gemma3n) | AltUp | c (fails: jax/F32, jax/Q8_0) | F32, Q8_0 |"
    rows[1]["passed"] = False  # c fails on F32 too: F32 passes on no validated backend
    assert architecture_markdown(rows).splitlines()[-1].endswith("| none (fails: c/F32, jax/F32, jax/Q8_0) | none |")


def test_a_quantized_type_failing_everywhere_does_not_unlist_the_backends():
    """A quantized type that fails on every backend (its rounding flips a near-tie) is listed as failing; the
    backends stay validated for the types that pass."""
    rows = [{"case": "qwen3moe", "quirks": ["MoE"]}] + [
        {"case": "qwen3moe", "backend": b, "weight_type": t, "passed": t != "IQ4_NL"}
        for t in ("F32", "IQ4_NL")
        for b in ("c", "numba")
    ]
    line = architecture_markdown(rows).splitlines()[-1]
    assert line == "| `qwen3moe` | GGUF, snapshot (qwen3_moe) | MoE | c, numba (fails: c/IQ4_NL, numba/IQ4_NL) | F32 |"


def test_a_type_measured_on_some_backends_only_says_which():
    """The newest types are validated on C (whose kernels Numba calls) where the older ones ran everywhere: the table
    names the backends beside such a type instead of implying all of them."""
    rows = [{"case": "llama", "quirks": ["tied output"]}] + [
        {"case": "llama", "backend": b, "weight_type": t, "passed": True}
        for t, backends in (("F32", ("c", "jax")), ("IQ2_XXS", ("c",)))
        for b in backends
    ]
    assert architecture_markdown(rows).splitlines()[-1] == "| `llama` | GGUF, snapshot (llama, mistral) | tied output | c, jax | F32; IQ2_XXS (c) |"


def test_a_fixture_that_cannot_be_written_in_a_type_is_a_row_that_says_why(tmp_path, monkeypatch):
    """A fixture none of whose weights holds whole blocks of the type validates nothing of it: each backend's row
    fails naming the case and the type, and the run goes on to the next case."""
    import alchemist.kernels.formats as formats
    from alchemist.harness.families import validate_families

    monkeypatch.setattr(formats, "block_size", lambda t: (1 << 20, 1))
    rows = validate_families(["llama", "qwen2"], ["c", "numba"], ["IQ2_XXS"], tmp_path, progress=None)
    results = [r for r in rows if "backend" in r]
    assert [(r["case"], r["backend"], r["passed"]) for r in results] == [
        ("llama", "c", False), ("llama", "numba", False), ("qwen2", "c", False), ("qwen2", "numba", False)
    ]  # fmt: skip
    assert results[0]["failures"] == [
        "ValueError: llama: no weight of the fixture has rows of whole 1048576-value IQ2_XXS blocks"
    ]
    assert not (tmp_path / "llama-IQ2_XXS.gguf").exists()
    assert [r["case"] for r in rows if "quirks" in r] == ["llama", "qwen2"]
