"""Reading GGUF files: `read_gguf(path) -> GGUFFacts` (validated header, lazy vocabulary, mmap'd data)."""

from alchemist.gguf_io.reader import GGUFFacts, StringArray, TensorInfo, read_gguf

__all__ = ["GGUFFacts", "StringArray", "TensorInfo", "read_gguf"]
