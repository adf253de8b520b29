"""Structured output through the server: response_format (json_object, json_schema), llama.cpp's grammar and
json_schema, vLLM's guided_regex / guided_choice; answers valid by construction whatever the weights say (the toy
engine's logits are random), hostile constraints refused or compiled within bounds, and instructor and LangChain
getting their objects from a served fixture model."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from alchemist.serve.app import create_app
from serving_toy import ToySlotEngine
from test_server import running

pytestmark = pytest.mark.filterwarnings("ignore::alchemist.tokenizer.chat.ChatTemplateWarning")  # fixtures: no template

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "describe a person"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


def _valid_person(obj) -> bool:
    return (
        set(obj) <= set(PERSON["properties"]) and {"name", "age", "role"} <= set(obj)
        and isinstance(obj["name"], str) and len(obj["name"]) <= 12
        and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120 and obj["role"] in ("admin", "user", "guest")
        and all(isinstance(t, str) and len(t) <= 5 for t in obj.get("tags", [])) and len(obj.get("tags", [])) <= 2
    )  # fmt: skip


@pytest.fixture(scope="module")
def toy_server(tiny_gguf):
    from alchemist.serve.scheduler import Scheduler
    from alchemist.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_gguf("llama"))
    sched = Scheduler(ToySlotEngine(tokenizer.vocab_size, n_slots=4, capacity=256, chunk=4), tokenizer)
    with running(create_app(sched, tokenizer, "toy", drain_s=3.0)) as url:
        yield sched, url


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_answer_parses_and_fits_the_schema(toy_server, temperature):
    """response_format json_schema, llama.cpp's json_schema and vLLM's guided_json: the answer (n = 3 choices, and
    streamed) parses and fits the schema; it ends because the grammar is complete ("stop")."""
    sched, url = toy_server
    asks = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}},
        {"json_schema": PERSON},
        {"guided_json": json.dumps(PERSON)},
    ]
    for ask in asks:
        r = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 120, "temperature": temperature,
                                         "seed": 3, "n": 3, **ask})  # fmt: skip
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            assert _valid_person(json.loads(choice["message"]["content"])), choice["message"]["content"]
    body = {"messages": MESSAGES, "max_tokens": 120, "temperature": temperature, "stream": True, **asks[0]}
    chunks = [json.loads(e[6:]) for e in httpx.post(url + CHAT, json=body).text.split("\n\n") if e.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert _valid_person(json.loads(text))


def test_json_object_regex_choice_and_grammar(toy_server):
    sched, url = toy_server
    body = {"messages": MESSAGES, "max_tokens": 150, "temperature": 0.7, "seed": 1}
    r = httpx.post(url + CHAT, json={**body, "response_format": {"type": "json_object"}}).json()["choices"][0]
    if r["finish_reason"] == "stop":  # any object: it may run past max_tokens, but what ends is one
        assert isinstance(json.loads(r["message"]["content"]), dict)
    # the older json_object with a schema
    old = {"response_format": {"type": "json_object", "schema": PERSON}}
    assert _valid_person(json.loads(httpx.post(url + CHAT, json={**body, **old}).json()["choices"][0]["message"]["content"]))
    text = httpx.post(url + COMP, json={"prompt": "code:", "max_tokens": 20, "guided_regex": "[0-9]{3}-[a-z]{2}"}).json()
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text["choices"][0]["text"])
    choice = httpx.post(url + COMP, json={"prompt": "colour:", "max_tokens": 20, "temperature": 1.0,
                                          "guided_choice": ["red", "green", "deep blue"]}).json()  # fmt: skip
    assert choice["choices"][0]["text"] in ("red", "green", "deep blue")
    gbnf = 'root ::= "yes" | "no" | "maybe, " [0-9]'
    answer = httpx.post(url + COMP, json={"prompt": "well?", "max_tokens": 20, "grammar": gbnf}).json()
    assert re.fullmatch(r"yes|no|maybe, [0-9]", answer["choices"][0]["text"])


BAD = [
    ("invalid regex", {"guided_regex": "(a"}, "guided_regex"),
    ("unknown schema type", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format"),
    ("json_schema without a schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("two constraints", {"guided_regex": "a", "grammar": 'root ::= "a"'}, "guided_regex"),
    ("not a schema", {"guided_json": "{not json"}, "guided_json"),
    ("bad grammar", {"grammar": "root ::= ("}, "grammar"),
]  # fmt: skip


@pytest.mark.parametrize("name,ask,param", BAD, ids=[b[0] for b in BAD])
def test_a_bad_constraint_is_a_400_naming_its_field(toy_server, name, ask, param):
    sched, url = toy_server
    r = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 5, **ask})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_hostile_constraints_are_bounded_and_the_server_goes_on(toy_server):
    """Deep nesting, a huge enum and a regex that backtracks catastrophically elsewhere: each answers (400, or an
    answer within llguidance's limits) and the server keeps answering."""
    sched, url = toy_server
    deep: dict = {"type": "string"}
    for _ in range(300):
        deep = {"type": "array", "items": deep}
    hostile = [
        {"response_format": {"type": "json_schema", "json_schema": {"schema": deep}}},
        {"guided_json": {"enum": [f"value-{i}" for i in range(50_000)]}},
        {"guided_regex": "(a+)+(b+)+(c+)+$" * 20},
        {"guided_regex": "[a-z]{1000}" * 50},
    ]
    for ask in hostile:
        r = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 8, **ask}, timeout=120)
        assert r.status_code in (200, 400), r.text
    ok = httpx.post(url + CHAT, json={"messages": MESSAGES, "max_tokens": 4, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


# ---------------------------------------------------------------------------------------------- tools
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_parse_calls_reads_each_models_syntax():
    from alchemist.serve.tools import parse_calls

    names = {"get_weather", "get_time"}
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    assert parse_calls(hermes, names) == [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                          {"name": "get_time", "arguments": {}}]  # fmt: skip
    assert parse_calls('[TOOL_CALLS] [{"name": "get_time", "arguments": "{}"}]', names) == [{"name": "get_time", "arguments": {}}]
    assert parse_calls(' {"name": "get_weather", "parameters": {"city": "Paris"}}', names)[0]["arguments"] == {"city": "Paris"}
    for plain in ("It is sunny.", '{"name": "rm_rf", "arguments": {}}', "<tool_call>{not json</tool_call>", "[1, 2]", "{"):
        assert parse_calls(plain, names) is None, plain


def test_a_forced_tool_call_fits_its_function_and_auto_reads_the_models_call(toy_server):
    """tool_choice naming a function, or "required": the answer is a call (finish_reason tool_calls) whose arguments
    fit the function's parameters, whole or streamed as a delta; with "auto" the model's own <tool_call> block is
    read as a call, and a plain answer stays content."""
    sched, url = toy_server
    body = {"messages": MESSAGES, "tools": [WEATHER, TIME], "max_tokens": 60, "temperature": 1.0, "seed": 2}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in (named, "required"):
        r = httpx.post(url + CHAT, json={**body, "tool_choice": choice}).json()["choices"][0]
        assert r["finish_reason"] == "tool_calls" and r["message"]["content"] is None, r
        (call,) = r["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        args = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7 and set(args) == {"city", "days"}
        else:
            assert choice == "required" and call["function"]["name"] == "get_time"
    chunks = [json.loads(e[6:]) for e in httpx.post(url + CHAT, json={**body, "tool_choice": named, "stream": True})
              .text.split("\n\n") if e.startswith("data: {")]  # fmt: skip
    deltas = [c["choices"][0]["delta"] for c in chunks]
    (call,) = next(d["tool_calls"] for d in deltas if d.get("tool_calls"))
    assert call["index"] == 0 and json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    said = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'
    auto = httpx.post(url + CHAT, json={**body, "max_tokens": 150, "guided_choice": [said]}).json()["choices"][0]
    assert auto["finish_reason"] == "tool_calls"
    assert json.loads(auto["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
    plain = httpx.post(url + CHAT, json={**body, "guided_choice": ["It is sunny."]}).json()["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"]["content"] == "It is sunny."
    # the conversation goes on: the assistant's call and the tool's answer are messages
    follow = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]  # fmt: skip
    assert httpx.post(url + CHAT, json={**body, "messages": follow, "tool_choice": "none"}).status_code == 200
    for bad, param in (({**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                       ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
                       ({**body, "tool_choice": "required", "guided_regex": "a"}, "tool_choice")):  # fmt: skip
        r = httpx.post(url + CHAT, json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------------------------- ecosystem clients
@pytest.fixture(scope="module")
def model_server(tiny_gguf, tiny_dir):
    """The llama fixture served through the real Scheduler and SlotEngine."""
    from alchemist import load_llm
    from alchemist.runtime.slot_engine import SlotEngine
    from alchemist.serve.scheduler import Scheduler

    model = load_llm(tiny_gguf("llama"), backend="c", context=1024, generated_dir=tiny_dir / "structured",
                     progress=False)  # fmt: skip
    sched = Scheduler(SlotEngine(model.engine, 2, chunk=32, decode_buckets=(1, 2)), model.tokenizer)
    with running(create_app(sched, model.tokenizer, "tiny-llama", drain_s=3.0)) as url:
        yield url


def test_instructor_and_langchain_get_their_objects(model_server):
    """instructor's JSON_SCHEMA and TOOLS modes and LangChain's with_structured_output (json_schema, function
    calling) return a valid object
    from the random-weight model: the schema holds by construction. instructor's JSON mode asks only for a JSON
    object (its schema goes into the prompt), so its model here has defaults for every field."""
    import instructor
    import openai
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=99)

    class Loose(BaseModel):
        note: str = ""

    client = openai.OpenAI(base_url=model_server + "/v1", api_key="unused", max_retries=0)
    ask = dict(model="tiny-llama", messages=[{"role": "user", "content": "who?"}], max_tokens=60, temperature=0)
    person = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA).chat.completions.create(
        response_model=Person, max_retries=0, **ask
    )
    assert isinstance(person, Person) and 0 <= person.age <= 99
    loose = instructor.from_openai(client, mode=instructor.Mode.JSON).chat.completions.create(
        response_model=Loose, max_retries=3, **ask
    )
    assert isinstance(loose, Loose)
    llm = ChatOpenAI(base_url=model_server + "/v1", api_key="unused", model="tiny-llama", max_tokens=60,
                     temperature=0, max_retries=0)  # fmt: skip
    got = llm.with_structured_output(Person, method="json_schema").invoke("who?")
    assert isinstance(got, Person) and len(got.name) <= 8
    # tools: instructor's TOOLS mode and LangChain's function calling force a call to the model's schema
    called = instructor.from_openai(client, mode=instructor.Mode.TOOLS).chat.completions.create(
        response_model=Person, max_retries=0, **ask
    )
    assert isinstance(called, Person) and 0 <= called.age <= 99
    got = llm.with_structured_output(Person, method="function_calling").invoke("who?")
    assert isinstance(got, Person) and len(got.name) <= 8
