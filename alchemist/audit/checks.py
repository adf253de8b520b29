"""The contracts a generated module must keep, each checked statically (the module is never imported).

Every check returns a CheckResult; its `why` says what was verified when it passes and the first findings
when it fails (all findings are kept in `details`). Checks that can compare against the GGUF file or the
IR do so when `Context` has them, and fall back to the module's own internal consistency otherwise.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass

import black
import libcst as cst

from alchemist.audit.report import CheckResult
from alchemist.audit.shapes import (
    CONSTANT_DIMS,
    STRICT_FUNCTIONS,
    Arr,
    ShapeInterpreter,
    numeric,
    prod,
    split_layer_name,
    tensor_spec,
)
from alchemist.audit.source import (
    BLOCK_PACKERS,
    KERNEL_SIGNATURES,
    KERNELS_MODULE,
    LOADER_FUNCTIONS,
    REQUIRED_CONSTANTS,
    REQUIRED_FUNCTIONS,
    ModuleSource,
    WEIGHT_DICT_NAMES,
    dotted,
    int_literal,
    is_binding,
    str_literal,
    walk,
)

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
PROVENANCE_FIELDS = ("model_name", "source_file", "source_sha256", "source_size", "generator", "ir_sha256")
ALLOWED_IMPORTS = ("numpy", "pytensor", "pytensor.tensor", "gguf", "gguf.quants", KERNELS_MODULE, "__future__")
FORBIDDEN_NAMES = {
    "eval",
    "exec",
    "compile",
    "__import__",
    "getattr",
    "setattr",
    "delattr",
    "hasattr",
    "globals",
    "locals",
    "vars",
    "breakpoint",
    "input",
    "exit",
    "quit",
    "help",
    "memoryview",
    "__builtins__",
    "builtins",
    "os",
    "sys",
    "subprocess",
    "importlib",
    "shutil",
    "socket",
    "pickle",
    "marshal",
    "ctypes",
    "pathlib",
    "io",
    "runpy",
}
FILE_ACCESS_NAMES = {"open"}
FILE_ACCESS_QUALNAMES = {
    "numpy.memmap",
    "numpy.fromfile",
    "numpy.load",
    "numpy.save",
    "numpy.savez",
    "numpy.loadtxt",
    "numpy.savetxt",
    "numpy.genfromtxt",
    "numpy.lib.format.open_memmap",
    "gguf.GGUFReader",
    "gguf.GGUFWriter",
}
FORBIDDEN_QUALNAME_PREFIXES = ("numpy.ctypeslib", "numpy.f2py", "numpy.distutils", "numpy.testing", "pytensor.config")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
MAX_SHOWN = 3


@dataclass
class Context:
    src: ModuleSource
    facts: object | None = None  # GGUFFacts
    ir: object | None = None  # ModelIR the expectations come from (given, or rebuilt from the GGUF)
    rebuilt_ir: object | None = None  # ModelIR rebuilt from the GGUF
    given_ir: object | None = None
    gguf_name: str | None = None
    gguf_error: str | None = None
    _interp: ShapeInterpreter | None = None
    _uses: list | None = None

    @property
    def inventory(self) -> dict | None:
        """name -> (ggml type, numpy shape, offset, nbytes) from the GGUF, else from the IR, else None."""
        if self.facts is not None:
            return {n: (t.ggml_type, tuple(t.shape), t.offset, t.nbytes) for n, t in self.facts.tensors.items()}
        if self.ir is not None:
            return {t.name: (t.ggml_type, tuple(t.shape), t.offset, t.nbytes) for t in self.ir.tensors}
        return None

    @property
    def inventory_label(self) -> str:
        return "the GGUF" if self.facts is not None else "the IR"

    def interp(self) -> ShapeInterpreter:
        if self._interp is None:
            self._interp = ShapeInterpreter(self.src).run()
        return self._interp

    def uses(self):
        if self._uses is None:
            self._uses = self.src.weight_uses()
        return self._uses

    def tensors(self) -> dict:
        value = self.src.constant("TENSORS", None)
        return value if isinstance(value, dict) else {}

    def n_layer(self) -> int:
        v = self.src.constant("N_LAYER", None)
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 100_000 else 0


def _result(name: str, findings: list[str], ok_why: str) -> CheckResult:
    if not findings:
        return CheckResult(name, True, ok_why)
    shown = "; ".join(findings[:MAX_SHOWN])
    if len(findings) > MAX_SHOWN:
        shown += f"; … and {len(findings) - MAX_SHOWN} more"
    return CheckResult(name, False, shown, tuple(findings))


def _short(h: str) -> str:
    return h[:12] + "…" if isinstance(h, str) and len(h) > 12 else str(h)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


# ---------------------------------------------------------------------------------------------------
# provenance
# ---------------------------------------------------------------------------------------------------
def check_provenance(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    doc = src.module.get_docstring(clean=False)
    if not doc or "Generated by alchemist" not in doc:
        f.append('module docstring (header) missing or does not say "Generated by alchemist"')
    prov = src.constant("PROVENANCE", None)
    if not isinstance(prov, dict):
        f.append("PROVENANCE is missing or not a literal dict")
        return _result("provenance", f, "")
    missing = [k for k in PROVENANCE_FIELDS if k not in prov]
    extra = sorted(str(k) for k in prov if k not in PROVENANCE_FIELDS)
    if missing:
        f.append(f"PROVENANCE lacks {', '.join(missing)}")
    if extra:
        f.append(f"PROVENANCE has unexpected fields {', '.join(extra)}")
    for k in ("model_name", "source_file", "generator"):
        if k in prov and not isinstance(prov[k], str):
            f.append(f"PROVENANCE[{k!r}] is not a string")
    for k in ("source_sha256", "ir_sha256"):
        if k in prov and not (isinstance(prov[k], str) and SHA256.match(prov[k])):
            f.append(f"PROVENANCE[{k!r}] is not a sha256 hex digest")
    if "source_size" in prov and not (_is_int(prov["source_size"]) and prov["source_size"] > 0):
        f.append("PROVENANCE['source_size'] is not a positive integer")
    gen = prov.get("generator")
    if isinstance(gen, str) and not re.match(r"^alchemist \d+\.\d+\S*$", gen):
        f.append(f"PROVENANCE['generator'] {gen!r} does not name an alchemist version")
    if isinstance(prov.get("source_file"), str) and not prov["source_file"].lower().endswith(".gguf"):
        f.append("PROVENANCE['source_file'] is not a .gguf file name")

    checked = []
    if ctx.gguf_error:
        f.append(f"cannot check against the GGUF: {ctx.gguf_error}")
    if ctx.facts is not None:
        facts = ctx.facts
        if prov.get("source_size") != facts.file_size:
            f.append(f"source_size {prov.get('source_size')} != {ctx.gguf_name} size {facts.file_size}")
        if prov.get("source_sha256") != facts.sha256():
            f.append(
                f"source_sha256 {_short(prov.get('source_sha256'))} != sha256 of {ctx.gguf_name} "
                f"{_short(facts.sha256())}"
            )
        if prov.get("source_file") != facts.file_name:
            f.append(f"source_file {prov.get('source_file')!r} != {facts.file_name!r}")
        checked.append(f"sha256 {_short(facts.sha256())} and size {facts.file_size} match {ctx.gguf_name}")
    if ctx.rebuilt_ir is not None:
        h = ctx.rebuilt_ir.ir_hash()
        if prov.get("ir_sha256") != h:
            f.append(f"ir_sha256 {_short(prov.get('ir_sha256'))} != hash of the IR rebuilt from the GGUF {_short(h)}")
        checked.append(f"ir_sha256 {_short(h)} matches the IR rebuilt from it")
    if ctx.given_ir is not None:
        gi = ctx.given_ir
        if prov.get("ir_sha256") != gi.ir_hash():
            f.append(f"ir_sha256 {_short(prov.get('ir_sha256'))} != hash of the given IR {_short(gi.ir_hash())}")
        if prov.get("source_sha256") != gi.source_sha256 or prov.get("source_size") != gi.file_size:
            f.append("source_sha256/source_size differ from the given IR's")
        if ctx.rebuilt_ir is not None and gi.ir_hash() != ctx.rebuilt_ir.ir_hash():
            f.append("the given IR differs from the IR rebuilt from the GGUF")
        if ctx.rebuilt_ir is None:
            checked.append("ir_sha256 matches the given IR")
    if not checked:
        checked.append("no GGUF given, so sha256/size/IR hash were not re-derived")
    ok = f"PROVENANCE complete ({prov.get('generator')}); " + "; ".join(checked)
    return _result("provenance", f, ok)


# ---------------------------------------------------------------------------------------------------
# syntax / format
# ---------------------------------------------------------------------------------------------------
def check_syntax(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    for name in REQUIRED_FUNCTIONS:
        if name not in src.functions:
            f.append(f"function {name}() is not defined at module level")
    for name in REQUIRED_CONSTANTS:
        if name not in src.assignments:
            f.append(f"constant {name} is not defined")
    f.extend(_undefined_names(src))
    return _result(
        "syntax",
        f,
        f"parses with libcst and ast; defines the {len(REQUIRED_FUNCTIONS)} template functions "
        f"and {len(REQUIRED_CONSTANTS)} constants; every name a function reads is defined",
    )


def _bound_names(target) -> set[str]:
    return {n.value for n in walk(target) if isinstance(n, cst.Name)} if target is not None else set()


def _undefined_names(src: ModuleSource) -> list[str]:
    """Names read in a function that nothing defines (a NameError waiting to happen)."""
    import builtins

    module_names = set(src.assignments) | set(src.functions) | set(src.imports) | set(dir(builtins))
    out = []
    for fname, fn in src.functions.items():
        local: set[str] = set()
        for p in list(fn.params.params) + list(fn.params.kwonly_params) + list(fn.params.posonly_params):
            local.add(p.name.value)
        for star in (fn.params.star_arg, fn.params.star_kwarg):
            if isinstance(star, cst.Param):
                local.add(star.name.value)
        skip: set[int] = set()
        for n in walk(fn.body):
            if isinstance(n, cst.Assign):
                for t in n.targets:
                    local |= (
                        _bound_names(t.target) if not isinstance(t.target, (cst.Subscript, cst.Attribute)) else set()
                    )
            elif isinstance(n, (cst.AugAssign, cst.AnnAssign)) and isinstance(n.target, cst.Name):
                local.add(n.target.value)
            elif isinstance(n, (cst.For, cst.CompFor)):
                local |= _bound_names(n.target)
            elif isinstance(n, cst.AsName):
                local |= _bound_names(n.name)
            elif isinstance(n, (cst.FunctionDef, cst.ClassDef)) and n is not fn:
                local.add(n.name.value)
            elif isinstance(n, cst.Lambda):
                local |= {p.name.value for p in n.params.params}
            elif isinstance(n, cst.ImportFrom) and not isinstance(n.names, cst.ImportStar):
                local |= {a.evaluated_alias or a.evaluated_name for a in n.names}
            elif isinstance(n, cst.Import):
                local |= {(a.evaluated_alias or a.evaluated_name).split(".")[0] for a in n.names}
            if isinstance(n, cst.Attribute):
                skip.add(id(n.attr))
            elif isinstance(n, cst.Arg) and n.keyword is not None:
                skip.add(id(n.keyword))
        seen = set()
        for n in walk(fn.body):
            if (
                isinstance(n, cst.Name)
                and id(n) not in skip
                and n.value not in local | module_names
                and n.value not in seen
            ):
                seen.add(n.value)
                out.append(f"{fname}() reads `{n.value}`, which is not defined")
    return out


def check_format(ctx: Context) -> CheckResult:
    from alchemist.codegen import BLACK_MODE

    text = ctx.src.text
    try:
        formatted = black.format_str(text, mode=BLACK_MODE)
    except Exception as e:  # black.InvalidInput and friends
        return _result("format", [f"black cannot format it: {type(e).__name__}"], "")
    if formatted == text:
        return _result("format", [], f"black-clean (line length {BLACK_MODE.line_length}, py312)")
    a, b = text.splitlines(), formatted.splitlines()
    line = next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) + 1)
    n_changed = sum(1 for op in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes() if op[0] != "equal")
    return _result("format", [f"not black-clean: black changes {n_changed} region(s), the first at line {line}"], "")


# ---------------------------------------------------------------------------------------------------
# safety
# ---------------------------------------------------------------------------------------------------
def _inert(node: cst.CSTNode) -> str | None:
    """Why a top-level assignment value would run code at import time, or None if it is inert."""
    for n in walk(node):
        if isinstance(
            n,
            (
                cst.Call,
                cst.Lambda,
                cst.Await,
                cst.Yield,
                cst.NamedExpr,
                cst.ListComp,
                cst.SetComp,
                cst.DictComp,
                cst.GeneratorExp,
                cst.Subscript,
                cst.Attribute,
            ),
        ):
            return type(n).__name__
    return None


def _plain_string(node) -> bool:
    return isinstance(node, cst.SimpleString) and not set(node.prefix.lower()) & {"b", "f", "u"}


def check_safety(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    imported = []
    for node in src.import_nodes:
        where = src.enclosing_function(node)
        if where is not None:
            f.append(f"import inside {where}(): imports belong at the top of the module")
        if isinstance(node, cst.Import):
            mods = [dotted(a.name) for a in node.names]
        else:
            if node.relative:
                f.append(f"relative import `{src.code(node)}`")
                continue
            mods = [dotted(node.module)]
            if isinstance(node.names, cst.ImportStar):
                f.append(f"star import `{src.code(node)}`")
        for m in mods:
            imported.append(m)
            if m not in ALLOWED_IMPORTS and not (m or "").startswith(KERNELS_MODULE + "."):
                f.append(f"import of {m!r} (allowed: {', '.join(a for a in ALLOWED_IMPORTS if a != '__future__')})")

    body = list(src.module.body)
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.FunctionDef):
            if stmt.decorators:
                f.append(f"decorator on {stmt.name.value}() runs code at import time")
            continue
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Import, cst.ImportFrom)):
                    continue
                if isinstance(small, cst.Expr) and i == 0 and isinstance(small.value, cst.SimpleString):
                    continue  # the docstring
                if isinstance(small, (cst.Assign, cst.AnnAssign)) and small.value is not None:
                    targets = small.targets if isinstance(small, cst.Assign) else [small]
                    if all(isinstance(t.target, cst.Name) for t in targets):
                        literal = all(
                            t.target.value in src.literal_assignments()
                            and src.assignments[t.target.value] is small.value
                            for t in targets
                        )
                        why = None if literal else _inert(small.value)
                        if why is None:
                            continue
                        f.append(f"top-level `{src.code(small)[:60]}` evaluates a {why} at import time")
                        continue
                f.append(f"top-level statement `{src.code(small)[:60]}` runs at import time")
            continue
        f.append(f"top-level {type(stmt).__name__} `{src.code(stmt)[:60]}` is not part of the module contract")

    import_ids = set()
    for node in src.import_nodes:
        import_ids.update(id(n) for n in walk(node))
    not_names: set[int] = set()  # attribute names (x.attr) and keyword names (f(k=...)) are not references
    for node in src.walk_code():
        if id(node) in import_ids:
            continue
        if isinstance(node, cst.Attribute):
            not_names.add(id(node.attr))
        elif isinstance(node, cst.Arg) and node.keyword is not None:
            not_names.add(id(node.keyword))
        if not isinstance(node, (cst.Name, cst.Attribute, cst.FunctionDef, cst.Global, cst.Nonlocal, cst.ClassDef)):
            continue
        fn = src.enclosing_function(node) or "module level"
        if isinstance(node, cst.Name) and id(node) not in not_names:
            if node.value in FORBIDDEN_NAMES:
                f.append(f"`{node.value}` used in {fn}")
            elif node.value in FILE_ACCESS_NAMES and fn != "load_weights":
                f.append(f"file access `{node.value}` in {fn} (only load_weights reads the file)")
            elif node.value.startswith("__") and node.value.endswith("__"):
                f.append(f"dunder name `{node.value}` in {fn}")
            q = src.qualname(node)
            if q is not None and q != node.value:
                if q in FILE_ACCESS_QUALNAMES and fn != "load_weights":
                    f.append(f"file access `{node.value}` ({q}) in {fn} (only load_weights reads the file)")
                if q.startswith(FORBIDDEN_QUALNAME_PREFIXES):
                    f.append(f"`{node.value}` ({q}) in {fn}")
        elif isinstance(node, cst.Attribute):
            attr = node.attr.value
            if attr.startswith("__") and attr.endswith("__"):
                f.append(f"dunder attribute access `{src.code(node)}` in {fn}")
            q = src.qualname(node)
            if q is not None:
                if q in FILE_ACCESS_QUALNAMES and fn != "load_weights":
                    f.append(f"file access `{src.code(node)}` in {fn} (only load_weights reads the file)")
                if q.startswith(FORBIDDEN_QUALNAME_PREFIXES):
                    f.append(f"`{src.code(node)}` ({q}) in {fn}")
        elif isinstance(node, cst.FunctionDef):
            if node.name.value.startswith("__"):
                f.append(f"dunder function name `{node.name.value}`")
        elif isinstance(node, (cst.Global, cst.Nonlocal, cst.ClassDef)):
            f.append(f"`{type(node).__name__}` statement in {fn}")

    # Metadata-derived strings must appear only as plain literals.
    prov = src.assignments.get("PROVENANCE")
    if isinstance(prov, cst.Dict):
        for el in prov.elements:
            if not isinstance(el, cst.DictElement) or not _plain_string(el.key):
                f.append("PROVENANCE key that is not a plain string literal")
            elif not (_plain_string(el.value) or isinstance(el.value, cst.Integer)):
                f.append(f"PROVENANCE[{src.code(el.key)}] is not a plain literal: `{src.code(el.value)[:50]}`")
    elif prov is not None:
        f.append("PROVENANCE is not a dict literal")
    tens = src.assignments.get("TENSORS")
    if isinstance(tens, cst.Dict):
        for el in tens.elements:
            if not isinstance(el, cst.DictElement) or not _plain_string(el.key):
                f.append(f"TENSORS key that is not a plain string literal: `{src.code(el)[:50]}`")
                continue
            v = el.value
            ok = (
                isinstance(v, cst.Tuple)
                and len(v.elements) == 4
                and _plain_string(v.elements[0].value)
                and isinstance(v.elements[1].value, cst.Tuple)
                and all(isinstance(e.value, cst.Integer) for e in v.elements[1].value.elements)
                and all(isinstance(e.value, cst.Integer) for e in v.elements[2:])
            )
            if not ok:
                f.append(f"TENSORS[{src.code(el.key)}] is not a plain (type, shape, offset, nbytes) literal")
    elif tens is not None:
        f.append("TENSORS is not a dict literal")
    for name in ("ARCHITECTURE",):
        node = src.assignments.get(name)
        if node is not None and not _plain_string(node):
            f.append(f"{name} is not a plain string literal")
    ignored = src.assignments.get("IGNORED_TENSORS")
    if ignored is not None and not (
        isinstance(ignored, cst.Dict)
        and all(
            isinstance(e, cst.DictElement) and _plain_string(e.key) and _plain_string(e.value) for e in ignored.elements
        )
    ):
        f.append("IGNORED_TENSORS is not a dict literal of plain strings")
    for name, node in src.assignments.items():
        for n in walk(node) if name not in src.literal_assignments() else ():
            if isinstance(n, (cst.FormattedString, cst.ConcatenatedString)):
                f.append(f"{name} is built with an f-string or string concatenation")
                break

    mods = sorted({m for m in imported if m != "__future__"})
    return _result(
        "safety",
        f,
        f"imports only {', '.join(mods)}; no eval/exec/compile/__import__/getattr/globals/os/subprocess, no dunder "
        "access, no import-time code; the file is opened only in load_weights; PROVENANCE, TENSORS and "
        "ARCHITECTURE are plain literals (nothing can turn metadata strings into code)",
    )


# ---------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------
def _ir_constants(ir) -> dict:
    from alchemist.codegen.render import module_constants

    constants = module_constants(ir)
    return {**constants, "EMBED_SCALE": constants.get("EMBED_SCALE"), "FINAL_LOGIT_SOFTCAP": constants.get("FINAL_LOGIT_SOFTCAP")}


def _names_in(node) -> set[str]:
    return {n.value for n in walk(node) if isinstance(n, cst.Name)}


def _ggml_sizes():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return {t.name: GGML_QUANT_SIZES[t] for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


def check_config(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    c = lambda name: src.constant(name, None)  # noqa: E731
    for name in ("N_VOCAB", "N_EMBD", "N_LAYER", "N_FF", "CONTEXT_LENGTH", "ROPE_DIM"):
        if not (_is_int(c(name)) and c(name) > 0):
            f.append(f"{name} is not a positive integer literal")
    if not (_is_int(c("DATA_OFFSET")) and c("DATA_OFFSET") >= 0):
        f.append("DATA_OFFSET is not a non-negative integer literal")
    for name in ("RMS_EPS", "SCORE_SCALE"):
        if not (_is_num(c(name)) and c(name) > 0):
            f.append(f"{name} is not a positive finite number")
    arch = c("ARCHITECTURE")
    if not (isinstance(arch, str) and re.match(r"^[a-z][a-z0-9_]{0,63}$", arch)):
        f.append("ARCHITECTURE is not an identifier string")
    n_layer = ctx.n_layer()
    for name, kind in (("SLIDING_WINDOW", "int"), ("ROPE_BASE", "num"), ("ROPE_FREQ_SCALE", "num")):
        v = c(name)
        if not (isinstance(v, tuple) and len(v) == n_layer):
            f.append(f"{name} is not a tuple of N_LAYER={n_layer} values")
        elif kind == "int" and not all(_is_int(x) and x >= 0 for x in v):
            f.append(f"{name} holds something other than non-negative integers")
        elif kind == "num" and not all(_is_num(x) and x > 0 for x in v):
            f.append(f"{name} holds something other than positive numbers")
    rope_dim, head_dim = c("ROPE_DIM"), c("HEAD_DIM")
    if _is_int(rope_dim) and _is_int(head_dim) and (rope_dim % 2 or rope_dim > head_dim):
        f.append(f"ROPE_DIM {rope_dim} must be even and at most HEAD_DIM {head_dim}")
    forward = src.functions.get("forward")
    used_in_forward = _names_in(forward) if forward is not None else set()
    for name in ("EMBED_SCALE", "FINAL_LOGIT_SOFTCAP"):
        defined = name in src.assignments
        if defined and not (_is_num(c(name)) and c(name) > 0):
            f.append(f"{name} is not a positive finite number")
        if defined != (name in used_in_forward):
            f.append(
                f"{name} is {'defined' if defined else 'not defined'} but "
                f"{'not used' if defined else 'used'} in forward()"
            )

    # TENSORS layout: well-formed, inside the file, non-overlapping, and where the GGUF says
    tensors = ctx.tensors()
    if not tensors:
        f.append("TENSORS is missing, empty or not a literal dict")
    sizes = _ggml_sizes()
    regions = []
    for name, entry in tensors.items():
        if not (isinstance(entry, tuple) and len(entry) == 4):
            f.append(f"TENSORS[{name!r}] is not (type, shape, offset, nbytes)")
            continue
        gtype, shape, offset, nbytes = entry
        if gtype not in sizes:
            f.append(f"TENSORS[{name!r}] has unknown ggml type {gtype!r}")
        if not (isinstance(shape, tuple) and shape and all(_is_int(d) and d > 0 for d in shape)):
            f.append(f"TENSORS[{name!r}] shape {shape!r} is not a tuple of positive integers")
        if not (_is_int(offset) and offset >= 0 and _is_int(nbytes) and nbytes > 0):
            f.append(f"TENSORS[{name!r}] offset/nbytes are not non-negative integers")
            continue
        regions.append((offset, offset + nbytes, name))
    regions.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(regions, regions[1:]):
        if b0 < a1:
            f.append(f"TENSORS regions of {an!r} and {bn!r} overlap")
    prov = c("PROVENANCE")
    size = prov.get("source_size") if isinstance(prov, dict) else None
    if regions and _is_int(size) and _is_int(c("DATA_OFFSET")) and c("DATA_OFFSET") + regions[-1][1] > size:
        f.append(f"TENSORS region of {regions[-1][2]!r} ends past the end of the {size}-byte file")

    kernel_weights = None
    if "KERNEL_WEIGHTS" in src.assignments:
        kw = c("KERNEL_WEIGHTS")
        if isinstance(kw, (set, frozenset)):  # (`set()` when empty: ast.literal_eval reads it)
            kernel_weights = set(kw)
        if kernel_weights is None or not all(isinstance(n, str) for n in kernel_weights):
            f.append("KERNEL_WEIGHTS is not a literal set of tensor names")
            kernel_weights = None
        else:
            for n in sorted(kernel_weights - set(tensors)):
                f.append(f"KERNEL_WEIGHTS names {n!r}, which is not in TENSORS")
    inv = ctx.inventory
    compared = []
    if ctx.facts is not None:
        if c("DATA_OFFSET") != ctx.facts.data_offset:
            f.append(f"DATA_OFFSET {c('DATA_OFFSET')} != the GGUF data section offset {ctx.facts.data_offset}")
        if arch != ctx.facts.metadata.get("general.architecture"):
            f.append(
                f"ARCHITECTURE {arch!r} != general.architecture {ctx.facts.metadata.get('general.architecture')!r}"
            )
    if inv is not None:
        for name, entry in tensors.items():
            if name in inv and isinstance(entry, tuple) and len(entry) == 4:
                if (entry[2], entry[3]) != (inv[name][2], inv[name][3]):
                    f.append(
                        f"TENSORS[{name!r}] offset/nbytes {entry[2]}/{entry[3]} != {ctx.inventory_label}'s "
                        f"{inv[name][2]}/{inv[name][3]}"
                    )
        compared.append(f"offsets and sizes of the tensors match {ctx.inventory_label}")
    if ctx.ir is not None:
        for name, want in _ir_constants(ctx.ir).items():
            got = c(name) if name in src.assignments else None
            if got != want:
                f.append(f"{name} = {got!r} but the IR says {want!r}")
        act = ctx.ir.layers[0].mlp.activation.value
        mlp = src.functions.get("mlp_block")
        if mlp is not None:
            called = {dotted(n.func) for n in walk(mlp) if isinstance(n, cst.Call)}
            want_fn = "gelu" if act == "gelu_tanh" else "silu"
            if want_fn not in called or ({"gelu", "silu"} - {want_fn}) & called:
                f.append(f"mlp_block does not apply {want_fn}() ({act}, per the IR)")
        rope = src.functions.get("rope")
        if rope is not None:
            pairs = any(
                isinstance(n, cst.Call) and isinstance(n.func, cst.Attribute) and n.func.attr.value == "reshape"
                for n in walk(rope)
            )
            style = "norm" if pairs else "neox"
            if style != ctx.ir.rope_style.value:
                f.append(f"rope() rotates {style}-style pairs but the IR says {ctx.ir.rope_style.value}")
        want = {t.name for t in ctx.ir.tensors if getattr(t, "kernel", False)}
        if kernel_weights is not None and kernel_weights != want:
            diff = sorted(kernel_weights ^ want)
            f.append(
                f"KERNEL_WEIGHTS differs from the IR's kernel tensors ({len(kernel_weights)} vs {len(want)}; "
                f"e.g. {diff[0]!r})"
            )
        elif kernel_weights is None and want and "KERNEL_WEIGHTS" not in src.assignments:
            f.append(f"KERNEL_WEIGHTS is not defined, but the IR marks {len(want)} tensors for the kernels")
        compared.append(
            "every constant"
            + (" (KERNEL_WEIGHTS included)" if kernel_weights is not None else "")
            + ", the activation and the RoPE style agree with the IR"
        )
    if not compared:
        compared.append("no GGUF/IR given: internal consistency only")
    ok = (
        f"constants well-formed ({arch}, {n_layer} layers, d_model {c('N_EMBD')}, ffn {c('N_FF')}, "
        f"vocab {c('N_VOCAB')}); {len(tensors)} TENSORS regions in bounds and disjoint; " + "; ".join(compared)
    )
    return _result("config", f, ok)


# ---------------------------------------------------------------------------------------------------
# dequantization
# ---------------------------------------------------------------------------------------------------
def _params(fn: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in fn.params.params]


def _f32_test(test, type_param: str | None):
    """(param name, True if the branch is F32-only / False if it is the non-F32 side) for `t == "F32"`."""
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        left, comp = test.left, test.comparisons[0]
        right = comp.comparator
        if str_literal(left) == "F32":
            left, right = right, left
        if isinstance(left, cst.Name) and str_literal(right) == "F32" and (type_param in (None, left.value)):
            if isinstance(comp.operator, cst.Equal):
                return left.value, True
            if isinstance(comp.operator, cst.NotEqual):
                return left.value, False
    return None


def _mentions_float32(src: ModuleSource, node) -> bool:
    for n in walk(node):
        if isinstance(n, (cst.Name, cst.Attribute)) and src.qualname(n) == "numpy.float32":
            return True
        if str_literal(n) in ("float32", "<f4", "f4"):
            return True
    return False


def _analyze_dequantize_tensor(src: ModuleSource, f: list[str]) -> str | None:
    fn = src.functions.get("dequantize_tensor")
    if fn is None:
        f.append("dequantize_tensor() is missing")
        return None
    type_param = None
    for n in walk(fn.body):
        if isinstance(n, cst.If):
            t = _f32_test(n.test, None)
            if t:
                type_param = t[0]
                break
    params = _params(fn)
    if type_param is None:
        type_param = params[1] if len(params) > 1 else None
    if type_param not in params:
        f.append("dequantize_tensor() has no ggml type parameter")
        return None
    deq_calls = [n for n in walk(fn.body) if isinstance(n, cst.Call) and src.is_dequantizer(n.func)]
    if not deq_calls:
        f.append(
            "dequantize_tensor() never calls gguf.quants.dequantize (or an alchemist.kernels dequantizer): "
            "quantized tensors would reach the graph as raw bytes"
        )
    for call in deq_calls:
        if type_param not in _names_in(call):
            f.append(
                f"dequantize_tensor() calls `{src.code(call)}` with a type that is not its `{type_param}` argument"
            )
    dequantizer = src.qualname(deq_calls[0].func) if deq_calls else None

    tainted: set[str] = set()

    def is_tainted(expr) -> bool:
        for n in walk(expr):
            if isinstance(n, cst.Call) and src.is_dequantizer(n.func):
                return True
            if isinstance(n, cst.Name) and n.value in tainted:
                return True
        return False

    def visit(stmts, f32_only: bool):
        """Walk statements; a return outside the F32-only branch must carry a dequantized value."""
        returned = False
        for stmt in stmts:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Assign):
                        t = is_tainted(small.value)
                        for tgt in small.targets:
                            for n in walk(tgt.target):
                                if isinstance(n, cst.Name):
                                    (tainted.add if t else tainted.discard)(n.value)
                    elif isinstance(small, cst.Return):
                        returned = True
                        if small.value is None:
                            f.append("dequantize_tensor() has a bare return")
                        elif f32_only:
                            if not _mentions_float32(src, small.value):
                                f.append(f"the F32 branch returns `{src.code(small.value)}` without reading float32")
                        elif not is_tainted(small.value):
                            f.append(
                                f"dequantize_tensor() returns `{src.code(small.value)}` for non-F32 types "
                                "without dequantizing"
                            )
            elif isinstance(stmt, cst.If):
                t = _f32_test(stmt.test, type_param)
                body_f32 = f32_only or bool(t and t[1])
                else_f32 = f32_only or bool(t and not t[1])
                r1 = visit(stmt.body.body, body_f32)
                r2 = False
                if isinstance(stmt.orelse, cst.Else):
                    r2 = visit(stmt.orelse.body.body, else_f32)
                elif isinstance(stmt.orelse, cst.If):
                    r2 = visit([stmt.orelse], else_f32)
                if r1 and r2:
                    returned = True
            elif isinstance(stmt, (cst.For, cst.While, cst.With, cst.Try)):
                visit(stmt.body.body, f32_only)
        return returned

    visit(fn.body.body, False)
    return dequantizer


def _eval_guard(src: ModuleSource, test, name_var, type_var, entry_name, entry_type):
    """Three-valued truth of a load_weights guard for one TENSORS entry (None: cannot tell)."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        v = _eval_guard(src, test.expression, name_var, type_var, entry_name, entry_type)
        return None if v is None else not v
    if isinstance(test, cst.BooleanOperation):
        a = _eval_guard(src, test.left, name_var, type_var, entry_name, entry_type)
        b = _eval_guard(src, test.right, name_var, type_var, entry_name, entry_type)
        if isinstance(test.operator, cst.And):
            return False if (a is False or b is False) else (True if a and b else None)
        return True if (a is True or b is True) else (False if a is False and b is False else None)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        left, comp = test.left, test.comparisons[0]
        op, right = comp.operator, comp.comparator
        if not isinstance(left, cst.Name):
            if isinstance(right, cst.Name) and isinstance(op, (cst.Equal, cst.NotEqual)):
                left, right = right, left
            else:
                return None
        subject = (
            {name_var: entry_name, type_var: entry_type}.get(left.value) if left.value in (name_var, type_var) else None
        )
        if subject is None:
            return None
        if isinstance(op, (cst.Equal, cst.NotEqual)):
            s = str_literal(right)
            if s is None:
                return None
            return (subject == s) == isinstance(op, cst.Equal)
        if isinstance(op, (cst.In, cst.NotIn)):
            coll = _literal_collection(src, right)
            if coll is None:
                return None
            return (subject in coll) == isinstance(op, cst.In)
    return None


def _literal_collection(src: ModuleSource, node):
    import ast

    if isinstance(node, cst.Name):
        node = src.assignments.get(node.value)
        if node is None:
            return None
    if isinstance(node, cst.Call) and dotted(node.func) in ("frozenset", "set", "tuple") and len(node.args) == 1:
        node = node.args[0].value
    try:
        value = ast.literal_eval(src.module.code_for_node(node).strip())
    except (ValueError, SyntaxError, TypeError):
        return None
    return value if isinstance(value, (set, frozenset, tuple, list, dict)) else None


def _tensors_loop_vars(loop: cst.For):
    """(name var, type var) of `for name, (ggml_type, ...) in TENSORS.items()`."""
    t = loop.target
    if isinstance(t, cst.Name):
        return t.value, None
    if isinstance(t, cst.Tuple) and len(t.elements) == 2:
        a, b = t.elements[0].value, t.elements[1].value
        name_var = a.value if isinstance(a, cst.Name) else None
        type_var = None
        if isinstance(b, cst.Tuple) and b.elements and isinstance(b.elements[0].value, cst.Name):
            type_var = b.elements[0].value.value
        return name_var, type_var
    return None, None


def _iterates_tensors(loop: cst.For) -> bool:
    it = loop.iter
    if isinstance(it, cst.Name) and it.value == "TENSORS":
        return True
    return (
        isinstance(it, cst.Call)
        and isinstance(it.func, cst.Attribute)
        and dotted(it.func.value) == "TENSORS"
        and it.func.attr.value in ("items", "keys")
        and not it.args
    )


@dataclass
class RawStore:
    """A store of an entry in the dict load_weights returns."""

    # "dequantized" (dequantize_tensor with the entry's type: float32), "blocks" (an alchemist.kernels packer:
    # uint8 GGUF blocks), "kernel" (another alchemist.kernels call), "raw" (anything else)
    kind: str
    snippet: str
    guard: str  # the conditions it is under, as code ("" if none)


def _analyze_load_weights(ctx: Context, f: list[str]) -> dict[str, list[RawStore]]:
    """The stores load_weights may make for each name (kind "dequantized" for dequantize_tensor(raw, type, ..))."""
    src = ctx.src
    tensors = ctx.tensors()
    all_names = set(tensors)
    fn = src.functions.get("load_weights")
    if fn is None:
        f.append("load_weights() is missing")
        return {}
    loops = [n for n in walk(fn.body) if isinstance(n, cst.For) and _iterates_tensors(n)]
    if not loops:
        f.append("load_weights() does not loop over TENSORS, so not every entry is dequantized")
        return {}
    returned = [
        small.value
        for n in walk(fn.body)
        if isinstance(n, cst.SimpleStatementLine)
        for small in n.body
        if isinstance(small, cst.Return)
    ]
    result_vars = {r.value for r in returned if isinstance(r, cst.Name)}
    if not returned or not all(isinstance(r, cst.Name) for r in returned):
        f.append("load_weights() does not return the dict it fills")
        return {}
    raw: dict[str, list[RawStore]] = {}
    n_stores = 0

    def store_kind(value, type_var) -> str:
        if isinstance(value, cst.Call):
            if (
                isinstance(value.func, cst.Name)
                and value.func.value == "dequantize_tensor"
                and "dequantize_tensor" in src.functions
            ):
                if type_var is not None and type_var not in _names_in(value):
                    return "raw"  # e.g. dequantize_tensor(raw, "F32", shape): bypasses the type
                return "dequantized"
            if src.qualname(value.func) in BLOCK_PACKERS:
                return "blocks"
            if src.is_kernel(value.func):
                return "kernel"
        return "raw"

    def visit(stmts, guards, loop):
        nonlocal n_stores
        for stmt in stmts:
            if isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    targets = []
                    if isinstance(small, cst.Assign):
                        targets = [t.target for t in small.targets]
                    elif isinstance(small, cst.AugAssign):
                        targets = [small.target]
                    elif isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
                        func = small.value.func
                        if isinstance(func, cst.Attribute) and dotted(func.value) in result_vars:
                            f.append(
                                f"load_weights() fills its result with `{src.code(small)[:60]}`, "
                                "which the auditor cannot follow"
                            )
                    for tgt in targets:
                        if isinstance(tgt, cst.Name) and tgt.value in result_vars and isinstance(small, cst.Assign):
                            if not isinstance(small.value, cst.Dict) or small.value.elements:
                                f.append(f"load_weights() assigns its result `{src.code(small)[:60]}`")
                            continue
                        if not (isinstance(tgt, cst.Subscript) and dotted(tgt.value) in result_vars):
                            continue
                        n_stores += 1
                        name_var, type_var = _tensors_loop_vars(loop) if loop is not None else (None, None)
                        kind = store_kind(small.value if isinstance(small, cst.Assign) else None, type_var)
                        index = (
                            tgt.slice[0].slice.value
                            if len(tgt.slice) == 1 and isinstance(tgt.slice[0].slice, cst.Index)
                            else None
                        )
                        if loop is None or not (isinstance(index, cst.Name) and index.value == name_var):
                            lit = str_literal(index) if index is not None else None
                            candidates = {lit} if lit is not None else set(all_names)
                        else:
                            candidates = set()
                            for name in all_names:
                                entry = tensors[name]
                                etype = entry[0] if isinstance(entry, tuple) and entry else None
                                ok = True
                                for test, polarity in guards:
                                    v = _eval_guard(src, test, name_var, type_var, name, etype)
                                    if v is not None and v != polarity:
                                        ok = False
                                        break
                                if ok:
                                    candidates.add(name)
                        guard = " and ".join(
                            src.code(test) if polarity else f"not ({src.code(test)})" for test, polarity in guards
                        )
                        store = RawStore(kind, src.code(small), guard)
                        for name in candidates:
                            raw.setdefault(name, []).append(store)
            elif isinstance(stmt, cst.If):
                visit(stmt.body.body, guards + [(stmt.test, True)], loop)
                orelse = stmt.orelse
                if isinstance(orelse, cst.Else):
                    visit(orelse.body.body, guards + [(stmt.test, False)], loop)
                elif isinstance(orelse, cst.If):
                    visit([orelse], guards + [(stmt.test, False)], loop)
            elif isinstance(stmt, cst.For):
                inner = stmt if _iterates_tensors(stmt) else loop
                visit(stmt.body.body, [] if inner is not loop else guards, inner)
            elif isinstance(stmt, (cst.While, cst.With, cst.Try)):
                visit(stmt.body.body, guards, loop)

    visit(fn.body.body, [], None)
    if n_stores == 0:
        f.append("load_weights() never stores a tensor in the dict it returns")
    return raw


def _bind_args(call: cst.Call, names: tuple[str, ...]) -> dict[str, cst.Arg] | None:
    """param name -> Arg for a call of a function with positional parameters `names`, or None."""
    bound: dict[str, cst.Arg] = {}
    for i, a in enumerate(call.args):  # (the grammar puts positional arguments first)
        if a.star:
            return None
        key = names[i] if a.keyword is None and i < len(names) else a.keyword.value if a.keyword else None
        if key is None or key not in names or key in bound:
            return None
        bound[key] = a
    return bound


def _kernel_call(src: ModuleSource, node: cst.CSTNode):
    """(call, signature) if `node` is the GGUF-blocks argument of a known alchemist.kernels function."""
    arg = src.parents.get(node)
    if not isinstance(arg, cst.Arg) or arg.star or arg.value is not node:
        return None
    call = src.parents.get(arg)
    if not isinstance(call, cst.Call):
        return None
    sig = KERNEL_SIGNATURES.get(src.qualname(call.func))
    if sig is None:
        return None
    bound = _bind_args(call, sig.params)
    return (call, sig) if bound is not None and bound.get(sig.blocks) is arg else None


def _kernel_calls(src: ModuleSource):
    """(function, call, signature, bound args or None) for every call of a blocks-taking kernel in the graph."""
    for fname, fn in src.functions.items():
        if fname in LOADER_FUNCTIONS:
            continue
        for n in walk(fn.body):
            if isinstance(n, cst.Call):
                sig = KERNEL_SIGNATURES.get(src.qualname(n.func))
                if sig is not None:
                    yield fname, n, sig, _bind_args(n, sig.params)


def _kernel_use(src: ModuleSource, node: cst.CSTNode) -> bool:
    """True if this value is passed straight to an alchemist.kernels function as its GGUF blocks."""
    return _kernel_call(src, node) is not None


def _fn_of(src: ModuleSource, node) -> cst.FunctionDef | None:
    name = src.enclosing_function(node)
    return src.functions.get(name) if name else None


def _references(src: ModuleSource, fn: cst.FunctionDef, var: str) -> list[cst.Name]:
    """The Name nodes in fn's body that refer to the variable `var` (reads and bindings)."""
    out = []
    for n in walk(fn.body):
        if isinstance(n, cst.Name) and n.value == var:
            parent = src.parents.get(n)
            if isinstance(parent, cst.Attribute) and parent.attr is n:
                continue
            if isinstance(parent, cst.Arg) and parent.keyword is n:
                continue
            out.append(n)
    return out


def _single_binding(src: ModuleSource, fn: cst.FunctionDef, var: str):
    """(value expression, leftover tuple path) if `var` is a local of fn bound exactly once, by a plain
    assignment (`var = e`, or `a, (var, b) = e1, (e2, e3)` which gives e2), else None."""
    if var in _params(fn) or var in {p.name.value for p in fn.params.kwonly_params}:
        return None
    bindings = [n for n in _references(src, fn, var) if is_binding(src, n)]
    if len(bindings) != 1:
        return None
    node = bindings[0]
    path = []
    child, parent = node, src.parents.get(node)
    while isinstance(parent, (cst.Element, cst.Tuple, cst.List)):
        if isinstance(parent, (cst.Tuple, cst.List)):
            path.append([e for e in parent.elements].index(child))
        child, parent = parent, src.parents.get(parent)
    if isinstance(child, cst.StarredElement) or not isinstance(parent, cst.AssignTarget):
        return None
    assign = src.parents.get(parent)
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1:
        return None
    value = assign.value
    path.reverse()
    while path and isinstance(value, (cst.Tuple, cst.List)):
        elements = value.elements
        if any(isinstance(e, cst.StarredElement) for e in elements) or path[0] >= len(elements):
            return None
        value = elements[path[0]].value
        path = path[1:]
    return value, tuple(path)


def _name_key(src: ModuleSource, fn: cst.FunctionDef, index):
    """What a tensor-name expression denotes: ("param", p) for a weight-name helper's name parameter,
    ("pattern", "blk.{il}.attn_q.weight") for a name the auditor resolves, else None."""
    helper = src.weight_helpers().get(fn.name.value)
    if helper is not None and isinstance(index, cst.Name) and index.value == helper.name_param:
        return ("param", index.value)
    pattern = src._name_pattern(index, src._local_string_assignments(fn))
    return ("pattern", pattern) if pattern is not None else None


def _key_names(src: ModuleSource, key, fname: str, n_layer: int) -> list[str]:
    """The tensor names a _name_key can denote: a pattern's names over the layers, or for a weight-name
    helper's parameter the names of all its call sites."""
    if key[0] == "param":
        patterns = [u.pattern for u in src.weight_uses() if u.via == fname and u.pattern is not None]
    else:
        patterns = [key[1]]
    out = []
    for p in patterns:
        out.extend([p.replace("{il}", str(il)) for il in range(n_layer)] if "{il}" in p else [p])
    return sorted(set(out))


def _key_code(key) -> str:
    """TENSORS[name] / TENSORS['blk.{il}.attn_q.weight'] for a _name_key."""
    return f"TENSORS[{key[1]}]" if key[0] == "param" else f"TENSORS[{key[1]!r}]"


def _resolve(src: ModuleSource, fn: cst.FunctionDef, expr, depth: int = 0):
    """What an expression in fn denotes, as far as the kernel checks need:
    ("weight", key) for w[name]; ("tensors", key, path) for TENSORS[name][i][j]...; ("const", code) for an
    integer expression over literals and module constants; None for anything else."""
    if depth > 8:
        return None
    if isinstance(expr, cst.Subscript):
        if len(expr.slice) != 1 or not isinstance(expr.slice[0].slice, cst.Index):
            return None
        index = expr.slice[0].slice.value
        if isinstance(expr.value, cst.Name):
            base = expr.value.value
            if base == "TENSORS" and "TENSORS" in src.assignments and not _references_bind(src, fn, "TENSORS"):
                key = _name_key(src, fn, index)
                return ("tensors", key, ()) if key else None
            if base in WEIGHT_DICT_NAMES and base in _params(fn):
                key = _name_key(src, fn, index)
                return ("weight", key) if key else None
        inner = _resolve(src, fn, expr.value, depth + 1)
        i = int_literal(index)
        if inner is not None and inner[0] == "tensors" and i is not None and i >= 0:
            return ("tensors", inner[1], inner[2] + (i,))
        return None
    if isinstance(expr, cst.Name):
        binding = _single_binding(src, fn, expr.value)
        if binding is not None:
            value, path = binding
            r = _resolve(src, fn, value, depth + 1)
            if not path:
                return r
            return ("tensors", r[1], r[2] + path) if r is not None and r[0] == "tensors" else None
        if not _references_bind(src, fn, expr.value) and _is_int(src.constant(expr.value, None)):
            return ("const", expr.value)  # a module-level integer constant (N_VOCAB, ...)
        return None
    if int_literal(expr) is not None:
        return ("const", src.code(expr))
    if isinstance(expr, cst.BinaryOperation) and isinstance(
        expr.operator, (cst.Multiply, cst.FloorDivide, cst.Add, cst.Subtract)
    ):
        a, b = _resolve(src, fn, expr.left, depth + 1), _resolve(src, fn, expr.right, depth + 1)
        if a is not None and b is not None and a[0] == b[0] == "const":
            return ("const", src.code(expr))
    return None


def _references_bind(src: ModuleSource, fn: cst.FunctionDef, var: str) -> bool:
    return var in _params(fn) or any(is_binding(src, n) for n in _references(src, fn, var))


def _statement_of(src: ModuleSource, fn: cst.FunctionDef, node) -> int | None:
    """Index of the top-level statement of fn's body that contains node."""
    top = {id(s): i for i, s in enumerate(fn.body.body)}
    n = node
    while n is not None and id(n) not in top:
        n = src.parents.get(n)
    return top.get(id(n)) if n is not None else None


def _always_exits(block) -> bool:
    """The block ends in a return or raise, or in an if/else whose branches all do (control never falls out)."""
    body = block.body if isinstance(block, cst.IndentedBlock) else []
    if not body:
        return False
    last = body[-1]
    if isinstance(last, cst.SimpleStatementLine):
        return isinstance(last.body[-1], (cst.Return, cst.Raise))
    while isinstance(last, cst.If):
        if not _always_exits(last.body) or last.orelse is None:
            return False
        if isinstance(last.orelse, cst.Else):
            return _always_exits(last.orelse.body)
        last = last.orelse
    return False


def _is_dtype_guard(test, var: str) -> bool:
    """`var.dtype == "uint8"` (either way round)."""
    if not (isinstance(test, cst.Comparison) and len(test.comparisons) == 1):
        return False
    comp = test.comparisons[0]
    if not isinstance(comp.operator, cst.Equal):
        return False
    a, b = test.left, comp.comparator
    if str_literal(a) == "uint8":
        a, b = b, a
    return (
        str_literal(b) == "uint8"
        and isinstance(a, cst.Attribute)
        and a.attr.value == "dtype"
        and isinstance(a.value, cst.Name)
        and a.value.value == var
    )


@dataclass
class Flow:
    """Where the value of one weight read goes in its function."""

    var: str | None  # the local the read is bound to (`weight = w[name]`), if it is bound once
    sites: list  # the nodes that consume the value: the read itself, or each read of `var`
    guard: cst.If | None  # the `if var.dtype == "uint8":` guard (whose body exits), if the function has one
    zone: dict  # id(site) -> "test" (the guard's dtype test), "blocks" (inside the guard), "float" (after it)
    problem: str | None  # why the guard does not hold (None when there is one)


def _flow(src: ModuleSource, read: cst.CSTNode) -> Flow:
    fn = _fn_of(src, read)
    parent = src.parents.get(read)
    target = parent.targets[0].target if isinstance(parent, cst.Assign) and len(parent.targets) == 1 else None
    if fn is None or not (isinstance(target, cst.Name) and parent.value is read):
        return Flow(None, [read], None, {}, None)
    var = target.value
    binding = _single_binding(src, fn, var)
    i = _statement_of(src, fn, parent)
    if binding is None or binding[0] is not read or i is None or fn.body.body[i] is not src.parents.get(parent):
        return Flow(None, [read], None, {}, f"`{var}` is rebound, or not bound at the top level of {fn.name.value}()")
    sites = [n for n in _references(src, fn, var) if n is not target]
    zone: dict[int, str] = {}
    by_stmt = sorted({_statement_of(src, fn, n) for n in sites} - {None})
    if not by_stmt or by_stmt[0] <= i:
        return Flow(var, sites, None, zone, f"`{var}` is read before (or where) it is bound")
    j = by_stmt[0]
    guard = fn.body.body[j]
    if not (isinstance(guard, cst.If) and _is_dtype_guard(guard.test, var)):
        return Flow(var, sites, None, zone, f'its first use is not an `if {var}.dtype == "uint8":` guard')
    if not _always_exits(guard.body):
        return Flow(var, sites, None, zone, f'the `if {var}.dtype == "uint8":` branch does not end in a return')
    test_ids = {id(n) for n in walk(guard.test)}
    body_ids = {id(n) for n in walk(guard.body)}
    for n in sites:
        zone[id(n)] = "test" if id(n) in test_ids else "blocks" if id(n) in body_ids else "float"
    return Flow(var, sites, guard, zone, None)


def _is_linear_weight(src: ModuleSource, node) -> bool:
    """`node` is the weight argument of linear(x, weight, bias)."""
    arg = src.parents.get(node)
    call = src.parents.get(arg) if isinstance(arg, cst.Arg) else None
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value == "linear"):
        return False
    bound = _bind_args(call, tuple(_params(src.functions["linear"]))) if "linear" in src.functions else None
    params = _params(src.functions["linear"]) if "linear" in src.functions else []
    return bound is not None and len(params) > 1 and bound.get(params[1]) is arg


def _orientation_problem(src: ModuleSource, read, role: str) -> str | None:
    """Why a weight read of this role is not applied as x @ W.T (or gathered by row, for the embedding)."""
    flow = _flow(src, read)
    for n in flow.sites if flow.var is not None else [read]:
        parent = src.parents.get(n)
        if _kernel_use(src, n) or _is_linear_weight(src, n):
            continue
        if isinstance(parent, cst.Attribute) and parent.value is n and parent.attr.value == "dtype":
            continue  # metadata (the blocks/float32 test)
        if role == "embedding" and isinstance(parent, cst.Subscript) and parent.value is n:
            continue  # row gather: token_embd is (N_VOCAB, N_EMBD)
        return f"used as `{_site_snippet(src, n)}` in {src.enclosing_function(n)}(), outside linear()/a kernel" + (
            " or a row gather" if role == "embedding" else ""
        )
    return None


def _site_snippet(src: ModuleSource, node) -> str:
    """The code around a use: its enclosing call, subscript or statement, shortened."""
    n = src.parents.get(node)
    while n is not None and not isinstance(n, (cst.Call, cst.Subscript, cst.BaseSmallStatement)):
        n = src.parents.get(n)
    text = src.code(n if n is not None else node)
    return text if len(text) <= 80 else text[:77] + "..."


def _raw_read_problem(src: ModuleSource, read) -> tuple[str | None, bool]:
    """(why GGUF blocks from this weight read could reach something other than a kernel, or None;
    True if the read relies on a `.dtype == "uint8"` guard, which needs the blocks to be uint8)."""
    if _kernel_use(src, read):
        return None, False
    flow = _flow(src, read)
    fname = src.enclosing_function(read)
    if flow.var is None:
        return f"{fname}() uses it as `{_site_snippet(src, read)}`, not through an alchemist.kernels function", False
    if flow.guard is None:
        return (
            f"{fname}() binds it to `{flow.var}` and {flow.problem}, so GGUF blocks could reach "
            f"`{_site_snippet(src, flow.sites[0]) if flow.sites else flow.var}`"
        ), False
    for n in flow.sites:
        if flow.zone.get(id(n)) == "blocks" and not _kernel_use(src, n):
            return (
                f'inside `if {flow.var}.dtype == "uint8":` {fname}() uses `{flow.var}` as '
                f"`{_site_snippet(src, n)}`, not as the blocks of an alchemist.kernels function"
            ), True
    return None, True


def check_dequantization(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    tensors = ctx.tensors()
    sizes = _ggml_sizes()
    inv = ctx.inventory
    types: dict[str, int] = {}
    for name, entry in tensors.items():
        if not (isinstance(entry, tuple) and len(entry) == 4):
            continue
        gtype, shape, _, nbytes = entry
        types[gtype] = types.get(gtype, 0) + 1
        if inv is not None and name in inv and inv[name][0] != gtype:
            f.append(f"TENSORS[{name!r}] claims type {gtype} but {ctx.inventory_label} stores {inv[name][0]}")
        if gtype in sizes and isinstance(shape, tuple) and all(_is_int(d) for d in shape) and _is_int(nbytes):
            block, type_size = sizes[gtype]
            n = math.prod(shape)
            if n % block or n // block * type_size != nbytes:
                f.append(f"TENSORS[{name!r}]: {nbytes} bytes is not {gtype} data for {n} elements")
    dequantizer = _analyze_dequantize_tensor(src, f)
    stores_of = _analyze_load_weights(ctx, f)
    raw = {nm: kept for nm, st in stores_of.items() if (kept := [x for x in st if x.kind != "dequantized"])}

    helpers = src.weight_helpers()
    n_layer = ctx.n_layer()
    by_name: dict[str, list] = {}
    for use in ctx.uses():
        if use.pattern is None and raw:
            f.append(
                f"{use.function}: `{use.snippet}` reads a weight by a name the auditor cannot resolve while "
                "load_weights keeps some tensors undequantized"
            )
        for nm in use.names(n_layer):
            by_name.setdefault(nm, []).append(use)
    kernel_names: set[str] = set()
    routes: dict[str, bool] = {}  # function holding a read of blocks -> True if it relies on a dtype guard
    verdicts: dict[int, tuple] = {}
    for nm in sorted(raw):
        stores = raw[nm]
        problem = None
        for use in by_name.get(nm, []):
            for read in helpers[use.via].reads if use.via else [use.node]:
                if id(read) not in verdicts:
                    verdicts[id(read)] = _raw_read_problem(src, read)
                why, guarded = verdicts[id(read)]
                fname = src.enclosing_function(read)
                if why is None and guarded:
                    other = [st for st in stores if st.kind != "blocks"]
                    if other:
                        why = (
                            f"load_weights may store it as `{other[0].snippet}`, not as uint8 GGUF blocks "
                            f"({', '.join(p.rsplit('.', 1)[-1] for p in BLOCK_PACKERS)}), so the "
                            f'`.dtype == "uint8"` test in {fname}() cannot tell it from float32'
                        )
                if why is not None:
                    problem = (use, why)
                    break
                routes[fname] = routes.get(fname, False) or guarded
            if problem:
                break
        if problem:
            use, why = problem
            where = f" and {use.function}() reads it as `{use.snippet}`;" if use.via else ", but"
            gtype = tensors[nm][0] if isinstance(tensors.get(nm), tuple) and tensors[nm] else "?"
            f.append(f"{nm} ({gtype}) may be stored undequantized by load_weights{where} {why}")
        else:
            kernel_names.add(nm)
    kernels_used: set[str] = set()
    for fname, call, sig, bound in _kernel_calls(src):
        if bound is None:
            f.append(f"{fname}(): `{src.code(call)}`: the auditor cannot bind its arguments")
            continue
        kernels_used.add(src.qualname(call.func).rsplit(".", 1)[-1])
        fn = src.functions[fname]
        blocks, type_arg = bound.get(sig.blocks), bound.get(sig.ggml_type)
        w = _resolve(src, fn, blocks.value) if blocks is not None else None
        if w is None or w[0] != "weight":
            f.append(
                f"{fname}(): `{src.code(call)}`: its {sig.blocks} are not a w[...] read the auditor can trace, so "
                "their ggml type cannot be checked against TENSORS"
            )
            continue
        guarded_blocks = False
        if isinstance(blocks.value, cst.Name):
            binding = _single_binding(src, fn, blocks.value.value)
            if binding is not None and not binding[1]:
                flow = _flow(src, binding[0])
                guarded_blocks = flow.guard is not None and flow.zone.get(id(blocks.value)) == "blocks"
        if not guarded_blocks:  # unguarded: only tensors that load_weights never dequantizes may reach it
            for nm in _key_names(src, w[1], fname, n_layer):
                floats = [st for st in stores_of.get(nm, []) if st.kind == "dequantized"]
                if floats:
                    f.append(
                        f"{fname}(): `{src.code(call)}` takes {nm} as GGUF blocks, but load_weights may store it "
                        f"as float32 (`{floats[0].snippet}`"
                        + (f" when {floats[0].guard}" if floats[0].guard else "")
                        + '), which the kernel cannot read: test `.dtype == "uint8"` first (like project())'
                    )
                    break
        t = _resolve(src, fn, type_arg.value) if type_arg is not None else None
        if t != ("tensors", w[1], (0,)):
            shown = src.code(type_arg.value) if type_arg is not None else "missing"
            binding = _single_binding(src, fn, type_arg.value.value) if isinstance(type_arg.value, cst.Name) else None
            if binding is not None and not binding[1]:
                shown += f"` (= `{src.code(binding[0])}`)"
            else:
                shown += "`"
            f.append(
                f"{fname}(): `{src.code(call)}`: {sig.ggml_type} is `{shown}, not TENSORS[name][0] of the weight "
                f"`{src.code(blocks.value)}` it decodes"
            )

    n_q = sum(v for k, v in types.items() if k != "F32")
    type_list = ", ".join(f"{k}×{v}" for k, v in sorted(types.items()))
    route = f"load_weights routes all {len(tensors)} TENSORS entries through dequantize_tensor"
    if raw and not f:
        guards = sorted({st.guard for nm in kernel_names for st in raw[nm]})
        packers = sorted({st.kind for nm in kernel_names for st in raw[nm]})
        kw = src.constant("KERNEL_WEIGHTS", None)
        label = " KERNEL_WEIGHTS" if isinstance(kw, (set, frozenset)) and set(kw) == kernel_names else ""
        guarded = sorted(fn for fn, g in routes.items() if g)
        direct = sorted(fn for fn, g in routes.items() if not g)
        reach = []
        if guarded:
            reach.append(
                "/".join(f"{fn}()" for fn in guarded)
                + ", which pass them to "
                + "/".join(sorted(kernels_used))
                + ' with the ggml type from TENSORS[name] when `weight.dtype == "uint8"` (a branch that returns) '
                "and use float32 weights as they are"
            )
        if direct:
            reach.append("straight into alchemist.kernels calls in " + "/".join(f"{fn}()" for fn in direct))
        route = (
            "load_weights dequantizes every TENSORS entry"
            + (f", except that under `if {' / '.join(guards)}:`" if all(guards) else ", except that")
            + f" {len(kernel_names)} quantized{label} tensors stay in GGUF blocks"
            + (" (as_blocks: uint8, one row of blocks per output)" if packers == ["blocks"] else "")
            + f"; those reach the graph only through {' and '.join(reach)}"
        )
    ok = (
        f"{route}; dequantize_tensor calls {dequantizer} with the entry's type for every non-F32 type "
        f"({n_q} of {len(tensors)} tensors quantized; {type_list}); the F32 branch reads float32; byte sizes agree "
        "with the types" + (f" and with {ctx.inventory_label}" if inv is not None else "")
    )
    return _result("dequantization", f, ok)


# ---------------------------------------------------------------------------------------------------
# orientation
# ---------------------------------------------------------------------------------------------------
def _constant_values(src: ModuleSource) -> dict[str, int]:
    out = {}
    for name in CONSTANT_DIMS:
        v = src.constant(name, None)
        if _is_int(v):
            out[name] = v
    return out


def _expected_numeric(spec_shape, values) -> tuple | None:
    dims = []
    for d in spec_shape:
        v = numeric(prod(d), values)
        if v is None or v.denominator != 1:
            return None
        dims.append(int(v))
    return tuple(dims)


def _transposed_product(src: ModuleSource, node, x: str, weight: str) -> bool | None:
    """For a dot/matmul/@ node: True if it is x @ weight.T, False if it is another product of x and weight."""
    if isinstance(node, cst.Call):
        q = src.qualname(node.func)
        if q not in ("pytensor.tensor.dot", "pytensor.tensor.matmul", "pytensor.tensor.basic.dot"):
            return None
        args = [a.value for a in node.args if a.keyword is None]
        if len(args) != 2:
            return False
        a, b = args
    elif isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
        a, b = node.left, node.right
    else:
        return None

    def is_transposed_weight(e) -> bool:
        if isinstance(e, cst.Attribute) and e.attr.value == "T" and dotted(e.value) == weight:
            return True
        if isinstance(e, cst.Call) and not [x for x in e.args if x.keyword is None][1:]:
            if (
                isinstance(e.func, cst.Attribute)
                and e.func.attr.value == "transpose"
                and dotted(e.func.value) == weight
                and not e.args
            ):
                return True
            if (
                src.qualname(e.func) == "pytensor.tensor.transpose"
                and len(e.args) == 1
                and dotted(e.args[0].value) == weight
            ):
                return True
        return False

    return dotted(a) == x and is_transposed_weight(b)


def _transposed_of_weight_product(src: ModuleSource, node, x: str, weight: str):
    """The inner product node if `node` is (W @ x.T).T -- the same x @ W.T, written so that XLA multiplies
    a row-major (n_out, n_in) weight without transposing it -- else None."""
    if not (isinstance(node, cst.Attribute) and node.attr.value == "T"):
        return None
    inner = node.value
    # `_transposed_product(inner, weight, x)` asks: is inner == weight @ x.T ?
    return inner if _transposed_product(src, inner, weight, x) else None


def check_orientation(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    tensors = ctx.tensors()
    inv = ctx.inventory
    values = _constant_values(src)
    sizes = _ggml_sizes()
    n_layer = ctx.n_layer()
    n_checked = 0
    for name, entry in tensors.items():
        if not (isinstance(entry, tuple) and len(entry) == 4 and isinstance(entry[1], tuple)):
            continue
        gtype, shape = entry[0], entry[1]
        if inv is not None and name in inv and tuple(inv[name][1]) != shape:
            f.append(f"TENSORS[{name!r}] shape {shape} != {ctx.inventory_label}'s {inv[name][1]} (GGUF ne reversed)")
        layer, _ = split_layer_name(name)
        spec = tensor_spec(name)
        if spec is not None:
            if layer is not None and not 0 <= layer < n_layer:
                f.append(f"{name}: layer {layer} outside range(N_LAYER={n_layer})")
            want = _expected_numeric(spec[1], values)
            if want is None:
                f.append(f"{name}: the constants needed for its expected shape are missing")
            elif want != shape:
                sym = "(" + ", ".join(str(prod(d)) for d in spec[1]) + ("," if len(spec[1]) == 1 else "") + ")"
                f.append(f"TENSORS[{name!r}] shape {shape} != {sym} = {want} from the constants")
            n_checked += 1
        if gtype in sizes and gtype != "F32" and shape and _is_int(shape[-1]) and shape[-1] % sizes[gtype][0]:
            f.append(f"TENSORS[{name!r}]: rows of {shape[-1]} values are not whole {gtype} blocks of {sizes[gtype][0]}")

    linear = src.functions.get("linear")
    if linear is None:
        f.append("linear() is missing")
    else:
        params = _params(linear)
        if len(params) < 2:
            f.append("linear() does not take (x, weight)")
        else:
            x, weight = params[0], params[1]
            nodes = list(walk(linear.body))
            wrapped = {
                id(i) for i in (_transposed_of_weight_product(src, n, x, weight) for n in nodes) if i is not None
            }
            forms = [(n, True if id(n) in wrapped else _transposed_product(src, n, x, weight)) for n in nodes]
            forms = [(n, ok) for n, ok in forms if ok is not None]
            if not forms:
                f.append("linear() computes no pt.dot/pt.matmul/@ product")
            for n, ok in forms:
                if not ok:
                    f.append(f"linear() computes `{src.code(n)}`, not {x} @ {weight}.T for W stored (n_out, n_in)")

    helpers = src.weight_helpers()
    routes: dict[str, set[str]] = {}  # role -> how its weights are applied ("linear()", "project()", ...)
    for use in ctx.uses():
        if use.pattern is None:
            continue
        spec = tensor_spec(use.pattern)
        if spec is None:
            continue
        role = spec[0]
        if role not in ("linear", "embedding"):
            continue
        reads = helpers[use.via].reads if use.via else [use.node]
        bad = next((b for b in (_orientation_problem(src, r, role) for r in reads) if b), None)
        if bad:
            f.append(f"{use.function}: `{use.snippet}` is a {role} weight {bad}")
        elif use.via:
            routes.setdefault(role, set()).add(f"{use.via}()")
        else:
            routes.setdefault(role, set()).add(f"{use.function}()")

    interp = ctx.interp()
    kernel_forms = []
    for fname, call, sig, bound in _kernel_calls(src):
        fn = src.functions[fname]
        blocks = bound.get(sig.blocks) if bound else None
        w = _resolve(src, fn, blocks.value) if blocks is not None else None
        if w is None or w[0] != "weight":
            continue  # reported by the dequantization check
        kname = src.qualname(call.func).rsplit(".", 1)[-1]
        shown, how = [], set()
        for what, path in ((sig.rows, (1, 0)), (sig.cols, (1, 1))):
            arg = bound.get(what)
            r = _resolve(src, fn, arg.value) if arg is not None else None
            code = src.code(arg.value) if arg is not None else "missing"
            shown.append(code)
            how.add("tensors" if r is not None and r[0] == "tensors" else "const")
            if r == ("tensors", w[1], path):
                continue
            if r is not None and r[0] == "tensors":
                f.append(
                    f"{fname}(): `{src.code(call)}`: {what} is `{code}` = {_key_code(r[1])}"
                    f"{''.join(f'[{i}]' for i in r[2])}, but the weight's stored {what} is "
                    f"{_key_code(w[1])}[1][{path[1]}]"
                )
            elif r is not None and r[0] == "const" and w[1][0] == "pattern":
                value = src._eval_const(arg.value, 0)
                names = [w[1][1].replace("{il}", str(il)) for il in range(n_layer)] if "{il}" in w[1][1] else [w[1][1]]
                for nm in names:
                    entry = tensors.get(nm)
                    stored = entry[1] if isinstance(entry, tuple) and len(entry) == 4 else None
                    if not (isinstance(stored, tuple) and len(stored) == 2 and stored[path[1]] == value):
                        f.append(
                            f"{fname}(): `{src.code(call)}`: {what} is `{code}` = {value!r}, but {nm} is "
                            f"stored {stored!r} ({sig.rows}, {sig.cols})"
                        )
                        break
            elif not (r is not None and r[0] == "const" and id(call) in interp.kernel_checked):
                f.append(
                    f"{fname}(): `{src.code(call)}`: {what} is `{code}`, neither {_key_code(w[1])}[1][{path[1]}] "
                    "nor a size constant the auditor could compare with the weight's shape"
                )
        kernel_forms.append(
            f"{fname}(): {kname}(…, {', '.join(shown)})"
            + (
                f" from {_key_code(w[1])}[1]"
                if how == {"tensors"}
                else f", equal to {_key_code(w[1])}[1]"
                + (" and to its symbolic shape" if id(call) in interp.kernel_checked else "")
            )
        )
    f.extend(interp.kernel_errors)
    lin = "/".join(sorted(routes.get("linear", ()))) or "linear()"
    emb = " and ".join(sorted(routes.get("embedding", ()))) or "a row gather"
    ok = (
        f"{len(tensors)} TENSORS shapes"
        + (f" equal {ctx.inventory_label}'s (ne reversed)" if inv else "")
        + f"; {n_checked} match the (n_out, n_in) shapes implied by N_HEAD·HEAD_DIM, N_KV_HEAD·HEAD_DIM, N_EMBD, "
        f"N_FF, N_VOCAB; linear() computes x @ weight.T; every projection weight is applied by {lin} "
        f"(token_embd by {emb}), where it is only linear()'s weight, the blocks of a kernel or (the embedding) "
        "gathered by row"
        + (f"; the kernels get the weight's stored (rows, columns): {'; '.join(kernel_forms)}" if kernel_forms else "")
    )
    return _result("orientation", f, ok)


# ---------------------------------------------------------------------------------------------------
# heads
# ---------------------------------------------------------------------------------------------------
def check_heads(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    n_head, n_kv, head_dim, group = (src.constant(n, None) for n in ("N_HEAD", "N_KV_HEAD", "HEAD_DIM", "GROUP_SIZE"))
    if not all(_is_int(v) and v > 0 for v in (n_head, n_kv, head_dim)):
        f.append("N_HEAD, N_KV_HEAD and HEAD_DIM must be positive integer literals")
    else:
        if n_head % n_kv:
            f.append(f"N_KV_HEAD {n_kv} does not divide N_HEAD {n_head}")
        if group != n_head // n_kv:
            f.append(f"GROUP_SIZE {group!r} != N_HEAD // N_KV_HEAD = {n_head // n_kv}")
    gnode = src.assignments.get("GROUP_SIZE")
    if gnode is not None and int_literal(gnode) is None and _names_in(gnode) - {"N_HEAD", "N_KV_HEAD"}:
        f.append(f"GROUP_SIZE is defined from `{src.code(gnode)}`")
    agree = ""
    if ctx.ir is not None:
        if not ctx.ir.uniform_layers:
            f.append("the IR's layers have different head shapes")
        att = ctx.ir.layers[0].attention
        for name, got, want in (
            ("N_HEAD", n_head, att.n_head),
            ("N_KV_HEAD", n_kv, att.n_kv_head),
            ("HEAD_DIM", head_dim, att.head_dim),
            ("GROUP_SIZE", group, att.group_size),
        ):
            if got != want:
                f.append(f"{name} = {got!r} but the IR says {want}")
        agree = " (agree with the IR)"
    interp = ctx.interp()
    f.extend(interp.errors)
    if "causal_attention" in src.functions and not isinstance(interp.returns.get("causal_attention"), Arr):
        f.append("could not infer the output shape of causal_attention()")
    fwd = interp.returns.get("forward")
    if "forward" in src.functions and not (getattr(fwd, "items", None) and isinstance(fwd.items[0], Arr)):
        f.append("could not follow the shapes from the token embedding to the logits in forward()")
    strict = [r for r in interp.reshapes if r.function in STRICT_FUNCTIONS]
    verified = [r for r in interp.reshapes if r.verified]
    if "attention_block" in src.functions and not strict:
        f.append("no head split/merge reshape found in attention_block()/causal_attention()")
    ok = (
        f"N_HEAD {n_head} = N_KV_HEAD {n_kv} × GROUP_SIZE {group}, HEAD_DIM {head_dim}{agree}; "
        f"{len(verified)} reshapes regroup their input symbolically ({len(strict)} head split/merge in "
        "attention_block/causal_attention); projections, attention and the cache agree on head shapes "
        "from the token embedding to the logits"
        + (
            f" ({'/'.join(f'{h}()' for h in sorted(src.weight_helpers()))} "
            f"give{'s' if len(src.weight_helpers()) == 1 else ''} the shape of linear(x, w[name]) on every path, "
            "kernel or float32)"
            if src.weight_helpers()
            else ""
        )
    )
    return _result("heads", f, ok)


# ---------------------------------------------------------------------------------------------------
# coverage
# ---------------------------------------------------------------------------------------------------
def check_coverage(ctx: Context) -> CheckResult:
    src, f = ctx.src, []
    tensors = ctx.tensors()
    n_layer = ctx.n_layer()
    ignored: dict[str, str] = {}
    ig = src.constant("IGNORED_TENSORS", None) if "IGNORED_TENSORS" in src.assignments else {}
    if not isinstance(ig, dict):
        f.append("IGNORED_TENSORS is not a literal dict")
        ig = {}
    for k, v in ig.items():
        if not (isinstance(v, str) and v.strip()):
            f.append(f"IGNORED_TENSORS[{k!r}] gives no reason")
        ignored[k] = v
    if ctx.ir is not None:
        for name, reason in ctx.ir.ignored_tensors:
            ignored.setdefault(name, reason)
    forward = src.functions.get("forward")
    if forward is not None:
        loops = [
            n
            for n in walk(forward.body)
            if isinstance(n, cst.For) and isinstance(n.target, cst.Name) and n.target.value == "il"
        ]
        full = [
            n
            for n in loops
            if isinstance(n.iter, cst.Call)
            and dotted(n.iter.func) == "range"
            and len(n.iter.args) == 1
            and dotted(n.iter.args[0].value) == "N_LAYER"
        ]
        if not full:
            f.append("forward() has no `for il in range(N_LAYER)` layer loop, so some layers' tensors may go unused")
    used: dict[str, str] = {}
    patterns = set()
    vias: set[str] = set()
    via_patterns: set[str] = set()
    for use in ctx.uses():
        if use.pattern is None:
            f.append(
                f"{use.function}: `{use.snippet}` "
                + (use.problem or "reads a weight by a name the auditor cannot resolve")
            )
            continue
        patterns.add(use.pattern)
        if use.via:
            vias.add(use.via)
            via_patterns.add(use.pattern)
        for nm in use.names(n_layer):
            used.setdefault(nm, use.function)
    for nm in sorted(set(used) - set(tensors), key=lambda s: (s.startswith("blk."), s)):
        f.append(f"{used[nm]} reads w[{nm!r}], which is not in TENSORS (the file has no such tensor)")
    inv = ctx.inventory
    if inv is not None:
        for nm in [n for n in used if n in tensors and n not in inv]:
            f.append(f"{used[nm]} reads {nm!r}, which {ctx.inventory_label} does not have")
        for nm in inv:
            if nm not in tensors and nm not in ignored:
                f.append(f"{ctx.inventory_label} tensor {nm!r} is neither in TENSORS nor ignored with a reason")
        for nm in tensors:
            if nm not in inv:
                f.append(f"TENSORS entry {nm!r} is not in {ctx.inventory_label}")
    for nm in tensors:
        if nm not in used and nm not in ignored:
            f.append(f"TENSORS entry {nm!r} is never used by the graph (nor ignored with a reason)")
        if nm in used and nm in ignored:
            f.append(f"{nm!r} is both used by the graph and listed as ignored")
    n_inv = len(inv) if inv is not None else len(tensors)
    n_via = len(via_patterns)
    ok = (
        f"all {n_inv} tensors"
        + (f" of {ctx.inventory_label}" if inv is not None else " in TENSORS")
        + f" are read by the graph ({len(patterns)} name patterns over {n_layer} layers"
        + (
            f", {n_via} of them through the weight-name helper"
            + ("s " if len(vias) > 1 else " ")
            + "/".join(f"{h}()" for h in sorted(vias))
            if vias
            else ""
        )
        + ")"
        + (f" or ignored with a reason ({len(ignored)})" if ignored else ", none ignored")
        + "; the graph reads no name the file lacks"
    )
    return _result("coverage", f, ok)


CHECKS = {
    "provenance": check_provenance,
    "syntax": check_syntax,
    "format": check_format,
    "safety": check_safety,
    "config": check_config,
    "dequantization": check_dequantization,
    "orientation": check_orientation,
    "heads": check_heads,
    "coverage": check_coverage,
}
