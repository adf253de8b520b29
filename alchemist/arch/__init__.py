"""Architecture profiles: one small file per family; `build_model_ir(facts)` picks the right one."""

from __future__ import annotations

from alchemist.arch import gemma3, llama, qwen2, qwen3
from alchemist.arch.common import FamilyProfile, build_ir
from alchemist.errors import UnsupportedModelError
from alchemist.gguf_io import GGUFFacts
from alchemist.ir import ModelIR

PROFILES: dict[str, FamilyProfile] = {m.PROFILE.name: m.PROFILE for m in (llama, qwen2, qwen3, gemma3)}


def build_model_ir(facts: GGUFFacts) -> ModelIR:
    arch = facts.architecture
    profile = PROFILES.get(arch)
    if profile is None:
        raise UnsupportedModelError(
            f"{facts.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(PROFILES))})"
        )
    return build_ir(facts, profile)


__all__ = ["PROFILES", "build_model_ir"]
