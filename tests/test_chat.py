"""`alchemist chat`: the chat loop on the toy slot engine, and the real CLI over a pty."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest

from alchemist.chat import ChatSession, run_chat
from alchemist.serve.scheduler import Request, Scheduler
from alchemist.tokenizer import load_tokenizer
from serving_toy import ToySlotEngine


@pytest.fixture(scope="module")
def tok(tiny_gguf):
    return load_tokenizer(str(tiny_gguf("llama")))


def toy():
    return ToySlotEngine(512, n_slots=1, capacity=256, chunk=4, decode_buckets=(1,))


def lines(*xs):
    it = iter(xs)

    def read(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_chat_loop_answers_resets_and_exits(tok):
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(
        engine_factory=lambda: (toy(), tok),
        max_tokens=12,
        read=lines("the cat", "/reset", "the cat", "/exit", "never read"),
        out=out,
        err=err,
    )
    assert rc == 0
    first, second, rest = out.getvalue().split("\n", 2)
    assert first and first == second and rest == ""  # after /reset the same message gets the same answer
    log = err.getvalue()
    assert "no chat template" in log and "(history cleared)" in log
    assert log.count("[") >= 2 and "reused" in log
    # end of input quits too
    assert run_chat(engine_factory=lambda: (toy(), tok), read=lines("the cat"), out=io.StringIO(), err=err) == 0


def test_chat_reuses_earlier_turns_and_answers_like_a_fresh_prompt(tok):
    engine = toy()
    session = ChatSession(Scheduler(engine, tok), tok, system="be brief", max_tokens=10, out=io.StringIO())
    a1, d1 = session.ask("the cat")
    prefilled = engine.stats.prefill_tokens
    a2, d2 = session.ask("and the dog")
    assert d1.usage["cached_tokens"] == 0 and d2.usage["cached_tokens"] >= 8
    assert engine.stats.prefill_tokens - prefilled == d2.usage["prompt_tokens"] - d2.usage["cached_tokens"]
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert session.messages[2]["content"] == a1 and session.messages[4]["content"] == a2
    # the same history on a cold slot gives the same answer
    fresh = Scheduler(toy(), tok)
    prompt = session._prompt(session.messages[:4])
    assert fresh.generate(Request(prompt, max_tokens=10)).text == a2


class CancelAfter(io.StringIO):
    """Output that presses Ctrl-C (a real SIGINT to this process) after n writes."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def write(self, s):
        self.n -= 1
        if self.n == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_ctrl_c_cancels_the_answer_and_the_chat_goes_on(tok):
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the tests run in a background job
    out, err = CancelAfter(2), io.StringIO()
    captured = {}

    def factory():
        captured["engine"] = toy()
        return captured["engine"], tok

    rc = run_chat(engine_factory=factory, max_tokens=40, read=lines("the cat", "it is"), out=out, err=err)
    assert rc == 0  # the SIGINT cancelled the answer instead of raising KeyboardInterrupt
    assert "(answer cancelled" in err.getvalue()
    log = err.getvalue()
    assert "| cancelled]" in log and ("| length]" in log or "| stop]" in log)  # the next message was answered
    assert signal.getsignal(signal.SIGINT) is before  # restored


def _read_until(fd, marker: bytes, timeout: float) -> bytes:
    import select

    buf, end = b"", time.time() + timeout
    while marker not in buf:
        left = end - time.time()
        if left <= 0:
            raise AssertionError(f"no {marker!r} within {timeout} s; got {buf[-2000:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                raise AssertionError(f"the chat exited before {marker!r}; got {buf[-2000:]!r}")
            buf += chunk
    return buf


def test_chat_cli_over_a_pty(tiny_gguf, tmp_path):
    """`alchemist chat` for real: prompt -> streamed answer -> /reset -> the same answer -> /exit returns 0."""
    import pty
    import subprocess

    path = tiny_gguf("llama")
    master, slave = pty.openpty()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in sys.path if p]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "alchemist.cli", "chat", str(path), "--max-tokens", "8", "--context", "64"]
        + ["--chunk", "8"],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    try:
        _read_until(master, b"> ", 600)  # loading + compiling the slot functions
        answers = []
        for text in (b"the cat", b"/reset", b"the cat"):
            os.write(master, text + b"\n")
            got = _read_until(master, b"> ", 120)
            if text != b"/reset":
                # the echo of the line, the answer, a newline, then the stats line "[n tok, ...]"
                body = got.split(text + b"\r\n", 1)[-1]
                answers.append(body.split(b"\r\n[", 1)[0])
            else:
                assert b"history cleared" in got
        assert answers[0] == answers[1] and answers[0].strip()
        os.write(master, b"/exit\n")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
