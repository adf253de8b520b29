"""alchemist.views: `alchemist graph` (one layer's graph, before and after a backend's rewrites) and `alchemist card`
(the architecture card from the IR), on tiny fixtures; the reference models only under the slow mark."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter

import pytest

from alchemist.cli import main
from alchemist.errors import AlchemistError
from alchemist.views import card, layer_graph
from alchemist.views.layer_graph import build_layer_graph, nodes_before, op_type, rewrite, run_graph, summarize

HAS_DOT = shutil.which("dot") is not None


@pytest.fixture(scope="session")
def q8_gemma3(tiny_dir):
    """A gemma3 fixture quantized to Q8_0 by llama.cpp: its matrices reach the graph as uint8 blocks on C."""
    try:
        from alchemist.harness.quantize import quantize_fixture
    except ImportError as e:
        pytest.skip(f"quantized fixtures need llama-cpp-python: {e}")
    from alchemist.fixtures import write_fixture

    f16 = write_fixture(tiny_dir / "views-gemma3-f16.gguf", "gemma3", weight_type="F16")
    return str(quantize_fixture(f16, tiny_dir / "views-gemma3-q8_0.gguf", "Q8_0").path)


# ---------------------------------------------------------------------------------------------------
# alchemist graph
# ---------------------------------------------------------------------------------------------------
LLAMA_LAYER_WEIGHTS = [
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
]


def test_graph_text_names_the_layers_weights_and_counts_its_ops(tiny_gguf):
    path = str(tiny_gguf("llama"))
    g = build_layer_graph(path, 1)
    nodes = nodes_before(g)
    assert sorted(g.ggml_types) == sorted(f"blk.1.{w}.weight" for w in LLAMA_LAYER_WEIGHTS)
    kinds = Counter(op_type(n.op) for n in nodes)
    assert kinds["Dot"] == 7  # q, k, v, output, gate, up, down: float32 weights, x @ W.T
    assert kinds["Blockwise(Dot)"] == 2  # q·k and probs·v
    assert kinds["SetSubtensor"] == 2  # the k and v cache writes, as slices

    text = run_graph(path, 1)
    assert "layer 1 of 2 (llama), backend c, 1 token, KV cache of 16 rows" in text
    assert f"graph before rewrites: {len(nodes)} nodes" in text
    listed = [line for line in text.splitlines() if re.match(r"\s+%\d+(\.\d+)?(, %\d+\.\d+)* = ", line)]
    assert len(listed) == len(nodes)
    for w in LLAMA_LAYER_WEIGHTS:
        assert re.search(rf"Dot\(.*blk\.1\.{w}\.weight", text) or w.endswith("norm"), w
        assert f"blk.1.{w}.weight" in text
    assert "blk.0." not in text
    assert "x float32 (1, 256)" in text and "k_cache.1 float32 (16, 2, 64)" in text
    assert re.search(r"outputs: x_out = %\d+, k_cache\.1' = %\d+, v_cache\.1' = %\d+", text)


def test_graph_quantized_weights_are_uint8_blocks_on_c_and_float32_on_jax(q8_gemma3):
    g = build_layer_graph(q8_gemma3, 0, "c")
    kinds = Counter(op_type(n.op) for n in nodes_before(g))
    assert kinds["QuantizedMatmul"] == 7 and kinds["Dot"] == 0
    q = next(v for v in g.inputs if v.name == "blk.0.attn_q.weight")
    assert q.type.dtype == "uint8" and g.ggml_types[q.name] == "Q8_0"
    assert q.type.shape[1] == 256 // 32 * 34  # n_in 256: 8 blocks of 34 bytes per row
    norm = next(v for v in g.inputs if v.name == "blk.0.attn_q_norm.weight")
    assert norm.type.dtype == "float32"
    text = run_graph(q8_gemma3, 0)
    assert "blk.0.attn_q.weight                Q8_0  as uint8 blocks (256, 272)" in text
    assert "QuantizedMatmul{ggml_type='Q8_0', n_out=256, n_in=256, numerics='exact'}" in text
    if "jax" in _available_backends():
        g = build_layer_graph(q8_gemma3, 0, "jax")
        assert all(v.type.dtype != "uint8" for v in g.inputs)


def _available_backends():
    from alchemist.errors import BackendUnavailableError
    from alchemist.runtime.backends import BACKENDS, require_backend

    out = []
    for b in BACKENDS:
        try:
            require_backend(b)
            out.append(b)
        except BackendUnavailableError:
            pass
    return out


def test_graph_rewrites_summary_is_consistent(q8_gemma3):
    """The one rewrite test: gemma3's layer 0 through the C backend's rewrites (no linking)."""
    g = build_layer_graph(q8_gemma3, 0, "c")
    before = nodes_before(g)
    fgraph = rewrite(g)
    after = fgraph.toposort()
    s = summarize(before, after)
    assert s.n_before == len(before) == sum(s.before.values())
    assert s.n_after == len(after) == sum(s.after.values())
    assert s.n_after < s.n_before
    assert s.after["QuantizedMatmul"] == s.before["QuantizedMatmul"] == 7  # kernels are kept as they are
    assert s.before["Composite"] == 0 and s.after["Composite"] == s.fused_nodes > 0
    assert (
        sum(s.elemwise_after.values()) == s.after["Elemwise"] < s.before["Elemwise"] == sum(s.elemwise_before.values())
    )
    assert s.fused_scalar_ops > s.fused_nodes  # each Composite holds several scalar ops
    assert "Softmax" in s.removed and "Blockwise(Dot)" in s.removed
    assert sum(s.inplace.values()) == sum(1 for n in after if n.op.destroy_map) > 0
    assert s.inplace["SetSubtensor"] == 2  # both cache writes in place, as in the Engine's update
    for k, v in s.introduced.items():
        assert s.before.get(k, 0) == 0 and v == s.after[k]

    text = run_graph(q8_gemma3, 0, rewrites=True)
    assert f"graph after the c backend's rewrites: {s.n_after} nodes" in text
    assert f"rewrites: {s.n_before} nodes before, {s.n_after} after" in text
    row = re.search(r"^\s+Composite\s+(\d+)\s+(\d+)$", text, re.M)
    assert row and (int(row.group(1)), int(row.group(2))) == (0, s.fused_nodes)
    assert f"the fused ones hold {s.fused_scalar_ops} scalar ops" in text
    assert "[inplace]" in text


def test_graph_dot_parses_and_labels_weights(tiny_gguf, tmp_path):
    path = str(tiny_gguf("qwen2"))
    text = run_graph(path, 0, fmt="dot")
    g = build_layer_graph(path, 0)
    n_nodes = len(nodes_before(g))
    assert text.startswith("digraph layer {") and text.rstrip().endswith("}")
    assert len(re.findall(r"^  n\d+ \[", text, re.M)) == n_nodes
    assert '"blk.0.attn_q.weight\\nF32 (256, 256)"' in text
    assert "blk.0.attn_q.bias" in text  # qwen2's q/k/v biases are inputs too
    if not HAS_DOT:
        pytest.skip("graphviz `dot` is not installed: the DOT text is not parsed")
    proc = subprocess.run(["dot", "-Tsvg"], input=text.encode(), capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.count(b'class="node"') == n_nodes + len(g.inputs) + 3 + text.count('shape="plaintext"')


@pytest.mark.skipif(not HAS_DOT, reason="graphviz `dot` is not installed")
def test_graph_png_is_written(tiny_gguf, tmp_path):
    out = tmp_path / "layer.png"
    msg = run_graph(str(tiny_gguf("llama")), 0, output=str(out))  # the format from the extension
    assert msg.startswith(f"wrote {out} (")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_graph_bad_input_is_a_clear_error(tiny_gguf, tmp_path, capsys):
    path = str(tiny_gguf("llama"))
    with pytest.raises(AlchemistError, match=r"--layer 2: .* has 2 layers \(0 to 1\)"):
        run_graph(path, 2)
    with pytest.raises(AlchemistError, match=r"--layer -1"):
        run_graph(path, -1)
    with pytest.raises(AlchemistError, match=r"--format 'jpg': choose one of text, dot, png, svg"):
        run_graph(path, 0, fmt="jpg")
    with pytest.raises(AlchemistError, match=r"--format png writes a file: give it with -o"):
        run_graph(path, 0, fmt="png")
    with pytest.raises(AlchemistError, match=r"no-such\.gguf: no such file"):
        run_graph(str(tmp_path / "no-such.gguf"), 0)
    with pytest.raises(AlchemistError, match=r"unknown backend 'tpu'"):
        run_graph(path, 0, backend="tpu")
    assert main(["graph", path, "--layer", "7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alchemist: error: --layer 7:") and len(err.strip().splitlines()) == 1


def test_layer_graph_render_without_dot_says_to_install_graphviz(monkeypatch, tmp_path):
    monkeypatch.setattr(layer_graph.shutil, "which", lambda name: None)
    with pytest.raises(AlchemistError, match="install graphviz"):
        layer_graph.render("digraph {}", "png", tmp_path / "x.png")


# ---------------------------------------------------------------------------------------------------
# alchemist card
# ---------------------------------------------------------------------------------------------------
def test_windows_and_per_layer_values_are_summarized_compactly():
    assert card._windows([512] * 5 + [0]) == "5 local : 1 global, window 512 (5 local, 1 global)"
    # gemma3-1b: 26 layers, the pattern's last period cut short
    assert card._windows(([512] * 5 + [0]) * 4 + [512] * 2) == ("5 local : 1 global, window 512 (22 local, 4 global)")
    assert card._windows([0] * 4) == "none (every layer global)"
    assert card._windows([4096] * 4) == "every layer, window 4096"
    assert card._windows([8, 0, 0, 8, 8]) == "pattern LGGLL (L local, G global), window 8 (3 local, 2 global)"
    local = [True] * 5 + [False]
    assert card._over_layers(["10000"] * 5 + ["1000000"], local) == "local 10000; global 1000000"
    nope = ["norm", "norm", "norm", "none"] * 3  # smollm3: no RoPE every 4th layer
    assert card._over_layers(nope, [False] * 12) == "3× norm : 1× none, repeating"


def test_card_text_of_one_model(tiny_gguf):
    text = card.run_card([str(tiny_gguf("gemma3"))], None)
    facts = dict(re.findall(r"^  (\S.*?)\s{2,}(\S.*)$", text, re.M))
    assert facts["family"] == "gemma3" and facts["layers"] == "2" and facts["n_embd"] == "256"
    assert facts["MLP"] == "gated GELU-tanh (GeGLU)"
    assert facts["sliding window"] == "1 local : 1 global, window 8 (1 local, 1 global)"
    assert facts["post norms"] == "RMSNorm after attention and MLP (sandwich)"
    assert facts["q/k norm"] == "RMSNorm per head"
    assert facts["embedding scale"] == "×√n_embd = 16"
    assert facts["output"] == "tied to the token embedding"


def test_card_diff_gemma3_vs_llama_lists_the_known_differences(tiny_gguf):
    text = card.run_card([str(tiny_gguf("gemma3")), str(tiny_gguf("llama"))], None)
    rows = {m[0]: (m[1], m[2]) for m in re.findall(r"^  (\S.*?)\s{2,}(\S.*?)\s{3,}(\S.*)$", text, re.M)}
    assert rows["MLP"] == ("gated GELU-tanh (GeGLU)", "gated SiLU (SwiGLU)")
    assert rows["sliding window"] == (
        "1 local : 1 global, window 8 (1 local, 1 global)",
        "none (every layer global)",
    )
    assert rows["q/k norm"] == ("RMSNorm per head", "none")
    assert rows["post norms"] == ("RMSNorm after attention and MLP (sandwich)", "none")
    assert rows["embedding scale"] == ("×√n_embd = 16", "none")
    assert rows["RoPE"] == ("neox (rotate halves)", "norm (adjacent pairs)")
    assert rows["family"] == ("gemma3", "llama")
    n = int(re.search(r"^(\d+) differences$", text, re.M).group(1))
    assert n == len(rows) == 7  # every difference has a row, and only those
    same = re.search(r"^same: (.*)$", text, re.M).group(1).split(", ")
    assert "heads" in same and "n_ff" in same and "MLP" not in same


def test_card_files_are_written(tiny_gguf, tmp_path):
    one, two = str(tiny_gguf("gemma3")), str(tiny_gguf("stablelm:parallel"))
    png = tmp_path / "card.png"
    out = card.run_card([one], str(png))
    assert out.endswith(f"wrote {png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    svg = tmp_path / "diff.svg"
    card.run_card([one, two], str(svg))
    first = svg.read_bytes()
    assert first.startswith(b"<?xml") and b"</svg>" in first
    assert b"Attention" in first or b"glyph" in first  # text as glyphs or as text
    card.run_card([one, two], str(svg))
    assert svg.read_bytes() == first  # deterministic


def test_card_bad_input_is_a_clear_error(tiny_gguf, tmp_path, capsys):
    one = str(tiny_gguf("llama"))
    with pytest.raises(AlchemistError, match=r"card takes one model, or two to compare; got 3"):
        card.run_card([one, one, one], None)
    with pytest.raises(AlchemistError, match=r"-o .*card\.pdf: a card is written as \.png or \.svg"):
        card.run_card([one], str(tmp_path / "card.pdf"))
    with pytest.raises(AlchemistError, match=r"missing\.gguf: no such file"):
        card.run_card([str(tmp_path / "missing.gguf")], None)
    assert main(["card", one, "-o", str(tmp_path / "x.jpg")]) == 2
    assert capsys.readouterr().err.startswith("alchemist: error: -o ")


@pytest.mark.slow
def test_card_reference_models(reference_models):
    text = card.run_card(["gemma-3-270m", "qwen2.5-coder-0.5b"], None)
    assert re.search(r"sliding window\s+5 local : 1 global, window 512 \(15 local, 3 global\)\s+none", text)
    assert re.search(r"RoPE base\s+local 10000; global 1000000\s+1000000", text)
    assert re.search(r"heads\s+4 query, 1 KV \(MQA\)\s+14 query, 2 KV \(GQA 7:1\)", text)
