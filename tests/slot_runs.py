"""The slot-engine-against-engine check several tests share: sequences run in slots (chunked prefill, then batched
decode steps) must give the logits a one-sequence engine gives them."""

from __future__ import annotations

import numpy as np


def run_in_slots(se, seqs: list[list[int]], prefilled: list[int]) -> tuple[dict, set]:
    """Sequence i in slot i: its first prefilled[i] tokens prefilled in chunks, then one batched decode step after
    another over the sequences still running. ({i: {position: logits}}, the decode batch sizes seen)."""
    got: dict = {i: {} for i in range(len(seqs))}
    for i, seq in enumerate(seqs):
        for a, b in se.chunk_plan(prefilled[i]):
            got[i][b - 1] = se.prefill(i, seq[a:b], a)
    pos, sizes = list(prefilled), set()
    while live := [i for i in range(len(seqs)) if pos[i] < len(seqs[i])]:
        out = se.decode(live, [seqs[i][pos[i]] for i in live], [pos[i] for i in live])
        sizes.add(len(live))
        for row, i in enumerate(live):
            got[i][pos[i]] = out[row]
            pos[i] += 1
    return got, sizes


def assert_slots_equal_engine(se, single, seqs: list[list[int]], prefilled: list[int]) -> None:
    """run_in_slots' rows equal the one-sequence engine `single`'s logits at the same positions (to 1e-4)."""
    got, _ = run_in_slots(se, seqs, prefilled)
    for i, seq in enumerate(seqs):
        single.reset()
        want = single.run(seq, 0, all_logits=True)
        rows = sorted(got[i])
        np.testing.assert_allclose(np.stack([got[i][r] for r in rows]), want[rows], rtol=1e-4, atol=1e-4)
