"""llama.cpp as an independent oracle: logits, greedy decoding and named intermediate tensors.

`LlamaCppOracle` drives llama.cpp through llama-cpp-python's low-level ctypes API (not the `Llama`
class), so that every knob that affects exactness is pinned:

- F32 K and V cache (`type_k = type_v = GGML_TYPE_F32`), flash attention disabled, CPU only;
- every position requested as an output, so llama.cpp computes all rows of the last layer too
  (its `inp_out_ids` get_rows is then the identity);
- the KV cache is cleared before every call (no state leaks between calls);
- no BOS or any other token is added: the caller passes exactly the ids to evaluate;
- `swa_full=True`, so sliding-window layers keep the whole history and differ only by their mask;
- `use_extra_bufts=False` in the model params: no AMX or repacked ("extra") CPU weight buffers. On
  this project's machines the AMX path faults (SIGSEGV in `ggml_backend_amx_mul_mat`, the OS does
  not grant AMX tile state), which also crashes `llama_cpp.Llama` on any quantized model; the plain
  CPU kernels are also the more reference-like choice. Results are bit-identical across n_threads.

Intermediate tensors come from the scheduler's graph-evaluation callback (`cb_eval` in
`llama_context_params`, type `ggml_backend_sched_eval_callback`). llama.cpp names graph nodes with
`cb(cur, "name", il)`, which becomes `"name-<il>"` for layer tensors and `"name"` otherwise (see
`src/models/<arch>.cpp`). Arrays are returned in numpy order, i.e. GGUF/ggml `ne` reversed:

    attn_norm-0, ffn_inp-0, ffn_out-0, l_out-0, kqv_out-0 ... ne=(n_embd, n_tokens)        -> (n_tokens, n_embd)
    Qcur-0 / Kcur-0 / Vcur-0                      ne=(head_dim, n_head, n_tokens)           -> (n_tokens, n_head, head_dim)
    kq-0 / kq_soft_max-0                          ne=(n_kv, n_tokens, n_head)               -> (n_head, n_tokens, n_kv)
    result_norm                                   ne=(n_embd, n_tokens)                     -> (n_tokens, n_embd)
    result_output                                 ne=(n_vocab, n_tokens)                    -> (n_tokens, n_vocab)

`n_kv` in `kq*` is the KV-cache view length (padded to a multiple of 256), not n_tokens: columns
past the sequence are unused cache cells (`kq` holds whatever the cache held times Q, `kq_soft_max` is
0 there after the causal mask). Slice `[..., :n_tokens]` to compare.

Where llama.cpp gives several nodes the same name (e.g. `Qcur-0` after the matmul, after the bias,
after the reshape and after RoPE), the last one evaluated wins: that is the value the model file
names, e.g. `Qcur-0` is post-RoPE and `Qcur_normed-0` (qwen3/gemma3) is the pre-RoPE QK-normed
value. `last_capture_log` lists every capture (name, op, ne) in evaluation order.
Float tensors are returned as float32 (F16 converted), I32 nodes as int32. Graph inputs (`inp_pos`,
the mask) and weights are leaves, not nodes: the callback never sees them.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from alchemist.harness import _llama
from alchemist.harness._llama import OracleError

# Minimum numpy rank per base name, so single-token captures keep their token axis.
_RANK_HINTS = {
    "Qcur": 3,
    "Kcur": 3,
    "Vcur": 3,
    "Qcur_normed": 3,
    "Kcur_normed": 3,
    "kq": 3,
    "kq_soft_max": 3,
    "kqv": 3,
    "kqv_merged": 3,
}
# graph nodes whose names are ggml's automatic decorations, not llama.cpp's `cb` names
_AUTO_NAME = re.compile(r"( \(|^node_|^leaf_|^$)")
# build_norm's internal "norm" / "norm-<il>" nodes share one name per layer (attention and FFN
# norms alike), so what they hold is ambiguous: not captured unless asked for by name
_AMBIGUOUS = {"norm"}
def _base_name(name: str) -> str:
    m = re.match(r"^(.*)-(\d+)$", name)
    return m.group(1) if m else name


class LlamaCppOracle:
    """A GGUF file loaded in llama.cpp (CPU, F32 KV cache, no flash attention) for reference outputs.

    `LlamaCppOracle(path, n_ctx=512, n_threads=None, n_batch=None)`; `n_threads` defaults to
    `os.cpu_count()`, `n_batch` (also the ubatch size, i.e. the most tokens evaluated in one graph)
    to `n_ctx`. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        n_ctx: int = 512,
        n_threads: int | None = None,
        n_batch: int | None = None,
    ) -> None:
        _llama.init()
        llc = _llama.llc
        self.path = str(path)
        if not Path(self.path).is_file():
            raise OracleError(f"{self.path}: no such GGUF file")
        self.n_ctx = int(n_ctx)
        self.n_threads = int(n_threads or os.cpu_count() or 1)
        self.n_batch = int(n_batch or self.n_ctx)
        self._model = None
        self._ctx = None
        self._ictx = None  # instrumented context (cb_eval set), created on first intermediates()
        self.last_capture_log: list[tuple[str, str, tuple[int, ...]]] = []

        mparams = llc.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = False  # no AMX / repacked CPU buffers (AMX faults where the OS denies it)
        _llama.clear_log()
        model = llc.llama_model_load_from_file(self.path.encode(), mparams)
        if not model:
            raise OracleError(f"{self.path}: llama.cpp could not load the model: {_llama.recent_log()}")
        self._model = model
        self._vocab = llc.llama_model_get_vocab(model)
        self.vocab_size = int(llc.llama_vocab_n_tokens(self._vocab))
        self.n_layer = int(llc.llama_model_n_layer(model))
        self.n_embd = int(llc.llama_model_n_embd(model))
        self.arch = self._meta("general.architecture")
        self._ctx = self._new_context()

    # ---------------------------------------------------------------- lifecycle

    def _context_params(self):
        llc = _llama.llc
        p = llc.llama_context_default_params()
        p.n_ctx = self.n_ctx
        p.n_batch = self.n_batch
        p.n_ubatch = self.n_batch
        p.n_seq_max = 1
        p.n_threads = self.n_threads
        p.n_threads_batch = self.n_threads
        p.type_k = llc.GGML_TYPE_F32
        p.type_v = llc.GGML_TYPE_F32
        p.flash_attn_type = llc.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.offload_kqv = False
        p.op_offload = False
        p.swa_full = True
        p.no_perf = True
        p.embeddings = False
        return p

    def _new_context(self, cb=None):
        llc = _llama.llc
        p = self._context_params()
        if cb is not None:
            p.cb_eval = cb
            p.cb_eval_user_data = ctypes.c_void_p(0)
        _llama.clear_log()
        ctx = llc.llama_init_from_model(self._model, p)
        if not ctx:
            raise OracleError(f"{self.path}: llama.cpp could not create a context: {_llama.recent_log()}")
        return ctx

    def close(self) -> None:
        llc = _llama.llc
        for attr in ("_ictx", "_ctx"):
            ctx = getattr(self, attr, None)
            if ctx:
                llc.llama_free(ctx)
            setattr(self, attr, None)
        if getattr(self, "_model", None):
            llc.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "LlamaCppOracle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _check_open(self) -> None:
        if not self._model:
            raise OracleError(f"{self.path}: oracle is closed")

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = _llama.llc.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def shared_intermediates(self, token_ids: Sequence[int], names: Iterable[str]) -> tuple[list[str], dict]:
        """(order, tensors): llama.cpp's tensors among `names` (alchemist's taps use its `cb` names), in the
        order its graph evaluated them; a name this family's graph does not have is left out."""
        captured = self.intermediates(token_ids, list(names), missing_ok=True)
        return [n for n in self.capture_order() if n in captured], captured

    def capture_order(self) -> list[str]:
        """Names of the last `intermediates` call, ordered by their final (kept) capture."""
        last = {name: i for i, (name, _, _) in enumerate(self.last_capture_log)}
        return sorted(last, key=last.__getitem__)

    # ---------------------------------------------------------------- tokens

    def tokenize(self, text: str, add_special: bool = True, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer: `add_special` adds BOS/EOS as the GGUF says, `special` parses `<|...|>`."""
        self._check_open()
        llc = _llama.llc
        data = text.encode("utf-8")
        cap = len(data) + 16
        while True:
            buf = (llc.llama_token * cap)()
            n = llc.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, special)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def detokenize(self, token_ids: Sequence[int], special: bool = True) -> str:
        self._check_open()
        llc = _llama.llc
        ids = (llc.llama_token * max(len(token_ids), 1))(*[int(t) for t in token_ids])
        cap = 16 * len(token_ids) + 16
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = llc.llama_detokenize(self._vocab, ids, len(token_ids), buf, cap, False, special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", "replace")
            cap = -n

    @property
    def bos_id(self) -> int:
        return int(_llama.llc.llama_vocab_bos(self._vocab))

    @property
    def eos_id(self) -> int:
        return int(_llama.llc.llama_vocab_eos(self._vocab))

    def is_eog(self, token_id: int) -> bool:
        return bool(_llama.llc.llama_vocab_is_eog(self._vocab, int(token_id)))

    # ---------------------------------------------------------------- evaluation

    def _validate(self, token_ids: Sequence[int]) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise OracleError("no tokens to evaluate")
        if len(ids) > self.n_ctx:
            raise OracleError(f"{len(ids)} tokens exceed the oracle's n_ctx={self.n_ctx}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise OracleError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        return ids

    def _decode(self, ctx, ids: Sequence[int], pos0: int, want_logits: bool = True) -> np.ndarray | None:
        """Decode `ids` at positions pos0.. into `ctx`'s cache, in chunks of n_batch; logits of every row."""
        llc = _llama.llc
        rows = []
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            n = len(chunk)
            batch = llc.llama_batch_init(n, 0, 1)
            try:
                for i, tok in enumerate(chunk):
                    batch.token[i] = tok
                    batch.pos[i] = pos0 + start + i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1 if want_logits else 0
                batch.n_tokens = n
                rc = llc.llama_decode(ctx, batch)
                if rc != 0:
                    raise OracleError(f"llama_decode returned {rc}: {_llama.recent_log()}")
                if want_logits:
                    ptr = llc.llama_get_logits(ctx)
                    arr = np.ctypeslib.as_array(ptr, shape=(n * self.vocab_size,))
                    rows.append(arr.reshape(n, self.vocab_size).astype(np.float32, copy=True))
            finally:
                llc.llama_batch_free(batch)
        return np.concatenate(rows, axis=0) if want_logits else None

    def _reset(self, ctx) -> None:
        llc = _llama.llc
        llc.llama_memory_clear(llc.llama_get_memory(ctx), True)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 (n_tokens, n_vocab): row i is the logits after token_ids[:i+1], from a fresh cache."""
        self._check_open()
        ids = self._validate(token_ids)
        self._reset(self._ctx)
        return self._decode(self._ctx, ids, 0)

    def decode_steps(self, prefix_ids: Sequence[int], continuation_ids: Sequence[int]) -> np.ndarray:
        """float32 (len(continuation), n_vocab): `prefix_ids` decoded in one batch, then each continuation token
        decoded alone (as generation does); row i is the logits after continuation_ids[i]."""
        self._check_open()
        prefix, cont = self._validate(prefix_ids), self._validate(continuation_ids)
        if len(prefix) + len(cont) > self.n_ctx:
            raise OracleError(f"{len(prefix)}+{len(cont)} tokens exceed the oracle's n_ctx={self.n_ctx}")
        self._reset(self._ctx)
        self._decode(self._ctx, prefix, 0, want_logits=False)
        return np.stack([self._decode(self._ctx, [tok], len(prefix) + i)[0] for i, tok in enumerate(cont)])

    def greedy(self, token_ids: Sequence[int], n_new: int, stop_at_eog: bool = False) -> list[int]:
        """Greedy (argmax, lowest id on exact ties) continuation of `token_ids`, one token per decode."""
        self._check_open()
        ids = self._validate(token_ids)
        if len(ids) + n_new > self.n_ctx:
            raise OracleError(f"{len(ids)}+{n_new} tokens exceed the oracle's n_ctx={self.n_ctx}")
        self._reset(self._ctx)
        row = self._decode(self._ctx, ids, 0)[-1]
        out: list[int] = []
        pos = len(ids)
        for _ in range(n_new):
            tok = int(np.argmax(row))
            out.append(tok)
            if stop_at_eog and self.is_eog(tok):
                break
            if len(out) == n_new:
                break
            row = self._decode(self._ctx, [tok], pos)[-1]
            pos += 1
        return out

    def rescore(self, prefix_ids: Sequence[int], continuation_ids: Sequence[int]) -> np.ndarray:
        """(len(continuation), n_vocab): the oracle's logits for each continuation step given the
        prefix and the continuation so far (teacher forcing), i.e. row k predicts continuation[k]
        from prefix + continuation[:k]. These are the oracle's "fresh-prefix decisions" on our path."""
        prefix = [int(t) for t in prefix_ids]
        cont = [int(t) for t in continuation_ids]
        if not prefix:
            raise OracleError("rescore needs a non-empty prefix")
        if not cont:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        full = self.logits(prefix + cont[:-1])
        return full[len(prefix) - 1 :]

    # ---------------------------------------------------------------- intermediates

    def intermediates(
        self,
        token_ids: Sequence[int],
        names: Iterable[str] | None = None,
        missing_ok: bool = False,
        prefix: Sequence[int] = (),
    ) -> dict[str, np.ndarray]:
        """llama.cpp's named graph tensors for one fresh evaluation of `token_ids` (all in one ubatch); after
        `prefix` (decoded first, uncaptured: token_ids then sit at positions len(prefix).., e.g. a decode step).

        `names`: exact names (`"l_out-0"`) or fnmatch patterns (`"l_out-*"`); None captures every
        node carrying a llama.cpp `cb` name. An exact name the graph does not evaluate raises, unless
        missing_ok. Returns numpy-order arrays (see module docstring).
        Logits of every position are requested, so last-layer tensors have all n_tokens rows.
        """
        self._check_open()
        ids = self._validate(token_ids)
        prefix = self._validate(prefix) if len(prefix) else []
        if len(ids) > self.n_batch:
            raise OracleError(f"intermediates needs one ubatch: {len(ids)} tokens > n_batch={self.n_batch}")
        if len(prefix) + len(ids) > self.n_ctx:
            raise OracleError(f"{len(prefix)}+{len(ids)} tokens exceed the oracle's n_ctx={self.n_ctx}")
        exact: set[str] = set()
        patterns: list[str] = []
        if names is not None:
            for n in names:
                if any(c in n for c in "*?["):
                    patterns.append(n)
                else:
                    exact.add(n)

        def wanted(name: str) -> bool:
            if names is None:
                return not _AUTO_NAME.search(name) and _base_name(name) not in _AMBIGUOUS
            return name in exact or any(fnmatch.fnmatchcase(name, p) for p in patterns)

        captured: dict[str, np.ndarray] = {}
        log: list[tuple[str, str, tuple[int, ...]]] = []
        errors: list[str] = []
        state = {"active": False}

        def callback(t, ask, _user_data):
            try:
                if not state["active"]:
                    return False if ask else True
                name = _llama.tensor_name(t)
                if ask:
                    return wanted(name)
                arr, info = _llama.tensor_to_numpy(t, _RANK_HINTS.get(_base_name(name), 2))
                captured[name] = arr
                log.append((name, info["op"], info["ne"]))
            except Exception as exc:  # an exception must not cross into C; ask=False False would abort
                errors.append(f"{type(exc).__name__}: {exc}")
                return False if ask else True
            return True

        if self._ictx is None:
            # one C function pointer per context, forwarding to the current call's closure
            # (the holder, not self, is captured: no reference cycle keeps the oracle alive)
            holder: dict = {"fn": None}

            def trampoline(t, ask, ud):
                fn = holder["fn"]
                return fn(t, ask, ud) if fn is not None else (not ask)

            self._cb_holder = holder
            self._cb_trampoline = _llama.llc.ggml_backend_sched_eval_callback(trampoline)  # kept alive with ctx
            self._ictx = self._new_context(cb=self._cb_trampoline)
        self._cb_holder["fn"] = callback
        try:
            self._reset(self._ictx)
            if prefix:
                self._decode(self._ictx, prefix, 0, want_logits=False)
            state["active"] = True
            self._decode(self._ictx, ids, len(prefix))
        finally:
            state["active"] = False
            self._cb_holder["fn"] = None
        if errors:
            raise OracleError(f"graph callback failed: {errors[0]}")
        self.last_capture_log = log
        if names is not None and not missing_ok:
            missing = sorted(n for n in exact if n not in captured)
            if missing:
                raise OracleError(
                    f"llama.cpp evaluated no tensor named {', '.join(missing)} "
                    f"(captured: {', '.join(list(captured)[:40])})"
                )
        return captured
