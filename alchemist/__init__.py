"""alchemist: GGUF language models as readable, inspectable PyTensor code.

from alchemist import load_llm, inference
model = load_llm("gemma-3-270m-q4_k_m.gguf", backend="c")
result = inference(model, input="What's causal inference?", max_tokens=32)
"""

from alchemist.runtime.backends import configure_pytensor

# PyTensor reads its flags once, at its first import: set them (system BLAS for the C backend, float32)
# before any alchemist module can import it, so no import order degrades the C backend.
configure_pytensor()

__version__ = "0.1.0"
__all__ = ["inference", "load_llm", "__version__"]


def __getattr__(name):
    # Imported lazily: the runtime pulls in pytensor, which `alchemist inspect` does not need.
    if name in ("load_llm", "inference"):
        from alchemist.runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'alchemist' has no attribute {name!r}")
