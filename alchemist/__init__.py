"""alchemist: GGUF language models as readable, inspectable PyTensor code.

from alchemist import load_llm, inference
model = load_llm("gemma-3-270m-q4_k_m.gguf", backend="c")
result = inference(model, input="What's causal inference?", max_tokens=32)
"""

# Importing alchemist changes nothing in the process: its PyTensor settings (float32, the system BLAS) and compile
# speed-ups are switched on around its own graph building and compiling only (alchemist.pytensor_ext.host).
from alchemist.version import __version__

__all__ = ["inference", "load_llm", "__version__"]


def __getattr__(name):
    # Imported lazily: the runtime pulls in pytensor, which `alchemist inspect` does not need.
    if name in ("load_llm", "inference"):
        from alchemist.runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'alchemist' has no attribute {name!r}")
