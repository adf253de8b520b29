"""Symbolic shapes: the expected shape of every tensor, and an abstract interpreter for the graph's reshapes.

A size is a `Mono`: a rational coefficient times a product of named atoms (`N_KV_HEAD`, `GROUP_SIZE`,
`HEAD_DIM`, `N_EMBD`, ..., and `T`, `S`, ... for data-dependent lengths). `N_HEAD` is not an atom: it is
`N_KV_HEAD · GROUP_SIZE` in that order (query head h reads KV head h // GROUP_SIZE), so a reshape that
splits or merges heads in the wrong order, or with N_KV_HEAD where N_HEAD belongs, or with a literal head
count, does not regroup the factors of its input and is reported, whatever the numeric values.

The interpreter walks the graph functions (`forward`, `attention_block`, `mlp_block`, `causal_attention`,
`rope`) with the parameter shapes their docstrings promise, tracking the shape of every local through
`linear`, the weight-name helpers (`project(x, w, name)`: `name` is bound to the call site's tensor-name
pattern, so `w[name]` and `TENSORS[name][1]` have that tensor's symbolic shape), the quantized kernels,
`reshape`, `dimshuffle`, `matmul`, `set_subtensor`, indexing, broadcasting and a few PyTensor
functions. Anything it does not model becomes "unknown", never an error; a reshape of an unknown value in
the attention functions is reported as unverifiable.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import libcst as cst

from alchemist.audit.source import (
    KERNEL_SIGNATURES,
    LOADER_FUNCTIONS,
    WEIGHT_DICT_NAMES,
    ModuleSource,
    int_literal,
)


@dataclass(frozen=True)
class Mono:
    coeff: Fraction
    exps: tuple[tuple[str, int], ...] = ()

    @staticmethod
    def atom(name: str) -> "Mono":
        return Mono(Fraction(1), ((name, 1),))

    @staticmethod
    def const(n) -> "Mono":
        return Mono(Fraction(n))

    def _combine(self, other: "Mono", sign: int) -> "Mono":
        e = dict(self.exps)
        for k, v in other.exps:
            e[k] = e.get(k, 0) + sign * v
        coeff = self.coeff * other.coeff if sign > 0 else self.coeff / other.coeff
        return Mono(coeff, tuple(sorted((k, v) for k, v in e.items() if v)))

    def __mul__(self, other: "Mono") -> "Mono":
        return self._combine(other, 1)

    def __truediv__(self, other: "Mono") -> "Mono":
        return self._combine(other, -1)

    def integral(self) -> bool:
        """A whole positive size: integer coefficient, no atom in the denominator."""
        return self.coeff > 0 and self.coeff.denominator == 1 and all(v > 0 for _, v in self.exps)

    def is_one(self) -> bool:
        return self.coeff == 1 and not self.exps

    def __str__(self) -> str:
        e = dict(self.exps)
        if e.get("N_KV_HEAD") == 1 and e.get("GROUP_SIZE") == 1:
            del e["N_KV_HEAD"], e["GROUP_SIZE"]
            e["N_HEAD"] = 1
        parts = []
        for k in sorted(e, key=lambda k: (_DISPLAY_ORDER.index(k) if k in _DISPLAY_ORDER else len(_DISPLAY_ORDER), k)):
            v = e[k]
            parts.append(k if v == 1 else f"{k}^{v}")
        if self.coeff != 1 or not parts:
            parts.insert(0, str(self.coeff))
        return "·".join(parts)


_DISPLAY_ORDER = (
    "T",
    "S",
    "C",
    "R",
    "H",
    "N_VOCAB",
    "N_EMBD",
    "N_FF",
    "N_HEAD",
    "N_KV_HEAD",
    "GROUP_SIZE",
    "HEAD_DIM",
    "ROPE_DIM",
)
ONE = Mono.const(1)
WILDCARDS = {"T", "S", "C", "R", "H"}  # data-dependent lengths: matched loosely at call sites


def opaque(m: Mono) -> bool:
    """A size the interpreter could not name (a fresh '?n' atom): compatible with anything."""
    return any(k.startswith("?") for k, _ in m.exps)


def same(a: Mono, b: Mono) -> bool:
    return a == b or opaque(a) or opaque(b)


def prod(factors) -> Mono:
    out = ONE
    for f in factors:
        out = out * f
    return out


Dim = tuple  # tuple[Mono, ...]: the ordered factors of one axis


def dim_str(d: Dim) -> str:
    return str(prod(d))


def shape_str(shape) -> str:
    return "(" + ", ".join(dim_str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


A = Mono.atom
KV, G, HD = A("N_KV_HEAD"), A("GROUP_SIZE"), A("HEAD_DIM")
E, F, V, RD = A("N_EMBD"), A("N_FF"), A("N_VOCAB"), A("ROPE_DIM")
HALF = Mono.const(Fraction(1, 2))
# Constants as sizes: N_HEAD is N_KV_HEAD·GROUP_SIZE (KV-major).
CONSTANT_DIMS = {
    "N_HEAD": (KV, G),
    "N_KV_HEAD": (KV,),
    "GROUP_SIZE": (G,),
    "HEAD_DIM": (HD,),
    "N_EMBD": (E,),
    "N_FF": (F,),
    "N_VOCAB": (V,),
    "ROPE_DIM": (RD,),
}

_Q, _KVD = (KV, G, HD), (KV, HD)
GLOBAL_TENSORS = {
    "token_embd.weight": ("embedding", ((V,), (E,))),
    "output.weight": ("linear", ((V,), (E,))),
    "output_norm.weight": ("norm", ((E,),)),
    "rope_freqs.weight": ("rope_freqs", ((RD * HALF,),)),
}
LAYER_TENSORS = {
    "attn_norm.weight": ("norm", ((E,),)),
    "attn_q.weight": ("linear", (_Q, (E,))),
    "attn_k.weight": ("linear", (_KVD, (E,))),
    "attn_v.weight": ("linear", (_KVD, (E,))),
    "attn_output.weight": ("linear", ((E,), _Q)),
    "attn_q.bias": ("bias", (_Q,)),
    "attn_k.bias": ("bias", (_KVD,)),
    "attn_v.bias": ("bias", (_KVD,)),
    "attn_output.bias": ("bias", ((E,),)),
    "attn_q_norm.weight": ("norm", ((HD,),)),
    "attn_k_norm.weight": ("norm", ((HD,),)),
    "ffn_norm.weight": ("norm", ((E,),)),
    "ffn_gate.weight": ("linear", ((F,), (E,))),
    "ffn_up.weight": ("linear", ((F,), (E,))),
    "ffn_down.weight": ("linear", ((E,), (F,))),
    "ffn_gate.bias": ("bias", ((F,),)),
    "ffn_up.bias": ("bias", ((F,),)),
    "ffn_down.bias": ("bias", ((E,),)),
    "post_attention_norm.weight": ("norm", ((E,),)),
    "post_ffw_norm.weight": ("norm", ((E,),)),
}


def split_layer_name(name: str) -> tuple[int | None, str]:
    """('blk.3.attn_q.weight') -> (3, 'attn_q.weight'); ('blk.{il}.x') -> (-1, 'x'); globals -> (None, name)."""
    if name.startswith("blk."):
        idx, _, rest = name[4:].partition(".")
        if idx == "{il}":
            return -1, rest
        if idx.isdigit() and rest:
            return int(idx), rest
    return None, name


def tensor_spec(name: str) -> tuple[str, tuple] | None:
    """(role, symbolic shape) of a tensor by its (possibly patterned) name, or None if unknown."""
    layer, rest = split_layer_name(name)
    if layer is None:
        return GLOBAL_TENSORS.get(name)
    return LAYER_TENSORS.get(rest)


def numeric(m: Mono, values: dict[str, int]) -> Fraction | None:
    out = m.coeff
    for k, v in m.exps:
        if k not in values:
            return None
        out *= Fraction(values[k]) ** v
    return out


# ---------------------------------------------------------------------------------------------------
# Abstract values
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arr:
    shape: tuple  # tuple[Dim, ...]
    weight: str | None = None  # tensor-name pattern when this is w[...]


@dataclass(frozen=True)
class Size:
    dim: Dim  # a Python integer that is an array length (n_tokens, x.shape[0], N_HEAD, ...)


@dataclass(frozen=True)
class ShapeOf:
    shape: tuple


@dataclass(frozen=True)
class Tup:
    items: tuple


@dataclass(frozen=True)
class WName:
    """A weight-name helper's name parameter, bound to its call site's tensor-name pattern."""

    pattern: str | None


@dataclass(frozen=True)
class TEntry:
    """TENSORS[name]: (ggml type, shape, offset, nbytes) of the tensor `pattern` names."""

    pattern: str | None


@dataclass(frozen=True)
class NoneVal:
    """The value None (an omitted parameter whose default is None)."""


@dataclass(frozen=True)
class Bool:
    value: bool


SCALAR = Arr(())


def _contract(*dims):
    return tuple(tuple(d) for d in dims)


T, S, C, R, H = A("T"), A("S"), A("C"), A("R"), A("H")
CONTRACTS: dict[str, dict[str, object]] = {
    "rope": {"x": _contract((T,), (H,), (HD,)), "angles": _contract((T,), (RD * HALF,))},
    "causal_attention": {
        "q": _contract((T,), (KV, G), (HD,)),
        "keys": _contract((S,), (KV,), (HD,)),
        "values": _contract((S,), (KV,), (HD,)),
        "q_positions": _contract((T,)),
        "key_positions": _contract((S,)),
        "window": (),
    },
    "attention_block": {
        "x": _contract((T,), (E,)),
        "positions": _contract((T,)),
        "key_positions": _contract((S,)),
        "start_pos": (),
        "k_cache": _contract((C,), (KV,), (HD,)),
        "v_cache": _contract((C,), (KV,), (HD,)),
        "attend_len": (),
    },
    "mlp_block": {"x": _contract((T,), (E,))},
    "forward": {"tokens": _contract((T,)), "start_pos": (), "attend_len": (), "output_rows": _contract((R,))},
}
ANALYSIS_ORDER = ("rope", "causal_attention", "mlp_block", "attention_block", "forward")
STRICT_FUNCTIONS = ("attention_block", "causal_attention")  # their reshapes must all be verified
SHAPE_PRESERVING = ("rms_norm", "silu", "gelu")
PT_ELEMENTWISE = {
    "cos",
    "sin",
    "tanh",
    "sigmoid",
    "exp",
    "log",
    "sqrt",
    "reciprocal",
    "sqr",
    "abs",
    "neg",
    "erf",
    "special.softmax",
    "softmax",
    "nnet.softmax",
    "cast",
    "as_tensor_variable",
}


@dataclass
class ReshapeRecord:
    function: str
    snippet: str
    verified: bool


class ShapeInterpreter:
    def __init__(self, src: ModuleSource):
        self.src = src
        self.errors: list[str] = []
        self.kernel_errors: list[str] = []  # orientation of quantized-kernel calls (n_out/n_in swapped)
        self.kernel_checked: set[int] = set()  # ids of kernel calls whose sizes were compared with the weight's
        self.reshapes: list[ReshapeRecord] = []
        self.returns: dict[str, object] = {}
        self._fn = ""  # label for messages: "attention_block" or "mlp_block → helper"
        self._cur = ""  # the function whose body is being interpreted
        self._env: dict[str, object] = {}
        self._opaque = 0
        self._inline_stack: list[str] = []
        self._ret_stack: list[object] = []

    # ------------------------------------------------------------------ driver
    def run(self) -> "ShapeInterpreter":
        for fname in ANALYSIS_ORDER:
            fn = self.src.functions.get(fname)
            if fn is None:
                continue
            self._fn = self._cur = fname
            env: dict[str, object] = {}
            self._env = env
            contract = CONTRACTS.get(fname, {})
            for p in fn.params.params:
                shape = contract.get(p.name.value)
                env[p.name.value] = Arr(shape) if shape is not None else None
            self._block(fn.body, env)
        return self

    def error(self, node: cst.CSTNode, message: str):
        self.errors.append(f"{self._fn}: `{self._snip(node)}`: {message}")

    def _snip(self, node) -> str:
        s = self.src.code(node)
        return s if len(s) <= 90 else s[:87] + "..."

    def _fresh(self, label: str) -> Dim:
        self._opaque += 1
        return (Mono.atom(f"?{self._opaque}"),)

    # ------------------------------------------------------------------ statements
    def _block(self, block, env):
        body = block.body if isinstance(block, (cst.IndentedBlock, cst.SimpleStatementSuite)) else block
        for stmt in body:
            self._stmt(stmt, env)

    def _stmt(self, stmt, env):
        if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)):
            for small in stmt.body:
                self._small(small, env)
        elif isinstance(stmt, cst.If):
            self._expr(stmt.test, env)
            self._block(stmt.body, env)
            orelse = stmt.orelse
            if isinstance(orelse, cst.If):
                self._stmt(orelse, env)
            elif isinstance(orelse, cst.Else):
                self._block(orelse.body, env)
        elif isinstance(stmt, (cst.For, cst.While)):
            if isinstance(stmt, cst.For):
                self._expr(stmt.iter, env)
                self._bind(stmt.target, None, env)
            self._block(stmt.body, env)
        elif isinstance(stmt, (cst.With, cst.Try)):
            self._block(stmt.body, env)
        # nested defs / classes are not analyzed

    def _small(self, small, env):
        if isinstance(small, cst.Assign):
            value = self._expr(small.value, env)
            for t in small.targets:
                self._bind(t.target, value, env)
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            self._bind(small.target, self._expr(small.value, env), env)
        elif isinstance(small, cst.AugAssign):
            value = self._binop(small.operator, self._expr(small.target, env), self._expr(small.value, env), small)
            self._bind(small.target, value, env)
        elif isinstance(small, cst.Expr):
            self._expr(small.value, env)
        elif isinstance(small, cst.Return) and small.value is not None:
            value = self._expr(small.value, env)
            if self._ret_stack:
                self._ret_stack[-1].append((value, small))
            elif self.returns.get(self._fn) is None:
                self.returns[self._fn] = value

    def _bind(self, target, value, env):
        if isinstance(target, cst.Name):
            env[target.value] = value
        elif isinstance(target, (cst.Tuple, cst.List)):
            items = value.items if isinstance(value, Tup) and len(value.items) == len(target.elements) else None
            for i, el in enumerate(target.elements):
                self._bind(el.value, items[i] if items else None, env)

    # ------------------------------------------------------------------ expressions
    def _expr(self, node, env):
        if isinstance(node, cst.Name):
            if node.value == "None":
                return NoneVal()
            if node.value in env:
                return env[node.value]
            if node.value in CONSTANT_DIMS and node.value in self.src.assignments:
                return Size(CONSTANT_DIMS[node.value])
            return None
        v = int_literal(node)
        if v is not None:
            return Size(()) if v == 1 else Size((Mono.const(v),)) if v > 0 else ("int", v)
        if isinstance(node, cst.Float):
            return SCALAR
        if isinstance(node, (cst.Tuple, cst.List)):
            return Tup(tuple(self._expr(el.value, env) for el in node.elements))
        if isinstance(node, cst.Attribute):
            return self._attribute(node, env)
        if isinstance(node, cst.Subscript):
            return self._subscript(node, env)
        if isinstance(node, cst.Call):
            return self._call(node, env)
        if isinstance(node, cst.BinaryOperation):
            return self._binop(node.operator, self._expr(node.left, env), self._expr(node.right, env), node)
        if isinstance(node, cst.UnaryOperation):
            inner = self._expr(node.expression, env)
            return inner if isinstance(inner, Arr) else None
        if (
            isinstance(node, cst.Comparison)
            and len(node.comparisons) == 1
            and isinstance(node.comparisons[0].operator, (cst.Is, cst.IsNot))
        ):
            a, b = self._expr(node.left, env), self._expr(node.comparisons[0].comparator, env)
            if isinstance(b, NoneVal) and isinstance(a, (NoneVal, Arr)):
                return Bool(isinstance(a, NoneVal) == isinstance(node.comparisons[0].operator, cst.Is))
            return None
        if isinstance(node, cst.Comparison):
            out = self._expr(node.left, env)
            for c in node.comparisons:
                out = self._broadcast(out, self._expr(c.comparator, env), node)
            return out
        if isinstance(node, cst.BooleanOperation):
            self._expr(node.left, env)
            self._expr(node.right, env)
            return None
        if isinstance(node, cst.IfExp):
            test = self._expr(node.test, env)
            if isinstance(test, Bool):
                return self._expr(node.body if test.value else node.orelse, env)
            a, b = self._expr(node.body, env), self._expr(node.orelse, env)
            return a if a == b else None
        return None

    def _attribute(self, node: cst.Attribute, env):
        attr = node.attr.value
        base = self._expr(node.value, env)
        if attr == "type":
            return base  # x.type.shape reads the static shape
        if attr == "shape" and isinstance(base, Arr):
            return ShapeOf(base.shape)
        if attr == "T" and isinstance(base, Arr):
            return Arr(tuple(reversed(base.shape)))
        return None

    def _name_arg(self, node, env) -> str | None:
        """The tensor-name pattern an index expression denotes in the current function."""
        if isinstance(node, cst.Name) and isinstance(env.get(node.value), WName):
            return env[node.value].pattern
        fn = self.src.functions[self._cur]
        return self.src._name_pattern(node, self.src._local_string_assignments(fn))

    def _subscript(self, node: cst.Subscript, env):
        index = (
            node.slice[0].slice.value if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index) else None
        )
        if isinstance(node.value, cst.Name) and node.value.value in WEIGHT_DICT_NAMES and node.value.value in env:
            pattern = self._name_arg(index, env) if index is not None else None
            spec = tensor_spec(pattern) if pattern else None
            return Arr(spec[1], weight=pattern) if spec else None
        if (
            isinstance(node.value, cst.Name)
            and node.value.value == "TENSORS"
            and "TENSORS" not in env
            and "TENSORS" in self.src.assignments
        ):
            return TEntry(self._name_arg(index, env)) if index is not None else None
        base = self._expr(node.value, env)
        if isinstance(base, (TEntry, Tup)):
            i = int_literal(index) if index is not None else None
            if isinstance(base, TEntry):
                spec = tensor_spec(base.pattern) if base.pattern else None
                if i == 1 and spec is not None:
                    return Tup(tuple(Size(d) for d in spec[1]))  # the stored (n_out, n_in), symbolically
                return None
            return base.items[i] if i is not None and -len(base.items) <= i < len(base.items) else None
        if isinstance(base, ShapeOf):
            if len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
                i = int_literal(node.slice[0].slice.value)
                if i is not None and -len(base.shape) <= i < len(base.shape):
                    return Size(base.shape[i])
            return None
        if not isinstance(base, Arr):
            for el in node.slice:
                if isinstance(el.slice, cst.Index):
                    self._expr(el.slice.value, env)
            return None
        dims = list(base.shape)
        out: list = []
        i = 0
        elements = list(node.slice)
        n_advanced = 0
        for k, el in enumerate(elements):
            s = el.slice
            if isinstance(s, cst.Slice):
                if i >= len(dims):
                    self.error(node, f"indexes {len(elements)} axes of a {len(dims)}-d value")
                    return None
                if s.lower is None and s.upper is None and s.step is None:
                    out.append(dims[i])
                elif s.step is None:
                    up = self._expr(s.upper, env) if s.upper is not None else Size(dims[i])
                    lo = self._expr(s.lower, env) if s.lower is not None else None
                    if lo is not None:
                        up = (
                            self._binop(cst.Subtract(), up, lo, node)
                            if isinstance(up, Size) and isinstance(lo, Size)
                            else None
                        )
                    out.append(up.dim if isinstance(up, Size) else self._fresh("slice"))
                else:
                    out.append(self._fresh("slice"))
                i += 1
                continue
            v = s.value
            if isinstance(v, cst.Ellipsis):
                later = sum(
                    1
                    for e2 in elements[k + 1 :]
                    if not (
                        isinstance(e2.slice, cst.Index)
                        and isinstance(e2.slice.value, cst.Name)
                        and e2.slice.value.value == "None"
                    )
                )
                keep = len(dims) - i - later
                if keep < 0:
                    return None
                out.extend(dims[i : i + keep])
                i += keep
            elif isinstance(v, cst.Name) and v.value == "None":
                out.append(())
            else:
                if i >= len(dims):
                    self.error(node, f"indexes {len(elements)} axes of a {len(dims)}-d value")
                    return None
                iv = self._expr(v, env)
                if isinstance(iv, Arr) and iv.shape:
                    n_advanced += 1
                    out.extend(iv.shape)
                i += 1
        if n_advanced > 1:
            return None
        out.extend(dims[i:])
        return Arr(tuple(out))

    # ------------------------------------------------------------------ calls
    def _args(self, call: cst.Call, env):
        pos, kw, starred = [], {}, False
        for a in call.args:
            if a.star:
                starred = True
                self._expr(a.value, env)
                continue
            val = self._expr(a.value, env)
            if a.keyword is not None:
                kw[a.keyword.value] = (val, a.value)
            elif not starred:
                pos.append((val, a.value))
        return pos, kw, starred

    def _call(self, call: cst.Call, env):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value in ("reshape", "dimshuffle", "astype", "transpose"):
            q = self.src.qualname(func)
            if q is None or not q.startswith(("numpy.", "pytensor.")):
                base = self._expr(func.value, env)
                pos, kw, _ = self._args(call, env)
                name = func.attr.value
                if name == "astype":
                    return base if isinstance(base, Arr) else None
                if name == "transpose" and not pos:
                    return Arr(tuple(reversed(base.shape))) if isinstance(base, Arr) else None
                if name == "reshape":
                    return self._reshape(call, base, [a for a in call.args])
                if name == "dimshuffle":
                    return self._dimshuffle(call, base, [p[1] for p in pos])
                return None
        pos, kw, starred = self._args(call, env)
        q = self.src.qualname(func)
        if q is not None:
            if q.startswith("pytensor.tensor."):
                return self._pt_call(call, q[len("pytensor.tensor.") :], pos, kw)
            if q in ("numpy.float32", "numpy.float64", "numpy.int64", "numpy.int32"):
                return SCALAR
            if q in KERNEL_SIGNATURES:
                return self._kernel(call, q, pos, kw)
            return None
        if isinstance(func, cst.Name) and func.value in self.src.functions:
            name = func.value
            if name == "linear":
                x = pos[0][0] if pos else kw.get("x", (None,))[0]
                wv = pos[1][0] if len(pos) > 1 else kw.get("weight", (None,))[0]
                b = pos[2][0] if len(pos) > 2 else kw.get("bias", (None,))[0]
                return self._linear(call, x, wv, b)
            if name in SHAPE_PRESERVING:
                return pos[0][0] if pos else None
            if name in CONTRACTS:
                self._check_contract(call, name, pos, kw)
                if name == "rope":
                    return pos[0][0] if pos else None
                return self.returns.get(name)
            return self._inline(name, pos, kw)
        return None

    def _kernel(self, call, q, pos, kw):
        """quantized_linear(x, w_blocks, type, n_out, n_in) -> (T, n_out) like linear(x, W);
        quantized_embedding(w_blocks, indices, type, n_rows, n_in) -> indices.shape + (n_in,) like W[indices].
        The sizes passed must be the weight's stored (rows, columns)."""
        names, wname, _, rows, cols = KERNEL_SIGNATURES[q]
        bound = {names[i]: p for i, p in enumerate(pos) if i < len(names)}
        bound.update({k: v for k, v in kw.items() if k in names})
        wv = bound.get(wname, (None,))[0]
        if not (isinstance(wv, Arr) and wv.weight and len(wv.shape) == 2):
            return None
        compared = 0
        for what, want in ((rows, wv.shape[0]), (cols, wv.shape[1])):
            val = bound.get(what, (None,))[0]
            if isinstance(val, Size):
                compared += 1
                if not same(prod(val.dim), prod(want)):
                    self.kernel_errors.append(
                        f"{self._fn}: `{self._snip(call)}`: {what} is {dim_str(val.dim)} but "
                        f"{wv.weight} is stored {shape_str(wv.shape)} ({rows}, {cols})"
                    )
        if compared == 2:
            self.kernel_checked.add(id(call))
        if names[0] == "x":
            x = bound.get("x", (None,))[0]
            return self._linear(call, x, wv, None)
        idx = bound.get("indices", (None,))[0]
        return Arr(idx.shape + (wv.shape[1],)) if isinstance(idx, Arr) else None

    def _inline(self, name, pos, kw):
        """Interpret a helper's body with the caller's argument values (no recursion, depth <= 3)."""
        if name in LOADER_FUNCTIONS or name in self._inline_stack or len(self._inline_stack) >= 3:
            return None
        fn = self.src.functions[name]
        env: dict[str, object] = {}
        params = [p.name.value for p in fn.params.params]
        helper = self.src.weight_helpers().get(name)
        for i, (pname, p) in enumerate(zip(params, fn.params.params)):
            if i < len(pos):
                env[pname] = pos[i][0]
            elif pname in kw:
                env[pname] = kw[pname][0]
            elif isinstance(p.default, cst.Name) and p.default.value == "None":
                env[pname] = NoneVal()
            else:
                env[pname] = None
            if helper is not None and pname == helper.name_param:
                node = pos[i][1] if i < len(pos) else kw[pname][1] if pname in kw else None
                env[pname] = WName(self._name_arg(node, self._env) if node is not None else None)
        saved = self._env, self._fn, self._cur
        self._inline_stack.append(name)
        self._ret_stack.append([])
        self._env, self._fn, self._cur = env, f"{saved[1]} → {name}", name
        try:
            self._block(fn.body, env)
            returns = self._ret_stack[-1]
            arrays = [(v, node) for v, node in returns if isinstance(v, Arr)]
            for v, node in arrays[1:]:  # every path must give the same shape (e.g. project's two paths)
                a = arrays[0][0]
                if len(v.shape) != len(a.shape) or not all(same(prod(x), prod(y)) for x, y in zip(v.shape, a.shape)):
                    self.error(node, f"returns {shape_str(v.shape)} where another path returns {shape_str(a.shape)}")
        finally:
            self._env, self._fn, self._cur = saved
            self._inline_stack.pop()
            returns = self._ret_stack.pop()
        first = next((v for v, _ in returns if isinstance(v, Arr)), None)
        return first if first is not None else next((v for v, _ in returns if v is not None), None)

    def _check_contract(self, call, name, pos, kw):
        fn = self.src.functions[name]
        contract = CONTRACTS[name]
        params = [p.name.value for p in fn.params.params]
        bound = {}
        for i, (val, node) in enumerate(pos):
            if i < len(params):
                bound[params[i]] = (val, node)
        bound.update({k: v for k, v in kw.items() if k in params})
        lengths: dict[str, tuple[Mono, str]] = {}  # wildcard length -> (size, first argument that set it)
        for pname in params:
            if pname not in bound:
                continue
            val, node = bound[pname]
            want = contract.get(pname)
            if want is None or not isinstance(val, Arr):
                continue
            if len(val.shape) != len(want):
                self.error(
                    node,
                    f"passed as `{pname}` of {name}() with shape {shape_str(val.shape)}, "
                    f"but {name} expects {shape_str(want)}",
                )
                continue
            for got, exp in zip(val.shape, want):
                wild = [k for f in exp for k, _ in f.exps if k in WILDCARDS]
                if wild:
                    if len(exp) == 1 and len(wild) == 1:  # the same length everywhere in one call
                        size = prod(got)
                        if wild[0] in lengths and not same(lengths[wild[0]][0], size):
                            first = lengths[wild[0]]
                            self.error(
                                node,
                                f"passed as `{pname}` of {name}() with length {size} where "
                                f"`{first[1]}` has {first[0]}",
                            )
                            break
                        lengths.setdefault(wild[0], (size, pname))
                    continue
                if not same(prod(got), prod(exp)):
                    self.error(
                        node,
                        f"passed as `{pname}` of {name}() with shape {shape_str(val.shape)}, "
                        f"but {name} expects {shape_str(want)}",
                    )
                    break

    def _linear(self, call, x, wv, b):
        if not isinstance(wv, Arr) or len(wv.shape) != 2:
            return None
        if not isinstance(x, Arr) or not x.shape:
            return None
        if not same(prod(x.shape[-1]), prod(wv.shape[1])):
            self.error(
                call,
                f"input features {dim_str(x.shape[-1])} do not match the weight's columns "
                f"{dim_str(wv.shape[1])} (weight {shape_str(wv.shape)}, applied as x @ W.T)",
            )
            return None
        if isinstance(b, Arr) and (len(b.shape) != 1 or not same(prod(b.shape[0]), prod(wv.shape[0]))):
            self.error(call, f"bias {shape_str(b.shape)} does not match the weight's rows {dim_str(wv.shape[0])}")
        return Arr(x.shape[:-1] + (wv.shape[0],))

    def _pt_call(self, call, name, pos, kw):
        vals = [p[0] for p in pos]
        if name in PT_ELEMENTWISE:
            return vals[0] if vals and isinstance(vals[0], Arr) else None
        if name in ("matmul", "dot"):
            if len(vals) != 2 or not all(isinstance(v, Arr) for v in vals):
                return None
            a, b = vals
            if name == "dot" and len(b.shape) == 2 and len(a.shape) >= 1:
                if not same(prod(a.shape[-1]), prod(b.shape[0])):
                    self.error(call, f"contracts {dim_str(a.shape[-1])} with {dim_str(b.shape[0])}")
                    return None
                return Arr(a.shape[:-1] + (b.shape[1],))
            if len(a.shape) < 2 or len(b.shape) < 2:
                return None
            if not same(prod(a.shape[-1]), prod(b.shape[-2])):
                self.error(
                    call,
                    f"contracts {dim_str(a.shape[-1])} with {dim_str(b.shape[-2])} "
                    f"({shape_str(a.shape)} @ {shape_str(b.shape)})",
                )
                return None
            batch = self._broadcast(Arr(a.shape[:-2]), Arr(b.shape[:-2]), call)
            if not isinstance(batch, Arr):
                return None
            return Arr(batch.shape + (a.shape[-2], b.shape[-1]))
        if name == "set_subtensor":
            if len(pos) != 2 or not isinstance(pos[0][1], cst.Subscript):
                return None
            region, value = vals
            base = self._expr(pos[0][1].value, self._env)
            if isinstance(region, Arr) and isinstance(value, Arr):
                ok = len(value.shape) <= len(region.shape) and all(
                    same(prod(v), prod(r)) or prod(v).is_one()
                    for v, r in zip(reversed(value.shape), reversed(region.shape))
                )
                if not ok:
                    self.error(call, f"writes a {shape_str(value.shape)} value into a {shape_str(region.shape)} region")
            return base
        if name == "where":
            if len(vals) != 3:
                return None
            out = vals[0]
            for v in vals[1:]:
                out = self._broadcast(out, v, call) if out is not None else None
            if out is None:  # condition of unknown shape: take a branch's
                out = vals[1] if isinstance(vals[1], Arr) else vals[2]
            return out if isinstance(out, Arr) else None
        if name == "tile":
            if len(vals) == 2 and isinstance(vals[0], Arr) and len(vals[0].shape) == 1 and isinstance(vals[1], Size):
                return Arr((vals[1].dim + vals[0].shape[0],))  # reps-major: row g * T + t
            return None
        if name == "arange":
            if vals and isinstance(vals[0], Size):
                return Arr((vals[0].dim,))
            return Arr((self._fresh("arange"),))
        if name in ("concatenate", "stack"):
            items = vals[0].items if vals and isinstance(vals[0], Tup) else None
            axis = kw.get("axis", (("int", 0) if name == "stack" else Size(()), None))[0]
            axis_v = self._int_value(axis)
            if not items or axis_v is None or not all(isinstance(v, Arr) for v in items):
                return None
            rank = len(items[0].shape)
            if any(len(v.shape) != rank for v in items):
                self.error(call, f"{name} of values with different ranks")
                return None
            if name == "stack":
                if any(tuple(map(prod, v.shape)) != tuple(map(prod, items[0].shape)) for v in items):
                    self.error(call, "stacks values of different shapes")
                    return None
                ax = axis_v if axis_v >= 0 else rank + 1 + axis_v
                shape = list(items[0].shape)
                shape.insert(ax, (Mono.const(len(items)),))
                return Arr(tuple(shape))
            ax = axis_v if axis_v >= 0 else rank + axis_v
            if not 0 <= ax < rank:
                return None
            for k in range(rank):
                if k != ax and len({prod(v.shape[k]) for v in items}) != 1:
                    self.error(call, f"concatenates values that differ on axis {k}")
                    return None
            sizes = [prod(v.shape[ax]) for v in items]
            if len({m.exps for m in sizes}) == 1:
                total = (Mono(sum((m.coeff for m in sizes), Fraction(0)), sizes[0].exps),)
            else:
                total = self._fresh("concat")
            shape = list(items[0].shape)
            shape[ax] = total
            return Arr(tuple(shape))
        return None

    def _int_value(self, v):
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "int":
            return v[1]
        if isinstance(v, Size):
            m = prod(v.dim)
            if not m.exps and m.coeff.denominator == 1:
                return int(m.coeff)
        return None

    # ------------------------------------------------------------------ broadcasting & arithmetic
    def _broadcast(self, a, b, node):
        if isinstance(a, Size) or a == SCALAR:
            return b if isinstance(b, Arr) else (SCALAR if isinstance(b, Size) or b == SCALAR else None)
        if isinstance(b, Size) or b == SCALAR:
            return a if isinstance(a, Arr) else None
        if not (isinstance(a, Arr) and isinstance(b, Arr)):
            return None
        out = []
        la, lb = list(a.shape), list(b.shape)
        n = max(len(la), len(lb))
        la = [()] * (n - len(la)) + la
        lb = [()] * (n - len(lb)) + lb
        for da, db in zip(la, lb):
            pa, pb = prod(da), prod(db)
            if pa == pb or (opaque(pa) and not pb.is_one()):
                out.append(da)
            elif opaque(pb) and not pa.is_one():
                out.append(db)
            elif pa.is_one():
                out.append(db)
            elif pb.is_one():
                out.append(da)
            else:
                self.error(node, f"broadcasts {shape_str(a.shape)} with {shape_str(b.shape)}")
                return None
        return Arr(tuple(out))

    def _binop(self, op, a, b, node):
        if isinstance(op, (cst.MatrixMultiply, cst.MatrixMultiplyAssign)):
            if isinstance(a, Arr) and isinstance(b, Arr) and len(a.shape) >= 2 and len(b.shape) >= 2:
                if not same(prod(a.shape[-1]), prod(b.shape[-2])):
                    self.error(node, f"contracts {dim_str(a.shape[-1])} with {dim_str(b.shape[-2])}")
                    return None
                return Arr(a.shape[:-2] + (a.shape[-2], b.shape[-1]))
            return None
        if isinstance(a, Size) and isinstance(b, Size):
            ma, mb = prod(a.dim), prod(b.dim)
            if isinstance(op, (cst.Multiply, cst.MultiplyAssign)):
                return Size(a.dim + b.dim)
            if isinstance(op, (cst.FloorDivide, cst.FloorDivideAssign)):
                q = ma / mb
                if not mb.exps:  # divided by a literal: an exact fraction of the size
                    return Size((q,))
                remaining = list(a.dim)
                for f in b.dim:
                    if f in remaining:
                        remaining.remove(f)
                    else:
                        return Size((q,)) if q.integral() else None
                return Size(tuple(remaining))
            if isinstance(op, (cst.Add, cst.AddAssign, cst.Subtract, cst.SubtractAssign)) and ma.exps == mb.exps:
                sign = 1 if isinstance(op, (cst.Add, cst.AddAssign)) else -1
                c = ma.coeff + sign * mb.coeff
                return Size((Mono(c, ma.exps),)) if c > 0 else None
            return None
        if isinstance(a, tuple) or isinstance(b, tuple):  # non-positive literal
            other = b if isinstance(a, tuple) else a
            return other if isinstance(other, Arr) else None
        return self._broadcast(a, b, node)

    # ------------------------------------------------------------------ reshape / dimshuffle
    def _reshape(self, call, base, args):
        targets_nodes = []
        if len(args) == 1 and isinstance(args[0].value, (cst.Tuple, cst.List)):
            targets_nodes = [el.value for el in args[0].value.elements]
        else:
            targets_nodes = [a.value for a in args if a.keyword is None and not a.star]
        strict = any(part in STRICT_FUNCTIONS for part in self._fn.split(" → "))
        snippet = self._snip(call)
        # a literal dimension other than -1, 1 or 2 is never a head/size constant
        for t in targets_nodes:
            v = int_literal(t)
            if v is not None and v not in (-1, 1, 2):
                self.error(call, f"literal dimension {v}: reshape dims must be named constants")
        env = self._env
        targets = []
        wildcard = None
        for k, t in enumerate(targets_nodes):
            v = self._expr(t, env)
            iv = self._int_value(v)
            if iv == -1:
                if wildcard is not None:
                    self.error(call, "more than one -1 dimension")
                    return None
                wildcard = k
                targets.append(None)
            elif isinstance(v, Size):
                targets.append(prod(v.dim))
            else:
                self.reshapes.append(ReshapeRecord(self._fn, snippet, False))
                if strict:
                    self.error(call, f"dimension `{self._snip(t)}` is not a size expression over the constants")
                return None
        if not isinstance(base, Arr):
            self.reshapes.append(ReshapeRecord(self._fn, snippet, False))
            if strict:
                self.error(call, "reshapes a value whose shape the auditor cannot infer")
            return None
        factors = [f for d in base.shape for f in d]
        if any(opaque(f) for f in factors):
            self.reshapes.append(ReshapeRecord(self._fn, snippet, False))
            if strict:
                self.error(call, f"reshapes a value of partly unknown shape {shape_str(base.shape)}")
            return None
        total = prod(factors)
        if wildcard is not None:
            known = prod(t for t in targets if t is not None)
            targets[wildcard] = total / known
        result = _regroup(factors, targets)
        if isinstance(result, str):
            self.reshapes.append(ReshapeRecord(self._fn, snippet, False))
            self.error(
                call, f"cannot reshape {shape_str(base.shape)} to " f"({', '.join(str(t) for t in targets)}): {result}"
            )
            return None
        self.reshapes.append(ReshapeRecord(self._fn, snippet, True))
        return Arr(tuple(tuple(parts) for parts in result))

    def _dimshuffle(self, call, base, nodes):
        if not isinstance(base, Arr):
            return None
        order = []
        for n in nodes:
            v = int_literal(n)
            if v is not None:
                order.append(v)
            elif isinstance(n, cst.SimpleString) and n.value.strip("'\"") == "x":
                order.append("x")
            else:
                return None
        idx = [o for o in order if o != "x"]
        if len(set(idx)) != len(idx) or any(not 0 <= o < len(base.shape) for o in idx):
            self.error(call, f"invalid dimshuffle of a {len(base.shape)}-d value")
            return None
        for k in range(len(base.shape)):
            if k not in idx and not prod(base.shape[k]).is_one():
                self.error(call, f"dimshuffle drops axis {k} of size {dim_str(base.shape[k])}")
                return None
        return Arr(tuple(() if o == "x" else base.shape[o] for o in order))


def _regroup(factors: list[Mono], targets: list[Mono]):
    """Split/merge the ordered input factors into the target sizes, or a reason why that is impossible."""
    rest = [f for f in factors if not f.is_one()]
    out = []
    for d in targets:
        if not (d.coeff > 0 and all(v > 0 for _, v in d.exps)):
            return f"size {d} is not a whole size"
        parts: list[Mono] = []
        acc = ONE
        while acc != d:
            if not rest:
                return f"no input factors left for {d}"
            a = rest[0]
            cand = acc * a
            if (d / cand).integral() or d == cand:
                parts.append(a)
                acc = cand
                rest.pop(0)
                continue
            need = d / acc
            left = a / need
            if need.coeff > 0 and all(v > 0 for _, v in need.exps) and (left.integral() or left.is_one()):
                parts.append(need)
                acc = d
                if left.is_one():
                    rest.pop(0)
                else:
                    rest[0] = left
                continue
            return f"{d} does not group the input factors ({' · '.join(str(f) for f in [a] + rest[1:])})"
        out.append(parts)
    if rest:
        return f"factors {' · '.join(str(f) for f in rest)} left over"
    return out
