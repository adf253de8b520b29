"""Is CausalAttentionGgml llama.cpp's attention on a model's decode steps? (T = 1 at positions > 0)

    python scripts/check_attention_decode.py gemma-3-270m "Hello, my name is" 8

At every step llama.cpp decodes the prompt and the greedy tokens so far in one batch, then the next token alone
(T = 1), capturing that step's Qcur, Kcur, Vcur and kqv_out of every layer (LlamaCppOracle.intermediates(...,
prefix=)) and, from the same one-batch evaluation of the prefix, the K and V rows its cache holds. Our Op attends
from llama.cpp's Qcur over those rows and each kqv_out is compared bit for bit; the generated float32 formula on
the same inputs is shown for contrast.
"""

from __future__ import annotations

import sys

import numpy as np

from alchemist.runtime.backends import configure_pytensor

configure_pytensor()

import pytensor  # noqa: E402
import pytensor.tensor as pt  # noqa: E402

from alchemist.harness import LlamaCppOracle  # noqa: E402
from alchemist.harness.validate import load_for_validation  # noqa: E402
from alchemist.kernels.attention import CausalAttentionGgml, attention_variant, causal_attention_formula  # noqa: E402
from alchemist.models import resolve_model  # noqa: E402
from alchemist.runtime.backends import get_mode  # noqa: E402


def main(model: str, prompt_text: str, n_steps: int) -> int:
    path = resolve_model(model)
    module = load_for_validation(path, numerics="exact").module
    variant = attention_variant(module)
    n_head, n_kv, dim, n_layer = module.N_HEAD, module.N_KV_HEAD, module.HEAD_DIM, module.N_LAYER
    names = ["Qcur-*", "Kcur-*", "Vcur-*", "kqv_out-*"]
    steps = []  # (llama.cpp's cache rows as its one-batch prefill of the prefix wrote them, the step's tensors)
    with LlamaCppOracle(path, n_ctx=512) as oracle:
        ids = oracle.tokenize(prompt_text)
        tokens = [int(np.argmax(oracle.logits(ids)[-1]))]
        for _ in range(n_steps):
            prefix = ids + tokens[:-1]
            cache = oracle.intermediates(prefix, ["Kcur-*", "Vcur-*"])
            steps.append((cache, oracle.intermediates(tokens[-1:], names, prefix=prefix)))
            tokens.append(int(np.argmax(oracle.logits(ids + tokens)[-1])))
    symbols = [pt.tensor(dtype="float32", shape=(1, n_head, dim))]
    symbols += [pt.tensor(dtype="float32", shape=(1, None, n_kv, dim)) for _ in range(2)]
    symbols += [pt.tensor(dtype="int64", shape=(1, 1)), pt.tensor(dtype="int64", shape=(1, None))]
    fns: dict = {}
    differing = formula_differing = total = 0
    for il in range(n_layer):
        window = int(module.SLIDING_WINDOW[il]) if hasattr(module, "SLIDING_WINDOW") else 0
        if window not in fns:
            op = CausalAttentionGgml(n_head, n_kv, dim, window, **variant)
            formula = causal_attention_formula(
                *symbols, n_head, n_kv, dim, window, variant["scale"], variant["softcap"]
            )
            fns[window] = pytensor.function(symbols, [op(*symbols), formula], mode=get_mode("c"))
        for cache, step in steps:
            k, v = (
                np.concatenate([t[f"{n}-{il}"].reshape(-1, n_kv, dim) for t in (cache, step)]) for n in ("Kcur", "Vcur")
            )
            pos = len(k) - 1
            q = step[f"Qcur-{il}"].reshape(1, n_head, dim)
            ours, formula = fns[window](q, k[None], v[None], np.array([[pos]]), np.arange(pos + 1)[None])
            theirs = step[f"kqv_out-{il}"].reshape(ours.shape)
            differing += int(np.count_nonzero(ours.view(np.uint32) != theirs.view(np.uint32)))
            formula_differing += int(np.count_nonzero(formula.view(np.uint32) != theirs.view(np.uint32)))
            total += ours.size
    print(f"{model}: prompt {len(ids)} tokens, {n_steps} decode steps x {n_layer} layers ({variant})")
    print(f"  kqv_out, CausalAttentionGgml: {differing}/{total} elements differ from llama.cpp's")
    print(f"  kqv_out, the generated formula: {formula_differing}/{total} elements differ")
    return 1 if differing else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
