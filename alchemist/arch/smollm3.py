"""SmolLM3: llama.cpp src/models/smollm3.cpp.

Llama (NORM RoPE, SiLU gated MLP, RMSNorm) without RoPE on every 4th layer: layer il rotates unless
(il + 1) % 4 == 0 (hparams.n_no_rope_layer_step, fixed at 4). The output is tied unless output.weight exists.
"""

from alchemist.arch.family import Family, FixtureSpec
from alchemist.arch.table import LLAMA
from alchemist.ir import Activation, RopeStyle

FAMILY = Family(
    name="smollm3",
    tensors=LLAMA,
    rope=RopeStyle.NORM,
    activation=Activation.SILU,
    rope_on_layer=lambda hp, il, sliding: (il + 1) % 4 != 0,
    # 4 layers, so the fixture has a layer without RoPE
    fixture=FixtureSpec(n_layer=4),
)
