"""alchemist: GGUF language models as readable, inspectable PyTensor code."""

__version__ = "0.1.0"
