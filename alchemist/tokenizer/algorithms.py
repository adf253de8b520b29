"""llama.cpp's SPM and BPE merge loops, and the merge table that lets Hugging Face's BPE run the SPM one.

llama.cpp's SPM tokenizer (`llm_tokenizer_spm_session`) starts from UTF-8 characters and repeatedly merges
the adjacent pair whose concatenation is the vocabulary token with the highest score (leftmost on ties);
leftover characters that are not tokens become `<0xXX>` byte tokens. That is byte-fallback BPE with one
merge (a, b) for every way of splitting a token t into two tokens a + b = t, ranked by t's score. The
`spm_merges` table below is built that way (vectorised: 262k tokens in ~0.2 s) and handed to
`tokenizers.models.BPE`, which then reproduces llama.cpp with Rust speed.

Two corners of llama.cpp's loop a merge table cannot express are sent to `spm_tokenize` (a line-by-line port,
also used by the tests as a second implementation):
- a character that is not itself a token but is part of a longer token can still be merged by llama.cpp;
- two different splits of the same token have the same score in llama.cpp but different ranks in a table
  (only matters when two such merges compete; not observed on the reference corpora).
"""

from __future__ import annotations

import heapq

import numpy as np

_B = np.uint64(0x100000001B3)  # polynomial hash base (odd)
_LEN_MIX = np.uint64(0x9E3779B97F4A7C15)


def spm_merges(tokens: list[str], scores: np.ndarray, flagged: np.ndarray | None = None):
    """Every (a, b) with a, b and a + b in `tokens`, ordered by the score of a + b (highest first), then by
    token id and split position.

    Returns (merges, uses_flagged): whether some merge has a piece among the `flagged` tokens (bool mask)."""
    n = len(tokens)
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    if n == 0 or lens.max() < 2:
        return [], False
    cps = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + np.uint64(1)
    starts = np.zeros(n, np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    # h[p] = hash of the token prefix ending at flat position p
    h = np.empty_like(cps)
    active = np.nonzero(lens > 0)[0]
    h[starts[active]] = cps[starts[active]]
    with np.errstate(over="ignore"):
        for k in range(1, int(lens.max())):
            active = active[lens[active] > k]
            p = starts[active] + k
            h[p] = h[p - 1] * _B + cps[p]
        full = h[starts + lens - 1]
        keys = full + lens.astype(np.uint64) * _LEN_MIX  # mix the length in: hash(s) + len(s) * C
        pow_b = np.ones(int(lens.max()) + 1, np.uint64)
        for i in range(1, len(pow_b)):
            pow_b[i] = pow_b[i - 1] * _B
        # every split point (token i, k chars on the left), k = 1 .. len-1
        multi = np.nonzero(lens >= 2)[0]
        counts = lens[multi] - 1
        tok = np.repeat(multi, counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        k = np.arange(len(tok), dtype=np.int64) - first + 1
        pref = h[starts[tok] + k - 1]
        suf_len = lens[tok] - k
        suf = full[tok] - pref * pow_b[suf_len]
        pkeys = pref + k.astype(np.uint64) * _LEN_MIX
        skeys = suf + suf_len.astype(np.uint64) * _LEN_MIX
    # membership by hash: sorted table of whole-token keys; the match position gives the piece's token id
    by_key = np.argsort(keys, kind="stable")
    table = keys[by_key]
    last = len(table) - 1

    def lookup(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.minimum(np.searchsorted(table, q), last)
        return table[pos] == q, by_key[pos]

    hit_p, id_p = lookup(pkeys)
    sel = np.nonzero(hit_p)[0]
    hit_s, id_s = lookup(skeys[sel])
    sel = sel[hit_s]
    tok, k, a_ids, b_ids = tok[sel], k[sel], id_p[sel], id_s[hit_s]
    uses_flagged = bool(flagged is not None and (flagged[a_ids].any() or flagged[b_ids].any()))
    order = np.lexsort((k, tok, -scores[tok].astype(np.float64)))
    get = tokens.__getitem__
    # pieces are tokens already: reuse their string objects instead of slicing (a third of the build time)
    return list(zip(map(get, a_ids[order].tolist()), map(get, b_ids[order].tolist()))), uses_flagged


def spm_tokenize(text: str, token_to_id: dict[str, int], scores, byte_token) -> list[int]:
    """Port of llama.cpp `llm_tokenizer_spm_session::tokenize` (text already whitespace-escaped).

    `byte_token(b)` returns the token for a byte (llama.cpp `byte_to_token`)."""
    if not text:
        return []
    n = len(text)
    # symbols: start, length (chars), prev, next
    start = list(range(n))
    size = [1] * n
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n)) + [-1]
    heap: list[tuple[float, int, int, int]] = []
    rev_merge: dict[str, tuple[int, int]] = {}
    get = token_to_id.get

    def try_add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        piece = text[start[left] : start[left] + size[left] + size[right]]
        tid = get(piece)
        if tid is None:
            return
        heapq.heappush(heap, (-float(scores[tid]), left, right, len(piece)))
        rev_merge[piece] = (left, right)

    for i in range(1, n):
        try_add(i - 1, i)
    while heap:
        _, left, right, length = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
            continue
        size[left] += size[right]
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        try_add(prev[left], left)
        try_add(left, nxt[left])

    out: list[int] = []

    def resegment(i: int) -> None:
        piece = text[start[i] : start[i] + size[i]]
        tid = get(piece)
        if tid is not None:
            out.append(tid)
            return
        p = rev_merge.get(piece)
        if p is None:
            for b in piece.encode("utf-8"):
                out.append(byte_token(b))
            return
        resegment(p[0])
        resegment(p[1])

    i = 0
    while i != -1:
        resegment(i)
        i = nxt[i]
    return out


def bpe_tokenize_word(
    word: str, ranks: dict[tuple[str, str], int], token_to_id: dict[str, int], ignore_merges: bool = False
) -> list[int]:
    """Port of the per-word merge loop of llama.cpp `llm_tokenizer_bpe_session::tokenize` for one
    pre-tokenized, byte-encoded word."""  # fmt: skip
    if ignore_merges and word in token_to_id:
        return [token_to_id[word]]
    syms = list(word)
    n = len(syms)
    nxt = list(range(1, n)) + [-1]
    prev = list(range(-1, n - 1))
    heap: list[tuple[int, int, int, str]] = []

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        r = ranks.get((syms[left], syms[right]))
        if r is not None:
            heapq.heappush(heap, (r, left, right, syms[left] + syms[right]))

    for i in range(1, n):
        add(i - 1, i)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not syms[left] or not syms[right] or syms[left] + syms[right] != merged or nxt[left] != right:
            continue
        syms[left] = merged
        syms[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])
    out = []
    for s in syms:
        if not s:
            continue
        tid = token_to_id.get(s)
        if tid is not None:
            out.append(tid)
        else:  # llama.cpp looks up each byte of the symbol as a one-byte string and drops misses
            for b in s.encode("utf-8"):
                t = token_to_id.get(chr(b)) if b < 0x80 else None
                if t is not None:
                    out.append(t)
    return out
