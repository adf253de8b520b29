"""Static audit of generated modules: `audit_module(path, gguf_path=None, ir=None) -> AuditReport`.

The generated module is parsed with libcst and never imported or executed; literal constants (PROVENANCE,
TENSORS, the configuration) are read with `ast.literal_eval`. With a GGUF file the audit also re-reads its
header, re-derives the IR and compares. Checks (see alchemist/audit/checks.py):

- provenance      header and PROVENANCE complete; sha256, size and IR hash match the GGUF / IR
- syntax          parses; defines the template's functions and constants
- format          black-clean with alchemist.codegen.BLACK_MODE
- safety          allowlisted imports only; no eval/exec/open/getattr/dunder/import-time code; the file is
                  read only in load_weights; metadata strings are plain literals
- config          constants well-formed and equal to the IR's; TENSORS regions in bounds, disjoint and at
                  the GGUF's offsets
- dequantization  every non-F32 tensor reaches the graph through gguf's dequantize (via dequantize_tensor
                  in load_weights) or only through an alchemist.kernels function; byte sizes match types
- orientation     TENSORS shapes are the GGUF's (ne reversed) and the (n_out, n_in) the constants imply;
                  linear() is x @ W.T; projection weights go through linear()
- heads           head constants consistent (and equal to the IR's); every head split/merge reshape regroups
                  its input symbolically (N_HEAD = N_KV_HEAD·GROUP_SIZE, KV-major)
- coverage        every GGUF tensor is used by the graph or ignored with a reason; no name used that the
                  file lacks

Kernel path (for quantized-matmul kernels): load_weights may store an entry without dequantize_tensor
(raw blocks, or the result of an alchemist.kernels packing function) under an `if` on the loop's name or
type variable against literal constants (e.g. `if name in KERNEL_WEIGHTS:` with KERNEL_WEIGHTS a literal
tuple/set/frozenset of names, or `if ggml_type in ("Q4_K", ...)`); every graph use of those tensors must
then be an argument of an alchemist.kernels function, directly or through a module-level helper whose
parameter is only passed to alchemist.kernels functions. A kernel call `k(x, w[name], ...)` is taken to
compute x @ W.T like linear().
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from alchemist.audit.checks import CHECK_NAMES, CHECKS, Context
from alchemist.audit.report import AuditReport, CheckResult, write_reports
from alchemist.audit.source import ModuleSource, ParseFailure
from alchemist.errors import AlchemistError


@functools.lru_cache(maxsize=4)
def _load_gguf(path: str, size: int, mtime_ns: int):
    """(facts, rebuilt IR or None, error or None) for a GGUF file, cached by identity and mtime."""
    from alchemist.arch import build_model_ir
    from alchemist.gguf_io import read_gguf

    facts = read_gguf(path)
    try:
        return facts, build_model_ir(facts), None
    except AlchemistError as e:
        return facts, None, str(e)


def _scrub(message: str, path: str) -> str:
    """Error text without the directory part of the GGUF path (reports must not hold absolute paths)."""
    return message.replace(os.path.abspath(path), os.path.basename(path)).replace(path, os.path.basename(path))


def audit_module(module_path, gguf_path=None, ir=None) -> AuditReport:
    """Audit the generated module at module_path, against a GGUF file and/or a ModelIR when given."""
    path = Path(module_path)
    text = path.read_text(encoding="utf-8")
    report = AuditReport(
        module=path.name,
        module_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        gguf=os.path.basename(str(gguf_path)) if gguf_path is not None else None,
    )
    facts = rebuilt = None
    gguf_error = None
    if gguf_path is not None:
        p = str(gguf_path)
        try:
            st = os.stat(p)
            facts, rebuilt, err = _load_gguf(os.path.abspath(p), st.st_size, st.st_mtime_ns)
            if err:
                gguf_error = _scrub(f"the IR cannot be rebuilt: {err}", p)
        except (AlchemistError, OSError) as e:
            gguf_error = _scrub(str(e), p)
    try:
        src = ModuleSource.parse(text, path.name)
    except ParseFailure as e:
        report.checks.append(CheckResult("syntax", False, f"does not parse: {e}"))
        for name in CHECK_NAMES:
            if name != "syntax":
                report.checks.append(CheckResult(name, False, "not checked: the module does not parse"))
        report.checks.sort(key=lambda c: CHECK_NAMES.index(c.name))
        return report
    ctx = Context(
        src=src,
        facts=facts,
        ir=ir if ir is not None else rebuilt,
        rebuilt_ir=rebuilt,
        given_ir=ir,
        gguf_name=report.gguf,
        gguf_error=gguf_error,
    )
    for name in CHECK_NAMES:
        try:
            result = CHECKS[name](ctx)
        except Exception as e:  # an auditor bug or a module shape it cannot follow: never a pass
            result = CheckResult(name, False, f"the check could not run: {type(e).__name__}: {e}")
        report.checks.append(result)
    return report


__all__ = ["AuditReport", "CheckResult", "CHECK_NAMES", "audit_module", "write_reports"]
