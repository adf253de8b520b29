"""The public API: `load_llm(path, backend=...)` and `inference(model, input=..., max_tokens=...)`."""

from __future__ import annotations

import functools
import gc
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from alchemist.version import __version__
from alchemist.arch import build_model_ir
from alchemist.codegen import module_slug, render_module
from alchemist.errors import AlchemistError
from alchemist.reading import read_model
from alchemist.ir import ModelIR
from alchemist.paths import cache_subdir
from alchemist.runtime.backends import blas_info, check_weights, mlx_packed, require_backend
from alchemist.runtime.numerics import DEFAULT as DEFAULT_NUMERICS
from alchemist.runtime.numerics import check_numerics
from alchemist.runtime.sampling import Sampler, SamplingParams
from alchemist.serve.text import TextStream


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def generated_cache_dir() -> Path:
    return cache_subdir("generated")


def write_generated(ir: ModelIR, out_dir: str | Path) -> Path:
    """Render the module for `ir` into out_dir/<slug>.py, rewriting it only if its content changed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = render_module(ir)
    target = out_dir / f"{module_slug(ir.source_file)}.py"
    if not target.exists() or target.read_text() != source:
        tmp = target.with_suffix(f".{os.getpid()}.tmp")  # per process: two may render the same module at once
        tmp.write_text(source)
        os.replace(tmp, target)
    return target


@dataclass
class LoadedModel:
    path: str
    backend: str
    ir: ModelIR
    module_path: Path
    module: object  # the generated module (its EXACT primitives: what alchemist.symbolic differentiates)
    engine: object  # runs module.forward with the primitives of `numerics` (engine.ops)
    tokenizer: object | None
    load_seconds: float
    weights_seconds: float
    compile_seconds: float
    peak_rss_mb: float
    weights: str = "quantized"  # how the quantized tensors are held: "quantized" (GGUF blocks) or "float32"
    numerics: str = DEFAULT_NUMERICS  # what the engine computes with (alchemist.runtime.numerics)
    _scheduler: object | None = field(default=None, repr=False, compare=False)

    @property
    def context(self) -> int:
        return self.engine.capacity

    # -- continuous batching (alchemist.serve) -----------------------------------------------------
    def start_batching(
        self,
        slots: int = 8,
        chunk: int = 32,
        max_queue: int = 64,
        decode_buckets=(1, 2, 4, 8),
        full_window: bool = False,
        warm_up: bool = True,
        progress: Callable[[str], None] | None = None,
    ):
        """Start a continuous-batching Scheduler on this model: from now on `inference(model, ...)` calls from
        any number of threads join one running batch of `slots` sequences. Returns the Scheduler."""
        from alchemist.runtime.slot_engine import SlotEngine
        from alchemist.serve.scheduler import Scheduler

        if self._scheduler is not None:
            raise AlchemistError("this model is already batching; call stop_batching() first")
        slot_engine = SlotEngine(
            self.engine, slots, chunk=chunk, decode_buckets=decode_buckets, full_window=full_window
        )
        scheduler = Scheduler(slot_engine, self.tokenizer, max_queue=max_queue)
        scheduler.start(warm_up=warm_up, progress=progress)
        scheduler.wait_ready()
        self._scheduler = scheduler
        return scheduler

    def stop_batching(self, drain_s: float = 10.0) -> None:
        """Stop the batching Scheduler (finishing running requests within drain_s); inference runs alone again."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.stop(drain_s)

    @property
    def batching(self) -> bool:
        return self._scheduler is not None

    # -- the model as PyTensor expressions (alchemist.symbolic) ------------------------------------
    def symbolic_logits(self, ids, embeddings=None):
        """Logits (T, n_vocab) of `ids` at positions 0..T-1 as a PyTensor expression over the model's weights."""
        from alchemist.symbolic import symbolic_logits

        return symbolic_logits(self, ids, embeddings)

    def log_prob(self, text_or_ids, given=None, embeddings=None):
        """log p(text_or_ids | given) as a scalar PyTensor expression (see alchemist.symbolic)."""
        from alchemist.symbolic import log_prob

        return log_prob(self, text_or_ids, given, embeddings)

    def token_log_probs(self, text_or_ids, given=None, embeddings=None):
        """Per-token log-probabilities of text_or_ids (given a prefix) as a PyTensor vector expression."""
        from alchemist.symbolic import token_log_probs

        return token_log_probs(self, text_or_ids, given, embeddings)

    @property
    def mode(self):
        """The PyTensor compilation mode of this model's backend (for compiling symbolic expressions)."""
        return self.engine.mode


@dataclass
class InferenceResult:
    output: str | None
    output_token_ids: list[int]
    prompt_token_ids: list[int]
    stop_reason: str
    report: dict = field(default_factory=dict)


def _load_tokenizer(path: str, facts=None):
    try:
        from alchemist.tokenizer import load_tokenizer
    except ImportError:
        return None
    return load_tokenizer(path, facts)


def _gc_paused(fn):
    """Run `fn` with Python's cyclic garbage collector paused (restored after, as it was).

    Loading builds hundreds of thousands of long-lived objects (the tokenizer's vocabulary, the step graph and
    its thunks) and almost no garbage, so every collection during it is wasted work: about 0.1 s of a new
    process's time to its first token."""

    @functools.wraps(fn)
    def paused(*args, **kwargs):
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused


def check_devices(devices: int, backend: str) -> None:
    if not isinstance(devices, int) or devices < 1:
        raise AlchemistError(f"devices must be a whole number >= 1, got {devices!r}")
    if devices > 1 and backend != "jax":
        raise AlchemistError(f"devices={devices}: a model across devices runs on backend='jax', not {backend!r}")


@_gc_paused
def load_llm(
    path: str | os.PathLike,
    backend: str = "c",
    context: int = 1024,
    generated_dir: str | os.PathLike | None = None,
    progress: bool = True,
    compile_now: bool = True,
    weights: str | None = None,
    numerics: str = DEFAULT_NUMERICS,
    devices: int = 1,
    split: str | None = None,
) -> LoadedModel:
    """Generate (or reuse) the PyTensor module for a GGUF file (or a reference model's name), load its weights
    and compile decoding.

    weights: "quantized" keeps quantized tensors in their GGUF blocks (on C and Numba, read-only views of the
    file's memory map: no copy); "float32" dequantizes them once at load. None: the backend's default
    (alchemist.runtime.backends.default_weights: quantized on C and Numba, and on JAX with numerics="ggml",
    whose custom calls are the C kernels; float32 on MLX and exact JAX, where the quantized graph dequantizes
    every weight on every step: less steady memory, much slower decoding).
    numerics: "ggml" (default) computes as llama.cpp's CPU backend does (activations rounded to each weight's
    vec_dot_type, ggml's GELU table), "exact" multiplies exact activations (alchemist.runtime.numerics); the
    model's `module` stays the generated module (what alchemist.symbolic differentiates), `engine.module` is
    the one the engine computes with.
    devices: on JAX, the model split over this many devices (tensor parallel: alchemist.runtime.sharding), each
    holding its part of the weights and KV cache; with several processes, call sharding.init_distributed first.
    split: how the projections back to the embedding divide, "rows" or "megatron" (sharding.layout); None: by
    numerics (sharding.default_policy: "rows" for ggml, whose logits then stay one device's bit for bit)."""
    from alchemist.audit import require_passing_audit
    from alchemist.runtime.engine import Engine, import_generated

    from alchemist.models import resolve_model

    require_backend(backend)
    check_numerics(numerics)
    check_weights(weights, backend, numerics)
    check_devices(devices, backend)
    t0 = time.perf_counter()
    path = resolve_model(path)  # a file, a snapshot directory, or a reference model's name ("gemma-3-270m")
    facts = read_model(path)
    ir = build_model_ir(facts)
    weights_format = check_weights(weights, backend, numerics, mlx_packed(ir))
    module_path = write_generated(ir, generated_dir or generated_cache_dir())
    require_passing_audit(module_path, ir)  # an AuditError naming the failed checks instead of importing it
    module = import_generated(module_path)
    total = sum(t.nbytes for t in ir.tensors)
    t_w = time.perf_counter()
    quantized = weights_format == "quantized"
    load, placement = module.load_weights, None
    if devices > 1:
        from alchemist.runtime import sharding

        placement = sharding.Placement.of(ir, devices, split or sharding.default_policy(numerics))
        if not getattr(facts, "source_files", ()):  # a GGUF file: each device's part read on its own
            load = functools.partial(sharding.load_sharded, module, lay=placement.layout, mesh=placement.mesh)
    if progress:
        from tqdm.auto import tqdm  # imported only to show the bar (tqdm.auto takes ~0.1 s to import)

        with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", leave=False) as bar:
            tensors = load(path, progress=lambda name, nbytes: bar.update(nbytes), quantized=quantized)
    else:
        tensors = load(path, quantized=quantized)
    weights_seconds = time.perf_counter() - t_w
    capacity = max(1, min(int(context), ir.n_ctx_train))
    engine = Engine(module, tensors, backend, capacity, numerics=numerics, placement=placement)
    del tensors
    if progress:  # a bar while a step function compiles: rewriting, then C modules linked / total
        from alchemist.pytensor_ext.compile_progress import TqdmProgress

        engine.compile_progress = TqdmProgress()
    if getattr(facts, "source_files", ()):  # a snapshot: its tokenizer.json (none: the model takes token ids)
        from alchemist.snapshot.tokenizer import load_snapshot_tokenizer

        tokenizer = load_snapshot_tokenizer(path)
    else:
        tokenizer = _load_tokenizer(path, facts)
    if compile_now:
        engine.step_function(1)
    load_seconds = time.perf_counter() - t0
    return LoadedModel(
        path=path,
        backend=backend,
        ir=ir,
        module_path=module_path,
        module=module,
        engine=engine,
        tokenizer=tokenizer,
        load_seconds=load_seconds,
        weights_seconds=weights_seconds,
        compile_seconds=engine.stats.compile_seconds,
        peak_rss_mb=peak_rss_mb(),
        weights=weights_format,
        numerics=numerics,
    )


def precompile(model: LoadedModel, input=None, chat: bool | None = None, add_special_tokens: bool = True) -> float:
    """Compile (or link from the graph cache) the step functions inference(model, input) will run: the prompt's
    prefill buckets and decode, pipelined (see Engine.precompile), so that a cold start rewrites one graph while
    the other's C modules build. Without `input`, decode only. The time is added to model.load_seconds and
    model.compile_seconds (as load_llm's own decode compile is); returns it."""
    engine = model.engine
    keys = []
    if input is not None:
        prompt, _ = _prompt_ids(model, input, chat, add_special_tokens)
        pos, left = 0, min(len(prompt), engine.capacity)
        while left > 0 and len(prompt) > 1:  # the chunks engine.run cuts a prompt into (one token: decode)
            b = engine.bucket(left, pos)
            keys.append((b, False))
            pos, left = pos + min(b, left), left - min(b, left)
    keys.append((1, False))
    t0 = time.perf_counter()
    engine.precompile(keys)
    seconds = time.perf_counter() - t0
    model.load_seconds += seconds
    model.compile_seconds = engine.stats.compile_seconds
    return seconds


def _prompt_ids(model: LoadedModel, input, chat: bool | None, add_special_tokens: bool) -> tuple[list[int], dict]:
    info: dict = {}
    if isinstance(input, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in input):
        ids = [int(t) for t in input]
        bad = [t for t in ids if not 0 <= t < model.ir.n_vocab]
        if bad:
            raise AlchemistError(f"token ids out of range [0, {model.ir.n_vocab}): {bad[:5]}")
        return ids, info
    tok = model.tokenizer
    if tok is None:
        raise AlchemistError("text input needs the tokenizer (alchemist.tokenizer); pass token ids instead")
    if isinstance(input, (list, tuple)):  # chat messages
        chat = True if chat is None else chat
        messages = list(input)
    else:
        if not isinstance(input, str):
            raise AlchemistError(
                f"input must be a string, a list of chat messages or token ids, not {type(input).__name__}"
            )
        messages = [{"role": "user", "content": input}]
    if chat:
        if not tok.has_chat_template:
            info["chat_template"] = "none in this GGUF: messages joined as plain text"
        text = tok.apply_chat_template(messages, add_generation_prompt=True)
        info["rendered_prompt"] = str(text)
        if getattr(text, "used_template", True) is False:
            info["chat_template"] = getattr(text, "note", "") or info.get("chat_template", "")
        return tok.encode_chat(messages, add_generation_prompt=True), info
    if isinstance(input, (list, tuple)):
        text = "".join(str(m.get("content", "")) for m in messages)
    else:
        text = input
    return tok.encode(text, add_special_tokens=add_special_tokens), info


def inference(
    model: LoadedModel,
    input,
    max_tokens: int = 32,
    chat: bool | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    stop: list[str] | None = None,
    stream: Callable[[str], None] | None = None,
    add_special_tokens: bool = True,
    validate: bool = False,
) -> InferenceResult:
    """Generate up to max_tokens after `input` (text, chat messages, or token ids).

    Returns the text, token ids and a report with timings, memory and compile counts. `stream` is
    called with each newly decoded piece of text (never half a UTF-8 character, never the start of a stop string
    that may still complete); the pieces join to the result's `output`.
    """
    if max_tokens < 0:
        raise AlchemistError(f"max_tokens must be >= 0, got {max_tokens}")
    engine = model.engine
    sampler = Sampler(SamplingParams(temperature, top_k, top_p, repetition_penalty, seed))
    prompt, info = _prompt_ids(model, input, chat, add_special_tokens)
    if not prompt:
        raise AlchemistError("the prompt is empty after tokenization")
    if model._scheduler is not None:  # join the running batch (start_batching)
        return _inference_batched(model, prompt, info, max_tokens, sampler.params, stop, stream, validate)
    # the KV cache is one shared buffer: a concurrent call waits for this one (its prefill and every decode step)
    # instead of overwriting its positions
    with engine.lock:
        return _inference_one(model, prompt, info, max_tokens, sampler, stop, stream, validate)


def _report_head(model, prompt, out_ids, stop_reason) -> dict:
    """The report fields an inference call has whether it ran alone or joined a batch."""
    return {
        "backend": model.backend,
        "numerics": model.numerics,
        "weights": model.weights,
        "blas": blas_info() if model.backend == "c" else None,
        "alchemist": __version__,
        "model": model.ir.model_name,
        "architecture": model.ir.architecture,
        "prompt_tokens": len(prompt),
        "generated_tokens": len(out_ids),
        "stop_reason": stop_reason,
    }


def _inference_one(model, prompt, info, max_tokens, sampler, stop, stream, validate) -> InferenceResult:
    engine = model.engine
    if len(prompt) + max_tokens > engine.capacity:
        raise AlchemistError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context of {engine.capacity}; "
            f"load the model with a larger context="
        )
    tok = model.tokenizer
    eos = set(getattr(tok, "eos_ids", ()) or ()) if tok is not None else set()
    compiles_before = engine.stats.compile_count
    compile_s_before = engine.stats.compile_seconds

    t0 = time.perf_counter()
    logits = engine.run(prompt, 0)
    t_first_token = time.perf_counter() - t0
    # a prefill bucket seen for the first time is compiled (or linked from the graph cache) inside run():
    # reported on its own so that the rate measures the computation
    prefill_compile_s = engine.stats.compile_seconds - compile_s_before
    t_prefill = t_first_token - prefill_compile_s
    compiles_after_prefill = engine.stats.compile_count

    out_ids: list[int] = []
    stop_reason = "max_tokens"
    text = TextStream(tok, stop or ()) if tok is not None else None
    pos = len(prompt)
    t1 = time.perf_counter()
    for _ in range(max_tokens):
        nxt = sampler(logits, prompt + out_ids)
        if nxt in eos:
            stop_reason = "eos"
            break
        out_ids.append(nxt)
        if text is not None:
            delta, finish = text.feed(nxt)
            if stream is not None and delta:
                stream(delta)
            if finish is not None:
                stop_reason = "stop_string"
                break
        if len(out_ids) == max_tokens:
            break
        logits = engine.run([nxt], pos)
        pos += 1
    if text is not None:
        tail = text.flush()  # held back: an incomplete character, or a stop string's start that never completed
        if stream is not None and tail:
            stream(tail)
    t_decode = time.perf_counter() - t1
    n_decoded = max(len(out_ids) - 1, 0)  # the first new token comes from the prefill logits

    report = {
        **_report_head(model, prompt, out_ids, stop_reason),
        "timings": {
            "load_s": round(model.load_seconds, 3),
            "weights_s": round(model.weights_seconds, 3),
            "prefill_s": round(t_prefill, 4),
            "prefill_compile_s": round(prefill_compile_s, 3),
            "first_token_s": round(t_first_token, 4),
            "prefill_tok_per_s": round(len(prompt) / t_prefill, 2) if t_prefill > 0 else None,
            "decode_s": round(t_decode, 4),
            "decode_tok_per_s": round(n_decoded / t_decode, 2) if n_decoded and t_decode > 0 else None,
            "compile_s_this_call": round(engine.stats.compile_seconds - compile_s_before, 3),
            "compile_s_total": round(engine.stats.compile_seconds, 3),
        },
        "memory": {"peak_rss_mb": round(peak_rss_mb(), 1)},
        "compilations": {
            "total": engine.stats.compile_count,
            "this_call": engine.stats.compile_count - compiles_before,
            "during_decode": engine.stats.compile_count - compiles_after_prefill,
            "shapes": [list(s) for s in engine.stats.compiled_shapes],
        },
        **info,
    }
    result = InferenceResult(text.text if text is not None else None, out_ids, prompt, stop_reason, report)
    if validate:
        from alchemist.harness import validate_generation

        report["validation"] = validate_generation(model, prompt, out_ids)
    return result


def _inference_batched(model, prompt, info, max_tokens, params, stop, stream, validate) -> InferenceResult:
    """inference() through the model's running Scheduler: same result and report fields as the solo path."""
    from alchemist.serve.scheduler import DoneEvent, Request

    scheduler = model._scheduler
    slot_engine = scheduler.engine
    stats = slot_engine.stats
    compiles_before, compile_s_before = stats.compile_count, stats.compile_seconds
    req = Request(prompt, params, max_tokens, list(stop or []))
    out_ids, parts, done = [], [], None
    for ev in scheduler.stream(req):
        text = ev.text
        if isinstance(ev, DoneEvent):
            done = ev
        else:
            out_ids.append(ev.token_id)
        if text:
            parts.append(text)
            if stream is not None:
                stream(text)
    if done.finish_reason == "error":
        raise AlchemistError(f"batched inference failed: {done.error}")
    if done.finish_reason == "stop":
        stop_reason = "eos" if isinstance(done.matched_stop, int) else "stop_string"
    else:
        stop_reason = {"length": "max_tokens"}.get(done.finish_reason, done.finish_reason)
    t_first = req.t_first - req.t_submit if req.t_first is not None else None
    t_decode = req.t_done - req.t_first if req.t_first is not None else 0.0
    n_decoded = max(len(out_ids) - 1, 0)
    report = {
        **_report_head(model, prompt, out_ids, stop_reason),
        "batched": {
            "slots": slot_engine.n_slots,
            "chunk": slot_engine.chunk,
            "cached_tokens": done.usage.get("cached_tokens", 0),
            "queue_s": round(done.timings.get("queue_s", 0.0), 4),
        },
        "timings": {
            "load_s": round(model.load_seconds, 3),
            "weights_s": round(model.weights_seconds, 3),
            "prefill_s": None,  # shared steps: only the time to the first token is the request's own
            "prefill_compile_s": 0.0,
            "first_token_s": round(t_first, 4) if t_first is not None else None,
            "prefill_tok_per_s": None,
            "decode_s": round(t_decode, 4),
            "decode_tok_per_s": round(n_decoded / t_decode, 2) if n_decoded and t_decode > 0 else None,
            "compile_s_this_call": round(stats.compile_seconds - compile_s_before, 3),
            "compile_s_total": round(stats.compile_seconds, 3),
        },
        "memory": {"peak_rss_mb": round(peak_rss_mb(), 1)},
        "compilations": {
            "total": stats.compile_count,
            "this_call": stats.compile_count - compiles_before,
            "during_decode": stats.compile_count - compiles_before,
            "shapes": [list(s) for s in stats.compiled_shapes],
        },
        **info,
    }
    text = "".join(parts) if model.tokenizer is not None else None
    result = InferenceResult(text, out_ids, prompt, stop_reason, report)
    if validate:
        from alchemist.harness import validate_generation

        report["validation"] = validate_generation(model, prompt, out_ids)
    return result


__all__ = ["InferenceResult", "LoadedModel", "inference", "load_llm", "precompile", "write_generated", "asdict"]
