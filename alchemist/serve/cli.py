"""`alchemist serve MODEL`: load the model, build a SlotEngine and a Scheduler, warm every step shape up, then serve
the OpenAI-compatible app with uvicorn until SIGTERM/SIGINT, which drains: the listening socket closes, streams in
flight finish (up to --drain seconds), then the scheduler stops."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from alchemist.errors import AlchemistError
from alchemist.serve.startup import DEFAULTS, build_scheduler


def add_arguments(p) -> None:
    d = DEFAULTS
    p.add_argument(
        "--backend",
        default=d["backend"],
        choices=["c", "numba"],
        help="c or numba (batched steps write the " "slot caches in place; jax and mlx would copy them every step)",
    )
    p.add_argument("--slots", type=int, default=d["slots"], help=f"concurrent sequences (default {d['slots']})")
    p.add_argument("--context", type=int, default=d["context"], help=f"positions per slot (default {d['context']})")
    p.add_argument("--chunk", type=int, default=d["chunk"], help=f"prefill chunk in tokens (default {d['chunk']})")
    p.add_argument("--host", default=d["host"], help=f"address to bind (default {d['host']})")
    p.add_argument("--port", type=int, default=d["port"], help=f"port (default {d['port']}; 0: any free port)")
    p.add_argument("--max-queue", type=int, default=d["max_queue"], help="queued requests before 429 (default 64)")
    p.add_argument("--drain", type=float, default=d["drain"], help="seconds to let streams finish at shutdown")
    p.add_argument("--model-id", default=None, help="the model name clients send (default: the file's stem)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("ALCHEMIST_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route (default: $ALCHEMIST_API_KEY; none: open)",
    )
    p.add_argument("--open-health", action="store_true", help="with --api-key: /health answers without the key")
    p.add_argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a Host name the server answers to besides its loopback names (repeatable; '*': any). Bound to "
        "a loopback address it answers only to localhost, 127.0.0.1 and ::1 (no DNS rebinding)",
    )
    g = p.add_argument_group("replicas on Ray Serve (pip install 'alchemist[ray]')")
    g.add_argument("--replicas", type=int, help="serve N replicas of the model (one process each) behind Ray's proxy")
    g.add_argument("--min-replicas", type=int, help="autoscale: at least this many replicas (with --max-replicas)")
    g.add_argument("--max-replicas", type=int, help="autoscale: at most this many replicas")
    g.add_argument(
        "--target-ongoing-requests",
        type=float,
        help="autoscale toward this many requests in flight per replica (default: --slots)",
    )
    g.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica reserves (default 1)")
    g.add_argument("--ray-address", help="join this Ray cluster (default: start a local one)")
    p.add_argument(
        "--full-window",
        action="store_true",
        help="sliding-window layers keep the whole context, as global "
        "ones do (more memory per slot; lets requests that share a long prefix, e.g. a system prompt, reuse its KV)",
    )


@dataclass
class ServerHandle:
    app: object
    server: object  # uvicorn.Server
    sock: socket.socket
    scheduler: object
    model_id: str

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or `server.should_exit`); returns after the drain."""
        self.sock.listen(128)  # bound early (a busy port fails before the model loads); from here clients queue
        print(f"alchemist serve: model {self.model_id!r}, listening on {self.url} (OpenAI API under /v1)",
              file=sys.stderr, flush=True)  # fmt: skip
        # uvicorn re-raises the signal it caught once it has drained; a no-op SIGTERM handler makes that a clean exit
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, lambda sig, frame: None) if in_main else None
        try:
            self.server.run(sockets=[self.sock])
        finally:
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            self.sock.close()
        print("alchemist serve: stopped", file=sys.stderr, flush=True)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AlchemistError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def build_server(
    model_path,
    *,
    scheduler=None,
    tokenizer=None,
    model_id: str | None = None,
    request_cls=None,
    log=None,
    backend: str = DEFAULTS["backend"],
    slots: int = DEFAULTS["slots"],
    context: int = DEFAULTS["context"],
    chunk: int = DEFAULTS["chunk"],
    host: str = DEFAULTS["host"],
    port: int = DEFAULTS["port"],
    max_queue: int = DEFAULTS["max_queue"],
    drain: float = DEFAULTS["drain"],
    full_window: bool = DEFAULTS["full_window"],
    log_level: str = "warning",
    numerics: str | None = None,
    api_key: str | None = None,
    open_health: bool = False,
    allowed_hosts: list[str] | None = None,
) -> ServerHandle:
    """Everything `alchemist serve` runs, unstarted. Pass `scheduler` (and `tokenizer`) to skip loading the model."""
    try:
        import uvicorn

        from alchemist.serve.app import create_app
    except ImportError as e:
        raise AlchemistError(
            f"alchemist serve needs fastapi and uvicorn ({e}), dependencies of alchemist: reinstall it"
        ) from None
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for name, value in (("slots", slots), ("context", context), ("chunk", chunk), ("max-queue", max_queue)):
        if value < 1:
            raise AlchemistError(f"--{name} must be >= 1, got {value}")
    if scheduler is not None and tokenizer is None:
        raise AlchemistError("build_server: pass the tokenizer with an injected scheduler")
    sock = _bind(host, port)
    try:
        if scheduler is None:
            scheduler, tokenizer = build_scheduler(
                model_path, backend, slots, context, chunk, max_queue, full_window, log, numerics
            )
    except BaseException:
        sock.close()
        raise
    model_id = model_id or Path(str(model_path)).stem
    from alchemist.serve.guard import allowed_hosts_for

    app = create_app(
        scheduler, tokenizer, model_id, request_cls=request_cls, drain_s=drain, api_key=api_key or None,
        allowed_hosts=allowed_hosts_for(host, allowed_hosts), open_health=open_health,
    )  # fmt: skip

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log(f"alchemist serve: {signal.Signals(sig).name}: draining (up to {drain:g} s)")
            app.state.draining = True  # /health answers 503 and new requests 503 from now on
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=max(1, int(drain))
    )
    return ServerHandle(app, Server(config), sock, scheduler, model_id)


def run_serve(args) -> int:
    if args.replicas is not None or args.min_replicas is not None or args.max_replicas is not None:
        return _run_replicas(args)
    handle = build_server(
        args.model, backend=args.backend, slots=args.slots, context=args.context, chunk=args.chunk, host=args.host,
        port=args.port, max_queue=args.max_queue, drain=args.drain, model_id=args.model_id,
        full_window=args.full_window, numerics=getattr(args, "numerics", None), api_key=args.api_key,
        open_health=args.open_health, allowed_hosts=args.allowed_host,
    )  # fmt: skip
    handle.run()
    return 0


def _run_replicas(args) -> int:
    from alchemist.serve import ray_serve

    return ray_serve.run(_replica_options(args), args.port, ray_address=args.ray_address)


def _replica_options(args):
    from alchemist.serve.ray_serve import ReplicaOptions

    return ReplicaOptions(
        model=str(args.model), backend=args.backend, slots=args.slots, context=args.context, chunk=args.chunk,
        max_queue=args.max_queue, full_window=args.full_window, numerics=getattr(args, "numerics", None),
        model_id=args.model_id, drain=args.drain, api_key=args.api_key, open_health=args.open_health,
        host=args.host, allowed_hosts=tuple(args.allowed_host or ()), replicas=args.replicas or 1,
        min_replicas=args.min_replicas, max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests, cpus_per_replica=args.cpus_per_replica,
    )  # fmt: skip
