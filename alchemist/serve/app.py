"""An OpenAI-compatible HTTP front end over a Scheduler: `/v1/completions`, `/v1/chat/completions` (streamed as
server-sent events or whole), `/v1/models`, the tokenizer's `/tokenize`, `/detokenize` and `/tokenizer_info`,
`/health` and `/metrics`.

The scheduler thread owns the model; this module only turns requests into token ids (in a worker thread, never the
scheduler's), submits them, and relays the scheduler's events, which cross threads through
`loop.call_soon_threadsafe` into one asyncio queue per request. Errors come back in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`; a client that goes away cancels its request."""

from __future__ import annotations

import asyncio
import bisect
import json
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from alchemist.errors import AlchemistError
from alchemist.runtime.sampling import SamplingParams
from alchemist.serve.constraints import ConstraintError, Constraints
from alchemist.serve.events import DoneEvent, PromptEvent, QueueFull, SchedulerClosed, TokenEvent
from alchemist.serve.guard import RequestGuard
from alchemist.serve.tools import forced_schema, openai_tool_calls, parse_calls, template_messages
from alchemist.serve.guard import openai_error as _error_response

MAX_BODY_BYTES = 8 << 20
MAX_STOP = 16
MAX_PROMPTS = 32  # choices in one request: prompts (/v1/completions) times n
MAX_N = 8  # choices per prompt
MAX_TOOLS = 128
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_WINDOW_S = 10.0
DISCONNECT_POLL_S = 0.25  # how often a whole (non-streamed) answer asks whether its client is still there


# ---------------------------------------------------------------------------------------------- request bodies
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # newer openai clients may send it; there is nothing to obfuscate


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")  # the older {"type": "json_object", "schema": {...}}


class _Common(_Strict):
    model: str | None = None  # optional: one model is served (as llama.cpp's and llama-cpp-python's servers)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int | None = Field(None, ge=1, le=MAX_N)  # choices per prompt, sampled apart (seed + j for choice j)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = Field(None, ge=0)  # extensions (llama.cpp, vLLM)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool | None = False
    # structured output: OpenAI's response_format; llama.cpp's grammar (GBNF) and json_schema; vLLM's guided_*
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None


class CompletionBody(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (with echo and logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class ToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class TokenizeBody(_Strict):
    """/tokenize in vLLM's shape (`prompt`, `add_special_tokens`, default true) or llama.cpp's (`content`,
    `add_special`, default false; `with_pieces`)."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    with_pieces: bool | None = False


class DetokenizeBody(_Strict):
    model: str | None = None
    tokens: list[int]


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = (
            status,
            message,
            type_,
            param,
            code,
            headers,
        )


def _unsupported(body: _Common) -> None:
    """Fields the openai client may send that we accept only at their neutral values."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(400, f"{name} is not supported (only 0)", param=name)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if isinstance(body, CompletionBody):
        if body.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        if body.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
    if isinstance(body, ChatBody) and body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")


def _constraint_spec(body: _Common) -> tuple[str, object, str] | None:
    """The request's structured-output constraint as (kind, value, the field that asked), or None; one at most."""
    asked = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        asked.append(("json_schema", rf.schema_, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        asked.append(("json_schema", rf.json_schema.schema_, "response_format"))
    for field, kind in (("grammar", "grammar"), ("json_schema", "json_schema"), ("guided_json", "json_schema"),
                        ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(body, field)
        if value is not None:
            if field == "guided_json" and isinstance(value, str):
                try:
                    value = json.loads(value)
                except (json.JSONDecodeError, RecursionError):
                    raise ApiError(400, "guided_json is not a JSON schema", param=field) from None
            asked.append((kind, value, field))
    mode, name = _tool_mode(body)
    if mode == "forced":
        asked.append(("json_schema", forced_schema(_tool_defs(body), name), "tool_choice"))
    if len(asked) > 1:
        raise ApiError(400, f"one structured-output constraint per request, got {', '.join(a[2] for a in asked)}",
                       param=asked[1][2])  # fmt: skip
    return asked[0] if asked else None


def _tool_defs(body) -> list[dict]:
    return [t.function.model_dump(exclude_none=True) for t in getattr(body, "tools", None) or []]


def _tool_mode(body) -> tuple[str, str | None]:
    """How a chat request uses its tools: "none" (no tools, or tool_choice none), "auto" (the model may call one:
    its answer is parsed), or "forced" (required, or the named function: the call is generated under the tools'
    schema); with the forced function's name."""
    tools, choice = getattr(body, "tools", None), getattr(body, "tool_choice", None)
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice names a call, but the request has no tools", param="tool_choice")
        return "none", None
    if choice == "none":
        return "none", None
    if choice is None or choice == "auto":
        return "auto", None
    if choice == "required":
        return "forced", None
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise ApiError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                       f"({', '.join(names)})", param="tool_choice")  # fmt: skip
    return "forced", choice.function.name


def _stop_list(stop) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stops = [s for s in stops if s]
    if len(stops) > MAX_STOP:
        raise ApiError(400, f"at most {MAX_STOP} stop strings", param="stop")
    return stops


def _sampling(body: _Common, choice: int = 0) -> SamplingParams:
    """The sampling parameters of a prompt's `choice`-th answer (n > 1: seed + choice, so they differ)."""
    seed = None if body.seed is None else (body.seed + choice) & 0xFFFFFFFFFFFFFFFF  # numpy wants a non-negative seed
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,  # OpenAI's default
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        repetition_penalty=body.repetition_penalty or 1.0,
        seed=seed,
    )


def _parse(raw: bytes, model_cls):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ApiError(400, "the request body nests arrays or objects too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        param = loc[0] if loc else None
        if err["type"] == "extra_forbidden":
            message = f"unknown field {'.'.join(loc)!r}"
        elif err["type"] == "missing":
            message = f"missing required field {'.'.join(loc)!r}"
        else:
            message = f"{'.'.join(loc)}: {err['msg']}"
        raise ApiError(400, message, param=param) from None


# ---------------------------------------------------------------------------------------------- metrics helpers
class _TokenRate:
    """Generated tokens per second over the last RATE_WINDOW_S, from the events' arrival times."""

    def __init__(self):
        self._times: deque[float] = deque(maxlen=200_000)

    def add(self) -> None:
        self._times.append(time.monotonic())  # called from the scheduler thread; deque.append is atomic

    def rate(self) -> float:
        now = time.monotonic()
        times = list(self._times)
        recent = [t for t in times if t > now - RATE_WINDOW_S]
        return len(recent) / RATE_WINDOW_S


def _buckets(values, buckets) -> tuple[list[tuple[str, float]], float]:
    """A latency histogram's cumulative buckets and sum, from the scheduler's stats: an object with `cumulative()`
    and `sum` (its own buckets), or a plain sequence of seconds (bucketed here)."""
    if hasattr(values, "cumulative"):
        cum = [(float(b), int(n)) for b, n in values.cumulative()]
        total = float(values.sum)
    else:
        xs = sorted(float(v) for v in (values or []))
        cum = [(float(b), bisect.bisect_right(xs, b)) for b in buckets] + [(float("inf"), len(xs))]
        total = sum(xs)
    return [("+Inf" if b == float("inf") else f"{b:g}", n) for b, n in cum], total


class _SchedulerMetrics:
    """A prometheus-client collector that reads the scheduler's stats at each scrape (nothing is updated twice)."""

    def __init__(self, scheduler, rate: _TokenRate):
        self.scheduler, self.rate = scheduler, rate

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        st = self.scheduler.stats
        gauges = (
            ("alchemist_queue_depth", "Requests waiting for a slot.", st.queue_depth),
            ("alchemist_active_slots", "Slots holding a running request.", st.active_slots),
            ("alchemist_slots", "Slots (concurrent sequences).", getattr(st, "n_slots", 0)),
            ("alchemist_kv_cache_usage_ratio", "Share of the slots' cache positions that running requests hold.",
             getattr(st, "kv_cache_usage", 0.0)),
            ("alchemist_tokens_per_second", f"Generated tokens per second over the last {RATE_WINDOW_S:g} s.",
             self.rate.rate()),
        )  # fmt: skip
        for name, help_, value in gauges:
            yield GaugeMetricFamily(name, help_, value=float(value or 0))
        counters = (
            ("alchemist_requests", "Requests admitted to the queue.", getattr(st, "requests_total", 0)),
            ("alchemist_generated_tokens", "Tokens generated.", st.generated_tokens_total),
            ("alchemist_prompt_tokens", "Prompt tokens submitted.", getattr(st, "prompt_tokens_total", 0)),
            ("alchemist_cached_tokens", "Prompt tokens reused from a slot's cache.", getattr(st, "cached_tokens_total", 0)),
        )  # fmt: skip
        for name, help_, value in counters:
            yield CounterMetricFamily(name, help_, value=float(value or 0))
        started = getattr(st, "started_at", None)
        if started:
            # started_at may be a perf_counter or a wall-clock stamp: only report a sensible uptime
            up = max(0.0, (time.time() if started > 1e9 else time.perf_counter()) - started)
            yield GaugeMetricFamily("alchemist_uptime_seconds", "Seconds since the scheduler started.", value=up)
        for name, help_, values in (
            ("alchemist_time_to_first_token_seconds", "Time from submit to the first token.", "ttft_seconds"),
            ("alchemist_inter_token_latency_seconds", "Time between a stream's tokens.", "itl_seconds"),
        ):
            buckets, total = _buckets(getattr(st, values, None), LATENCY_BUCKETS)
            yield HistogramMetricFamily(name, help_, buckets=buckets, sum_value=total)


# ---------------------------------------------------------------------------------------------- the app
def create_app(
    scheduler,
    tokenizer,
    model_id: str,
    *,
    request_cls=None,
    drain_s: float = 10.0,
    manage_scheduler: bool = True,
    retry_after_s: int = 1,
    api_key: str | None = None,
    allowed_hosts=None,
    open_health: bool = False,
) -> FastAPI:
    """The FastAPI app over `scheduler` (the serving contract's Scheduler interface).

    With `api_key` every route wants `Authorization: Bearer <api_key>` (/health not with `open_health`);
    `allowed_hosts` (alchemist.serve.guard.allowed_hosts_for) limits the Host headers it answers to.

    `request_cls` builds the scheduler's requests (default `alchemist.serve.scheduler.Request`). With
    `manage_scheduler` the app's lifespan starts the scheduler (unless it runs already) and, at shutdown, stops it
    with `scheduler.stop(drain_s)`. `app.state.draining = True` makes /health answer 503 and new requests 503."""
    if request_cls is None:
        from alchemist.serve.scheduler import Request as request_cls  # noqa: N813 (resolved late: a sibling module)

    rate = _TokenRate()
    created = int(time.time())
    constraints = Constraints(tokenizer)  # reads the vocabulary on the first constrained request

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_scheduler and not getattr(scheduler.stats, "running", False):
            scheduler.start()
        try:
            yield
        finally:
            app.state.draining = True
            if manage_scheduler:
                await run_in_threadpool(scheduler.stop, drain_s)
            constraints.close()

    app = FastAPI(title="alchemist", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.draining = False
    app.state.scheduler = scheduler
    if api_key is not None or allowed_hosts is not None:
        open_paths = ("/health",) if open_health else ()
        app.add_middleware(RequestGuard, api_key=api_key, allowed_hosts=allowed_hosts, open_paths=open_paths)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):  # FastAPI's 422 becomes 400
        return _error_response(400, str(e.errors()[:1]), "invalid_request_error")

    # ------------------------------------------------------------------ shared request path
    async def _read(request: Request, model_cls):
        # JSON only: a cross-site form may post text/plain without a preflight, never application/json
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, f"the request body must be sent as Content-Type: application/json, not "
                           f"{media or 'without a Content-Type'}")  # fmt: skip
        body = _parse(await _body(request), model_cls)
        if body.model is not None and body.model != model_id:
            raise ApiError(404, f"the model {body.model!r} does not exist (this server has {model_id!r})",
                           param="model", code="model_not_found")  # fmt: skip
        if isinstance(body, _Common):
            _unsupported(body)
        if app.state.draining:
            raise ApiError(503, "the server is shutting down", "server_error", code="server_shutting_down")
        return body

    async def _body(request: Request) -> bytes:
        """The body, read no further than MAX_BODY_BYTES: a stranger's gigabyte is refused, not buffered."""
        too_big = ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_big
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise too_big
        return bytes(raw)

    def _checked_ids(ids, param: str) -> list[int]:
        ids, n_vocab = [int(t) for t in ids], tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is out of range [0, {n_vocab})", param=param)
        return ids

    def _check_lengths(n_prompt: int, max_tokens: int | None, explicit: bool) -> int:
        ctx = int(scheduler.max_context)
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty (0 tokens)", param="prompt")
        if n_prompt >= ctx:
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens, but the prompt is {n_prompt} "
                           "tokens (one position must remain for the answer)", param="messages",
                           code="context_length_exceeded")  # fmt: skip
        if max_tokens is None:
            return ctx - n_prompt
        if explicit and n_prompt + max_tokens > ctx:
            raise ApiError(400, f"this model's maximum context length is {ctx} tokens; you requested "
                           f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                           "completion)", param="max_tokens", code="context_length_exceeded")  # fmt: skip
        return min(max_tokens, ctx - n_prompt)

    def _submit(prompt: list[int], body: _Common, max_tokens: int, logprobs: int | None, q: asyncio.Queue,
                index: int = 0, prompt_logprobs: int | None = None, choice: int = 0, constraint=None):  # fmt: skip
        """Queue one choice's request; its events arrive in q as (index, event)."""
        loop = asyncio.get_running_loop()

        def sink(ev) -> None:  # the scheduler thread: never block, never raise
            if isinstance(ev, TokenEvent):
                rate.add()
            try:
                loop.call_soon_threadsafe(q.put_nowait, (index, ev))
            except RuntimeError:  # the loop has closed (shutdown)
                pass

        # not in every scheduler's Request: only when asked
        extra = {"ignore_eos": True} if body.ignore_eos else {}
        if prompt_logprobs is not None:
            extra["prompt_logprobs"] = prompt_logprobs
        if constraint is not None:
            extra["constraint"] = constraint
        try:
            req = request_cls(
                prompt=prompt, params=_sampling(body, choice), max_tokens=max_tokens, stop=_stop_list(body.stop),
                logprobs=logprobs, sink=sink, **extra,
            )  # fmt: skip
        except TypeError:
            asked = next(k for k in ("constraint", "prompt_logprobs", "ignore_eos") if k in extra)
            what = {"constraint": "structured output", "prompt_logprobs": "echo with logprobs"}.get(asked, asked)
            raise ApiError(400, f"{what} is not supported by this server's scheduler",
                           param={"prompt_logprobs": "echo", "constraint": None}.get(asked, asked)) from None  # fmt: skip
        try:
            scheduler.submit(req)
        except AlchemistError as e:
            if isinstance(e, QueueFull):
                raise ApiError(429, f"the server is busy ({e}); retry later", "rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(retry_after_s)}) from None  # fmt: skip
            if isinstance(e, SchedulerClosed):
                raise ApiError(503, str(e), "server_error", code="server_shutting_down") from None
            code = "context_length_exceeded" if "context" in str(e) else None
            raise ApiError(400, str(e), param="max_tokens" if code else None, code=code) from None
        return req

    async def _constraints_for(body: _Common, n_choices: int) -> list:
        """Each choice's structured-output matcher (compiled once, in a worker thread), or Nones."""
        spec = _constraint_spec(body)
        if spec is None:
            return [None] * n_choices
        kind, value, field = spec
        try:
            grammar = await run_in_threadpool(constraints.grammar, kind, value)
            return [await run_in_threadpool(constraints.constraint, grammar) for _ in range(n_choices)]
        except ConstraintError as e:
            raise ApiError(400, str(e), param=field) from None

    async def _submit_all(prompts: list, body: _Common, lengths: list, logprobs, prompt_logprobs=None):
        """Queue n choices of each prompt (choice j of prompt i has index i * n + j); all of them or none."""
        n = body.n or 1
        if len(prompts) * n > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} choices per request (prompts times n), got {len(prompts) * n}",
                           param="n" if n > 1 else "prompt")  # fmt: skip
        matchers = await _constraints_for(body, len(prompts) * n)
        q: asyncio.Queue = asyncio.Queue()
        reqs = []
        try:
            for i, (ids, max_tokens) in enumerate(zip(prompts, lengths)):
                for j in range(n):
                    k = len(reqs)
                    reqs.append(_submit(ids, body, max_tokens, logprobs, q, k, prompt_logprobs, j, matchers[k]))
        except ApiError:
            for r in reqs:
                scheduler.cancel(r.id)
            raise
        return reqs, q

    def _piece(tid: int) -> tuple[str, list[int]]:
        b = tokenizer.token_to_piece(int(tid))
        return b.decode("utf-8", errors="replace"), list(b)

    def _usage(dones) -> dict:
        """The usage of a request's choices, summed."""
        us = [dict(d.usage or {}) for d in dones]
        usage = {k: sum(int(u.get(k, 0)) for u in us) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        if any("cached_tokens" in u for u in us):
            usage["prompt_tokens_details"] = {"cached_tokens": sum(int(u.get("cached_tokens", 0)) for u in us)}
        return usage

    def _end_error(done) -> ApiError | None:
        if done.finish_reason == "error":
            return ApiError(500, f"generation failed: {done.error}", "server_error", code="generation_error")
        if done.finish_reason == "cancelled":
            return ApiError(503, "the request was cancelled (the server is shutting down)", "server_error",
                            code="cancelled")  # fmt: skip
        return None

    async def _events(request: Request, reqs: list, q: asyncio.Queue, poll_disconnect: bool):
        """Yield (index, event) of the requests' events until each has sent its DoneEvent; cancel those still
        running if we are torn down or the client leaves."""
        running = set(range(len(reqs)))
        loop = asyncio.get_running_loop()
        check_at = loop.time() + DISCONNECT_POLL_S
        try:
            while running:
                if poll_disconnect:
                    try:
                        item = await asyncio.wait_for(q.get(), max(0.0, check_at - loop.time()))
                    except TimeoutError:
                        item = None
                    if loop.time() >= check_at:  # on a clock, not on silence: tokens arrive faster than that
                        if await request.is_disconnected():
                            return
                        check_at = loop.time() + DISCONNECT_POLL_S
                    if item is None:
                        continue
                else:
                    item = await q.get()
                if isinstance(item[1], DoneEvent):
                    running.discard(item[0])
                yield item
        finally:
            for i in running:
                scheduler.cancel(reqs[i].id)

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _stream(gen) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(gen, media_type="text/event-stream", headers=headers)

    # ------------------------------------------------------------------ the two answers' shapes
    class _CompletionShape:
        """/v1/completions: text_completion objects, a choice per prompt; logprobs in the legacy format (tokens,
        token_logprobs, top_logprobs, text_offset in characters from the prompt's start), the prompt's own first
        when it is echoed and scored (its first token's logprob and alternatives null)."""

        def __init__(self, rid: str, created: int, logprobs: int | None, prompts: list, echo: bool):
            # prompts: per choice (its text, its ids)
            self.rid, self.created, self.want_logprobs, self.echo = rid, created, logprobs is not None, echo
            self.prompts = prompts
            self.offsets = [len(text) for text, _ in prompts]
            self.scored = echo and logprobs is not None

        def _chunk(self, index: int, text, finish=None, logprobs=None) -> dict:
            c = {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
            return {"id": self.rid, "object": "text_completion", "created": self.created, "model": model_id,
                    "choices": [c]}  # fmt: skip

        def _entries(self, ids, lps, offset: int) -> dict:
            out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for tid, (lp, top) in zip(ids, lps):
                text, _ = _piece(tid)
                out["tokens"].append(text)
                out["token_logprobs"].append(None if lp is None else float(lp))
                out["top_logprobs"].append(None if lp is None else {_piece(t)[0]: float(x) for t, x in top or []})
                out["text_offset"].append(offset)
                offset += len(text)
            return out

        def logprob(self, index: int, ev) -> dict | None:
            if isinstance(ev, PromptEvent):
                return self._entries(self.prompts[index][1], ev.logprobs, 0)
            if ev.logprob is None:
                return None
            out = self._entries([ev.token_id], [(ev.logprob, ev.top_logprobs)], self.offsets[index])
            self.offsets[index] += len(out["tokens"][0])
            return out

        def first(self) -> list[dict]:  # an echo without scores goes first; a scored one with its PromptEvent
            return (
                [self._chunk(i, text) for i, (text, _) in enumerate(self.prompts)]
                if self.echo and not self.scored
                else []
            )

        def chunk(self, index: int, ev, logprob) -> list[dict]:
            if isinstance(ev, PromptEvent):
                return [self._chunk(index, self.prompts[index][0], logprobs=logprob)]
            return [self._chunk(index, ev.text, logprobs=logprob)] if ev.text or logprob is not None else []

        def final(self, index: int, done) -> list[dict]:
            return [self._chunk(index, done.text, done.finish_reason)]

        def whole(self, dones: dict, texts: dict, logprobs: dict) -> dict:
            keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            choices = []
            for i in sorted(dones):
                merged = {k: [x for d in logprobs[i] for x in d[k]] for k in keys} if self.want_logprobs else None
                text = (self.prompts[i][0] if self.echo else "") + texts[i]
                choices.append(self._chunk(i, text, dones[i].finish_reason, merged)["choices"][0])
            return {"id": self.rid, "object": "text_completion", "created": self.created, "model": model_id,
                    "choices": choices, "usage": _usage(dones.values())}  # fmt: skip

    class _ChatShape:
        """/v1/chat/completions: chat.completion(.chunk) objects, a choice per n; logprobs as content entries with
        their bytes."""

        def __init__(self, rid: str, created: int, logprobs: int | None, n: int, tool_names: set[str]):
            self.rid, self.created, self.want_logprobs, self.n = rid, created, logprobs is not None, n
            # with tools the answer is held back until it ends: it may turn out to be a call
            self.tool_names, self.held = tool_names, {i: [] for i in range(n)}

        def _chunk(self, index: int, delta: dict, finish=None, logprobs=None) -> dict:
            c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": model_id,
                    "choices": [c]}  # fmt: skip

        def logprob(self, index: int, ev) -> dict | None:
            if ev.logprob is None:
                return None
            text, b = _piece(ev.token_id)
            top = []
            for t, lp in ev.top_logprobs or []:
                tt, tb = _piece(t)
                top.append({"token": tt, "logprob": float(lp), "bytes": tb})
            return {"token": text, "logprob": float(ev.logprob), "bytes": b, "top_logprobs": top}

        def first(self) -> list[dict]:
            return [self._chunk(i, {"role": "assistant", "content": ""}) for i in range(self.n)]

        def chunk(self, index: int, ev, logprob) -> list[dict]:
            if self.tool_names:
                self.held[index].append(ev.text)
                return []
            if not ev.text and logprob is None:
                return []
            lps = None if logprob is None else {"content": [logprob]}
            return [self._chunk(index, {"content": ev.text}, logprobs=lps)]

        def calls(self, text: str, finish: str) -> list[dict] | None:
            return parse_calls(text, self.tool_names) if self.tool_names and finish == "stop" else None

        def final(self, index: int, done) -> list[dict]:
            if self.tool_names:
                text = "".join(self.held[index]) + done.text
                calls = self.calls(text, done.finish_reason)
                if calls is not None:
                    delta = {"content": None, "tool_calls": openai_tool_calls(calls, streamed=True)}
                    return [self._chunk(index, delta), self._chunk(index, {}, "tool_calls")]
            else:
                text = done.text
            return ([self._chunk(index, {"content": text})] if text else []) + [
                self._chunk(index, {}, done.finish_reason)
            ]

        def whole(self, dones: dict, texts: dict, logprobs: dict) -> dict:
            choices = []
            for i in sorted(dones):
                message = {"role": "assistant", "content": texts[i], "refusal": None}
                finish = dones[i].finish_reason
                calls = self.calls(texts[i], finish)
                if calls is not None:
                    message.update(content=None, tool_calls=openai_tool_calls(calls))
                    finish = "tool_calls"
                choice = {"index": i, "message": message, "logprobs": None, "finish_reason": finish}
                if self.want_logprobs:
                    choice["logprobs"] = {"content": logprobs[i], "refusal": None}
                choices.append(choice)
            return {"id": self.rid, "object": "chat.completion", "created": self.created, "model": model_id,
                    "choices": choices, "usage": _usage(dones.values())}  # fmt: skip

    async def _answer(request: Request, reqs: list, q: asyncio.Queue, shape, stream: bool, include_usage: bool):
        """Both endpoints' one path: the shape's chunks as server-sent events, or the whole answer once every
        choice is done. A choice that fails fails the answer (the others are cancelled)."""
        if stream:

            def sse(c: dict) -> str:
                if include_usage:
                    c["usage"] = None
                return _sse(c)

            async def gen():
                for c in shape.first():
                    yield sse(c)
                dones, last = [], None
                async for index, ev in _events(request, reqs, q, poll_disconnect=False):
                    if isinstance(ev, DoneEvent):
                        err = _end_error(ev)
                        if err is not None:
                            yield _sse({"error": {"message": err.message, "type": err.type, "param": None,
                                                  "code": err.code}})  # fmt: skip
                            break
                        dones.append(ev)
                        for c in shape.final(index, ev):
                            last = c
                            yield sse(c)
                        continue
                    for c in shape.chunk(index, ev, shape.logprob(index, ev)):
                        yield sse(c)
                else:
                    if include_usage and last is not None:
                        u = {k: last[k] for k in ("id", "object", "created", "model")}
                        yield _sse({**u, "choices": [], "usage": _usage(dones)})
                yield "data: [DONE]\n\n"

            return _stream(gen())
        dones, texts, logprobs = {}, {i: [] for i in range(len(reqs))}, {i: [] for i in range(len(reqs))}
        async for index, ev in _events(request, reqs, q, poll_disconnect=True):
            if isinstance(ev, DoneEvent):
                err = _end_error(ev)
                if err is not None:
                    raise err
                texts[index].append(ev.text)
                dones[index] = ev
                continue
            if isinstance(ev, TokenEvent):
                texts[index].append(ev.text)
            lp = shape.logprob(index, ev)
            if lp is not None:
                logprobs[index].append(lp)
        if len(dones) < len(reqs):
            return Response(status_code=499)  # the client went away
        return JSONResponse(shape.whole(dones, {i: "".join(t) for i, t in texts.items()}, logprobs))

    def _include_usage(body) -> bool:
        return bool(body.stream and body.stream_options and body.stream_options.include_usage)

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionBody = await _read(request, CompletionBody)
        p = body.prompt
        batch = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not batch:
            raise ApiError(400, "the prompt list is empty", param="prompt")
        if len(batch) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}", param="prompt")
        prompts = []  # (text, ids) per choice
        for one in batch:
            if isinstance(one, str):
                try:
                    ids = await run_in_threadpool(tokenizer.encode, one)
                except AlchemistError as e:
                    raise ApiError(400, str(e), param="prompt") from None
                prompts.append((one, ids))
            else:
                ids = _checked_ids(one, "prompt")
                prompts.append((await run_in_threadpool(tokenizer.decode, ids), ids))
        requested = 16 if body.max_tokens is None else body.max_tokens
        lengths = [_check_lengths(len(ids), requested, True) for _, ids in prompts]
        scored = body.logprobs if body.echo and body.logprobs is not None else None
        reqs, q = await _submit_all([ids for _, ids in prompts], body, lengths, body.logprobs, scored)
        per_choice = [one for one in prompts for _ in range(body.n or 1)]
        shape = _CompletionShape(f"cmpl-{reqs[0].id}", int(time.time()), body.logprobs, per_choice, bool(body.echo))
        return await _answer(request, reqs, q, shape, body.stream, _include_usage(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatBody = await _read(request, ChatBody)
        messages = []
        for m in body.messages:
            content = m.content if not isinstance(m.content, list) else "".join(p.text for p in m.content)
            extra = {k: v for k, v in (("name", m.name), ("tool_calls", m.tool_calls), ("tool_call_id", m.tool_call_id))
                     if v is not None}  # fmt: skip
            messages.append({"role": m.role, "content": content or "", **extra})
        mode, _ = _tool_mode(body)
        tools = [{"type": "function", "function": f} for f in _tool_defs(body)] or None
        try:  # the template runs here (a worker thread), never in the scheduler's thread
            ids = await run_in_threadpool(tokenizer.encode_chat, template_messages(messages), tools=tools)
        except AlchemistError as e:
            raise ApiError(400, f"cannot render the chat template: {e}", param="messages") from None
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = _check_lengths(len(ids), requested, requested is not None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reqs, q = await _submit_all([ids], body, [max_tokens], logprobs)
        names = {t.function.name for t in body.tools or []} if mode != "none" else set()
        shape = _ChatShape(f"chatcmpl-{reqs[0].id}", int(time.time()), logprobs, body.n or 1, names)
        return await _answer(request, reqs, q, shape, body.stream, _include_usage(body))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "alchemist"}]}  # fmt: skip

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise ApiError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
        return {"id": model_id, "object": "model", "created": created, "owned_by": "alchemist"}

    # ------------------------------------------------------------------ the server's own tokenizer (lm-eval's remote
    # tokenizer and llama.cpp's clients count and split text with it)
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body: TokenizeBody = await _read(request, TokenizeBody)
        if (body.prompt is None) == (body.content is None):
            raise ApiError(400, "send the text as `prompt` (vLLM) or as `content` (llama.cpp), one of them",
                           param="prompt")  # fmt: skip
        special = next((x for x in (body.add_special_tokens, body.add_special) if x is not None),
                       body.prompt is not None)  # each server's own default  # fmt: skip
        text = body.prompt if body.prompt is not None else body.content
        try:
            ids = await run_in_threadpool(tokenizer.encode, text, add_special_tokens=special)
        except AlchemistError as e:
            raise ApiError(400, str(e), param="prompt") from None
        tokens = [{"id": t, "piece": _piece_json(t)} for t in ids] if body.with_pieces else ids
        return {"tokens": tokens, "count": len(ids), "max_model_len": int(scheduler.max_context)}

    def _piece_json(t: int):
        """A token's text where it is whole UTF-8, else its bytes (as llama.cpp's server answers)."""
        piece = tokenizer.token_to_piece(t)
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return list(piece)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body: DetokenizeBody = await _read(request, DetokenizeBody)
        text = await run_in_threadpool(tokenizer.decode, _checked_ids(body.tokens, "tokens"))
        return {"prompt": text, "content": text}  # vLLM's key and llama.cpp's

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        def token(tid):
            return None if tid is None else tokenizer.id_to_token(tid)

        return {"tokenizer_class": "alchemist (GGUF vocabulary)", "vocab_size": tokenizer.vocab_size,
                "model_max_length": int(scheduler.max_context), "bos_token": token(tokenizer.bos_id),
                "eos_token": token(tokenizer.eos_id), "pad_token": token(tokenizer.pad_id),
                "add_bos_token": bool(tokenizer.add_bos), "chat_template": tokenizer.chat_template}  # fmt: skip

    @app.get("/health")
    async def health():
        st = scheduler.stats
        if getattr(st, "warming", False):
            status = "warming"
        elif app.state.draining:
            status = "draining"
        elif not getattr(st, "running", True):
            status = "stopped"
        else:
            status = "ok"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    registry = CollectorRegistry(auto_describe=False)  # this app's own: nothing in the process-wide registry
    registry.register(_SchedulerMetrics(scheduler, rate))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["create_app", "ApiError"]
