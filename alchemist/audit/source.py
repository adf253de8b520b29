"""A generated module read as text: libcst tree, top-level functions and assignments, literal constants, imports.

Nothing here imports or executes the module; constants are read with `ast.literal_eval`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Iterator

import libcst as cst

CONTRACT_FUNCTIONS = ("dequantize_tensor", "load_weights", "forward")
CONTRACT_CONSTANTS = ("PROVENANCE", "DATA_OFFSET", "TENSORS", "KERNEL_WEIGHTS")
NOT_LITERAL = object()


class ParseFailure(Exception):
    pass


def walk(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """Every node below and including `node`, depth first."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        stack.extend(reversed(n.children))


def dotted(node) -> str | None:
    """'a.b.c' for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


MAX_REPEAT = 1 << 16  # a per-layer constant's count; far above any model's layer count


def literal(node: ast.expr):
    """ast.literal_eval, plus the one non-literal form the generator writes: a tuple of plain values times a
    count, (0,) * 24 (codegen's py_constant)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.left, ast.Tuple):
        pattern, count = ast.literal_eval(node.left), ast.literal_eval(node.right)
        if type(count) is not int or not 0 <= count <= MAX_REPEAT:
            raise ValueError(f"a repeat count of {count!r}")
        return pattern * count
    return ast.literal_eval(node)


@dataclass
class ModuleSource:
    path_name: str
    text: str
    module: cst.Module
    functions: dict[str, cst.FunctionDef] = field(default_factory=dict)
    assignments: dict[str, cst.BaseExpression] = field(default_factory=dict)  # top-level NAME = expr
    constants: dict[str, object] = field(default_factory=dict)  # the assignments whose value is a literal
    imports: dict[str, str] = field(default_factory=dict)  # local name -> qualified name

    @classmethod
    def parse(cls, text: str, path_name: str) -> "ModuleSource":
        try:
            module = cst.parse_module(text)
            tree = ast.parse(text)  # libcst accepts a few things CPython rejects (e.g. `return` at top level)
        except (cst.ParserSyntaxError, SyntaxError, ValueError) as e:
            raise ParseFailure(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
        src = cls(path_name, text, module)
        for node in tree.body:
            if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
                try:
                    value = literal(node.value)
                except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
                    value = NOT_LITERAL
                for t in node.targets:
                    src.constants[t.id] = value
        for stmt in module.body:
            if isinstance(stmt, cst.FunctionDef):
                src.functions[stmt.name.value] = stmt
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, cst.Assign):
                        for t in small.targets:
                            if isinstance(t.target, cst.Name):
                                src.assignments[t.target.value] = small.value
                    elif isinstance(small, cst.Import):
                        for a in small.names:
                            full = dotted(a.name)
                            local = a.asname.name.value if a.asname else full.split(".")[0]
                            src.imports[local] = full if a.asname else local
                    elif isinstance(small, cst.ImportFrom) and not isinstance(small.names, cst.ImportStar):
                        base = dotted(small.module) if small.module else ""
                        for a in small.names:
                            local = a.asname.name.value if a.asname else dotted(a.name)
                            src.imports[local] = f"{base}.{dotted(a.name)}"
        src.constants = {k: v for k, v in src.constants.items() if v is not NOT_LITERAL and k in src.assignments}
        for name in set(src.functions) | set(src.assignments):
            src.imports.pop(name, None)  # a module-level def or assignment shadows an import
        return src

    def constant(self, name: str, default=None):
        return self.constants.get(name, default)

    def code(self, node: cst.CSTNode) -> str:
        return " ".join(self.module.code_for_node(node).split())

    def qualname(self, node) -> str | None:
        """The imported thing an expression names ('pt.dot' -> 'pytensor.tensor.dot'), else None."""
        d = dotted(node)
        if d is None:
            return None
        head, _, rest = d.partition(".")
        if head not in self.imports:
            return None
        return f"{self.imports[head]}.{rest}" if rest else self.imports[head]
