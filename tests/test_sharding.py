"""A model across JAX devices (alchemist.runtime.sharding): the layout decided from the IR, the sharded logits
against one device's, per-device memory, the bytes each process reads, and two jax.distributed processes.

JAX fixes its device count when it starts, so the runs are child processes (tests/sharding_child.py) started with
XLA_FLAGS asking for 4 host devices."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from alchemist.errors import AlchemistError
from alchemist.fixtures import FixtureConfig, write_fixture
from alchemist.runtime import sharding

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).with_name("sharding_child.py")
CONFIG = FixtureConfig(arch="llama", n_head=8, n_kv_head=4, n_ff=1024, n_vocab=512)


@pytest.fixture(scope="module")
def llama_tp(tmp_path_factory) -> Path:
    return write_fixture(tmp_path_factory.mktemp("tp") / "llama-tp.gguf", "llama", config=CONFIG)


def _ir(path):
    from alchemist.arch import build_model_ir
    from alchemist.reading import read_model

    return build_model_ir(read_model(path))


# ---------------------------------------------------------------------------------------------- the layout
def test_layout_splits_a_llama_block_as_megatron(llama_tp):
    ir = _ir(llama_tp)
    lay = sharding.layout(ir, 4)
    rows = sharding.layout(ir, 4, "rows")  # every projection by output rows
    assert rows.spec("blk.0.attn_output.weight") == rows.spec("blk.0.ffn_down.weight") == ("tp", None)
    assert sharding.default_policy("ggml") == "rows" and sharding.default_policy("exact") == "megatron"
    assert rows.digest != lay.digest
    for il in range(2):
        for name in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            assert lay.spec(f"blk.{il}.{name}.weight") == ("tp", None), name
        assert lay.spec(f"blk.{il}.attn_output.weight") == (None, "tp")
        assert lay.spec(f"blk.{il}.ffn_down.weight") == (None, "tp")
        assert lay.spec(f"blk.{il}.attn_norm.weight") == ()  # replicated
    assert ir.output.tied and lay.spec("token_embd.weight") == ("tp", None)  # the output projection too
    assert lay.cache_split == (True, True) and lay.cache_spec(0, "k") == (None, "tp", None)
    assert lay.reasons == ()
    assert sharding.layout(_ir(llama_tp), 1).specs == {}


def test_layout_replicates_what_does_not_divide(llama_tp):
    lay = sharding.layout(_ir(llama_tp), 3)  # 8 heads, 1024 hidden units, 512 rows: none divide by 3
    assert lay.specs == {} and lay.cache_split == (False, False)
    assert any("8 heads / 4 KV heads do not divide by 3" in r for r in lay.reasons)
    assert any("1024 hidden units do not divide by 3" in r for r in lay.reasons)
    assert any("token_embd.weight: 512 vocabulary rows" in r for r in lay.reasons)
    lay8 = sharding.layout(_ir(llama_tp), 8)  # 4 KV heads: attention replicated, the MLP split
    assert lay8.spec("blk.0.attn_q.weight") == () and lay8.spec("blk.0.ffn_up.weight") == ("tp", None)


def test_layout_of_the_reference_models_from_their_generated_modules():
    """Qwen2.5's Q6_K ffn_down (4864 columns = 19 super-blocks) cannot split into whole blocks over 2: it goes by
    rows; gemma-3's single KV head keeps its attention replicated."""
    from alchemist.audit import ir_from_module
    from alchemist.audit.source import ModuleSource

    def ir_of(stem):
        path = ROOT / "generated" / f"{stem}.py"
        ir, err = ir_from_module(ModuleSource.parse(path.read_text(), path.name))
        assert err is None, err
        return ir

    qwen = sharding.layout(ir_of("qwen2_5_coder_0_5b_instruct_q4_k_m"), 2)
    assert qwen.spec("blk.0.attn_q.weight") == ("tp", None) and qwen.spec("blk.0.attn_output.weight") == (None, "tp")
    assert qwen.spec("blk.0.ffn_down.weight") == ("tp", None)
    assert any("blk.0.ffn_down.weight split by rows, not columns" in r for r in qwen.reasons)
    gemma = sharding.layout(ir_of("gemma_3_270m_q4_k_m"), 2)
    assert gemma.spec("blk.0.attn_q.weight") == () and not any(gemma.cache_split)
    assert gemma.spec("blk.0.ffn_gate.weight") == ("tp", None)


def test_devices_need_jax(llama_tp):
    from alchemist.runtime.api import load_llm

    with pytest.raises(AlchemistError, match="runs on backend='jax'"):
        load_llm(llama_tp, backend="c", devices=2, progress=False)
    with pytest.raises(AlchemistError, match="whole number"):
        load_llm(llama_tp, backend="jax", devices=0, progress=False)


# ---------------------------------------------------------------------------------------------- sharded runs
def _env(host_devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={host_devices}")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _result(proc_out: str) -> dict:
    line = next((x for x in proc_out.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc_out[-3000:]
    return json.loads(line[len("RESULT ") :])


def _child(model, devices: int, host_devices: int = 4, extra=()) -> dict:
    cmd = [sys.executable, str(CHILD), str(model), "--devices", str(devices), *extra]
    proc = subprocess.run(cmd, env=_env(host_devices), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return _result(proc.stdout)


def _nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (b**2).sum())


@pytest.fixture(scope="module")
def one_device(llama_tp):
    return _child(llama_tp, 1)


@pytest.fixture(scope="module")
def llama_tp_q4_k(llama_tp):
    from alchemist.harness.quantize import quantize_fixture

    out = llama_tp.with_name("llama-tp-Q4_K.gguf")
    quantize_fixture(llama_tp, out, "Q4_K", pure=True)
    return out


def test_quantized_parts_are_read_as_whole_blocks(llama_tp_q4_k):
    """A Q4_K file: ffn_down's 1024 columns split into one 256-weight super-block per device (columns), the
    attention output's 512 into 128 (not whole blocks: rows); each part dequantized on its own gives the
    logits of the whole tensors dequantized on one device."""
    lay = sharding.layout(_ir(llama_tp_q4_k), 4)
    assert lay.spec("blk.0.ffn_down.weight") == (None, "tp") and lay.spec("blk.0.attn_output.weight") == ("tp", None)
    one, four = _child(llama_tp_q4_k, 1), _child(llama_tp_q4_k, 4)
    assert four["tokens"] == one["tokens"]
    for step, (a, b) in enumerate(zip(four["logits"], one["logits"])):
        assert _nmse(a, b) <= 1e-10, step


@pytest.mark.parametrize("split", ["rows", "megatron"])
def test_ggml_kernels_on_four_devices(llama_tp_q4_k, split):
    """numerics="ggml": each device runs the C kernels on its part (kernels.sharded, under shard_map). A
    row-split product is the unsharded kernel's rows bit for bit, so with split="rows" (ggml's default) the
    logits are one device's bit for bit. split="megatron" splits the output and down projections by columns:
    the same per-block products summed across devices in another order (float32 rounding), which the next
    layer's activation rounding may carry on; the logits agree to that, with the same tokens. Either way no
    weight is gathered and a device holds a quarter of the weights."""
    one = _child(llama_tp_q4_k, 1, extra=["--numerics", "ggml"])
    four = _child(llama_tp_q4_k, 4, extra=["--numerics", "ggml", "--split", split, "--products", "--collectives"])
    assert four["tokens"] == one["tokens"]
    splits = four["products"]
    assert {s for s, _, _ in splits.values()} == ({"rows"} if split == "rows" else {"rows", "cols"})
    for name, (how, same, rel) in splits.items():
        assert same if how == "rows" else rel < 1e-5, (name, how, same, rel)
    for step, (a, b) in enumerate(zip(four["logits"], one["logits"])):
        assert (a == b) if split == "rows" else _nmse(a, b) <= 1e-10, step
    # the collectives move activation rows (and the embedding row's bytes), never a weight's part (>= 64 KiB)
    sizes = [int(np.prod([int(d) for d in c.split("[")[1].rstrip("]").split(",") if d])) for c in four["collectives"]]
    assert max(sizes) <= 1024, four["collectives"]
    (single,) = one["device_bytes"].values()
    assert all(held <= 1.2 * single / 4 for held in four["device_bytes"].values()), four["device_bytes"]


def test_four_devices_give_one_devices_logits_and_a_quarter_of_the_memory(llama_tp, one_device):
    four = _child(llama_tp, 4, extra=["--collectives"])
    # no weight or cache is ever gathered: a decode step's only collectives are one all-reduce of the token's
    # embedding row (its vocabulary part) and one per column-split projection (2 per block), each one row
    kinds = {c.split()[0] for c in four["collectives"]}
    assert kinds == {"all-reduce"} and len(four["collectives"]) == 1 + 2 * 2, four["collectives"]
    assert all(c.endswith("[1,256]") for c in four["collectives"]), four["collectives"]
    assert four["tokens"] == one_device["tokens"]
    for step, (a, b) in enumerate(zip(four["logits"], one_device["logits"])):
        assert _nmse(a, b) <= 1e-10, step
    # every device holds a quarter of what one device held, plus the replicated norms: within 20%
    (single,) = one_device["device_bytes"].values()
    assert len(four["device_bytes"]) == 4
    for device, held in four["device_bytes"].items():
        assert held <= 1.2 * single / 4, (device, held, single)
    # each tensor's parts were read once: the file's bytes (the replicated norms once, not per device)
    assert four["bytes_read"] == four["file_tensor_bytes"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_generate_one_process_tokens(llama_tp, one_device, tmp_path):
    """jax.distributed on 127.0.0.1: two processes of 2 CPU devices each (collectives over gloo) decode the same
    tokens and logits as one process, each reading only its half of the weights from the file."""
    port = _free_port()
    procs, logs = [], []
    for i in range(2):
        # output to files, not pipes: a process blocked on a full pipe would stall the other at shutdown's barrier
        logs.append((tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt"))
        cmd = [sys.executable, str(CHILD), str(llama_tp), "--devices", "4", "--coordinator", f"127.0.0.1:{port}"]
        cmd += ["--num-processes", "2", "--process-id", str(i), "--local-devices", "2"]
        with open(logs[-1][0], "w") as out, open(logs[-1][1], "w") as err:
            procs.append(subprocess.Popen(cmd, env=_env(2), stdout=out, stderr=err))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    results = []
    for p, (out, err) in zip(procs, logs):
        assert p.returncode == 0, out.read_text()[-2000:] + err.read_text()[-4000:]
        results.append(_result(out.read_text()))
    for r in results:
        assert r["tokens"] == one_device["tokens"]
        for step, (a, b) in enumerate(zip(r["logits"], one_device["logits"])):
            assert _nmse(a, b) <= 1e-10, step
        assert len(r["device_bytes"]) == 2
        # half the file, and the replicated tensors (norms) read by both
        assert r["bytes_read"] <= 0.55 * r["file_tensor_bytes"], r["bytes_read"]
    assert sum(r["bytes_read"] for r in results) >= results[0]["file_tensor_bytes"]


def test_run_cli_splits_over_devices_and_prints_per_device_memory(llama_tp):
    cmd = [sys.executable, "-m", "alchemist.cli", "run", str(llama_tp), "--backend", "jax", "--devices", "4"]
    cmd += ["--tokens", "1,5,9", "--max-tokens", "3", "--context", "64"]
    proc = subprocess.run(cmd, env=_env(4), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor parallel over 4 devices (rows): 15 of 20 tensors split" in proc.stderr  # ggml numerics
    line = next(x for x in proc.stderr.splitlines() if x.startswith("per device"))
    assert [x.split()[0] for x in line.split(": ", 1)[1].split(", ")] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    bad = [x if x != "jax" else "c" for x in cmd]
    bad = subprocess.run(bad, env=_env(4), capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "--devices 4 runs on --backend jax" in bad.stderr


@pytest.mark.oracle
def test_validate_on_four_devices_against_llama_cpp(llama_tp, tmp_path):
    """`alchemist validate --backend jax --devices 4`: the split model against llama.cpp, position by position and
    layer by layer (F32: every named intermediate), as the one-device model is validated."""
    cmd = [sys.executable, "-m", "alchemist.cli", "validate", str(llama_tp), "--backend", "jax", "--devices", "4"]
    cmd += ["--numerics", "exact", "--generate", "4", "-o", str(tmp_path)]
    proc = subprocess.run(cmd, env=_env(4), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "validation PASSED" in proc.stdout
    (report,) = tmp_path.glob("*.json")
    data = json.loads(report.read_text())
    assert data["jax_devices"] == 4 and data["backends"]["jax"]["passed"]
