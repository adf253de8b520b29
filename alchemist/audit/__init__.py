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
- dequantization  every tensor reaches the graph as float32 through gguf's dequantize (via dequantize_tensor
                  in load_weights), or in GGUF blocks only into alchemist.kernels (see "Kernel path");
                  byte sizes match types
- orientation     TENSORS shapes are the GGUF's (ne reversed) and the (n_out, n_in) the constants imply;
                  linear() is x @ W.T; projection weights go through linear(), project() or a kernel; the
                  kernels get the weight's stored (rows, columns)
- heads           head constants consistent (and equal to the IR's); every head split/merge reshape regroups
                  its input symbolically (N_HEAD = N_KV_HEAD·GROUP_SIZE, KV-major)
- coverage        every GGUF tensor is used by the graph or ignored with a reason; no name used that the
                  file lacks

Kernel path (quantized matrices kept in GGUF blocks). load_weights may store an entry without
dequantize_tensor under an `if` on the loop's name or type variable against literal constants (e.g.
`if quantized and name in KERNEL_WEIGHTS:`, KERNEL_WEIGHTS a literal set of names equal to the IR's kernel
tensors, or `if ggml_type in ("Q4_K", ...)`). Every graph read of such a tensor must then be one of:
- the blocks argument of alchemist.kernels.quantized_linear(x, w_blocks, ggml_type, n_out, n_in) or
  quantized_embedding(w_blocks, indices, ggml_type, n_rows, n_in), passed `w[name]` directly; or
- `weight = w[name]` bound once at the top level of a function whose first use of `weight` is
  `if weight.dtype == "uint8":`, a branch that ends in a return and uses `weight` only as such a blocks
  argument; after (or in the else of) that branch `weight` is float32 and used as any weight. This form is
  accepted only if every undequantized store of the tensor is alchemist.kernels.as_blocks(...) (uint8), so
  that the dtype test tells blocks from float32.
In every such kernel call the ggml type is TENSORS[name][0] of the weight it decodes (dequantization) and
the sizes are TENSORS[name][1][0] and [1][1] of that weight, or size constants equal to its stored shape
(numerically when the name is a literal pattern, and symbolically wherever the shape interpreter reaches
the call; one of the two is required) (orientation); quantized_linear computes x @ W.T like linear(), and
quantized_embedding(W, tokens) is W[tokens].

Weight-name helpers. A module-level function with the weights dict `w` as a parameter that it only
subscripts, and a parameter `name` that it never rebinds and reads weights with as `w[name]` (the
template's `project(x, w, name, bias=None)`), is a weight-name helper: each call of it counts as a read of
the weight its call site names (`project(x, w, p + "attn_q.weight")` reads blk.{il}.attn_q.weight) for
coverage, and the helper's `w[name]` reads are checked as above for every tensor it is called with, for
orientation with that tensor's role (in project(): float32 into linear(x, weight, bias), blocks into
quantized_linear with (n_out, n_in) = TENSORS[name][1]). The shape interpreter binds `name` to the call
site's pattern, so project(x, w, pattern) has the shape of linear(x, w[pattern]) on every path.
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
