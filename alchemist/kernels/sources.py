"""The kernels' C and C++ source files (alchemist/kernels/csrc/, shipped in the wheel), read as the Ops compile them.

`source(name)` is the text of csrc/<name> with every line `#include "<file>"` naming a file of csrc/ replaced by
that file's text (recursively): the ops share headers (ggml's vectorized expf, `v_expf.h`) and each Op still hands
PyTensor or g++ one self-contained source, whose hash keys the compiled module. System headers (`<...>`) stay.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"\n', re.M)


@cache
def source(name: str) -> str:
    path = CSRC / name
    text = path.read_text(encoding="utf-8")
    return _LOCAL_INCLUDE.sub(lambda m: source(m.group(1)) if (CSRC / m.group(1)).is_file() else m.group(0), text)
