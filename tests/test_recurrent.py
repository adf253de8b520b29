"""Recurrent layers (granitehybrid's Mamba-2, qwen35's gated delta-net, nemotron_h's Mamba-2 blocks beside MLP-only
blocks, mamba2's Mamba-2 alone without attention, falcon-h1's beside attention in every layer) under the cache
contract: their states
against llama.cpp through whole prompts, split prefills, decode steps and restarts; per slot in the serving
engine with checkpoints at chunk boundaries for prefix reuse; and `alchemist chat` reusing a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

from alchemist.errors import AlchemistError

PROMPT = [1, 40, 300, 7, 99, 260, 45, 45, 3, 128, 17, 5, 77, 300, 12, 9, 400, 33, 21]
# each family's first recurrent layer's caches
FAMILIES = {
    "granitehybrid": (("conv_window_cache.0", "ssm_cache.0"), (8, 64, 16)),
    "qwen35": (("conv_window_cache.0", "delta_cache.0"), (4, 64, 64)),
    "nemotron_h": (("conv_window_cache.0", "ssm_cache.0"), (8, 64, 16)),  # and an MLP-only block without caches
    "mamba2": (("conv_window_cache.0", "ssm_cache.0"), (4, 64, 16)),  # no attention, no MLP
    # attention and Mamba-2 side by side: a KV cache and the states in every layer
    "falcon-h1": (("k_cache.0", "v_cache.0", "conv_window_cache.0", "ssm_cache.0"), (4, 64, 16)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def recurrent(request, fixture_files):
    from alchemist.harness.validate import load_for_validation

    path = str(fixture_files(request.param, "F32"))
    return request.param, path, load_for_validation(path)


def _nmse(a, b) -> float:
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


def test_recurrent_states_follow_the_prefill_decode_contract(recurrent):
    """Against llama.cpp: a whole prompt, a prompt in two prefills then one token at a time through the states,
    and a new prompt from position 0 over the used states; continuing elsewhere than where the states are is
    refused."""
    from alchemist.harness.oracle import LlamaCppOracle
    from alchemist.runtime.engine import Engine

    family, path, model = recurrent
    names, state_shape = FAMILIES[family]
    engine = Engine(model.module, model.weights_for("c"), "c", 64)
    assert tuple(sv.name for sv in engine.cache[0]) == names
    assert engine.cache[0][-1].get_value().shape == state_shape  # no capacity axis
    other = [5, 77, 300, 12, 9, 400, 33, 21]
    with LlamaCppOracle(path, n_ctx=64, n_threads=1) as oracle:
        ref, ref_other = oracle.logits(PROMPT), oracle.logits(other)
    assert _nmse(engine.run(PROMPT, 0, all_logits=True), ref) < 1e-9
    steps = [engine.run(PROMPT[:9], 0, all_logits=True), engine.run(PROMPT[9:12], 9, all_logits=True)]
    steps += [engine.run([t], 12 + i, all_logits=True) for i, t in enumerate(PROMPT[12:])]
    assert _nmse(np.concatenate(steps), ref) < 1e-9
    with pytest.raises(AlchemistError, match=r"recurrent state holds positions 0\.\.18; continue at 19"):
        engine.run([5], 10)
    assert _nmse(engine.run(other, 0, all_logits=True), ref_other) < 1e-9


def test_slot_engine_keeps_states_per_slot_and_reuses_checkpoints(recurrent):
    """Two prompts prefilled in chunks into two slots, the second reusing the first's checkpoint at its first
    chunk boundary, then decoded together: every logit row equals the single-sequence engine's."""
    from alchemist.runtime.engine import Engine
    from alchemist.runtime.slot_engine import SlotEngine

    family, _, model = recurrent
    weights = model.weights_for("c")
    single = Engine(model.module, weights, "c", 32)
    slots = SlotEngine(Engine(model.module, weights, "c", 32), n_slots=2, chunk=4, decode_buckets=(2,))
    assert slots.cache[0][-1].type.shape == (3, *FAMILIES[family][1])
    a, b = PROMPT[:9], PROMPT[:6] + [5, 77, 300]
    for lo, hi in slots.chunk_plan(len(a)):
        slots.prefill(0, a[lo:hi], lo)
    assert sorted(slots.checkpoints[0]) == [4, 8]  # chunk boundaries; 9 is not one
    assert slots.reusable_prefix(len(a), 6, len(b), slot=0) == 4
    assert slots.reusable_prefix(len(a), 6, len(b)) == 0  # without the slot: no checkpoint to restore
    slots.copy_prefix(0, 1, 4)
    assert sorted(slots.checkpoints[1]) == [4]
    for lo, hi in slots.chunk_plan(len(b), 4):
        got_b = slots.prefill(1, b[lo:hi], lo)
    got = slots.decode([0, 1], [17, 64], [len(a), len(b)])
    ref_a, ref_b = single.run(a + [17], 0, all_logits=True), single.run(b + [64], 0, all_logits=True)
    assert _nmse(got_b, ref_b[len(b) - 1]) < 1e-9
    assert _nmse(got[0], ref_a[-1]) < 1e-9 and _nmse(got[1], ref_b[-1]) < 1e-9
    # a slot going back to its own checkpoint (a new prompt sharing 8 tokens) continues from there
    c = a[:8] + [250, 251]
    assert slots.reusable_prefix(len(a) + 1, 8, len(c), slot=0) == 8
    slots.copy_prefix(0, 0, 8)
    assert _nmse(slots.prefill(0, c[8:], 8), single.run(c, 0, all_logits=True)[-1]) < 1e-9


def test_chat_reuses_a_state_checkpoint_and_answers_like_a_fresh_prompt(recurrent):
    """`alchemist chat`'s session on the slot engine: the second turn restarts from the states of the last chunk
    boundary of the first and answers as a cold slot does."""
    import io

    from alchemist.chat import ChatSession
    from alchemist.runtime.engine import Engine
    from alchemist.runtime.slot_engine import SlotEngine
    from alchemist.serve.scheduler import Request, Scheduler
    from alchemist.tokenizer import load_tokenizer

    _, path, model = recurrent
    tok = load_tokenizer(path)
    weights = model.weights_for("c")

    def engine():
        return SlotEngine(Engine(model.module, weights, "c", 128), n_slots=1, chunk=8, decode_buckets=(1,))

    session = ChatSession(Scheduler(engine(), tok), tok, max_tokens=10, out=io.StringIO())
    session.ask("the cat sat on the mat and looked at the dog")
    a2, d2 = session.ask("and then")
    assert d2.usage["cached_tokens"] >= 8 and d2.usage["cached_tokens"] % 8 == 0
    prompt = session._prompt(session.messages[:-1])
    assert Scheduler(engine(), tok).generate(Request(prompt, max_tokens=10)).text == a2
