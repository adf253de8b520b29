"""The loaded model as PyTensor expressions: logits and log-probabilities to put into a user's own graph.

    lp = model.log_prob(" Paris", given="The capital of France is")   # a scalar PyTensor expression
    f = pytensor.function([], lp)                                      # any backend's mode

Every expression reads the model's weights as the engine's shared variables (nothing is copied), runs a fresh
sequence from position 0 (its own zero KV cache, not the engine's) and is built from the generated module's
`forward` as written (numerics "exact"), so it computes exactly what inference does with load_llm(...,
numerics="exact"). A model loaded with the default numerics "ggml" infers with llama.cpp's activation rounding
(alchemist.runtime.numerics), whose rounding steps have no useful gradient; its expressions stay exact.

What is differentiable:
- with respect to activations and the input embeddings, always: the quantized kernels' gradient with respect
  to their input is the product with the dequantized weight (`QuantizedMatmul.pullback`), so gradients work
  with the weights kept in their GGUF blocks;
- with respect to the weights only where they are float32 (F32/F16 tensors, or a model loaded on a backend
  that dequantizes); GGUF blocks (uint8) have no gradient, and asking for one raises PyTensor's
  NullTypeGradError naming the Op.
"""

from __future__ import annotations

import numpy as np
import pytensor.tensor as pt
from pytensor.graph.basic import Variable
from pytensor.graph.replace import graph_replace
from pytensor.graph.traversal import ancestors
from pytensor.tensor.shape import Reshape

from alchemist.errors import AlchemistError
from alchemist.kernels import QuantizedEmbedding
from alchemist.pytensor_ext.host import activating


def _token_vector(model, ids) -> Variable:
    """An int64 vector of static length: a symbolic vector as is, or a constant from ids."""
    if isinstance(ids, Variable):
        if ids.type.ndim != 1 or ids.type.shape[0] is None or "int" not in ids.type.dtype:
            raise AlchemistError(f"token ids must be an integer vector of static length, got {ids.type}")
        return pt.cast(ids, "int64") if ids.type.dtype != "int64" else ids
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise AlchemistError(f"token ids must be a non-empty list of integers, got {ids.tolist()!r:.80}")
    bad = ids[(ids < 0) | (ids >= model.ir.n_vocab)]
    if bad.size:
        raise AlchemistError(f"token ids out of range [0, {model.ir.n_vocab}): {bad[:5].tolist()}")
    return pt.constant(ids.astype(np.int64), name="tokens")


def _forward(model, tokens, output_rows=None):
    """forward() over a zero cache of exactly the tokens' length; returns the logits expression."""
    module = model.module
    n = tokens.type.shape[0]
    from alchemist.runtime.engine import cache_shape, layer_caches, state_kinds

    states = state_kinds(module)
    cache = [
        tuple(pt.zeros(cache_shape(kind, row, n, states), dtype="float32") for kind, row in layer)
        for layer in layer_caches(module)
    ]
    positions = pt.constant(np.arange(n, dtype=np.int64), name="positions")
    logits, _ = module.forward(model.engine.weights, tokens, positions, cache, attend_len=n, output_rows=output_rows)
    return logits


@activating
def input_embeddings(model, logits: Variable, tokens: Variable) -> Variable:
    """The variable in `logits`' graph holding the token-embedding rows of `tokens` (before any scale).

    It is the one node that indexes the token-embedding table by the tokens: a gather, or the quantized
    embedding kernel (the tied output projection reads the same table through a matmul, never by tokens).
    """
    table = model.engine.weights[model.ir.embedding.weight]

    def reads_tokens(var) -> bool:  # the tokens themselves, or forward()'s tokens.reshape((-1,)) of them
        owner = var.owner
        return var is tokens or (owner is not None and isinstance(owner.op, Reshape) and owner.inputs[0] is tokens)

    for var in ancestors([logits]):
        node = var.owner
        if node is None or table not in node.inputs or not any(reads_tokens(v) for v in node.inputs):
            continue
        if isinstance(node.op, QuantizedEmbedding) or node.inputs[0] is table:
            return node.outputs[0]
    raise AlchemistError("could not find the token-embedding lookup in the model's graph")


@activating
def embedding_rows(model, ids) -> np.ndarray:
    """The token-embedding rows of ids as the model reads them (dequantized exactly when in GGUF blocks)."""
    import pytensor

    tokens = _token_vector(model, ids)
    rows = input_embeddings(model, _forward(model, tokens), tokens)
    return np.asarray(pytensor.function([], rows, mode=model.mode)(), dtype=np.float32)


@activating
def symbolic_logits(model, ids, embeddings: Variable | None = None) -> Variable:
    """Logits (T, n_vocab) for the token ids at positions 0..T-1, as a PyTensor expression.

    ids: a list of token ids, or an int vector variable of static length.
    embeddings: optionally a float32 (T, n_embd) expression used in place of the token-embedding rows
    (e.g. a perturbed or free input for saliency); the rest of the input path (scale, positions) still applies.
    """
    tokens = _token_vector(model, ids)
    logits = _forward(model, tokens)
    if embeddings is not None:
        logits = replace_embeddings(model, logits, tokens, embeddings)
    return logits


@activating
def replace_embeddings(model, expr: Variable, tokens: Variable, embeddings: Variable) -> Variable:
    """`expr` with the token-embedding rows of `tokens` replaced by `embeddings` (T, n_embd)."""
    rows = input_embeddings(model, expr, tokens)
    embeddings = pt.as_tensor_variable(embeddings)
    if embeddings.type.ndim != 2 or embeddings.type.dtype != "float32":
        raise AlchemistError(f"embeddings must be a float32 matrix (T, {model.ir.n_embd}), got {embeddings.type}")
    return graph_replace(expr, {rows: pt.specify_shape(embeddings, rows.type.shape)}, strict=False)


def encode_scored(model, text_or_ids, given=None) -> tuple[list[int], int]:
    """The full token sequence and the index of its first scored token.

    Text is tokenized with the model's tokenizer: `given` (the condition) with the special tokens the model
    adds (BOS), the scored text without them, each separately. Without `given`, the text's own first token
    (its BOS when the model adds one) is the condition. Token ids are used as they are.
    """

    def encode(x, first: bool) -> list[int]:
        if isinstance(x, str):
            if model.tokenizer is None:
                raise AlchemistError("text needs the model's tokenizer; pass token ids instead")
            return model.tokenizer.encode(x, add_special_tokens=first)
        if isinstance(x, (list, tuple, np.ndarray)) and all(isinstance(t, (int, np.integer)) for t in x):
            return [int(t) for t in x]
        raise AlchemistError(f"expected text or a list of token ids, not {type(x).__name__}")

    if given is None:
        ids = encode(text_or_ids, True)
        if len(ids) < 2:
            raise AlchemistError(f"log_prob needs at least 2 tokens without `given` (got {len(ids)}): nothing to score")
        return ids, 1
    prefix = encode(given, True)
    rest = encode(text_or_ids, False)
    if not prefix or not rest:
        raise AlchemistError("log_prob: both `given` and the scored text must have at least one token")
    return prefix + rest, len(prefix)


@activating
def token_log_probs(model, text_or_ids, given=None, embeddings: Variable | None = None) -> Variable:
    """log p(token_t | tokens before t) for every scored token (see encode_scored): a float32 vector expression.

    Only the rows whose next token is scored are projected to the vocabulary. `embeddings`: as in
    symbolic_logits, for the whole sequence (`given` and text).
    """
    ids, first = encode_scored(model, text_or_ids, given)
    if len(ids) > model.ir.n_ctx_train:
        raise AlchemistError(f"{len(ids)} tokens exceed the model's trained context of {model.ir.n_ctx_train}")
    tokens = _token_vector(model, ids)
    rows = np.arange(first - 1, len(ids) - 1, dtype=np.int64)
    logits = _forward(model, tokens, output_rows=pt.constant(rows, name="scored_rows"))
    logp = pt.special.log_softmax(logits, axis=-1)
    targets = pt.constant(np.asarray(ids[first:], np.int64), name="targets")
    scored = logp[pt.arange(len(rows)), targets]
    if embeddings is not None:
        scored = replace_embeddings(model, scored, tokens, embeddings)
    return scored


@activating
def log_prob(model, text_or_ids, given=None, embeddings: Variable | None = None) -> Variable:
    """log p(text | given) = the sum of token_log_probs: a float32 scalar expression."""
    return token_log_probs(model, text_or_ids, given, embeddings).sum()


__all__ = [
    "embedding_rows",
    "encode_scored",
    "input_embeddings",
    "log_prob",
    "replace_embeddings",
    "symbolic_logits",
    "token_log_probs",
]
