"""Which web pages may call `clover serve` from a browser (CORS).

A page's requests carry its `Origin`. Pages served from this machine (http or https on localhost, 127.0.0.1 or
[::1], any port) are allowed by default, as Ollama allows them; others only when named by --cors-origin or
CLOVER_CORS_ORIGINS (a comma-separated list), `*` allowing every origin. An allowed origin's preflight (OPTIONS with
Access-Control-Request-Method) is answered 204 with the Access-Control-Allow-* headers, before the API key is
checked (a browser sends no credentials with a preflight); its other responses, errors included, carry
Access-Control-Allow-Origin. A disallowed origin's preflight gets a 403 JSON error, and its responses no CORS
headers, so the browser keeps them from the page.
"""

from __future__ import annotations

import re

from .errors import CloverError

LOCAL = re.compile(r"(?i)^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d{1,5})?$")
_ORIGIN = re.compile(r"(?i)^[a-z][a-z0-9+.-]*://[^/\s?#@,]+$")
METHODS = "GET, POST, OPTIONS"
EXPOSED = "X-Clover-Queue-Position, X-Clover-Ignored"
MAX_AGE = "600"  # seconds a browser may keep a preflight's answer


def parse_origins(flags, env_value: str | None) -> tuple[str, ...]:
    """The origins --cors-origin (repeated) and CLOVER_CORS_ORIGINS name, or a one-line error for one that is not
    `*` or scheme://host[:port]."""
    named = [("--cors-origin", o) for o in flags or ()]
    named += [("CLOVER_CORS_ORIGINS", o.strip()) for o in (env_value or "").split(",") if o.strip()]
    origins = []
    for where, origin in named:
        origin = origin.strip().rstrip("/")
        if origin != "*" and not _ORIGIN.match(origin):
            raise CloverError(f"{where} takes '*' or an origin such as https://app.example.com:8080 (scheme://host"
                              f"[:port], no path), not {origin!r}")
        origins.append(origin.lower())
    return tuple(origins)


class Cors:
    """ASGI middleware around the app: the CORS answer to a browser's requests (see the module's docstring)."""

    def __init__(self, app, origins=()):
        self.app = app
        self.any = "*" in origins
        self.origins = {o.lower() for o in origins if o != "*"}

    def allowed(self, origin: str) -> bool:
        return self.any or origin.lower() in self.origins or bool(LOCAL.match(origin))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", []))
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        origin = origin.decode("latin-1")
        ok = self.allowed(origin)
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            return await self._preflight(ok, origin, headers, scope, receive, send)
        if not ok:
            return await self.app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + [
                    (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                    (b"access-control-expose-headers", EXPOSED.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    async def _preflight(self, ok: bool, origin: str, headers: dict, scope, receive, send):
        from starlette.responses import JSONResponse, Response

        from .api import ApiError, error_body

        if not ok:
            e = ApiError(403, f"the origin {origin[:200]!r} may not call this server from a browser (clover serve "
                              f"--cors-origin ORIGIN allows it)", code="origin_not_allowed")
            return await JSONResponse(error_body(e), status_code=403)(scope, receive, send)
        allow = {"Access-Control-Allow-Origin": origin, "Access-Control-Allow-Methods": METHODS,
                 "Access-Control-Max-Age": MAX_AGE, "Vary": "Origin"}
        asked = headers.get(b"access-control-request-headers")
        if asked:
            allow["Access-Control-Allow-Headers"] = asked.decode("latin-1")
        await Response(status_code=204, headers=allow)(scope, receive, send)
