"""`alchemist serve MODEL --replicas N`: replicas of the server on Ray Serve.

Each replica is one Ray actor (one process) holding one model with its own SlotEngine and continuous-batching
Scheduler behind the same FastAPI app `alchemist serve` runs; Ray's HTTP proxy takes the requests and its router
spreads them over the replicas (power of two choices on their ongoing requests). A replica that dies fails only
the requests it was answering; Ray's controller starts another in its place. With `--min-replicas` /
`--max-replicas` Ray's autoscaler adds and removes replicas to keep about `--target-ongoing-requests` per replica.

Every response carries `x-alchemist-replica` (the replica's Ray actor name), and each replica's `/metrics` its
own queue, running requests and KV-cache use (alchemist_queue_depth, alchemist_active_slots,
alchemist_kv_cache_usage_ratio); through the proxy a scrape reaches one replica, so scrape the replicas (or use
Ray's own ray_serve_* metrics) to see the fleet.

Ray is optional (`pip install 'alchemist[ray]'`); nothing here imports it until a deployment is built.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from alchemist.errors import AlchemistError
from alchemist.serve.startup import DEFAULTS, build_scheduler

APP_NAME = "alchemist"
REPLICA_HEADER = "x-alchemist-replica"

# the running replica's scheduler (a replica is a process of its own): what its health check reads
_REPLICA: dict = {}


@dataclass(frozen=True)
class ReplicaOptions:
    """What each replica loads and how many replicas run (a fixed count, or autoscaling bounds)."""

    model: str
    backend: str = DEFAULTS["backend"]
    slots: int = DEFAULTS["slots"]
    context: int = DEFAULTS["context"]
    chunk: int = DEFAULTS["chunk"]
    max_queue: int = DEFAULTS["max_queue"]
    full_window: bool = DEFAULTS["full_window"]
    numerics: str | None = None
    model_id: str | None = None
    drain: float = DEFAULTS["drain"]
    api_key: str | None = None
    open_health: bool = False
    host: str = DEFAULTS["host"]
    allowed_hosts: tuple = ()
    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    cpus_per_replica: float = 1.0

    def check(self) -> None:
        if self.replicas < 1:
            raise AlchemistError(f"--replicas must be >= 1, got {self.replicas}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise AlchemistError("--min-replicas and --max-replicas go together (autoscaling bounds)")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise AlchemistError(
                f"autoscaling bounds: need 0 <= --min-replicas <= --max-replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if self.max_replicas is not None and self.max_replicas < 1:
            raise AlchemistError(f"--max-replicas must be >= 1, got {self.max_replicas}")

    def deployment_options(self) -> dict:
        """serve.deployment's options: a fixed replica count or Ray's autoscaling config, the concurrency a
        replica takes (its slots and queue: more would only wait in our queue or get our 429), health checks
        and the drain at shutdown."""
        self.check()
        options = dict(
            max_ongoing_requests=self.slots + self.max_queue,
            graceful_shutdown_timeout_s=self.drain,
            health_check_period_s=5,
            ray_actor_options={"num_cpus": self.cpus_per_replica},
        )
        if self.min_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "initial_replicas": min(max(self.replicas, self.min_replicas), self.max_replicas),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests or self.slots,
            }
        return options


class _ReplicaHeader:
    """ASGI middleware naming the replica on every response (pure ASGI: streams pass through untouched)."""

    def __init__(self, app, name: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + [self.header]
            await send(message)

        await self.app(scope, receive, send_named)


def _app_builder(opts: ReplicaOptions):
    """The function each replica calls to build its app: load the model, warm the scheduler up, wrap the app."""

    def build():
        from ray import serve

        from alchemist.serve.app import create_app
        from alchemist.serve.guard import allowed_hosts_for

        log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - Ray forwards replicas' stderr
        scheduler, tokenizer = build_scheduler(
            opts.model, opts.backend, opts.slots, opts.context, opts.chunk, opts.max_queue, opts.full_window,
            log, opts.numerics,
        )  # fmt: skip
        _REPLICA["scheduler"] = scheduler
        app = create_app(
            scheduler, tokenizer, opts.model_id or Path(opts.model).stem, drain_s=opts.drain,
            api_key=opts.api_key or None, open_health=opts.open_health,
            allowed_hosts=allowed_hosts_for(opts.host, list(opts.allowed_hosts)),
        )  # fmt: skip
        app.add_middleware(_ReplicaHeader, name=serve.get_replica_context().replica_id.to_full_id_str())
        return app

    return build


def application(opts: ReplicaOptions):
    """The Ray Serve application (bound, not yet running): `serve.run(application(opts), route_prefix="/")`."""
    try:
        from ray import serve
    except ImportError as e:
        raise AlchemistError(f"--replicas runs on Ray Serve: pip install 'alchemist[ray]' ({e})") from None

    @serve.deployment(name=APP_NAME, **opts.deployment_options())
    @serve.ingress(_app_builder(opts))
    class AlchemistReplica:
        def check_health(self):
            """Ray restarts a replica whose scheduler thread has stopped (a failed step it could not recover)."""
            scheduler = _REPLICA.get("scheduler")
            if scheduler is not None and not getattr(scheduler.stats, "running", True):
                raise RuntimeError("the replica's scheduler has stopped")

    return AlchemistReplica.bind()


def run(opts: ReplicaOptions, port: int, ray_address: str | None = None) -> int:
    """Start (or join) Ray, deploy the replicas behind Ray's HTTP proxy on opts.host:port, and serve until
    SIGTERM/SIGINT; then shut the deployment down (each replica drains for up to opts.drain seconds)."""
    opts.check()
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise AlchemistError(f"--replicas runs on Ray Serve: pip install 'alchemist[ray]' ({e})") from None
    if not ray.is_initialized():
        ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    serve.start(http_options={"host": opts.host, "port": port})
    serve.run(application(opts), name=APP_NAME, route_prefix="/", blocking=False)
    print(f"alchemist serve: {_describe(opts)} on Ray Serve, listening on http://{opts.host}:{port} "
          f"(OpenAI API under /v1)", file=sys.stderr, flush=True)  # fmt: skip
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    previous = (
        {s: signal.signal(s, lambda sig, frame: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)} if in_main else {}
    )
    try:
        stop.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("alchemist serve: stopping the replicas", file=sys.stderr, flush=True)
        serve.shutdown()
    return 0


def _describe(opts: ReplicaOptions) -> str:
    if opts.min_replicas is None:
        return f"{opts.replicas} replica{'s' * (opts.replicas != 1)}"
    return f"{opts.min_replicas}..{opts.max_replicas} replicas (autoscaling)"
