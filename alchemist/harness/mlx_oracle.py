"""mlx-lm as a second, independent oracle for Hugging Face snapshots: its own model classes (mlx_lm.models) over
the snapshot directory, on MLX's CPU backend. It computes in the weights' dtype: a float16 or bfloat16 snapshot is
widened to float32 first (exactly), so the comparison is of the equations, not of half-precision activations.
It has no named intermediates: validation against it compares the logits at every position and greedy steps."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from alchemist.errors import AlchemistError


class MlxLmOracle:
    name = "mlx-lm"

    def __init__(self, path: str):
        try:
            import mlx.core as mx
            from mlx_lm.utils import load_model
        except ImportError as e:
            raise AlchemistError(f"the mlx-lm oracle needs mlx-lm (pip install mlx-lm): {e}") from None
        self.path, self._mx = str(path), mx
        self.model, self.config = load_model(Path(path))
        if "quantization" not in self.config:
            self.model.set_dtype(mx.float32)

    def logits(self, ids: list[int]) -> np.ndarray:
        """(len(ids), n_vocab) float32: the logits at every position of one fresh evaluation."""
        mx = self._mx
        out = self.model(mx.array([list(map(int, ids))]))
        return np.array(out[0].astype(mx.float32))

    def rescore(self, prompt: list[int], generated: list[int]) -> np.ndarray:
        """The logits that chose each generated token: positions len(prompt) - 1 .. of prompt + generated."""
        full = list(prompt) + list(generated)
        return self.logits(full[:-1])[len(prompt) - 1 :]

    def close(self) -> None:
        self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
