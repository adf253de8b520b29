"""Architecture families: one small declarative file each (`alchemist/arch/<family>.py` defines FAMILY);
`build_model_ir(facts)` picks the file's family and builds the ModelIR with `alchemist.arch.build`."""

from __future__ import annotations

from alchemist.arch import (
    cohere2,
    command_r,
    deepseek2,
    exaone,
    exaone4,
    falcon_h1,
    gemma,
    gemma2,
    gemma3,
    gemma3n,
    gemma4,
    glm4moe,
    gpt2,
    gpt_oss,
    granite,
    granitehybrid,
    internlm2,
    lfm2,
    lfm2moe,
    mamba2,
    nemotron_h,
    llama,
    llama4,
    mistral3,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3moe,
    qwen35,
    qwen35moe,
    qwen3next,
    smollm3,
    stablelm,
    starcoder2,
)
from alchemist.arch.build import build_ir
from alchemist.arch.family import Family
from alchemist.errors import UnsupportedModelError
from alchemist.gguf_io import GGUFFacts
from alchemist.ir import ModelIR

FAMILY_MODULES = (
    llama,
    qwen2,
    qwen3,
    gemma3,
    gemma,
    gemma2,
    phi3,
    granite,
    granitehybrid,
    olmo2,
    smollm3,
    starcoder2,
    gpt2,
    stablelm,
    internlm2,
    exaone,
    exaone4,
    command_r,
    cohere2,
    lfm2,
    qwen3moe,
    qwen35,
    qwen35moe,
    qwen3next,
    gpt_oss,
    gemma3n,
    mistral3,
    lfm2moe,
    nemotron_h,
    glm4moe,
    llama4,
    deepseek2,
    mamba2,
    falcon_h1,
    gemma4,
)
FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in FAMILY_MODULES}


def build_model_ir(facts: GGUFFacts) -> ModelIR:
    arch = facts.architecture
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedModelError(
            f"{facts.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    return build_ir(facts, family)


__all__ = ["FAMILIES", "Family", "build_model_ir"]
