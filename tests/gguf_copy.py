"""Copies of GGUF files with gguf-py, edited on the way: tests that need a file a fixture cannot write."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def rewrite_gguf(src: Path, dst: Path, arch: str | None = None, drop: set[str] = frozenset(), extra=None, name=None):
    """Copy a GGUF with gguf-py, optionally renaming the architecture, dropping or adding tensors."""
    r = gguf.GGUFReader(str(src))
    old_arch = r.fields["general.architecture"].contents()
    arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        new_key = key.replace(f"{old_arch}.", f"{arch}.", 1) if key.startswith(f"{old_arch}.") else key
        value = field.contents()
        if key == "general.name" and name is not None:
            value = name
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(new_key, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(new_key, value, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(int(x) for x in reversed(t.shape))))
    for tname, arr in (extra or {}).items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
