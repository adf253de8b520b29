"""Load test: `alchemist serve` vs llama-cpp-python's server on the same GGUF and thread count, 127.0.0.1 only.

    python benchmarks/serve_load.py MODEL [--servers alchemist,llama] [--clients 1,4,8,16] [--requests 2]
        [--prompt-tokens 128] [--gen-tokens 128] [--threads 2] [--context 1024] [--slots 8]
        [--replicas N] [--alchemist-url URL] [--llama-url URL] [--max-time 300] [--json OUT]
    python benchmarks/serve_load.py MODEL --soak 600 [--servers alchemist]

For each concurrency level, N clients each stream `--requests` chat completions (or, with `--endpoint completions`,
completions of the same raw text) one after another (asyncio + httpx),
with ~128-token prompts (distinct per request) and 128-token answers at temperature 0. Both servers are asked not to
stop at end-of-generation (alchemist: `ignore_eos`, llama.cpp: `min_tokens`; `--no-ignore-eos` turns that off); the
table counts the tokens that came. A level stops starting requests after `--max-time` seconds.

Per server and level: aggregate generated tok/s (all tokens / wall time), time to first token p50/p99, inter-token
latency p50/p99 (gaps between streamed content chunks), errors, tokens per request, and the alchemist/llama.cpp
ratios. Then, for alchemist, a greedy-identity check: each prompt answered in a batch is asked again alone and the two
texts must be equal. `--soak S`: 8 clients for S seconds per server, sampling the server's RSS; reports lost requests
(errors or streams that never finished) and RSS at start/end/max.

A server is started here (and stopped with SIGTERM) unless its URL is given. llama-cpp-python's server runs one request
at a time; it is started with `--interrupt_requests False`, since its default cancels the running stream whenever a
new request arrives.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PASSAGES = [
    "Causal inference is the process of determining the independent, actual effect of a particular phenomenon "
    "that is a component of a larger system.",
    "The main difference between causal inference and inference of association is that causal inference analyzes "
    "the response of an effect variable when a cause of the effect variable is changed.",
    "A lighthouse keeper kept a logbook of every ship that passed, the weather at dawn, and the colour of the sea.",
    "Bread rises because yeast ferments sugars into carbon dioxide, which the gluten network traps as bubbles.",
    "The river changed its course twice in a century, leaving oxbow lakes where the old meanders had been.",
    "Compilers translate a program through several intermediate representations before emitting machine code.",
    "In the mountains, the snow line moves up in spring and down in autumn, and the herds follow the grass.",
    "A good map leaves things out: it keeps what the traveller needs and drops everything else.",
]
# alchemist's kernels run --threads OpenMP / Numba threads; its system OpenBLAS stays on one thread (the backend's
# default: a BLAS pool beside the OpenMP one fights it for the cores). llama.cpp takes --n_threads.
THREAD_ENV = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")


# ---------------------------------------------------------------------------------------------- prompts
def make_prompts(model_path: str, n: int, n_tokens: int) -> list[str]:
    """n distinct user messages of about n_tokens tokens each (sized with the model's own tokenizer)."""
    from alchemist.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    prompts = []
    for i in range(n):
        rot = PASSAGES[i % len(PASSAGES) :] + PASSAGES[: i % len(PASSAGES)]
        text = f"Request {i}. Read this and continue it in the same style:\n" + " ".join(rot * 4)
        ids = tok.encode(text, add_special_tokens=False)[: max(8, n_tokens - 12)]  # ~12 tokens of chat template
        prompts.append(tok.decode(ids))
    return prompts


# ---------------------------------------------------------------------------------------------- one streamed request
async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, args, extra: dict) -> dict:
    chat = args.endpoint == "chat"
    body = {"model": model, "max_tokens": args.gen_tokens, "temperature": 0, "stream": True, **extra}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    t0 = time.perf_counter()
    times, parts, usage, finish, error = [], [], None, None, None
    try:
        async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        error = f"stream error: {obj['error']}"
                        break
                    usage = obj.get("usage") or usage
                    for ch in obj.get("choices") or []:
                        content = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                        if content:
                            times.append(time.perf_counter())
                            parts.append(content)
                        finish = ch.get("finish_reason") or finish
    except Exception as e:  # noqa: BLE001 (a benchmark counts every failure as an error)
        error = f"{type(e).__name__}: {e}"
    if error is None and finish is None:
        error = "the stream ended without a finish_reason"
    n = usage["completion_tokens"] if usage else len(times)
    return {
        "error": error, "text": "".join(parts), "tokens": n, "finish": finish,
        "ttft": times[0] - t0 if times else None, "itl": [b - a for a, b in zip(times, times[1:])],
        "t0": t0, "t1": time.perf_counter(),
    }  # fmt: skip


def _limits(n: int) -> httpx.Limits:
    return httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)


async def run_level(url, model, n_clients, prompts, args, extra) -> dict:
    results = []
    t_start = time.perf_counter()
    deadline = t_start + args.max_time

    async def client_loop(c: int, client) -> None:
        for j in range(args.requests):
            if time.perf_counter() > deadline:
                return
            idx = (c * args.requests + j) % len(prompts)
            res = await one_request(client, url, model, prompts[idx], args, extra)
            res["prompt"] = idx
            results.append(res)

    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=_limits(n_clients)) as client:
        await asyncio.gather(*(client_loop(c, client) for c in range(n_clients)))
    return summarize(results, time.perf_counter() - t_start, n_clients)


def _pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def summarize(results, wall, n_clients) -> dict:
    ok = [r for r in results if r["error"] is None]
    tokens = sum(r["tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl"]]
    return {
        "clients": n_clients, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if r["error"]})[:3],
        "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall if wall > 0 else 0.0,
        "tok_per_req": tokens / len(ok) if ok else 0.0,
        "ttft_p50": _pct([r["ttft"] for r in ok], 50), "ttft_p99": _pct([r["ttft"] for r in ok], 99),
        "itl_p50": _pct(itl, 50), "itl_p99": _pct(itl, 99),
        "outputs": [(r["prompt"], r["text"]) for r in ok],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process started here, or one already running at a URL (then pid is only known if given)."""

    def __init__(self, kind: str, url: str | None = None, pid: int | None = None):
        self.kind, self.url, self.pid, self.proc, self.log = kind, url, pid, None, None

    def start(self, args) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, **{k: str(args.threads) for k in THREAD_ENV}}
        if self.kind == "alchemist":
            cmd = [sys.executable, "-m", "alchemist.cli", "serve", args.model, "--port", str(port), "--host",
                   "127.0.0.1", "--context", str(args.context), "--slots", str(args.slots), "--backend", args.backend,
                   "--max-queue", "256"] + (["--replicas", str(args.replicas)] if args.replicas > 1 else [])  # fmt: skip
        else:
            cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model, "--n_ctx", str(args.context),
                   "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                   "--interrupt_requests", "False", "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve_load_{self.kind}_", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        deadline = time.monotonic() + args.startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=5).status_code == 200:
                    if self.kind != "alchemist" or httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.kind} server not ready after {args.startup_timeout} s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 3000) -> str:
        if self.log is None:
            return ""
        return Path(self.log.name).read_text(errors="replace")[-n:]

    def model_id(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def rss_mb(self) -> float | None:
        if self.pid is None:
            return None
        try:
            import psutil

            return psutil.Process(self.pid).memory_info().rss / 2**20
        except ImportError:
            pass
        except Exception:  # noqa: BLE001 (the process is gone)
            return None
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------- modes
def _extra(kind: str, args) -> dict:
    """Per-server request fields: usage in the stream (alchemist), and not stopping at end-of-generation."""
    if kind == "alchemist":
        return {"stream_options": {"include_usage": True}, **({"ignore_eos": True} if args.ignore_eos else {})}
    return {"min_tokens": args.gen_tokens} if args.ignore_eos else {}


async def identity_check(server: Server, model: str, levels: list[dict], prompts, args) -> dict:
    """Each prompt answered in a batch (clients > 1) is asked again alone: greedy texts must be equal."""
    batched = {}
    for lv in levels:
        if lv["clients"] > 1:
            for idx, text in lv["outputs"]:
                batched.setdefault(idx, []).append(text)
    chosen = sorted(batched)[: args.identity_prompts]
    same = total = 0
    mismatches = []
    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=_limits(1)) as client:
        for idx in chosen:
            solo = await one_request(client, server.url, model, prompts[idx], args, _extra(server.kind, args))
            for text in batched[idx]:
                total += 1
                if solo["error"] is None and text == solo["text"]:
                    same += 1
                elif len(mismatches) < 3:
                    k = next((i for i, (a, b) in enumerate(zip(text, solo["text"])) if a != b), None)
                    mismatches.append({"prompt": idx, "first_diff_char": k, "error": solo["error"]})
    return {"identical": same, "compared": total, "prompts": len(chosen), "mismatches": mismatches}


async def soak(server: Server, model: str, prompts, args) -> dict:
    results, rss = [], []
    t_start = time.perf_counter()
    deadline = t_start + args.soak
    extra = _extra(server.kind, args)
    started = 0

    async def client_loop(c: int, client) -> None:
        nonlocal started
        j = 0
        while time.perf_counter() < deadline:
            idx = (c * 1009 + j) % len(prompts)
            started += 1
            res = await one_request(client, server.url, model, prompts[idx], args, extra)
            res["prompt"] = idx
            results.append(res)
            j += 1

    async def sampler() -> None:
        while time.perf_counter() < deadline:
            rss.append((time.perf_counter() - t_start, server.rss_mb()))
            await asyncio.sleep(args.rss_every)

    timeout = httpx.Timeout(args.request_timeout, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=_limits(args.soak_clients)) as client:
        await asyncio.gather(sampler(), *(client_loop(c, client) for c in range(args.soak_clients)))
    rss.append((time.perf_counter() - t_start, server.rss_mb()))
    wall = time.perf_counter() - t_start
    s = summarize(results, wall, args.soak_clients)
    values = [m for _, m in rss if m is not None]
    s.update(started=started, lost=started - (s["requests"] - s["errors"]), rss_samples=rss,
             rss_start_mb=values[0] if values else None, rss_end_mb=values[-1] if values else None,
             rss_max_mb=max(values) if values else None)  # fmt: skip
    return s


# ---------------------------------------------------------------------------------------------- report
def _ms(x) -> str:
    return "-" if x != x else f"{1000 * x:.0f}"


def _ratio(a, b) -> str:
    return "-" if not b or a != a or b != b else f"{a / b:.2f}x"


def print_table(by_server: dict, label: dict) -> None:
    hdr = ("clients", "server", "reqs", "err", "tok/req", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
           "ITL p99 ms")  # fmt: skip
    rows = [hdr]
    levels = sorted({lv["clients"] for lvs in by_server.values() for lv in lvs})
    for n in levels:
        per = {k: next((lv for lv in lvs if lv["clients"] == n), None) for k, lvs in by_server.items()}
        for kind, lv in per.items():
            if lv is not None:
                rows.append((str(n), label[kind], str(lv["requests"]), str(lv["errors"]), f"{lv['tok_per_req']:.0f}",
                             f"{lv['tok_s']:.1f}", _ms(lv["ttft_p50"]), _ms(lv["ttft_p99"]), _ms(lv["itl_p50"]),
                             _ms(lv["itl_p99"])))  # fmt: skip
        a, b = per.get("alchemist"), per.get("llama")
        if a and b:
            rows.append(("", "alchemist/llama.cpp", "", "", "", _ratio(a["tok_s"], b["tok_s"]),
                         *(_ratio(a[k], b[k]) for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"))))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
    for i, r in enumerate(rows):
        print("| " + " | ".join(c.rjust(w) if j != 1 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


async def _run_server(server: Server, args, prompts, levels_wanted) -> dict:
    model = server.model_id()
    out = {"model_id": model, "url": server.url, "levels": []}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30)) as client:
        warm = await one_request(client, server.url, model, prompts[-1], args, {})  # first-request costs, uncounted
    if warm["error"]:
        print(f"[{server.kind}] warm-up request failed: {warm['error']}", file=sys.stderr, flush=True)
    if args.soak:
        print(f"[{server.kind}] soak: {args.soak_clients} clients for {args.soak:g} s", file=sys.stderr, flush=True)
        out["soak"] = await soak(server, model, prompts, args)
        return out
    for n in levels_wanted:
        print(f"[{server.kind}] {n} client(s) x {args.requests} request(s)", file=sys.stderr, flush=True)
        out["levels"].append(await run_level(server.url, model, n, prompts, args, _extra(server.kind, args)))
    if server.kind == "alchemist" and args.identity:
        print(f"[{server.kind}] greedy identity check", file=sys.stderr, flush=True)
        out["identity"] = await identity_check(server, model, out["levels"], prompts, args)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF path or a reference-model name (gemma-3-270m, qwen2.5-coder-0.5b)")
    ap.add_argument("--servers", default="alchemist,llama", help="alchemist, llama or both (default both)")
    ap.add_argument("--clients", default="1,4,8,16", help="concurrency levels (default 1,4,8,16)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client per level (default 2)")
    ap.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                    help="chat (default) or completions: the same raw prompt text on both servers, for a model whose "
                    "GGUF has no chat template (llama-cpp-python then formats chat its own way)")  # fmt: skip
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for both servers")
    ap.add_argument("--context", type=int, default=1024, help="llama.cpp n_ctx and alchemist's positions per slot")
    ap.add_argument("--slots", type=int, default=8, help="alchemist slots (default 8)")
    ap.add_argument("--backend", default="c", help="alchemist backend (default c)")
    ap.add_argument("--replicas", type=int, default=1, help="alchemist replicas on Ray Serve (default 1: no Ray)")
    ap.add_argument("--alchemist-url", help="use this running alchemist server instead of starting one")
    ap.add_argument("--llama-url", help="use this running llama_cpp.server instead of starting one")
    ap.add_argument("--alchemist-pid", type=int, help="pid of the running alchemist server (RSS in --soak)")
    ap.add_argument("--llama-pid", type=int, help="pid of the running llama_cpp.server (RSS in --soak)")
    ap.add_argument("--max-time", type=float, default=300, help="seconds per level before no new request starts")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--startup-timeout", type=float, default=1200, help="seconds to wait for a server (compiles)")
    ap.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask servers that allow it (llama.cpp: min_tokens) to keep going past end-of-generation",
    )
    ap.add_argument("--identity", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--identity-prompts", type=int, default=8)
    ap.add_argument("--soak", type=float, default=0, help="soak mode: seconds per server")
    ap.add_argument("--soak-clients", type=int, default=8)
    ap.add_argument("--rss-every", type=float, default=5.0, help="RSS sampling period in soak mode (s)")
    ap.add_argument("--json", help="write all measurements here")
    args = ap.parse_args(argv)  # fmt: skip

    from alchemist.models import resolve_model

    args.model = str(resolve_model(args.model))
    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    bad = set(kinds) - {"alchemist", "llama"}
    if bad:
        ap.error(f"unknown server(s) {sorted(bad)}: use alchemist and/or llama")
    levels = [int(x) for x in args.clients.split(",")]
    prompts = make_prompts(args.model, max(32, max(levels) * args.requests, 8 * args.soak_clients), args.prompt_tokens)
    replicas = f", {args.replicas} replicas on Ray Serve" if args.replicas > 1 else ""
    label = {
        "alchemist": f"alchemist ({args.backend}, {args.slots} slots{replicas})",
        "llama": "llama-cpp-python server",
    }
    results = {}
    for kind in kinds:
        given = getattr(args, f"{kind}_url")
        server = Server(kind, given.rstrip("/") if given else None, getattr(args, f"{kind}_pid"))
        try:
            if given is None:
                t0 = time.perf_counter()
                server.start(args)
                print(f"[{kind}] ready in {time.perf_counter() - t0:.1f} s at {server.url}", file=sys.stderr)
            results[kind] = asyncio.run(_run_server(server, args, prompts, levels))
        finally:
            if given is None:
                server.stop()

    print(f"\n{Path(args.model).name}: {args.prompt_tokens}-token prompts, {args.gen_tokens}-token answers, "
          f"temperature 0, {args.threads} threads, 127.0.0.1")  # fmt: skip
    if args.soak:
        for kind, r in results.items():
            s = r["soak"]
            rss = (
                "RSS n/a"
                if s["rss_start_mb"] is None
                else (
                    f"RSS start {s['rss_start_mb']:.0f} MB, end {s['rss_end_mb']:.0f} MB, max {s['rss_max_mb']:.0f} MB"
                )
            )
            print(f"{label[kind]}: soak {args.soak:g} s x {args.soak_clients} clients: {s['started']} requests, "
                  f"{s['lost']} lost ({s['errors']} errors), {s['tok_s']:.1f} tok/s, "
                  f"TTFT p50 {_ms(s['ttft_p50'])} ms, ITL p50 {_ms(s['itl_p50'])} ms; {rss}")  # fmt: skip
            for e in s["error_samples"]:
                print(f"  error: {e}")
    else:
        print_table({k: r["levels"] for k, r in results.items()}, label)
        for kind, r in results.items():
            for lv in r["levels"]:
                for e in lv["error_samples"]:
                    print(f"  {kind} {lv['clients']} clients error: {e}")
        ident = results.get("alchemist", {}).get("identity")
        if ident:
            print(f"greedy identity (alchemist): {ident['identical']}/{ident['compared']} batched answers equal the "
                  f"single-request answer ({ident['prompts']} prompts)")  # fmt: skip
            for m in ident["mismatches"]:
                print(f"  mismatch: {m}")
    if args.json:
        for r in results.values():
            for lv in r["levels"]:
                lv.pop("outputs", None)
            r.get("soak", {}).pop("outputs", None)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
