"""A parsed generated module, read without running it: libcst tree, literal constants, imports, weight uses.

Nothing here imports or executes the audited module. Constants are read with `ast.literal_eval` on the
source text of their right-hand side (literals only; a few inert integer expressions such as
`N_HEAD // N_KV_HEAD` are evaluated by a tiny arithmetic evaluator over other constants).
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

import libcst as cst

# Functions of the loader side: the only place the GGUF file is read and decoded.
LOADER_FUNCTIONS = ("dequantize_tensor", "load_weights")
# Functions the template defines; the graph is everything that is not the loader.
REQUIRED_FUNCTIONS = (
    "dequantize_tensor",
    "load_weights",
    "linear",
    "rms_norm",
    "rope",
    "causal_attention",
    "attention_block",
    "mlp_block",
    "forward",
)
REQUIRED_CONSTANTS = (
    "PROVENANCE",
    "ARCHITECTURE",
    "N_VOCAB",
    "N_EMBD",
    "N_LAYER",
    "N_HEAD",
    "N_KV_HEAD",
    "HEAD_DIM",
    "GROUP_SIZE",
    "N_FF",
    "CONTEXT_LENGTH",
    "RMS_EPS",
    "ROPE_DIM",
    "SCORE_SCALE",
    "SLIDING_WINDOW",
    "ROPE_BASE",
    "ROPE_FREQ_SCALE",
    "DATA_OFFSET",
    "TENSORS",
)
WEIGHT_DICT_NAMES = ("w",)  # the graph functions' weights parameter
LAYER_VAR = "il"
KERNELS_MODULE = "alchemist.kernels"


class KernelSignature(NamedTuple):
    params: tuple[str, ...]  # positional parameters, in order
    blocks: str  # the GGUF blocks (uint8, one row of blocks per stored row)
    ggml_type: str
    rows: str  # the stored shape (rows, columns) of the blocks' tensor
    cols: str


# The alchemist.kernels functions the graph may hand GGUF blocks to.
KERNEL_SIGNATURES = {
    f"{KERNELS_MODULE}.quantized_linear": KernelSignature(
        ("x", "w_blocks", "ggml_type", "n_out", "n_in"), "w_blocks", "ggml_type", "n_out", "n_in"
    ),
    f"{KERNELS_MODULE}.quantized_embedding": KernelSignature(
        ("w_blocks", "indices", "ggml_type", "n_rows", "n_in"), "w_blocks", "ggml_type", "n_rows", "n_in"
    ),
}
# alchemist.kernels functions that turn a tensor's raw GGUF bytes into uint8 (n_out, row_bytes) blocks
BLOCK_PACKERS = (KERNELS_MODULE + ".as_blocks",)
DEQUANTIZERS = ("gguf.quants.dequantize", "gguf.dequantize")

_NOT_LITERAL = object()


class ParseFailure(Exception):
    pass


# Formatting-only nodes: they hold no names, calls or literals, so walks skip them (and their subtrees).
_TRIVIA = (
    cst.BaseParenthesizableWhitespace,
    cst.TrailingWhitespace,
    cst.EmptyLine,
    cst.Newline,
    cst.Comment,
    cst.Comma,
    cst.LeftParen,
    cst.RightParen,
    cst.Colon,
    cst.Semicolon,
    cst.AssignEqual,
    cst.Dot,
    cst.LeftSquareBracket,
    cst.RightSquareBracket,
    cst.LeftCurlyBrace,
    cst.RightCurlyBrace,
)
_FIELDS: dict[type, tuple[str, ...]] = {}


def children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The non-trivia child nodes, read from the dataclass fields (much cheaper than CSTNode.children)."""
    names = _FIELDS.get(type(node))
    if names is None:
        names = _FIELDS[type(node)] = tuple(f.name for f in dataclasses.fields(node))
    out = []
    for name in names:
        v = getattr(node, name)
        if isinstance(v, cst.CSTNode):
            if not isinstance(v, _TRIVIA):
                out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, cst.CSTNode) and not isinstance(x, _TRIVIA))
    return out


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Every (non-trivia) node below and including `node`, depth first."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(children(n)))


def dotted(node: cst.CSTNode) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def int_literal(node: cst.CSTNode) -> int | None:
    if isinstance(node, cst.Integer):
        return int(node.value.replace("_", ""), 0)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        v = int_literal(node.expression)
        return None if v is None else -v
    return None


def str_literal(node: cst.CSTNode) -> str | None:
    """The value of a plain (unprefixed or r-prefixed, non-f, non-bytes) single string literal."""
    if isinstance(node, cst.SimpleString) and "b" not in node.prefix.lower():
        return ast.literal_eval(node.value)
    return None


@dataclass
class Use:
    """One weight read in the graph -- a `w[...]` subscript, or a call of a weight-name helper such as
    `project(x, w, p + "attn_q.weight")` (then `via` names the helper and `node` is the call) -- with the
    tensor-name pattern it reads and where."""

    node: cst.CSTNode
    function: str
    pattern: str | None  # e.g. "blk.{il}.attn_q.weight"; None when the name is computed dynamically
    snippet: str
    via: str | None = None  # the weight-name helper the name is passed to
    problem: str | None = None  # why the auditor cannot follow this read (pattern is then None)

    def names(self, n_layer: int) -> list[str]:
        if self.pattern is None:
            return []
        if "{il}" in self.pattern:
            return [self.pattern.replace("{il}", str(il)) for il in range(n_layer)]
        return [self.pattern]


@dataclass
class Helper:
    """A weight-name helper: a module-level function with a weights-dict parameter `w_param` that it only
    subscripts (never rebinds nor passes on), and a parameter `name_param` that it never rebinds and reads
    weights with, `w_param[name_param]` (e.g. `project(x, w, name)`). Every call of it is a read of the weight
    its call site names; its `w_param[name_param]` reads stand for those calls."""

    name: str
    w_param: str
    name_param: str
    params: tuple[str, ...]
    reads: list[cst.Subscript]  # the `w_param[name_param]` subscripts in its body


def _is_reference(src: "ModuleSource", node: cst.Name) -> bool:
    """A Name node that refers to a variable (not an attribute name `x.attr` nor a keyword `f(k=...)`)."""
    parent = src.parents.get(node)
    if isinstance(parent, cst.Attribute) and parent.attr is node:
        return False
    if isinstance(parent, cst.Arg) and parent.keyword is node:
        return False
    return True


def is_binding(src: "ModuleSource", node: cst.CSTNode) -> bool:
    """True if a Name/Subscript node is (part of) an assignment, loop, with, del or walrus target."""
    child, parent = node, src.parents.get(node)
    while isinstance(parent, (cst.Tuple, cst.List, cst.StarredElement, cst.Element)):
        child, parent = parent, src.parents.get(parent)
    if isinstance(parent, cst.AssignTarget):
        return True
    if isinstance(parent, (cst.AugAssign, cst.AnnAssign, cst.For, cst.CompFor, cst.NamedExpr)):
        return parent.target is child
    if isinstance(parent, (cst.AsName, cst.Del, cst.Param)):
        return True
    return False


@dataclass
class ModuleSource:
    path_name: str
    text: str
    module: cst.Module
    functions: dict[str, cst.FunctionDef] = field(default_factory=dict)
    assignments: dict[str, cst.BaseExpression] = field(default_factory=dict)  # top-level NAME = expr (last wins)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> qualified name
    import_nodes: list[cst.CSTNode] = field(default_factory=list)
    parents: dict[cst.CSTNode, cst.CSTNode] = field(default_factory=dict)
    _constants: dict[str, object] = field(default_factory=dict)
    _literal_names: set[str] | None = None
    _ast_values: dict[str, ast.expr] = field(default_factory=dict)
    _local_strings: dict[str, dict] = field(default_factory=dict)
    _helpers: dict[str, Helper] | None = None

    @classmethod
    def parse(cls, text: str, path_name: str) -> "ModuleSource":
        try:
            module = cst.parse_module(text)
            tree = ast.parse(text)  # libcst accepts a few things CPython rejects (e.g. `return` at top level)
        except (cst.ParserSyntaxError, SyntaxError, ValueError) as e:
            raise ParseFailure(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
        src = cls(path_name, text, module)
        for node in tree.body:  # the same top-level assignments, as ast nodes (literal_eval reads them fast)
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        src._ast_values[t.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                src._ast_values[node.target.id] = node.value
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                src._ast_values.pop(node.name, None)
        rebound: set[str] = set()
        for stmt in module.body:
            if isinstance(stmt, cst.FunctionDef):
                src.functions[stmt.name.value] = stmt
                rebound.add(stmt.name.value)
            elif isinstance(stmt, cst.ClassDef):
                rebound.add(stmt.name.value)
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Assign):
                        for t in small.targets:
                            if isinstance(t.target, cst.Name):
                                src.assignments[t.target.value] = small.value
                                rebound.add(t.target.value)
                    elif isinstance(small, cst.AnnAssign) and isinstance(small.target, cst.Name) and small.value:
                        src.assignments[small.target.value] = small.value
                        rebound.add(small.target.value)
        for node in src.walk_code():
            for child in children(node):
                src.parents[child] = node
            if isinstance(node, cst.Import):
                src.import_nodes.append(node)
                for alias in node.names:
                    full = dotted(alias.name)
                    if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                        src.imports[alias.asname.name.value] = full
                    else:
                        top = full.split(".")[0]
                        src.imports[top] = top
            elif isinstance(node, cst.ImportFrom):
                src.import_nodes.append(node)
                base = ("." * len(node.relative)) + (dotted(node.module) or "") if node.module or node.relative else ""
                if isinstance(node.names, cst.ImportStar):
                    continue
                for alias in node.names:
                    name = dotted(alias.name)
                    local = (
                        alias.asname.name.value if alias.asname and isinstance(alias.asname.name, cst.Name) else name
                    )
                    src.imports[local] = f"{base}.{name}"
        # A module-level def or assignment shadows an imported name.
        for name in rebound:
            src.imports.pop(name, None)
        return src

    # ---------------------------------------------------------------------------------------------
    def literal_assignments(self) -> set[str]:
        """Top-level names whose value is a pure literal (ast.literal_eval accepts it)."""
        if self._literal_names is None:
            self._literal_names = set()
            for name in self.assignments:
                if name not in self._ast_values:
                    continue
                try:
                    value = ast.literal_eval(self._ast_values[name])
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    continue
                self._literal_names.add(name)
                self._constants[name] = value
        return self._literal_names

    def walk_code(self) -> Iterator[cst.CSTNode]:
        """Every node of the module except inside pure-literal constant values (e.g. the TENSORS table):
        a literal holds no names, calls or attributes, so nothing there can matter to the checks that walk."""
        literal_values = {id(self.assignments[n]) for n in self.literal_assignments()}
        stack: list[cst.CSTNode] = [self.module]
        while stack:
            n = stack.pop()
            yield n
            if id(n) in literal_values:
                continue
            stack.extend(reversed(children(n)))

    def code(self, node: cst.CSTNode) -> str:
        return " ".join(self.module.code_for_node(node).split())

    def qualname(self, node: cst.CSTNode) -> str | None:
        """The imported thing an expression names ('pt.dot' -> 'pytensor.tensor.dot'), else None."""
        d = dotted(node)
        if d is None:
            return None
        head, _, rest = d.partition(".")
        if head not in self.imports:
            return None
        full = self.imports[head]
        return f"{full}.{rest}" if rest else full

    def is_kernel(self, func: cst.CSTNode) -> bool:
        q = self.qualname(func)
        return q is not None and (q == KERNELS_MODULE or q.startswith(KERNELS_MODULE + "."))

    def is_dequantizer(self, func: cst.CSTNode) -> bool:
        q = self.qualname(func)
        if q is None:
            return False
        return q in DEQUANTIZERS or (self.is_kernel(func) and "dequant" in q.rsplit(".", 1)[-1])

    def enclosing_function(self, node: cst.CSTNode) -> str | None:
        n = node
        while n in self.parents:
            n = self.parents[n]
            if isinstance(n, cst.FunctionDef) and self.parents.get(n) is self.module:
                return n.name.value
        return None

    # ---------------------------------------------------------------------------------------------
    def constant(self, name: str, default=_NOT_LITERAL):
        """A top-level constant's value if it is a literal (or inert integer arithmetic over literals)."""
        self.literal_assignments()
        if name in self._constants:
            return self._constants[name]
        node = self.assignments.get(name)
        value = _NOT_LITERAL if node is None else self._eval_const(node, depth=0)
        self._constants[name] = value
        if value is _NOT_LITERAL:
            if default is _NOT_LITERAL:
                raise KeyError(name)
            return default
        return value

    def has_constant(self, name: str) -> bool:
        return self.constant(name, None) is not None

    def _eval_const(self, node: cst.BaseExpression, depth: int):
        try:
            return ast.literal_eval(self.module.code_for_node(node).strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        if depth > 8:
            return _NOT_LITERAL
        if isinstance(node, cst.Name) and node.value in self.assignments:
            return self._eval_const(self.assignments[node.value], depth + 1)
        if isinstance(node, cst.BinaryOperation):
            a = self._eval_const(node.left, depth + 1)
            b = self._eval_const(node.right, depth + 1)
            if not (isinstance(a, int) and isinstance(b, int)) or isinstance(a, bool) or isinstance(b, bool):
                return _NOT_LITERAL
            op = type(node.operator)
            if op is cst.FloorDivide and b != 0:
                return a // b
            if op is cst.Multiply:
                return a * b
            if op is cst.Add:
                return a + b
            if op is cst.Subtract:
                return a - b
        return _NOT_LITERAL

    # ---------------------------------------------------------------------------------------------
    def weight_helpers(self) -> dict[str, Helper]:
        """The module's weight-name helpers (see Helper), by name."""
        if self._helpers is not None:
            return self._helpers
        self._helpers = {}
        for fname, fn in self.functions.items():
            if (
                fname in LOADER_FUNCTIONS
                or isinstance(fn.params.star_arg, cst.Param)
                or fn.params.star_kwarg is not None
            ):
                continue
            params = tuple(p.name.value for p in fn.params.params)
            wparams = [p for p in params if p in WEIGHT_DICT_NAMES]
            if len(wparams) != 1:
                continue
            wp = wparams[0]
            names = {}
            for n in walk(fn.body):
                if isinstance(n, cst.Name) and _is_reference(self, n):
                    names.setdefault(n.value, []).append(n)
            w_reads = [self.parents.get(n) for n in names.get(wp, [])]
            # the weights dict is only ever subscripted (read), never rebound or passed on
            if not w_reads or not all(
                isinstance(sub, cst.Subscript) and sub.value is occ and not is_binding(self, sub)
                for sub, occ in zip(w_reads, names.get(wp, []))
            ):
                continue
            tensors_local = "TENSORS" in params or any(is_binding(self, n) for n in names.get("TENSORS", []))
            for pname in params:
                if pname == wp or pname not in names:
                    continue
                if any(is_binding(self, n) for n in names[pname]):
                    continue  # rebound: w[pname] would not read the call site's name
                reads = [
                    sub
                    for sub in w_reads
                    if len(sub.slice) == 1
                    and isinstance(sub.slice[0].slice, cst.Index)
                    and isinstance(sub.slice[0].slice.value, cst.Name)
                    and sub.slice[0].slice.value.value == pname
                ]
                if reads and not tensors_local:
                    self._helpers[fname] = Helper(fname, wp, pname, params, reads)
                    break
        return self._helpers

    def helper_call_args(self, call: cst.Call, helper: Helper) -> dict[str, cst.BaseExpression] | None:
        """param name -> argument expression for a call of a helper, or None if it cannot be bound."""
        bound: dict[str, cst.BaseExpression] = {}
        positional = True
        for i, a in enumerate(call.args):
            if a.star:
                return None
            if a.keyword is None:
                if not positional or i >= len(helper.params):
                    return None
                bound[helper.params[i]] = a.value
            else:
                positional = False
                if a.keyword.value not in helper.params or a.keyword.value in bound:
                    return None
                bound[a.keyword.value] = a.value
        return bound

    def weight_uses(self) -> list[Use]:
        """Every weight read of the graph outside the loader, with its name pattern: each subscript of the
        weights dict, and each call of a weight-name helper (whose own `w[name]` reads stand for its calls)."""
        helpers = self.weight_helpers()
        internal = {id(r) for h in helpers.values() for r in h.reads}
        uses = []
        for fname, fn in self.functions.items():
            if fname in LOADER_FUNCTIONS:
                continue
            params = {p.name.value for p in fn.params.params}
            wnames = [n for n in WEIGHT_DICT_NAMES if n in params]
            local_strings = self._local_string_assignments(fn)
            for node in walk(fn.body):
                if (
                    wnames
                    and isinstance(node, cst.Subscript)
                    and isinstance(node.value, cst.Name)
                    and node.value.value in wnames
                    and id(node) not in internal
                ):
                    pattern = None
                    if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                        pattern = self._name_pattern(node.slice[0].slice.value, local_strings)
                    uses.append(Use(node, fname, pattern, self.code(node)))
                elif isinstance(node, cst.Name) and node.value in helpers and _is_reference(self, node):
                    helper = helpers[node.value]
                    call = self.parents.get(node)
                    problem = pattern = None
                    if not (isinstance(call, cst.Call) and call.func is node):
                        problem = f"refers to the weight-name helper {node.value}() other than by calling it"
                        call = node
                    else:
                        args = self.helper_call_args(call, helper)
                        warg = args.get(helper.w_param) if args else None
                        narg = args.get(helper.name_param) if args else None
                        if args is None or narg is None:
                            problem = f"calls {helper.name}() with arguments the auditor cannot bind"
                        elif not (isinstance(warg, cst.Name) and warg.value in wnames):
                            problem = (
                                f"passes `{self.code(warg) if warg is not None else 'nothing'}` as "
                                f"{helper.name}()'s weights dict `{helper.w_param}`, not the graph's weights"
                            )
                        else:
                            pattern = self._name_pattern(narg, local_strings)
                    uses.append(Use(call, fname, pattern, self.code(call), via=helper.name, problem=problem))
        return uses

    def _local_string_assignments(self, fn: cst.FunctionDef) -> dict[str, list[cst.BaseExpression]]:
        key = fn.name.value
        if key in self._local_strings and self._local_strings[key][0] is fn:
            return self._local_strings[key][1]
        out: dict[str, list[cst.BaseExpression]] = {}
        self._local_strings[key] = (fn, out)
        for node in walk(fn.body):
            if isinstance(node, cst.Assign):
                for t in node.targets:
                    if isinstance(t.target, cst.Name):
                        out.setdefault(t.target.value, []).append(node.value)
            elif isinstance(node, (cst.AugAssign, cst.For)):
                target = node.target
                if isinstance(target, cst.Name):
                    out.setdefault(target.value, []).append(None)
        return out

    def _name_pattern(self, node: cst.BaseExpression, local: dict, depth: int = 0) -> str | None:
        """'blk.{il}.attn_q.weight' for `p + "attn_q.weight"` with p = f"blk.{il}.", or a plain name."""
        if depth > 6:
            return None
        s = str_literal(node)
        if s is not None:
            return s
        if isinstance(node, cst.FormattedString):
            out = []
            for part in node.parts:
                if isinstance(part, cst.FormattedStringText):
                    out.append(part.value)
                elif (
                    isinstance(part, cst.FormattedStringExpression)
                    and isinstance(part.expression, cst.Name)
                    and part.expression.value == LAYER_VAR
                    and part.conversion is None
                    and part.format_spec is None
                ):
                    out.append("{" + LAYER_VAR + "}")
                else:
                    return None
            return "".join(out)
        if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.Add):
            a = self._name_pattern(node.left, local, depth + 1)
            b = self._name_pattern(node.right, local, depth + 1)
            return None if a is None or b is None else a + b
        if isinstance(node, cst.Name) and node.value in local:
            values = local[node.value]
            if len(values) == 1 and values[0] is not None:
                return self._name_pattern(values[0], local, depth + 1)
        return None
