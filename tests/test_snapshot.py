"""Hugging Face snapshots (config.json and safetensors) as a second input: the same IR as the GGUF the converter
would write, a generated module that loads the snapshot in place and passes its audit, the same logits; and
malformed snapshots refused by file and field. The snapshots are written from GGUF fixtures by undoing the
conversion (tests/snapshot_fixture.py)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from alchemist import load_llm
from alchemist.arch import build_model_ir
from alchemist.errors import AlchemistError, UnsupportedModelError
from alchemist.gguf_io import read_gguf
from alchemist.snapshot import SnapshotError, read_snapshot
from snapshot_fixture import snapshot_from_gguf, write_safetensors

IDS = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128]


def _computation(ir):
    """The IR without where it was read from (file, identity, tensor places and types) and the keys it read."""
    return dataclasses.replace(ir, source_file="", source_sha256="", file_size=0, data_offset=0, source_files=(),
                               tensors=(), metadata=(), model_name="")  # fmt: skip


@pytest.mark.parametrize(
    "arch,shards", [("llama", 1), ("llama", 3), ("qwen3", 2), ("gemma3", 2), ("qwen3moe", 2), ("gemma3n", 2)]
)
def test_a_snapshot_reads_into_the_ir_of_its_gguf_conversion(tiny_gguf, tmp_path, arch, shards):
    """config.json keys become the GGUF keys, Hugging Face names the GGUF names (gguf-py's map), llama's q/k rows
    are marked for the converter's reordering, gemma3n's text model read from its multimodal config and its AltUp
    projections stacked: the IR computes what the GGUF's does; each tensor stays in place. One difference is the
    models' own: gemma3n's activation sparsity takes the std over n in Hugging Face's model, over n - 1 in
    llama.cpp's, and each IR says its model's."""
    gguf_path = tiny_gguf(arch)
    snap = snapshot_from_gguf(gguf_path, tmp_path / "snap", shards=shards)
    facts = read_snapshot(snap)
    ours, theirs = build_model_ir(facts), build_model_ir(read_gguf(gguf_path))
    if arch == "gemma3n":
        assert {lay.mlp.sparsity_ddof for lay in ours.layers} == {0} and ours.layers[0].mlp.sparsity_std > 0
        assert {lay.mlp.sparsity_ddof for lay in theirs.layers} == {1}
        ddof_1 = tuple(
            dataclasses.replace(lay, mlp=dataclasses.replace(lay.mlp, sparsity_ddof=1)) for lay in ours.layers
        )
        ours = dataclasses.replace(ours, layers=ddof_1)
        assert any(name.endswith(".altup_projections.1.weight") for name in json.loads(
            (snap / "model.safetensors.index.json").read_text())["weight_map"])  # fmt: skip
    assert _computation(ours) == _computation(theirs) and ours.computation_hash() == theirs.computation_hash()
    assert ours.ir_hash() != theirs.ir_hash()  # the IR hash also covers where each was read from
    assert [t.name for t in ours.tensors] != [] and {t.name for t in ours.tensors} == {t.name for t in theirs.tensors}
    assert len(ours.source_files) == shards and ours.source_file == "snap" and ours.data_offset == 0
    q = next(t for t in ours.tensors if t.name == "blk.0.attn_q.weight")
    assert q.transform == (("rope_pairs", 4) if arch == "llama" else ())
    norm = next(t for t in ours.tensors if t.name == "blk.0.attn_norm.weight")
    assert norm.transform == (("plus_one",) if arch == "gemma3" else ())
    assert sum(size for _, size in ours.source_files) == facts.file_size
    stored = facts.tensor_bytes("blk.1.attn_output.weight").view(np.float32)
    assert np.array_equal(stored, read_gguf(gguf_path).tensor_bytes("blk.1.attn_output.weight").view(np.float32))


def test_a_snapshot_model_computes_what_its_gguf_computes(tiny_gguf, tiny_dir, tmp_path):
    """load_llm(snapshot directory): the generated module passes its audit (against the directory too), reads the
    F32 snapshot into the GGUF's very weights (llama's q/k rows reordered) and gives its logits bit for bit; a BF16
    snapshot reads its values widened exactly."""
    from alchemist.audit import audit_module

    gguf_path = tiny_gguf("llama")
    f32 = snapshot_from_gguf(gguf_path, tmp_path / "f32", shards=2)
    bf16 = snapshot_from_gguf(gguf_path, tmp_path / "bf16", dtype="BF16")
    want = load_llm(gguf_path, backend="c", context=32, generated_dir=tiny_dir / "snap-ref", progress=False)
    got = load_llm(f32, backend="c", context=32, generated_dir=tmp_path / "gen", progress=False)
    assert got.tokenizer is None  # no tokenizer.json in this snapshot: token ids in
    for m in (want, got):
        m.engine.reset()
    np.testing.assert_array_equal(got.engine.run(IDS, 0, all_logits=True), want.engine.run(IDS, 0, all_logits=True))
    report = audit_module(got.module_path, gguf_path=f32)
    assert report.passed, [c for c in report.checks if not c.passed]
    from alchemist.runtime.engine import import_generated

    module = import_generated(load_llm(bf16, backend="c", context=32, generated_dir=tmp_path / "gen16",
                                       progress=False, compile_now=False).module_path)  # fmt: skip
    weights = module.load_weights(str(bf16))
    exact = want.engine.weights  # float32 shared variables of the GGUF's weights
    w = weights["token_embd.weight"]
    ref = exact["token_embd.weight"].get_value()
    assert w.dtype == np.float32 and np.max(np.abs(w - ref)) <= np.max(np.abs(ref)) * 2**-8
    assert np.array_equal(w.view(np.uint32) & 0xFFFF, np.zeros_like(w.view(np.uint32)))  # bf16: the low half zero


def _mutate(snap, mutation):
    """Apply one mutation to a valid one-file snapshot's files."""
    st = snap / "model.safetensors"
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    kind, *args = mutation
    if kind == "header":
        header = args[0](header)
        text = json.dumps(header).encode()
        st.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    elif kind == "bytes":
        st.write_bytes(args[0](raw))
    elif kind == "config":
        cfg = json.loads((snap / "config.json").read_text())
        (snap / "config.json").write_text(json.dumps(args[0](cfg)) if callable(args[0]) else args[0])
    elif kind == "index":
        (snap / "model.safetensors.index.json").write_text(json.dumps(args[0]))


def _first(h):
    return next(k for k in h if k != "__metadata__")


MALFORMED = [
    ("header length past the file", ("bytes", lambda r: (10**9).to_bytes(8, "little") + r[8:]), "header length"),
    ("file shorter than 8 bytes", ("bytes", lambda r: r[:5]), "header length"),
    ("header not JSON", ("bytes", lambda r: r[:8] + b"x" + r[9:]), "header"),
    ("unknown dtype", ("header", lambda h: {**h, _first(h): {**h[_first(h)], "dtype": "Q7"}}), "dtype"),
    ("a dtype alchemist does not read", ("header", lambda h: {**h, _first(h): {**h[_first(h)], "dtype": "I64"}}),
     "not read by alchemist"),
    ("bytes that do not hold the shape", ("header", lambda h: {**h, _first(h): {**h[_first(h)], "shape": [3, 3]}}),
     "data_offsets"),
    ("negative dimension", ("header", lambda h: {**h, _first(h): {**h[_first(h)], "shape": [-1]}}), "shape"),
    ("a gap or overlap", ("header", lambda h: {**h, _first(h): {**h[_first(h)], "data_offsets": [
        h[_first(h)]["data_offsets"][0] + 4, h[_first(h)]["data_offsets"][1] + 4]}}), "data_offsets"),
    ("trailing bytes", ("bytes", lambda r: r + b"\0" * 16), "data"),
    ("extra field in an entry", ("header", lambda h: {**h, _first(h): {**h[_first(h)], "x": 1}}), "tensor"),
    ("config not JSON", ("config", "{nope"), "config.json"),
    ("unknown model_type", ("config", lambda c: {**c, "model_type": "wizard"}), "model_type 'wizard'"),
    ("layer count not a number", ("config", lambda c: {**c, "num_hidden_layers": "two"}), "num_hidden_layers"),
    ("an index naming a file outside", ("index", {"weight_map": {"x": "../model.safetensors"}}), "weight_map"),
    ("a tensor the name map does not know", ("header", lambda h: {"model.mystery.weight": h[_first(h)], **{
        k: v for k, v in h.items() if k != _first(h)}}), "name map does not know"),
]  # fmt: skip


@pytest.mark.parametrize("name,mutation,mention", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_snapshot_is_refused_by_file_and_field(tiny_gguf, tmp_path, name, mutation, mention):
    snap = snapshot_from_gguf(tiny_gguf("qwen3"), tmp_path / "snap")
    _mutate(snap, mutation)
    with pytest.raises((SnapshotError, UnsupportedModelError)) as e:
        build_model_ir(read_snapshot(snap))
    assert mention in str(e.value) and isinstance(e.value, AlchemistError)


def test_a_gemma3n_snapshot_is_its_text_model_and_llama_cpp_s_constants(tiny_gguf, tmp_path):
    """gemma3n's text model: the vision and audio towers' tensors are skipped, as the converter skips them; what
    llama.cpp takes as constants (AltUp streams, LAuReL rank, which layers share caches or are sparse) is required
    of config.json, another value refused by key; a config without its text_config is refused by field."""
    from snapshot_fixture import write_safetensors

    snap = snapshot_from_gguf(tiny_gguf("gemma3n"), tmp_path / "snap")
    write_safetensors(snap / "towers.safetensors", {"model.vision_tower.patch.weight": ("F32", np.ones((4, 4), np.float32)),
                                                    "model.embed_audio.embedding.weight": ("F32", np.ones(8, np.float32))})  # fmt: skip
    facts = read_snapshot(snap)
    assert {t.file for t in facts.tensors.values()} == {0} and len(facts.source_files) == 2
    assert build_model_ir(facts).computation_hash() == build_model_ir(read_snapshot(snap)).computation_hash()
    config = json.loads((snap / "config.json").read_text())
    text = config["text_config"]
    for changed, mention in (
        ({"laurel_rank": 32}, "laurel_rank is 32, not 64"),
        ({"num_kv_shared_layers": 2}, "num_kv_shared_layers is 2, not 0"),
        ({"activation_sparsity_pattern": [0.95] * 5 + [0.0]}, "activation_sparsity_pattern is"),
        ({"altup_num_inputs": 2}, "altup_num_inputs is 2, not 4"),
    ):
        (snap / "config.json").write_text(json.dumps({**config, "text_config": {**text, **changed}}))
        with pytest.raises(UnsupportedModelError, match=mention):
            read_snapshot(snap)
    for broken, error, mention in (
        ({**config, "text_config": None}, SnapshotError, "text_config"),
        ({**config, "text_config": {**text, "layer_types": "sliding"}}, SnapshotError, "layer_types"),
    ):
        (snap / "config.json").write_text(json.dumps(broken))
        with pytest.raises(error, match=mention):
            read_snapshot(snap)


@pytest.mark.parametrize("quantize", [False, True])
def test_gemma3n_per_layer_embeddings_of_fewer_rows_are_padded_with_zeros(tiny_gguf, tmp_path, quantize):
    """Gemma 3n stores per-layer embeddings for the first 262144 of its 262400 tokens (vocab_size_per_layer_input):
    read padded with zero rows up to the vocabulary, as the converter pads them (packed too, quantized, where the
    graph reads the rows it needs); mlx-lm's logits for a prompt of those tokens are ours."""
    from alchemist.harness.mlx_oracle import MlxLmOracle
    from alchemist.harness.validate import THRESHOLDS
    from snapshot_fixture import mlx_quantized, write_safetensors

    snap = snapshot_from_gguf(tiny_gguf("gemma3n"), tmp_path / "snap")
    raw = (snap / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    tensors = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        values = np.frombuffer(raw[8 + n + start : 8 + n + end], np.float32).reshape(entry["shape"])
        tensors[key] = ("F32", values[:480] if "embed_tokens_per_layer" in key else values)
    write_safetensors(snap / "model.safetensors", tensors)
    config = json.loads((snap / "config.json").read_text())
    config["text_config"]["vocab_size_per_layer_input"] = 480
    (snap / "config.json").write_text(json.dumps(config))
    if quantize:
        snap = mlx_quantized(snap, tmp_path / "q4")
    facts = read_snapshot(snap)
    info = facts.tensors["per_layer_token_embd.weight"]
    assert info.shape[0] == 512 and info.transform == ("pad_rows", 32)
    model = load_llm(snap, backend="c", context=64, generated_dir=tmp_path / "gen", progress=False, numerics="exact")
    if not quantize:
        table = model.module.load_weights(str(snap))["per_layer_token_embd.weight"]
        assert table.shape[0] == 512 and not table[480:].any() and table[:480].any()
    ids = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 479, 64, 9]
    ours = model.engine.run(ids, 0, all_logits=True)
    with MlxLmOracle(str(snap)) as oracle:
        theirs = oracle.logits(ids)
    assert float(((ours - theirs) ** 2).sum() / (theirs**2).sum()) <= THRESHOLDS["exact_nmse"]


def test_a_snapshot_and_its_gguf_conversion_three_ways(tiny_gguf, tmp_path, capsys):
    """`alchemist validate SNAPSHOT --oracle mlx-lm --gguf CONVERSION`: alchemist, mlx-lm and llama.cpp side by side.
    For llama the three agree; for gemma3n the two oracles differ (the sparsity's std over n in Hugging Face's
    model, n - 1 in llama.cpp's) and alchemist's snapshot module is mlx-lm's model, not llama.cpp's."""
    from alchemist.cli import main

    for arch in ("llama", "gemma3n"):
        snap = snapshot_from_gguf(tiny_gguf(arch), tmp_path / arch)
        out = tmp_path / f"{arch}-report"
        assert main(["validate", str(snap), "--oracle", "mlx-lm", "--gguf", str(tiny_gguf(arch)), "--backend", "c",
                     "--tokens", "1,40,300,7,99,260,45,45,3,128", "--generate", "2", "-o", str(out)]) == 0  # fmt: skip
        report = json.loads(next(out.glob("*.json")).read_text())
        pairs = report["three_way"]["pairs"]
        assert pairs["alchemist vs mlx-lm"]["logits_nmse"] <= 1e-10
        disagree = pairs["mlx-lm vs llama.cpp"]["logits_nmse"]
        assert (
            (disagree <= 1e-10) if arch == "llama" else (disagree > 1e3 * pairs["alchemist vs mlx-lm"]["logits_nmse"])
        )
        assert pairs["alchemist vs llama.cpp"]["logits_nmse"] == pytest.approx(disagree, rel=0.1, abs=1e-10)
        assert "| mlx-lm vs llama.cpp |" in next(out.glob("*.md")).read_text()
    capsys.readouterr()


def test_the_writer_and_reader_agree_on_layout(tmp_path):
    """write_safetensors (the fixtures') lays tensors out as the safetensors library does; the reader finds each."""
    from alchemist.snapshot import read_safetensors

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(5, np.float16)
    write_safetensors(tmp_path / "t.safetensors", {"a": ("F32", a), "b": ("F16", b)})
    st = read_safetensors(tmp_path / "t.safetensors")
    assert np.array_equal(st.array("a"), a) and np.array_equal(st.array("b"), b)


def test_random_damage_to_a_safetensors_file_is_an_alchemist_error_or_harmless(tiny_gguf, tmp_path):
    """300 random byte flips and truncations of a snapshot's file, header and data: reading it either succeeds or
    raises an AlchemistError naming the file, never another exception."""
    from alchemist.snapshot import read_safetensors

    snap = snapshot_from_gguf(tiny_gguf("qwen3"), tmp_path / "snap")
    raw = (snap / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    rng = np.random.default_rng(7)
    damaged = tmp_path / "damaged.safetensors"
    for trial in range(300):
        data = bytearray(raw)
        if trial % 5 == 0:
            data = data[: int(rng.integers(0, len(data)))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                at = int(rng.integers(0, 8 + n)) if trial % 2 else int(rng.integers(0, len(data)))
                data[at] = int(rng.integers(0, 256))
        damaged.write_bytes(bytes(data))
        try:
            read_safetensors(damaged)
        except AlchemistError as e:
            assert str(damaged) in str(e)


@pytest.mark.parametrize(
    "mutation,check",
    [
        (('("rope_pairs", 4)', '("rope_pairs", 2)'), "config"),  # a transform the IR does not say
        (("    if not transform:\n        return values\n", "    return values\n"), "dequantization"),  # none applied
        (("model-00002-of-00002.safetensors", "../model-00002-of-00002.safetensors"), "config"),  # outside the snapshot
        (("return values + np.float32(1.0)", "return values"), "dequantization"),  # Gemma's norm shift dropped
    ],
    ids=["wrong transform", "transform skipped", "file outside", "norm shift dropped"],
)
def test_the_audit_catches_a_snapshot_module_that_reads_wrong(tiny_gguf, tmp_path, mutation, check):
    from alchemist.audit import audit_module
    from alchemist.runtime.api import write_generated

    arch = "gemma3" if "1.0" in mutation[0] else "llama"
    snap = snapshot_from_gguf(tiny_gguf(arch), tmp_path / "snap", shards=2)
    ir = build_model_ir(read_snapshot(snap))
    path = write_generated(ir, tmp_path / "gen")
    assert audit_module(path, gguf_path=snap, ir=ir).passed
    text = path.read_text()
    assert mutation[0] in text
    path.write_text(text.replace(mutation[0], mutation[1], 1))
    report = audit_module(path, ir=ir)
    failed = {c.name for c in report.checks if not c.passed}
    assert check in failed, [(c.name, c.why) for c in report.checks]


@pytest.mark.parametrize(
    "mutation",
    [
        ('w[name + ".scales"], w[name + ".biases"], bits', 'w[name + ".biases"], w[name + ".scales"], bits'),
        ('name + ".scales": regions_as_float32(files, scales,', 'name + ".scales": regions_as_float32(files, biases,'),
        ("return {key: transformed(values, transform)", "return {key: values"),
    ],
    ids=["scales and biases swapped in the graph", "biases read as scales", "packed rows left unpermuted"],
)
def test_the_audit_catches_a_packed_module_that_reads_wrong(tiny_gguf, tmp_path, mutation):
    """An MLX-quantized module whose projections stay packed: its graph must hand each MlxAffineMatmul the weight's
    own packed rows, scales and biases, and load_weights(quantized=True) must return them as stored."""
    from alchemist.audit import audit_module
    from alchemist.runtime.api import write_generated
    from snapshot_fixture import mlx_quantized

    q4 = mlx_quantized(snapshot_from_gguf(tiny_gguf("llama"), tmp_path / "snap"), tmp_path / "q4")
    ir = build_model_ir(read_snapshot(q4))
    path = write_generated(ir, tmp_path / "gen")
    assert audit_module(path, gguf_path=q4, ir=ir).passed
    text = path.read_text()
    assert text.count(mutation[0]) == 1
    path.write_text(text.replace(mutation[0], mutation[1]))
    report = audit_module(path, ir=ir)
    assert "dequantization" in {c.name for c in report.checks if not c.passed}, [(c.name, c.why) for c in report.checks]


@pytest.mark.parametrize(
    "arch,backend,dtype",
    [("llama", "c", "F32"), ("qwen3", "c", "F32"), ("gemma3", "c", "BF16"), ("qwen3moe", "c", "F32"),
     ("gemma3n", "c", "BF16"), ("llama", "numba", "F32"), ("qwen3", "numba", "F32"), ("gemma3", "numba", "BF16"),
     ("qwen3moe", "numba", "F32"), ("gemma3", "mlx", "BF16"), ("qwen3", "jax", "F16")],
)  # fmt: skip
# gemma3n on C only: a snapshot's module differs from its GGUF's in the loader (and the sparsity's std divisor, a
# graph op), and gemma3n's graph runs on Numba against llama.cpp in test_validation (three minutes more here)
def test_a_snapshot_passes_validation_against_mlx_lm(tiny_gguf, tmp_path, arch, backend, dtype):
    """mlx-lm, a second and independent oracle (its own model classes over the snapshot, MLX on CPU; half-precision
    weights widened to float32 on both sides): the logits at every prompt position within the exact bar (NMSE <=
    1e-6) and 8 greedy steps the same."""
    from alchemist.harness.validate import validate_model

    snap = snapshot_from_gguf(tiny_gguf(arch), tmp_path / "snap", shards=2, dtype=dtype)
    report = validate_model(str(snap), [backend], n_generate=8, context=64, oracle="mlx-lm", progress=None)
    result = report["backends"][backend]
    assert report["passed"] and report["oracle"] == "mlx-lm", result["failures"]
    assert result["prompt"]["logits_nmse"] <= 1e-6 and result["greedy"]["n_agree"] == 8


def test_a_mixture_of_experts_snapshot_in_either_form_and_what_llama_cpp_cannot_compute(tiny_gguf, tmp_path):
    """qwen3moe's experts stacked as MLX stores them (mlp.switch_mlp.*), or one tensor each as transformers does
    (mlp.experts.N.*, stacked by the loader from their places in the files): the same computation; a stack with a
    missing expert is refused; a config asking for what llama.cpp's qwen3moe does not compute (weights not
    renormalized) is refused by key."""
    from alchemist.audit import audit_module
    from alchemist.runtime.api import write_generated

    stacked = build_model_ir(read_snapshot(snapshot_from_gguf(tiny_gguf("qwen3moe"), tmp_path / "mlx")))
    snap = snapshot_from_gguf(tiny_gguf("qwen3moe"), tmp_path / "snap", shards=3, per_expert=True)
    ir = build_model_ir(read_snapshot(snap))
    assert ir.layers[0].mlp.up == "ffn_up_exps.weight" and ir.layers[0].mlp.router.n_expert == 8
    assert ir.computation_hash() == stacked.computation_hash()
    up = next(t for t in ir.tensors if t.name == "blk.0.ffn_up_exps.weight")
    assert len(up.parts) == 8 and len({file for file, _, _ in up.parts}) > 1  # its experts in several files
    assert audit_module(write_generated(ir, tmp_path / "gen"), gguf_path=snap, ir=ir).passed
    config = json.loads((snap / "config.json").read_text())
    (snap / "config.json").write_text(json.dumps({**config, "norm_topk_prob": False}))
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob is False, not True: llama.cpp's qwen3moe always"):
        read_snapshot(snap)
    (snap / "config.json").write_text(json.dumps(config))
    for st in snap.glob("*.safetensors"):
        raw = st.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        st.write_bytes(raw[:8] + raw[8 : 8 + n].replace(b"experts.3.up_proj", b"experts.9.up_proj") + raw[8 + n :])
    with pytest.raises(SnapshotError, match="lacks some of 0..7"):
        read_snapshot(snap)


CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen3", "llama"])  # a byte-level BPE; a SentencePiece-style unigram
def test_a_snapshots_tokenizer_is_its_tokenizer_json(tiny_gguf, tmp_path, arch):
    """Token ids as the tokenizers library gives them; decoding, piece by piece and streamed, gives the text back;
    special tokens parsed or kept as text; the end of generation and the chat template from tokenizer_config.json,
    rendered in alchemist's sandbox."""
    from tokenizers import Tokenizer

    from alchemist.snapshot.tokenizer import SnapshotTokenizer
    from alchemist.tokenizer.chat import ChatTemplateError

    snap = snapshot_from_gguf(tiny_gguf(arch), tmp_path / "snap", tokenizer=True, chat_template=CHAT)
    tok, hf = SnapshotTokenizer(snap), Tokenizer.from_file(str(snap / "tokenizer.json"))
    text = "the quick brown fox, café ☕ and then<|im_end|> done"
    ids = tok.encode(text)
    assert ids == hf.encode(text).ids and tok.decode(ids) == hf.decode(ids, skip_special_tokens=False) == text
    stream = tok.stream_decoder()
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == text
    if arch == "qwen3":
        end = tok.token_to_id("<|im_end|>")
        assert end in ids and end not in tok.encode(text, parse_special=False) and end in tok.eos_ids
        assert tok.encode_chat([{"role": "user", "content": "hi"}])[:1] == [tok.token_to_id("<|im_start|>")]
    assert tok.eos_id in tok.eos_ids and tok.vocab_size == hf.get_vocab_size()
    config = json.loads((snap / "tokenizer_config.json").read_text())
    (snap / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ ''.__class__.__mro__ }}"}))
    with pytest.raises(ChatTemplateError):
        SnapshotTokenizer(snap).encode_chat([{"role": "user", "content": "hi"}])


def test_inference_on_a_snapshot_takes_text(tiny_gguf, tiny_dir, tmp_path):
    """load_llm(snapshot with tokenizer.json): inference from text gives what the GGUF's model gives for the same
    token ids (the snapshot's tokenizer.json is the tokenizer)."""
    from alchemist import inference

    gguf_path = tiny_gguf("qwen3")
    snap = snapshot_from_gguf(gguf_path, tmp_path / "snap", tokenizer=True)
    ours = load_llm(snap, backend="c", context=64, generated_dir=tmp_path / "gen", progress=False)
    ref = load_llm(gguf_path, backend="c", context=64, generated_dir=tiny_dir / "snap-qwen3", progress=False)
    out = inference(ours, "the quick brown fox", max_tokens=6)
    ids = ours.tokenizer.encode("the quick brown fox")
    assert out.prompt_token_ids == ids
    assert out.output_token_ids == inference(ref, ids, max_tokens=6).output_token_ids
    assert out.output == ours.tokenizer.decode(out.output_token_ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3moe", "gemma3n"])
def test_an_mlx_quantized_snapshot_reads_as_mlx_dequantizes_and_validates(tiny_gguf, tmp_path, arch):
    """A snapshot quantized by mlx-lm's own quantizer (4 bits, groups of 32; the down projections 8 bits in groups
    of 64 by a per-layer override; qwen3moe's stacked experts and gemma3n's AltUp projections, quantized one by one
    and stacked, too): every weight loads as mx.dequantize gives it, bit for bit; the module passes its audit;
    against mlx-lm, with the projections packed through alchemist's kernels on C and Numba, the logits hold the
    quantized bar and 8 greedy steps agree."""
    import gguf
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from alchemist.audit import audit_module
    from alchemist.audit.graph import _rope_pairs
    from alchemist.harness.validate import validate_model
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated
    from snapshot_fixture import mlx_quantized

    snap = snapshot_from_gguf(tiny_gguf(arch), tmp_path / "snap")
    q4 = mlx_quantized(snap, tmp_path / "q4", overrides={"down_proj": {"bits": 8, "group_size": 64}})
    facts = read_snapshot(q4)
    ir = build_model_ir(facts)
    assert {t.quant[:2] for t in ir.tensors if t.quant} >= {(4, 32), (8, 64)}
    path = write_generated(ir, tmp_path / "gen")
    assert audit_module(path, gguf_path=q4, ir=ir).passed
    ours = import_generated(path).load_weights(str(q4))
    model, _ = load_model(q4)
    params = dict(tree_flatten(model.parameters()))
    names = gguf.get_tensor_name_map({n: a for a, n in gguf.MODEL_ARCH_NAMES.items()}[arch], ir.n_layer)
    compared = 0
    for module in (n.removesuffix(".scales") for n in params if n.endswith(".scales")):
        q = [params[f"{module}.{part}"] for part in ("weight", "scales", "biases")]
        hf, index = module.replace(".switch_mlp.", ".experts.").replace(".language_model.", "."), None
        if re.search(r"_projections\.\d+$", hf):  # gemma3n's AltUp projections: parts of one stacked tensor
            hf, index = hf.rsplit(".", 1)[0], int(hf.rsplit(".", 1)[1])
        info = next(t for t in ir.tensors if t.name == names.get_name(hf + ".weight", try_suffixes=(".weight",)))
        want = np.array(mx.dequantize(*q, group_size=info.quant[1], bits=info.quant[0]))
        if info.transform:  # llama's q/k rows, reordered as the converter does
            want = _rope_pairs(want, info.transform[1])
        np.testing.assert_array_equal(ours[info.name] if index is None else ours[info.name][index], want)
        compared += 1
    assert compared >= 4 * ir.n_layer
    # the projections packed through alchemist's kernels (the packed weights, not their float32 dequantization)
    backends = ["c"] if arch == "gemma3n" else ["c", "numba"]  # gemma3n: see test_a_snapshot_passes_validation...
    report = validate_model(str(q4), backends, n_generate=8, context=64, oracle="mlx-lm", progress=None)
    for backend, result in report["backends"].items():
        assert result["passed"] and result["greedy"]["n_agree"] == 8, (backend, result["failures"])
        assert result["quantized_kernels"] and not result["exact_weights"], backend
    packed = import_generated(path).load_weights(str(q4), quantized=True)
    assert {name for name, v in packed.items() if v.dtype == np.uint32} == {
        t.name for t in ir.tensors if t.kernel
    } and len(packed) == len(ours) + 2 * sum(t.kernel for t in ir.tensors)  # fmt: skip


def test_load_llm_on_mlx_multiplies_an_mlx_snapshot_with_mlx_quantized_matmul(tiny_gguf, tmp_path, monkeypatch):
    """As the seed did: load_llm(4-bit MLX snapshot, backend="mlx") keeps the projections packed and MLX multiplies
    them with its own mx.quantized_matmul; against mlx-lm the logits hold the quantized bar and 8 greedy steps
    agree."""
    import mlx.core as mx

    from alchemist.harness.validate import engine_weights, validate_model
    from snapshot_fixture import mlx_quantized

    q4 = mlx_quantized(snapshot_from_gguf(tiny_gguf("qwen3"), tmp_path / "snap"), tmp_path / "q4")
    calls, real = [], mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: calls.append(k) or real(*a, **k))
    model = load_llm(q4, backend="mlx", context=64, generated_dir=tmp_path / "gen", progress=False)
    assert model.weights == "quantized"
    kernel = sum(t.kernel for t in model.ir.tensors)  # every projection (7 a layer, the output) and the embedding
    assert (
        kernel == 7 * model.ir.n_layer + 2
        and sum(str(v.dtype) == "mlx.core.uint32" for v in engine_weights(model.engine)) == kernel
    )
    model.engine.run([1, 2, 3], 0)
    assert calls and {k["bits"] for k in calls} == {4}
    report = validate_model(str(q4), ["mlx"], n_generate=8, context=64, oracle="mlx-lm", progress=None)
    result = report["backends"]["mlx"]
    assert report["passed"] and result["quantized_kernels"] and result["greedy"]["n_agree"] == 8, result["failures"]


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4"])
def test_an_mlx_float_mode_snapshot_reads_as_mlx_dequantizes_and_validates(tiny_gguf, tmp_path, mode):
    """mlx-lm's float quantization modes (E2M1 or E4M3 values, E8M0 or E4M3 scales per group of 32 or 16, no
    biases): every weight loads as mx.dequantize gives it, bit for bit (as float32: no kernel multiplies them
    packed yet); the module passes its audit; against mlx-lm the logits hold the bar and 8 greedy steps agree."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from alchemist.audit import audit_module
    from alchemist.harness.validate import validate_model
    from alchemist.runtime.api import write_generated
    from alchemist.runtime.engine import import_generated
    from snapshot_fixture import mlx_quantized

    q = mlx_quantized(snapshot_from_gguf(tiny_gguf("qwen3"), tmp_path / "snap"), tmp_path / mode, bits=None,
                      group_size=None, mode=mode)  # fmt: skip
    ir = build_model_ir(read_snapshot(q))
    assert {t.ggml_type for t in ir.tensors} == {"F32", f"MLX_{mode.upper()}"} and not any(t.kernel for t in ir.tensors)
    path = write_generated(ir, tmp_path / "gen")
    assert audit_module(path, gguf_path=q, ir=ir).passed
    ours = import_generated(path).load_weights(str(q))
    model, _ = load_model(q)
    params = dict(tree_flatten(model.parameters()))
    compared = 0
    for module in (n.removesuffix(".scales") for n in params if n.endswith(".scales")):
        want = np.array(mx.dequantize(params[module + ".weight"], params[module + ".scales"], None, mode=mode,
                                      dtype=mx.float32))  # fmt: skip
        got = [v for name, v in ours.items() if v.shape == want.shape and np.array_equal(v, want, equal_nan=True)]
        compared += bool(got)
        assert got, module
    assert compared >= 7 * ir.n_layer
    report = validate_model(str(q), ["c"], n_generate=8, context=64, oracle="mlx-lm", progress=None)
    result = report["backends"]["c"]
    assert report["passed"] and result["greedy"]["n_agree"] == 8, result["failures"]


def test_an_mlx_quantized_snapshot_that_says_too_little_is_refused_by_key(tiny_gguf, tmp_path):
    from snapshot_fixture import mlx_quantized

    q4 = mlx_quantized(snapshot_from_gguf(tiny_gguf("qwen3"), tmp_path / "snap"), tmp_path / "q4")
    config = json.loads((q4 / "config.json").read_text())
    for changed, error, mention in (
        ({"quantization": {**config["quantization"], "mode": "q9"}}, UnsupportedModelError, "mode 'q9'"),
        (
            {"quantization": {**config["quantization"], "mode": "mxfp4", "group_size": 16}},
            SnapshotError,
            "for mode 'mxfp4'",
        ),
        (
            {"quantization": {**config["quantization"], "mode": "mxfp4"}},
            SnapshotError,
            r"scales: is F32 \[512, 8\], not U8",
        ),
        ({"quantization": None, "quantization_config": None}, SnapshotError, "quantization"),
        ({"quantization": {**config["quantization"], "bits": 9}}, SnapshotError, "bits 9"),
        ({"quantization": {**config["quantization"], "bits": 8}}, SnapshotError, r"scales: is F32 \[512, 8\], not"),
    ):
        (q4 / "config.json").write_text(json.dumps({**config, **changed}))
        with pytest.raises(error, match=mention):
            build_model_ir(read_snapshot(q4))


@pytest.mark.parametrize(
    "model_type,quantize", [("llama", False), ("qwen3", False), ("qwen3", True), ("gemma3n", False), ("gemma3n", True)]
)
def test_a_snapshot_mlx_lm_wrote_validates_against_it(tmp_path, model_type, quantize):
    """A random-weight snapshot written by mlx-lm's own model class (no GGUF in the loop; its weights' names and
    layout are mlx-lm's), and that snapshot quantized by mlx-lm: alchemist's module computes mlx-lm's logits."""
    from alchemist.harness.validate import validate_model
    from snapshot_fixture import mlx_quantized, mlx_random_snapshot

    snap = mlx_random_snapshot(model_type, tmp_path / "snap")
    if quantize:
        snap = mlx_quantized(snap, tmp_path / "q4")
    report = validate_model(str(snap), ["c"], n_generate=8, context=64, oracle="mlx-lm", progress=None)
    result = report["backends"]["c"]
    assert report["passed"] and result["greedy"]["n_agree"] == 8, result["failures"]
    assert quantize or result["prompt"]["logits_nmse"] <= 1e-6
