"""Per-token saliency: how much each input token's embedding moves log p(target | prompt).

The gradient of the target's log-probability with respect to the token-embedding rows of the whole sequence
(prompt and target) is taken symbolically through the generated model (alchemist.symbolic); per token it is
reported as gradient × input (the first-order estimate of what removing that embedding changes) and the
gradient's L2 norm (how sensitive the target is to that token at all).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alchemist.errors import AlchemistError
from alchemist.pytensor_ext.host import activating


@dataclass
class Saliency:
    token_ids: list[int]
    pieces: list[str]
    n_prompt: int  # tokens of the condition; the rest are the target
    log_prob: float  # log p(target | prompt)
    grad_x_input: np.ndarray  # (T,) sum over the embedding dimension of gradient * embedding
    grad_norm: np.ndarray  # (T,) L2 norm of the gradient per token
    gradient: np.ndarray  # (T, n_embd)
    embeddings: np.ndarray  # (T, n_embd), the token-embedding rows (before any embedding scale)

    def table(self, bar_width: int = 24) -> str:
        """A fixed-width table: position, token, part, gradient × input (with a bar), gradient norm."""
        top = max(float(np.abs(self.grad_x_input).max()), 1e-30)
        lines = [
            f"log p(target | prompt) = {self.log_prob:.6g}   ({len(self.token_ids) - self.n_prompt} target tokens, "
            f"{self.n_prompt} prompt tokens)",
            f"{'pos':>4}  {'token':<16} {'part':<6} {'grad·input':>12}  {'':<{bar_width}}  {'|grad|':>10}",
        ]
        for i, (piece, gx, gn) in enumerate(zip(self.pieces, self.grad_x_input, self.grad_norm)):
            n = int(round(abs(gx) / top * bar_width))
            bar = ("+" if gx >= 0 else "-") * n
            lines.append(
                f"{i:>4}  {_show(piece):<16.16} {'prompt' if i < self.n_prompt else 'target':<6} {gx:>12.4g}  "
                f"{bar:<{bar_width}}  {gn:>10.4g}"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "log_prob": self.log_prob,
            "n_prompt": self.n_prompt,
            "tokens": [
                {"position": i, "id": t, "piece": p, "grad_x_input": float(gx), "grad_norm": float(gn)}
                for i, (t, p, gx, gn) in enumerate(zip(self.token_ids, self.pieces, self.grad_x_input, self.grad_norm))
            ],
        }


def _show(piece: str) -> str:
    """A token's text on one line: spaces visible as ␣, control characters escaped."""
    return repr(piece)[1:-1].replace(" ", "␣") if piece else "∅"


def _pieces(tokenizer, ids: list[int]) -> list[str]:
    """The text each token adds to the decoded sequence (a lone SentencePiece token decodes without its space)."""
    if tokenizer is None:
        return [str(t) for t in ids]
    texts = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    return [b[len(a) :] if b.startswith(a) else tokenizer.decode([t]) for a, b, t in zip(texts, texts[1:], ids)]


@activating
def saliency_function(model, target, prompt):
    """A compiled function E (T, n_embd) -> (log p(target | prompt), d/dE), the ids and the prompt length."""
    import pytensor
    import pytensor.tensor as pt

    from alchemist.symbolic import encode_scored, log_prob

    ids, n_prompt = encode_scored(model, target, given=prompt)
    emb = pt.tensor("embeddings", dtype="float32", shape=(len(ids), model.ir.n_embd))
    lp = log_prob(model, ids[n_prompt:], given=ids[:n_prompt], embeddings=emb)
    fn = pytensor.function([emb], [lp, pytensor.grad(lp, emb)], mode=model.mode)
    return fn, ids, n_prompt


def saliency(model, target, prompt) -> Saliency:
    """Gradient × input and gradient norm of log p(target | prompt) per input token (text or token ids)."""
    from alchemist.symbolic import embedding_rows

    fn, ids, n_prompt = saliency_function(model, target, prompt)
    emb = embedding_rows(model, ids)
    lp, grad = fn(emb)
    grad = np.asarray(grad, dtype=np.float64)
    pieces = _pieces(model.tokenizer, ids)
    return Saliency(
        token_ids=list(ids),
        pieces=pieces,
        n_prompt=n_prompt,
        log_prob=float(lp),
        grad_x_input=(grad * emb).sum(axis=1),
        grad_norm=np.linalg.norm(grad, axis=1),
        gradient=grad,
        embeddings=emb,
    )


def draw(result: Saliency, path: str | Path, title: str = "") -> Path:
    """A horizontal bar chart per token (gradient × input, and the gradient norm) as PNG or SVG."""
    from alchemist.pictures import figure, save

    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise AlchemistError(f"{path}: the picture must be .png or .svg")
    n = len(result.token_ids)
    labels = [f"{_show(p)[:18]}  [{i}]" for i, p in enumerate(result.pieces)]
    y = np.arange(n)
    colors = ["#3b75af" if i < result.n_prompt else "#c8553d" for i in range(n)]
    fig = figure(10, 0.32 * n + 1.6)
    ax1, ax2 = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    ax1.barh(y, result.grad_x_input, color=colors)
    ax1.axvline(0, color="black", lw=0.8)
    ax1.set_xlabel("gradient × input")
    ax1.set_yticks(y, labels, fontsize=8)
    ax1.invert_yaxis()
    ax2.barh(y, result.grad_norm, color=colors)
    ax2.set_xlabel("‖gradient‖")
    for ax in (ax1, ax2):
        ax.grid(axis="x", alpha=0.3)
        ax.axhline(result.n_prompt - 0.5, color="gray", ls="--", lw=0.8)
    fig.suptitle(
        (title + "\n" if title else "") + f"log p(target | prompt) = {result.log_prob:.4g}  "
        "(blue: prompt, red: target)",
        fontsize=10,
    )
    fig.tight_layout()
    return save(fig, path)


__all__ = ["Saliency", "draw", "saliency", "saliency_function"]
