"""Who may talk to the server, checked before any route runs.

- The Host header against an allow-list: a server bound to a loopback address answers only to its own names, so a
  web page cannot reach it through DNS rebinding (a name the attacker controls, re-pointed at 127.0.0.1).
- With an API key, `Authorization: Bearer <key>`, compared in constant time; `open_paths` (/health, for a load
  balancer) may go without it.

A pure ASGI middleware, not Starlette's BaseHTTPMiddleware, which would hide a client's disconnect from the routes.
Refusals are OpenAI-shaped errors, as every other error of the server."""

from __future__ import annotations

import hmac
import ipaddress

from starlette.responses import JSONResponse

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def openai_error(status: int, message: str, type_: str, param=None, code=None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts_for(bind_host: str, extra: list[str] | None) -> frozenset[str] | None:
    """The Host names a server bound to `bind_host` answers to: its loopback names where it listens on loopback, plus
    `extra`; None (any) where it listens elsewhere and nothing was named, or where `extra` holds "*"."""
    extra = [h.strip().lower() for h in extra or []]
    if "*" in extra:
        return None
    if is_loopback(bind_host):
        return frozenset(LOOPBACK_NAMES + tuple(extra))
    return frozenset(extra) if extra else None


def host_name(header: str) -> str:
    """A Host header's name without its port: 'a.example:8080' -> 'a.example', '[::1]:80' -> '::1'."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class RequestGuard:
    def __init__(self, app, *, api_key: str | None = None, allowed_hosts=None, open_paths=()):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        refusal = self.refusal(scope) if scope["type"] == "http" else None
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> JSONResponse | None:
        headers = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.lower(), value)  # the first of a repeated header
        if self.allowed_hosts is not None:
            host = headers.get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed_hosts:
                return openai_error(
                    403,
                    f"this server does not answer to the Host {host!r} (allowed: {', '.join(sorted(self.allowed_hosts))}"
                    "; `alchemist serve --allowed-host NAME` adds one)",
                    "invalid_request_error",
                    code="host_not_allowed",
                )
        if self.api_key is not None and scope.get("path") not in self.open_paths:
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return openai_error(
                    401,
                    "a valid API key is required, sent as 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return None
