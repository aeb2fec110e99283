"""Browser protection: a web page open in the learner's browser must not be able to drive the server.

A server on 127.0.0.1 is out of reach of other machines, but not of the browser on this one. Any page
can send a "simple" cross-origin request (``Content-Type: text/plain``, no preflight), and through DNS
rebinding (the attacker's name re-resolved to 127.0.0.1) even read the answers. Local AI servers have
been attacked exactly this way (Ollama's fix checks ``Host``); Jupyter checks ``Host`` and ``Origin``
too. So by default this server refuses:

* a ``Host`` that does not name it (403): localhost, loopback addresses, the ``--host`` it binds and
  ``--allowed-hosts`` pass; a rebound attacker's name does not;
* an ``Origin`` that is not allowed (403): same-origin pages and ``--allowed-origins`` (vLLM's option;
  empty by default) pass; programs (the ``openai`` client, httpx, curl, a notebook kernel) send no Origin;
* a request body that is not ``application/json`` (415): what browsers can send without a preflight.

Allowed origins also get CORS headers (Starlette's ``CORSMiddleware``), so a page you trust can call it.
Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

WILDCARD_BIND = ("0.0.0.0", "::", "")  # bound to every interface: no single name to accept
BODY_METHODS = ("POST", "PUT", "PATCH")


# RFC 9110's Host: uri-host [ ":" port ], uri-host an IP literal in brackets or a reg-name (no "@", "/", "[" ...).
_HOST = re.compile(r"(?:\[(?P<literal>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._~!$&'()*+,;=%-]*))(?::(?P<port>[0-9]{0,5}))?")


def _hostname(host_header: str) -> str | None:
    """The name in a Host header, lower-case, without port, brackets or the root's trailing dot; None if the header is
    not a host and an optional port (``localhost:80@evil.com``, ``[::1]evil.com``): no loose reading can admit it."""
    match = _HOST.fullmatch(host_header.strip().lower())
    if match is None or (match["port"] and int(match["port"]) > 65535):
        return None
    if match["literal"] is not None:  # RFC 3986: brackets hold an IPv6 address ("[127.0.0.1]" is no host)
        try:
            ipaddress.IPv6Address(match["literal"])
        except ValueError:
            return None
        return match["literal"]
    return match["name"].rstrip(".")


def _is_loopback(name: str) -> bool:
    try:
        addr = ipaddress.ip_address(name)
    except ValueError:
        return name == "localhost"
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass(frozen=True)
class AccessPolicy:
    """Which ``Host`` and ``Origin`` values the server accepts. Notebook 09.

    ``bind_host``: the ``--host`` the server listens on; ``allowed_hosts``: more names clients use
    (``"*"``: any; ``".example.org"``: that domain and its subdomains); ``allowed_origins``: pages allowed
    to call it from a browser (``"*"``: any), vLLM's ``--allowed-origins``.
    """

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def host_allowed(self, host_header: str | None) -> bool:
        if "*" in self.allowed_hosts:
            return True
        if not host_header:  # browsers always send Host; HTTP/1.1 requires it
            return False
        name = _hostname(host_header)
        if name is None:  # not a host[:port] at all
            return False
        bound = self.bind_host.strip().lower().strip("[]").rstrip(".")  # an address or name, never a Host header
        if _is_loopback(name) or (name == bound and name not in WILDCARD_BIND):
            return True
        for allowed in self.allowed_hosts:
            allowed = allowed.lower().rstrip(".")
            if name == allowed.removeprefix(".") or (allowed.startswith(".") and name.endswith(allowed)):
                return True
        return False

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if "*" in self.allowed_origins or origin in (o.lower().rstrip("/") for o in self.allowed_origins):
            return True
        # a page this server served itself (e.g. /docs): its origin is this Host, which passed the check above
        return host_header is not None and origin in (f"http://{host_header.lower()}", f"https://{host_header.lower()}")


def parse_list_option(value: str) -> tuple[str, ...]:
    """An option's list: vLLM's JSON form ``'["a", "b"]'``, or ``a,b``."""
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"expected a JSON list of strings, got {value!r}")
        return tuple(items)
    return tuple(item.strip() for item in value.split(",") if item.strip())


async def _drain(receive: Receive, limit: int = 64 * 1024 * 1024) -> None:
    """Read a refused request's body (up to ``limit``): closing a socket with unread data resets it, and the
    client would see a reset instead of its 4xx."""
    received = 0
    while received <= limit:
        message = await receive()
        received += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _refuse(receive: Receive, send: Send, status: int, message: str, param: str) -> None:
    await _drain(receive)
    error_type = "invalid_request_error" if status == 415 else "permission_error"
    body = json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": None}},
                      ensure_ascii=True).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BrowserGuard:
    """ASGI middleware refusing a foreign ``Host``, a disallowed ``Origin`` and non-JSON bodies. Notebook 09."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        if not self.policy.host_allowed(host):
            await _refuse(receive, send, 403, f"Host {host!a} does not name this server; if clients reach it by "
                          "that name, start it with --allowed-hosts (a guard against DNS rebinding)", "Host")
            return
        if origin is not None and not self.policy.origin_allowed(origin, host):
            await _refuse(receive, send, 403, f"Origin {origin!a} is not allowed to call this server from a browser; "
                          "start it with --allowed-origins to allow that page", "Origin")
            return
        if scope["method"] in BODY_METHODS:
            content_type = headers.get("content-type")
            media_type = (content_type or "").split(";", 1)[0].strip().lower()
            if media_type != "application/json":
                await _refuse(receive, send, 415, "request body must be JSON: send Content-Type: application/json "
                              f"(got {content_type!a})", "Content-Type")
                return
        await self.app(scope, receive, send)


def add_browser_protection(app: Any, policy: AccessPolicy) -> None:
    """Install the guard (outermost) and, for allowed origins, CORS headers answering browsers' preflights."""
    if policy.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(policy.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BrowserGuard, policy=policy)

