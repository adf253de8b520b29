"""Audit of generated modules: `audit_module(path, gguf_path=None, ir=None) -> AuditReport`.

Source checks (alchemist/audit/checks.py: libcst, the module is not imported) -- what only the text shows:

- provenance      header and PROVENANCE complete; sha256, size and IR hash match the GGUF, the given IR, or
                  (neither given) the IR rebuilt from the module's own METADATA and TENSORS
- syntax          parses; defines forward(), load_weights(), dequantize_tensor() and the contract's constants
- format          black-clean with alchemist.codegen.BLACK_MODE
- safety          allowlisted imports only; no eval/exec/open/getattr/dunders/import-time code; the file is
                  read only in load_weights; metadata strings are plain literals
- config          constants equal module_constants(IR); TENSORS well-formed, in bounds, disjoint and equal to
                  the IR's and the GGUF's inventory; KERNEL_WEIGHTS the IR's kernel tensors

Graph checks (alchemist/audit/graph.py: only once safety passed, the module is executed into a fresh module
object, its loader probed on a synthetic file and `forward` built symbolically, never compiled or run):
dequantization, orientation, heads, coverage. No check knows a family or a template's function names: the
IR (tensor roles, head sizes) and the module contract are all they read, so a new family needs no change.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from alchemist.audit.report import AuditReport, CheckResult, write_reports
from alchemist.errors import AlchemistError, AuditError

# the source checks, then the graph checks (libcst, black and pytensor are imported when a module is audited)
CHECK_NAMES = (
    "provenance",
    "syntax",
    "format",
    "safety",
    "config",
    "dequantization",
    "orientation",
    "heads",
    "coverage",
)


@functools.lru_cache(maxsize=4)
def _load_gguf(path: str, size: int, mtime_ns: int):
    """(facts, rebuilt IR or None, error or None) for a GGUF file, cached by identity and mtime."""
    from alchemist.arch import build_model_ir
    from alchemist.reading import read_model

    facts = read_model(path)  # a GGUF file, or a snapshot directory
    try:
        return facts, build_model_ir(facts), None
    except AlchemistError as e:
        return facts, None, str(e)


def _scrub(message: str, path: str) -> str:
    """Error text without the directory part of the GGUF path (reports must not hold absolute paths)."""
    return message.replace(os.path.abspath(path), os.path.basename(path)).replace(path, os.path.basename(path))


def ir_from_module(src) -> tuple[object | None, str | None]:
    """(the IR rebuilt from a parsed module's METADATA, TENSORS, DATA_OFFSET and PROVENANCE, None) or (None, why
    not). The module is not imported: its literals are read as data and the family validates them as it would a
    GGUF file's header. A module whose IR hash then differs from its PROVENANCE fails the provenance check."""
    from alchemist.arch import build_model_ir
    from alchemist.arch.build import metadata_value
    from alchemist.gguf_io.reader import GGUFFacts, TensorInfo

    metadata, tensors = src.constant("METADATA"), src.constant("TENSORS")
    prov, data_offset = src.constant("PROVENANCE"), src.constant("DATA_OFFSET")
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        return None, "METADATA is missing or not a literal dict of str keys"
    if not isinstance(tensors, dict) or not isinstance(prov, dict) or not isinstance(data_offset, int):
        return None, "TENSORS, PROVENANCE or DATA_OFFSET is missing or not a literal"
    source, placed = src.constant("SOURCE_FILES"), src.constant("TENSOR_FILES") or {}
    quant, stacked = src.constant("MLX_QUANTIZED") or {}, src.constant("TENSOR_PARTS") or {}
    try:
        infos = {
            name: TensorInfo(
                name, ggml_type, tuple(reversed(shape)), offset, nbytes, *placed.get(name, (0, ())),
                quant.get(name, ()), stacked.get(name, ()),
            )  # fmt: skip
            for name, (ggml_type, shape, offset, nbytes) in tensors.items()
        }
        if source is not None:  # a snapshot: its metadata is already in GGUF keys
            from alchemist.snapshot import SnapshotFacts

            facts = SnapshotFacts(
                path=str(prov["source_file"]),
                file_size=prov["source_size"],
                metadata={k: metadata_value(v) for k, v in metadata.items()},
                tensors=infos,
                source_files=tuple(tuple(e) for e in source),
                _sha256=prov["source_sha256"],
            )
            return build_model_ir(facts), None
        facts = GGUFFacts(
            path=str(prov["source_file"]),
            file_size=prov["source_size"],
            version=3,  # the header's version and alignment: not read by the families
            alignment=32,
            data_offset=data_offset,
            metadata={k: metadata_value(v) for k, v in metadata.items()},
            metadata_types={},
            tensors=infos,
            _sha256=prov["source_sha256"],
        )
        return build_model_ir(facts), None
    except AlchemistError as e:
        return None, str(e)
    except (KeyError, TypeError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def audit_module(module_path, gguf_path=None, ir=None) -> AuditReport:
    """Audit the generated module at module_path, against a GGUF file and/or a ModelIR when given."""
    from alchemist.audit.checks import SOURCE_CHECKS, Context
    from alchemist.audit.graph import GRAPH_CHECKS, run_graph_check
    from alchemist.audit.source import ModuleSource, ParseFailure

    assert CHECK_NAMES == tuple(SOURCE_CHECKS) + tuple(GRAPH_CHECKS)
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
    module_ir = module_ir_error = None
    if ir is None and gguf_path is None:
        module_ir, module_ir_error = ir_from_module(src)
    ctx = Context(
        src=src,
        facts=facts,
        ir=ir if ir is not None else rebuilt if rebuilt is not None else module_ir,
        rebuilt_ir=rebuilt,
        given_ir=ir,
        module_ir=module_ir,
        module_ir_error=module_ir_error,
        gguf_name=report.gguf,
        gguf_error=gguf_error,
    )
    for name in CHECK_NAMES:
        try:
            result = SOURCE_CHECKS[name](ctx) if name in SOURCE_CHECKS else run_graph_check(name, ctx)
        except Exception as e:  # an auditor bug or a module shape it cannot follow: never a pass
            result = CheckResult(name, False, f"the check could not run: {type(e).__name__}: {e}")
        report.checks.append(result)
        if name == "safety":
            ctx.safe = result.passed
    return report


def require_passing_audit(module_path, ir) -> AuditReport:
    """Audit the module load_llm is about to import against its IR; raise AuditError if a check fails.

    The verdict is remembered under the cache's audits/ by (module sha256, IR hash, alchemist version and the
    auditor's own source), so a module already audited costs a hash and a small read."""
    import json

    from alchemist.version import __version__
    from alchemist.paths import cache_subdir, remember

    path = Path(module_path)
    h = hashlib.sha256(f"{ir.ir_hash()}\0{__version__}\0".encode() + path.read_bytes())
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.read_bytes())
    memo = cache_subdir("audits") / f"{h.hexdigest()}.json"
    try:
        data = json.loads(memo.read_text())
        report = AuditReport(data["module"], data["module_sha256"], data["gguf"])
        report.checks = [CheckResult(c["name"], c["passed"], c["why"], tuple(c["details"])) for c in data["checks"]]
    except (OSError, ValueError, KeyError, TypeError):
        report = audit_module(path, ir=ir)
        remember(memo, report.to_json())
    if not report.passed:
        failed = "; ".join(f"{c.name}: {c.why}" for c in report.checks if not c.passed)
        raise AuditError(f"{path.name} fails its audit, so it is not imported: {failed}")
    return report


__all__ = ["AuditReport", "CheckResult", "CHECK_NAMES", "audit_module", "require_passing_audit", "write_reports"]
