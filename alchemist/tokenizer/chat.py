"""Rendering a GGUF's `tokenizer.chat_template` safely.

Chat templates come from whoever made the GGUF, so they are untrusted code. They run in jinja2's
`ImmutableSandboxedEnvironment` (no attribute walking to `__class__`/`__globals__`, no mutation of the
messages), made stricter here:
- any unsafe attribute access raises at once (stock jinja2 returns an Undefined that prints as "");
- rendering runs on a worker thread with a deadline; a template still running when it expires is stopped
  (an asynchronous exception at its next bytecode) and the call fails;
- the output, string/list repetition and concatenation (`*`, `+`, `~`, `**`) and the size-taking string
  methods and filters are bounded, so a template cannot build a huge string without emitting it;
- recursion (macros calling themselves) is bounded by Python's recursion limit and reported.
The environment matches Hugging Face transformers / llama-cpp-python (trim_blocks, lstrip_blocks,
loopcontrols, `tojson` with ensure_ascii=False, `{% generation %}` ignored), with the usual globals:
`messages`, `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `tools` (None),
`strftime_now`.

A GGUF without a template (a base model such as gemma-3-270m) gets the message contents joined with
newlines; the result says so (`ChatPrompt.used_template` is False) and a warning is issued.
"""

from __future__ import annotations

import copy
import ctypes
import functools
import json
import re
import threading
import warnings
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable

from alchemist.errors import AlchemistError

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_OUTPUT_CHARS = 1 << 22  # 4 Mi characters
MAX_STRING_CHARS = 1 << 22  # any single string or list a template builds
MAX_INT_BITS = 1 << 16  # integers a template may compute (a 2**(2**20) would stall the interpreter)
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")  # widths/precisions in '%10.3f'
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")  # the spec part of '{0:>10}'


class ChatTemplateError(AlchemistError):
    """A chat template failed, was refused (unsafe), or ran past its time or size bounds."""


class ChatTemplateWarning(UserWarning):
    """Something about chat formatting the caller should know (e.g. no template: plain concatenation)."""


class ChatPrompt(str):
    """The rendered prompt (a str) that also says how it was made."""

    used_template: bool
    note: str

    def __new__(cls, text: str, used_template: bool, note: str = ""):
        obj = super().__new__(cls, text)
        obj.used_template = used_template
        obj.note = note
        return obj


class _Stop(BaseException):
    """Raised asynchronously inside a render thread whose deadline passed (BaseException: templates'
    internal `except Exception` cannot swallow it)."""


class _TemplateRaised(Exception):
    pass


def _too_big(what: str, n: int) -> ChatTemplateError:
    return ChatTemplateError(f"chat template refused: {what} would have {n} items (limit {MAX_STRING_CHARS})")


def _sized(x) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


@lru_cache(maxsize=1)
def _environment_class():
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class _Generator(CodeGenerator):
        # `a ~ b` normally compiles to str_join((a, b)), which no sandbox hook sees; route it through the env
        def visit_Concat(self, node, frame):
            self.write("environment.alchemist_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class IgnoreGenerationTags(jinja2.ext.Extension):
        """Pass-through for Hugging Face's `{% generation %}` chat-template tag."""

        tags = {"generation"}

        def parse(self, parser):
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    _SIZE_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs"}

    class Sandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _Generator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def unsafe_undefined(self, obj, attribute):
            raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, k in ((left, right), (right, left)):
                    n = _sized(seq)
                    if n is not None and isinstance(k, int) and n * k > MAX_STRING_CHARS:
                        raise _too_big(f"{type(seq).__name__} * {k}", n * k)
                if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise ChatTemplateError("chat template refused: integer product too large")
            elif operator == "+":
                a, b = _sized(left), _sized(right)
                if a is not None and b is not None and a + b > MAX_STRING_CHARS:
                    raise _too_big("concatenation", a + b)
            elif operator == "**":
                if _is_int(left) and _is_int(right) and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
                    raise ChatTemplateError(f"chat template refused: {left!r} ** {right!r} is too large")
            elif operator == "%" and isinstance(left, str):
                _check_percent_format(left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt = value.__self__

            def checked(*args, **kwargs):
                _check_str_format(fmt, args, kwargs)
                return wrapped(*args, **kwargs)

            return checked

        def alchemist_concat(self, parts):
            parts = [p if isinstance(p, str) else str(p) for p in parts]
            n = sum(map(len, parts))
            if n > MAX_STRING_CHARS:
                raise _too_big("~ concatenation", n)
            return "".join(parts)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            name = getattr(__obj, "__name__", "")
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                if name in _SIZE_METHODS:
                    width = args[0] if args else kwargs.get("width", kwargs.get("tabsize", 0))
                    if isinstance(width, int) and width > MAX_STRING_CHARS:
                        raise _too_big(f"str.{name}({width})", width)
                    if name == "expandtabs" and isinstance(width, int) and owner.count("\t") * width > MAX_STRING_CHARS:
                        raise _too_big("str.expandtabs", owner.count("\t") * width)
                elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                    grow = (
                        owner.count(args[0]) * (len(args[1]) - len(args[0])) if args[0] else len(owner) * len(args[1])
                    )
                    if len(owner) + grow > MAX_STRING_CHARS:
                        raise _too_big("str.replace", len(owner) + grow)
                elif name == "join" and args:
                    items = list(args[0])
                    _check_join(owner, items)
                    args = (items,) + args[1:]
            return super().call(__context, __obj, *args, **kwargs)

    return Sandbox, IgnoreGenerationTags, SecurityError


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_widths(numbers: Iterable[int], what: str) -> None:
    for n in numbers:
        if n > MAX_STRING_CHARS:
            raise _too_big(what, n)


def _check_percent_format(fmt: str, args) -> None:
    """`'%999999999d' % x` and `'%*d' % (10**9, x)` would build huge strings."""
    _check_widths((int(d) for m in _PERCENT_SPEC.findall(fmt) for d in m if d), "%-format width")
    values = args if isinstance(args, tuple) else (args.values() if isinstance(args, dict) else (args,))
    if "*" in fmt:
        _check_widths((v for v in values if _is_int(v)), "%-format width")


def _check_str_format(fmt: str, args, kwargs) -> None:
    specs = _FORMAT_SPEC.findall(fmt)
    _check_widths((int(d) for spec in specs for d in re.findall(r"\d+", spec)), "str.format width")
    if re.search(r":[^{}]*\{", fmt):  # a nested field sets the width: '{:{w}}'.format(x, w=...)
        _check_widths((v for v in list(args) + list(kwargs.values()) if _is_int(v)), "str.format width")


def _check_join(sep: str, items: list) -> None:
    total = len(sep) * max(0, len(items) - 1) + sum(len(x) if isinstance(x, str) else 32 for x in items)
    if total > MAX_STRING_CHARS:
        raise _too_big("join", total)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    if _is_int(indent) and indent > 256:
        raise ChatTemplateError(f"chat template refused: tojson(indent={indent})")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _checked_filter(env, name: str, size_of):
    original = env.filters[name]

    def wrapper(*args, **kwargs):
        n = size_of(*args, **kwargs)
        if n > MAX_STRING_CHARS:
            raise _too_big(f"|{name}", n)
        return original(*args, **kwargs)

    functools.update_wrapper(wrapper, original)  # keeps jinja2's pass_eval_context / pass_environment marks
    return wrapper


def _make_env():
    import jinja2
    import jinja2.ext

    Sandbox, IgnoreGenerationTags, _ = _environment_class()
    env = Sandbox(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[IgnoreGenerationTags, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson

    def _int(x, default=0):
        return x if isinstance(x, int) else default

    env.filters["center"] = _checked_filter(env, "center", lambda s, width=80: _int(width))
    env.filters["indent"] = _checked_filter(
        env,
        "indent",
        lambda s, width=4, *a, **k: len(str(s))
        + (str(s).count("\n") + 1) * (_int(width) if not isinstance(width, str) else len(width)),
    )

    def _replace_size(ctx, s, old, new, count=None) -> int:
        s, old, new = str(s), str(old), str(new)
        hits = s.count(old) if old else len(s) + 1
        return len(s) + hits * len(new)

    env.filters["replace"] = _checked_filter(env, "replace", _replace_size)
    env.filters["wordwrap"] = _checked_filter(env, "wordwrap", lambda ctx, s, width=79, *a, **k: 2 * len(str(s)))

    def _format_size(value, *args, **kwargs) -> int:
        _check_percent_format(str(value), tuple(args) if args else kwargs)
        return 0

    env.filters["format"] = _checked_filter(env, "format", _format_size)
    original_join = env.filters["join"]

    @functools.wraps(original_join)
    def join(eval_ctx, value, d="", attribute=None):
        items = list(value)
        if attribute is None:
            _check_join(str(d), items)
        result = original_join(eval_ctx, items, d, attribute)
        if len(result) > MAX_STRING_CHARS:
            raise _too_big("|join", len(result))
        return result

    env.filters["join"] = join
    return env


@lru_cache(maxsize=32)
def compile_template(source: str):
    """Compile (and cache) a chat template; syntax errors become ChatTemplateError."""
    import jinja2

    env = _make_env()
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from None


def _raise_exception(message: str = ""):
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def render_template(
    source: str,
    context: dict[str, Any],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
    where: str = "chat template",
) -> str:
    """Render an untrusted jinja2 template with the sandbox, a deadline and an output bound."""
    import jinja2

    _, _, SecurityError = _environment_class()
    template = compile_template(source)
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            chunks, n = [], 0
            for chunk in template.generate(**context):
                n += len(chunk)
                if n > max_output_chars:
                    raise ChatTemplateError(f"{where} output exceeds {max_output_chars} characters; stopped")
                chunks.append(chunk)
            result["text"] = "".join(chunks)
        except BaseException as e:  # noqa: BLE001 - everything is reported to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=work, name="alchemist-chat-template", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Stop))
        thread.join(1.0)
        raise ChatTemplateError(f"{where} did not finish within {timeout_s:g} s; stopped (runaway loop?)")
    err = result.get("error")
    if err is None:
        return result["text"]
    if isinstance(err, ChatTemplateError):
        raise err
    if isinstance(err, SecurityError):
        raise ChatTemplateError(f"{where} refused: {err}") from None
    if isinstance(err, _TemplateRaised):
        raise ChatTemplateError(f"{where} raised an exception: {err}") from None
    if isinstance(err, RecursionError):
        raise ChatTemplateError(f"{where} recursed too deeply; stopped") from None
    if isinstance(err, OverflowError):  # jinja2's sandboxed range() refuses huge ranges this way
        raise ChatTemplateError(f"{where} refused: {err}") from None
    if isinstance(err, MemoryError):
        raise ChatTemplateError(f"{where} ran out of memory; stopped") from None
    if isinstance(err, jinja2.TemplateError):
        raise ChatTemplateError(f"{where} failed: {type(err).__name__}: {err}") from None
    if isinstance(err, Exception):
        raise ChatTemplateError(f"{where} failed: {type(err).__name__}: {err}") from None
    raise err


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI-style parts
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _check_messages(messages) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ChatTemplateError(f"messages[{i}] must be a dict with a 'role' (and usually 'content'), got {m!r}")
    return copy.deepcopy(list(messages))


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    tools: list | None = None,
    template: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_output_chars: int | None = None,
    **extra: Any,
) -> ChatPrompt:
    """Render `messages` with the tokenizer's chat template (or `template`, a jinja2 source string or the
    name of one of the GGUF's `tokenizer.chat_template.<name>` templates)."""
    messages = _check_messages(messages)
    vocab = tokenizer.vocab
    source = template
    if source is not None and source in vocab.chat_templates:
        source = vocab.chat_templates[source]
    if source is None:
        source = vocab.chat_template
    if not source:
        note = (
            f"{vocab.path} has no tokenizer.chat_template (a base model?): "
            "the prompt is the message contents joined by newlines"
        )
        warnings.warn(note, ChatTemplateWarning, stacklevel=3)
        return ChatPrompt("\n".join(_content_text(m.get("content")) for m in messages), used_template=False, note=note)

    def tok_text(tid):
        return vocab.tokens[tid] if tid is not None else ""

    context = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": tok_text(vocab.bos_id),
        "eos_token": tok_text(vocab.eos_id),
        "raise_exception": _raise_exception,
        "tools": copy.deepcopy(tools),
        "strftime_now": _strftime_now,
        **extra,
    }
    if max_output_chars is None:
        size = sum(len(_content_text(m.get("content"))) for m in messages) + len(json.dumps(tools or []))
        max_output_chars = max(DEFAULT_MAX_OUTPUT_CHARS, 4 * size)
    text = render_template(source, context, timeout_s=timeout_s, max_output_chars=max_output_chars)
    return ChatPrompt(text, used_template=True)
