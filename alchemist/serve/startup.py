"""Starting a server's model: load it and warm its continuous-batching scheduler (alchemist serve, and each
replica of alchemist.serve.ray_serve)."""

from __future__ import annotations

import sys

from alchemist.errors import AlchemistError

# a server's settings unless told otherwise (alchemist serve's options, and each Ray Serve replica's)
DEFAULTS = dict(
    backend="c",
    slots=8,
    context=4096,
    chunk=32,
    host="127.0.0.1",
    port=8080,
    max_queue=64,
    drain=10.0,
    full_window=False,
)


def build_scheduler(model_path, backend, slots, context, chunk, max_queue, full_window, log, numerics=None):
    """Load the model, make its SlotEngine and Scheduler, compile and warm every step shape (a progress bar on
    stderr), start the scheduler; (scheduler, tokenizer). What one server, or one Ray Serve replica, runs."""
    from alchemist import load_llm

    try:
        from alchemist.runtime.slot_engine import SlotEngine
        from alchemist.serve.scheduler import Scheduler
    except ImportError as e:
        raise AlchemistError(f"alchemist serve needs the slot engine and the scheduler: {e}") from None

    from alchemist.runtime.numerics import resolve_numerics

    lm = load_llm(model_path, backend=backend, context=context, compile_now=False, numerics=resolve_numerics(numerics))
    slot_engine = SlotEngine(lm.engine, n_slots=slots, chunk=chunk, full_window=full_window)
    scheduler = Scheduler(slot_engine, lm.tokenizer, max_queue=max_queue)
    from tqdm.auto import tqdm

    with tqdm(desc="warming up", unit="shape", file=sys.stderr, leave=False) as bar:

        def progress(msg: str) -> None:
            bar.set_postfix_str(str(msg)[:60])
            bar.update(1)

        scheduler.start(warm_up=True, progress=progress)  # /health answers 503 until it is ready
        scheduler.wait_ready()
    stats = slot_engine.stats
    log(f"alchemist serve: {slots} slots x {slot_engine.capacity} positions, {len(stats.compiled_shapes)} step shapes "
        f"ready ({stats.compile_count} compiled in {stats.compile_seconds:.1f} s)")  # fmt: skip
    return scheduler, lm.tokenizer
