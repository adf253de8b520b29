"""Tool calls: OpenAI's `tools` and `tool_choice` over a model's own chat template.

The tools reach the model through its chat template (the `tools` variable, as the template expects them). A
forced call (tool_choice "required", or a named function) is generated under a JSON-schema constraint: the object
{"name": ..., "arguments": {...}} of one of the tools, its arguments held to that function's parameter schema, so
it is valid whatever the model. With "auto" the model answers as it likes, and its own tool-call syntax is read
from the answer: Hermes/Qwen `<tool_call>{...}</tool_call>` blocks, Mistral's `[TOOL_CALLS] [...]`, or a bare
`{"name": ..., "arguments" | "parameters": ...}` object (or a list of them) as Llama 3 writes it."""

from __future__ import annotations

import json
import re
import uuid

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"


def forced_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one call to the named tool (None: to any of them)."""
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
        if name is None or t["name"] == name
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def _call(obj, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


def _calls(candidates, names: set[str]) -> list[dict] | None:
    calls = [_call(c, names) for c in candidates]
    return calls if calls and all(c is not None for c in calls) else None


def _loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def parse_calls(text: str, names: set[str]) -> list[dict] | None:
    """The tool calls in a model's answer ([{"name", "arguments": dict}]), or None for a plain answer."""
    blocks = _HERMES.findall(text)
    if blocks:
        return _calls([_loads(b) for b in blocks], names)
    stripped = text.strip()
    if stripped.startswith(_MISTRAL):
        stripped = stripped[len(_MISTRAL) :].strip()
    obj = _loads(stripped) if stripped[:1] in "{[" else None
    return _calls(obj if isinstance(obj, list) else [obj], names) if obj is not None else None


def openai_tool_calls(calls: list[dict], streamed: bool = False) -> list[dict]:
    """The calls in OpenAI's shape (arguments as a JSON string; streamed deltas also carry their index)."""
    out = []
    for i, c in enumerate(calls):
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}  # fmt: skip
        out.append({"index": i, **call} if streamed else call)
    return out


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a chat template: an assistant's tool calls with their arguments as objects (templates write
    them with `tojson`; OpenAI's clients send them as JSON strings)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: dict) -> dict:
    fn = call.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        parsed = _loads(fn["arguments"])
        if isinstance(parsed, dict):
            return {**call, "function": {**fn, "arguments": parsed}}
    return call
