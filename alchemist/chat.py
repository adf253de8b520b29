"""`alchemist chat MODEL`: an interactive chat in the terminal, streamed token by token.

One-slot `Scheduler` driven synchronously (`Scheduler.stream`): each turn renders the whole history with the
GGUF's chat template, and the slot's prefix cache reuses the KV of every earlier turn, so only the new message
is prefilled. `/reset` clears the history, `/exit` or end of input quits, Ctrl-C cancels the current answer.
"""

from __future__ import annotations

import signal
import sys
import threading
import warnings
from typing import Callable, TextIO

from alchemist.errors import AlchemistError
from alchemist.runtime.sampling import SamplingParams
from alchemist.serve.scheduler import DoneEvent, Request, Scheduler

HELP = "/reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops an answer"


class ChatSession:
    """A conversation on a one-slot Scheduler: `ask(text)` streams the answer to `out` and returns it."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer,
        system: str | None = None,
        max_tokens: int = 512,
        params: SamplingParams = SamplingParams(),
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
    ):
        if tokenizer is None:
            raise AlchemistError("chat needs the model's tokenizer")
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.system, self.max_tokens, self.params = system, max_tokens, params
        self.out, self.err = out, err
        self.messages: list[dict] = []
        self.templated = bool(tokenizer.has_chat_template)
        self.current: Request | None = None
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt(self, messages: list[dict]) -> list[int]:
        with warnings.catch_warnings():  # no template: the fallback's note is printed once, at the start
            warnings.simplefilter("ignore")
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True)

    def _fit(self, messages: list[dict]) -> list[int]:
        """The prompt for messages, dropping the oldest turns (not the system prompt) until an answer fits."""
        head = 1 if self.system else 0
        while True:
            ids = self._prompt(messages)
            if len(ids) < self.scheduler.max_context:
                return ids
            if len(messages) - head <= 1:
                raise AlchemistError(
                    f"the message is {len(ids)} tokens, over the context of {self.scheduler.max_context}"
                )
            del messages[head : head + 2]  # the oldest user/assistant pair
            self.messages = messages

    def ask(self, text: str) -> tuple[str, DoneEvent]:
        messages = self.messages + [{"role": "user", "content": text}]
        prompt = self._fit(messages)
        max_tokens = min(self.max_tokens, self.scheduler.max_context - len(prompt))
        req = Request(prompt, self.params, max_tokens)
        self.current = req
        parts, done = [], None
        try:
            for ev in self.scheduler.stream(req):
                if ev.text:
                    parts.append(ev.text)
                    self.out.write(ev.text)
                    self.out.flush()
                if isinstance(ev, DoneEvent):
                    done = ev
        finally:
            self.current = None
        answer = "".join(parts)
        if done.finish_reason in ("stop", "length"):
            self.messages = messages + [{"role": "assistant", "content": answer}]
        return answer, done

    def cancel(self) -> None:
        """Stop the current answer at the next step (safe from a signal handler: takes no lock)."""
        req = self.current
        if req is not None:
            req.cancelled.set()


def chat_loop(
    session: ChatSession, read: Callable[[str], str] = input, stats: bool = True, note: str | None = None
) -> int:
    """Read messages until /exit or end of input; returns the exit status (0)."""
    out, err = session.out, session.err
    if note:
        print(note, file=err)
    print(HELP, file=err)
    on_main = threading.current_thread() is threading.main_thread()
    while True:
        try:
            line = read("> ")
        except EOFError:
            print(file=out)
            return 0
        except KeyboardInterrupt:
            print("\n(Ctrl-C at the prompt: /exit or Ctrl-D quits)", file=err)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            print("(history cleared)", file=err)
            continue
        if text.startswith("/") and text.split()[0] in ("/help", "/?"):
            print(HELP, file=err)
            continue
        previous = signal.signal(signal.SIGINT, lambda *_: session.cancel()) if on_main else None
        try:
            answer, done = session.ask(text)
        except AlchemistError as e:
            print(f"alchemist: error: {e}", file=err)
            continue
        finally:
            if on_main:
                signal.signal(signal.SIGINT, previous)
        print(file=out)
        out.flush()
        if done.finish_reason == "cancelled":
            print("(answer cancelled; not kept in the history)", file=err)
        elif done.finish_reason == "error":
            print(f"alchemist: error: {done.error}", file=err)
        if stats and done.finish_reason != "error":
            u, t = done.usage, done.timings
            rate = t.get("decode_tok_per_s")
            print(
                f"[{u['completion_tokens']} tok"
                + (f", {rate:.1f} tok/s" if rate else "")
                + f", first token {t.get('ttft_s', 0.0):.2f} s, prompt {u['prompt_tokens']} tok"
                f" ({u['cached_tokens']} reused) | {done.finish_reason}]",
                file=err,
            )


def run_chat(
    model: str | None = None,
    backend: str = "c",
    context: int = 4096,
    system: str | None = None,
    max_tokens: int = 512,
    params: SamplingParams = SamplingParams(),
    chunk: int = 32,
    engine_factory: Callable[[], tuple[object, object]] | None = None,
    read: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    numerics: str | None = None,
) -> int:
    """Chat with `model` (a GGUF path or reference model name). `engine_factory() -> (slot_engine, tokenizer)`
    replaces loading the model (tests run the chat loop on a toy engine)."""
    if engine_factory is None:

        def engine_factory():
            from alchemist import load_llm
            from alchemist.runtime.slot_engine import SlotEngine

            from alchemist.runtime.numerics import resolve_numerics

            llm = load_llm(model, backend=backend, context=context, compile_now=False, numerics=resolve_numerics(numerics))
            slot_engine = SlotEngine(llm.engine, 1, chunk=chunk, decode_buckets=(1,))
            print("compiling (or linking from the graph cache) the chat's step functions ...", file=err)
            slot_engine.warm_up()
            return slot_engine, llm.tokenizer

    slot_engine, tokenizer = engine_factory()
    scheduler = Scheduler(slot_engine, tokenizer, max_queue=1)
    session = ChatSession(scheduler, tokenizer, system, max_tokens, params, out, err)
    note = None
    if not session.templated:
        note = "(this GGUF has no chat template: the conversation is plain text, one message per line)"
    return chat_loop(session, read, note=note)
