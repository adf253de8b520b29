"""TextStream (alchemist/serve/text.py): incremental text with stop strings, and inference() streaming through it."""

from __future__ import annotations

import random

import pytest

from alchemist.serve.text import TextStream, clean_spaces
from alchemist.tokenizer import load_tokenizer
from alchemist.tokenizer.tokenizer import _clean_spaces


@pytest.fixture(scope="module")
def toks(tiny_gguf):
    """The two fixture vocabularies: llama (SentencePiece, byte tokens) and qwen2 (byte-level BPE)."""
    return {arch: load_tokenizer(str(tiny_gguf(arch))) for arch in ("llama", "qwen2")}


def run(stream: TextStream, ids) -> tuple[list[str], str | None]:
    deltas, reason = [], None
    for t in ids:
        d, reason = stream.feed(t)
        deltas.append(d)
        if reason is not None:
            break
    if reason is None:
        deltas.append(stream.flush())
    return deltas, reason


def expected(tok, ids, stops) -> str:
    text = tok.decode(ids)
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=len(text))
    return text[:cut]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_utf8_split_across_byte_tokens_is_never_half_emitted(toks, arch):
    tok = toks[arch]
    ids = tok.encode("héllo ✓ wörld €", add_special_tokens=False)
    assert len(ids) > len("héllo ✓ wörld €") - 3  # multi-byte characters come as byte tokens
    deltas, reason = run(TextStream(tok), ids)
    assert reason is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == "héllo ✓ wörld €"
    # while a character is incomplete, the text before it is shown and the character is not
    s, shown, n_partial = TextStream(tok), "", 0
    for i, t in enumerate(ids):
        shown += s.feed(t)[0]
        partial = tok.decode(ids[: i + 1])
        n_partial += partial.endswith("\ufffd")
        assert shown == partial.rstrip("\ufffd")
    assert n_partial >= 4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stop_string_split_across_tokens_is_never_streamed(toks, arch):
    tok = toks[arch]
    ids = tok.encode("the cat and the dog", add_special_tokens=False)
    s = TextStream(tok, stop=["and the d"])
    shown = ""
    for t in ids:
        d, reason = s.feed(t)
        shown += d
        assert "the cat and the dog"[: len(shown)] == shown
        assert not shown.endswith(("a", "an", "and", "and ", "and t", "and th", "and the", "and the "))
        if reason:
            break
    assert reason == "stop" and shown == s.text == "the cat "
    assert s.feed(ids[0]) == ("", "stop") and s.flush() == ""


def test_a_stop_string_start_that_never_completes_is_released(toks):
    tok = toks["llama"]
    ids = tok.encode("the cat and", add_special_tokens=False)
    s = TextStream(tok, stop=["and then"], eos_ids=tok.eos_ids)
    shown = "".join(s.feed(t)[0] for t in ids)
    assert shown == "the cat "  # "and" might still become "and then"
    eos = next(iter(tok.eos_ids))
    assert s.feed(eos) == ("and", "stop")  # eos: the held text is real text
    assert s.text == "the cat and"
    s = TextStream(tok, stop=["and then"])
    assert "".join(s.feed(t)[0] for t in ids) + s.flush() == "the cat and"  # a length limit: flushed


def test_earliest_stop_string_wins(toks):
    tok = toks["qwen2"]
    ids = tok.encode("the cat and the dog", add_special_tokens=False)
    deltas, reason = run(TextStream(tok, stop=["dog", "cat", "t"]), ids)
    assert reason == "stop" and "".join(deltas) == ""  # "t" at position 0
    deltas, reason = run(TextStream(tok, stop=["dog", "cat"]), ids)
    assert "".join(deltas) == "the "


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-clean"])
def test_streamed_text_equals_final_text_on_random_tokens(tiny_gguf, toks, arch):
    if arch == "qwen2-clean":  # a vocabulary with llama.cpp's clean_spaces post-processing (llama3's BPE has it)
        tok = load_tokenizer(str(tiny_gguf("qwen2")))
        tok.vocab.clean_spaces = True
        assert tok.decode(tok.encode(" a , b 's")) == " a, b's"
    else:
        tok = toks[arch]
    rng = random.Random(1)
    # tokens of text rich in the characters that matter (spaces, punctuation, multi-byte), plus random ids
    corpus = "the ' s , . ? héllo 're ✓ 've and 'm in € wörld !"
    pool = sorted(set(tok.encode(corpus, add_special_tokens=False))) + [rng.randrange(3, 500) for _ in range(30)]
    n_checked_stops = 0
    for trial in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 25))]
        full = tok.decode(ids)
        stops = []
        if trial % 2 and len(full) > 2:
            a = rng.randrange(len(full) - 1)
            stops.append(full[a : a + rng.randint(1, 4)])
        if trial % 3 == 0:
            stops.append("xyz")
        s = TextStream(tok, stop=stops)
        shown, reason = "", None
        want = expected(tok, ids, stops)
        for t in ids:
            d, reason = s.feed(t)
            shown += d
            assert want.startswith(shown), (ids, stops, shown, want)  # nothing streamed is ever taken back
            if reason:
                break
        if reason is None:
            shown += s.flush()
        assert shown == s.text == want, (ids, stops)
        n_checked_stops += reason == "stop"
    assert n_checked_stops > 50


def test_clean_spaces_substitutions_equal_llama_cpp_passes():
    rng = random.Random(0)
    for _ in range(20000):
        text = "".join(rng.choice(" ',.?!smrevxé") for _ in range(rng.randint(0, 14)))
        assert clean_spaces(text) == _clean_spaces(text.encode()).decode(), text


def test_inference_streams_exactly_its_output_and_cuts_at_a_stop_string(tiny_gguf, tmp_path):
    from alchemist import inference, load_llm

    model = load_llm(tiny_gguf("qwen2"), backend="c", context=64, generated_dir=tmp_path, progress=False)
    free = inference(model, input="the cat and the dog", max_tokens=12)
    assert free.stop_reason == "max_tokens" and len(free.output) > 6
    stop = free.output[3:6]
    pieces: list[str] = []
    cut = inference(model, input="the cat and the dog", max_tokens=12, stop=[stop], stream=pieces.append)
    assert cut.stop_reason == "stop_string"
    assert "".join(pieces) == cut.output == free.output[: free.output.index(stop)]
    assert cut.output_token_ids == free.output_token_ids[: len(cut.output_token_ids)]
    assert model.tokenizer.decode(cut.output_token_ids).startswith(cut.output + stop)
