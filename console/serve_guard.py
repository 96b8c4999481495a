"""Who may use ``aerie serve``: the request guard (Host, Origin, token, cookie), the token file and log redaction.

The browser console can kill stages, so every request passes, in this order (as Jupyter server does):

1. **Host** (against DNS rebinding): the ``Host`` header must name this server as it is reached — a loopback
   spelling (``127.0.0.1``, ``localhost``, ``[::1]``) or the bound address, with the server's port — or the
   host of an ``--allow-origin`` URL (an SSH forward to another local port). A wildcard bind
   (``--allow-remote --host 0.0.0.0``) cannot know its names: any Host passes there, and the token guards.
2. **Origin** (against other web pages): when a request carries ``Origin`` it must be the server's own
   origin — ``http://`` + the request's (already checked) Host, or a loopback spelling of the same port —
   or one the operator allowed with ``--allow-origin``. Browsers send ``Origin`` on every WebSocket upgrade,
   so a page of another origin never gets a console, even when the browser holds our cookie (cookies
   ignore ports: a page on ``localhost:18800`` is "same-site" with ``localhost:8000``). ``null`` is refused.
3. **Token**: one of the tokens (``?token=``, the HttpOnly ``SameSite=Strict`` cookie, or
   ``Authorization: Bearer``), compared in constant time, is required by default, on loopback too (a
   loopback port is open to every account on the machine). A missing ``Origin`` is a non-browser client:
   it needs the token like anyone. The first visit with ``?token=`` sets the cookie and is redirected to the
   same URL without the token, so it stays in neither the address bar, the history nor a ``Referer``.
   ``--no-token`` (loopback only) turns this step off, and says what that risks.

Failures are 403 (Host, Origin) or 401 (token) with a plain sentence saying what to do; ``/`` without a
token gets a small page asking for it. Every response forbids framing (no clickjacking of the console by
another page) and sends no ``Referer``.

A generated token is written to ``<state dir>/serve/<host>-<port>.token`` (``~/.local/state/aerie/serve``
unless ``$AERIE_STATE_DIR``, ``$AERIE_HOME`` or ``$XDG_STATE_HOME`` say otherwise): the directory 0700,
the file 0600, both checked to be this user's; the operator is shown only ``cat PATH``. No token reaches a
log: the access log writes the path with every ``token=`` value replaced, and a filter on every log
handler replaces each token's text wherever it appears (tracebacks included, rendered without locals).
"""

from __future__ import annotations

import contextlib
import hmac
import html
import ipaddress
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
READ_ONLY_KEY = "aerie_read_only"  # the request's role, set by the guard
TOKEN_ENV, VIEW_TOKEN_ENV = "AERIE_SERVE_TOKEN", "AERIE_SERVE_VIEW_TOKEN"
_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+)(:[0-9]{1,5})?$")
log = logging.getLogger("aerie.serve")
_TOKEN_QUERY = re.compile(r"(token=)[^&\s\"']*", re.IGNORECASE)


class GuardError(ValueError):
    """A setting the guard cannot work with (a bad ``--allow-origin``, an unsafe token directory)."""


def cookie_name(port: int) -> str:
    """Per port: cookies ignore ports, so two servers on one host must not overwrite each other's."""
    return f"aerie_token_{port}"


def url_host(host: str) -> str:
    """``host`` as it appears in a URL (an IPv6 address in brackets), lower case."""
    host = host.lower().strip("[]")
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    return host


def host_key(value: str, default_port: int = 80) -> str | None:
    """A ``Host`` header (``name[:port]``) as ``name:port`` in lower case; None if it is not one."""
    value = value.strip()
    m = _HOST_RE.match(value)
    if not m:
        return None
    port = int(m.group(2)[1:]) if m.group(2) else default_port
    return f"{url_host(m.group(1))}:{port}"


def normalize_origin(url: str) -> str:
    """``scheme://host:port`` of an origin URL (the port made explicit); :class:`GuardError` if it is not one."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise GuardError(f"{url!r} is not an origin: give scheme://host[:port], e.g. http://localhost:9000")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise GuardError(f"{url!r}: an origin is only scheme://host[:port], without a path or query")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise GuardError(f"{url!r}: bad port") from None
    return f"{parts.scheme}://{url_host(parts.hostname)}:{port}"


@dataclass
class Guard:
    """What this server accepts, and how many browser sessions it runs now."""

    port: int
    bound: str  # the --host it listens on
    allow_origins: tuple[str, ...] = ()  # normalized --allow-origin values
    tokens: dict[str, bool] = field(default_factory=dict)  # token -> read-only; empty: --no-token
    any_host: bool = False  # a wildcard bind with --allow-remote: its names are unknown
    max_sessions: int = 4
    token_hint: str = ""  # how the operator reads the token (shown on the 401 page)
    sessions: int = 0

    def __post_init__(self) -> None:
        names = {*LOOPBACK_NAMES, url_host(self.bound)}
        self.hosts = {f"{n}:{self.port}" for n in names}
        self.hosts |= {o.split("://", 1)[1] for o in self.allow_origins}
        self.origins = {f"http://{n}:{self.port}" for n in names} | set(self.allow_origins)
        self._known = [(t.encode(), ro) for t, ro in self.tokens.items()]

    # ------------------------------------------------------------------ the checks, each a sentence or None
    def host_problem(self, host: str | None) -> str | None:
        key = host_key(host or "")
        if key is None:
            return "aerie serve: refused: the request has no valid Host header\n"
        if self.any_host or key in self.hosts:
            return None
        if ":" not in (host or "").strip().rsplit("]", 1)[-1] and host_key(host or "", 443) in self.hosts:
            return None  # no port: https's default (a TLS proxy named with --allow-origin https://...)
        return (
            f"aerie serve: refused: Host {key} is not this server's address "
            f"({', '.join(sorted(self.hosts))}); a page on another name that resolves here (DNS rebinding) "
            "is refused. If you forwarded another local port (ssh -L 9000:127.0.0.1:"
            f"{self.port}), start aerie serve with --allow-origin http://localhost:9000\n"
        )

    def behind_tls(self, host: str) -> bool:
        """Whether ``host`` is that of an ``https://`` origin the operator allowed (a TLS proxy in front)."""
        keys = {host_key(host), host_key(host, 443)}
        return any(o.split("://", 1)[1] in keys for o in self.allow_origins if o.startswith("https://"))

    def origin_problem(self, origin: str | None, host: str | None) -> str | None:
        if origin is None:
            return None  # not a cross-origin browser request; the token still applies
        try:
            given = normalize_origin(origin)
        except GuardError:
            given = None
        own = f"http://{host_key(host or '')}"
        if given is not None and (given == own or given in self.origins):
            return None
        return (
            f"aerie serve: refused: a page from {origin[:200]} may not use this console (only its own "
            f"origin, {own}, may). To allow another origin, start aerie serve with --allow-origin URL\n"
        )

    def role(self, given: str) -> bool | None:
        """Read-only (True), full control (False) or None: every token compared, each in constant time."""
        role = None
        for expected, ro in self._known:
            if hmac.compare_digest(given.encode(), expected):
                role = ro
        return role

    @property
    def full(self) -> bool:
        return self.sessions >= self.max_sessions

    def full_text(self) -> str:
        return (
            f"aerie serve: {self.sessions} browser consoles are open, the most this server runs "
            f"(--max-sessions {self.max_sessions}). Close one (each tab is a console), then reload.\n"
        )

    def redact(self, text: str) -> str:
        return redact(text, self.tokens)


def redact(text: str, tokens: Iterable[str]) -> str:
    """``text`` with every ``token=`` value and every known token's text replaced."""
    text = _TOKEN_QUERY.sub(r"\1[redacted]", text)
    for token in tokens:
        if token:
            text = text.replace(token, "[redacted]")
    return text


def login_page(hint: str, wrong: bool) -> str:
    """The 401 page of ``/``: where the token is, and a box to paste it."""
    why = "That token is not this server's. " if wrong else ""
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>aerie serve: token needed</title></head>"
        "<body style='font-family:monospace;background:#0c181f;color:#e0e0e0;padding:2em'>"
        f"<p>{html.escape(why)}This console needs its token ({html.escape(hint)}, on the machine "
        "that runs aerie serve).</p>"
        "<form method='get' action='/'><input type='password' name='token' size='40' autofocus "
        "placeholder='token'> <button type='submit'>Open</button></form></body></html>"
    )


def middleware(guard: Guard) -> Any:
    """The aiohttp middleware that applies the checks to every route, ``/ws`` and ``/static`` included."""
    from aiohttp import hdrs, web

    cookie = cookie_name(guard.port)

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        problem = guard.host_problem(request.headers.get(hdrs.HOST)) or guard.origin_problem(
            request.headers.get(hdrs.ORIGIN), request.headers.get(hdrs.HOST)
        )
        if problem:
            log.warning("%s %s: %s", request.method, request.path, problem.strip())
            raise web.HTTPForbidden(text=problem)
        if not guard.tokens:  # --no-token
            request[READ_ONLY_KEY] = False
            return await handler(request)
        from_query = request.query.get("token", "")
        given = from_query or request.cookies.get(cookie, "")
        auth = request.headers.get(hdrs.AUTHORIZATION, "")
        if not given and auth.startswith("Bearer "):
            given = auth[7:]
        role = guard.role(given)
        if role is None:
            if request.path == "/" and request.method in ("GET", "HEAD") and not _is_upgrade(request):
                raise web.HTTPUnauthorized(
                    text=login_page(guard.token_hint, bool(given)), content_type="text/html"
                )
            raise web.HTTPUnauthorized(
                text="aerie serve: this console needs its token (open its URL in the browser and paste "
                f"the token, or send ?token=, the cookie or a Bearer header; {guard.token_hint})\n"
            )
        request[READ_ONLY_KEY] = role
        if from_query and request.method in ("GET", "HEAD") and not _is_upgrade(request):
            # Once, from the URL: keep it in an HttpOnly cookie and drop it from the address bar.
            rest = [(k, v) for k, v in request.query.items() if k != "token"]
            location = request.path + (f"?{urlencode(rest)}" if rest else "")
            redirect = web.HTTPSeeOther(location=location)
            redirect.set_cookie(cookie, given, httponly=True, samesite="Strict", path="/")
            raise redirect
        return await handler(request)

    return check


def _is_upgrade(request: Any) -> bool:
    return str(request.headers.get("Upgrade", "")).lower() == "websocket"


async def safe_headers(_request: Any, response: Any) -> None:
    """``on_response_prepare``: no page may frame the console (clickjacking), no Referer leaves it."""
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Content-Type-Options"] = "nosniff"


# ------------------------------------------------------------------------------------------------ logs
class RedactingFilter(logging.Filter):
    """On a handler: the record's message and traceback with every token replaced (never dropped)."""

    def __init__(self, tokens: Iterable[str]) -> None:
        super().__init__()
        self.tokens = [t for t in tokens if t]

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage(), self.tokens)
        record.args = ()
        if record.exc_info:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info), self.tokens)
            record.exc_info = None
        return True


def access_logger_class(tokens: Iterable[str]) -> Any:
    """aiohttp's access logger, writing the path with its ``token=`` values (and any token text) redacted."""
    from aiohttp.abc import AbstractAccessLogger

    known = [t for t in tokens if t]

    class AccessLogger(AbstractAccessLogger):
        def log(self, request: Any, response: Any, time: float) -> None:
            self.logger.info(
                '%s "%s %s" %s %s %.3fs',
                request.remote,
                request.method,
                redact(request.path_qs, known),
                response.status,
                response.body_length,
                time,
            )

    return AccessLogger


# ------------------------------------------------------------------------------------------ token file
def token_path(host: str, port: int) -> Path:
    """Where a generated token for this address is written (see the module docstring)."""
    from console.settings import state_dir

    name = url_host(host).strip("[]").replace(":", "_")
    return state_dir() / "serve" / f"{name}-{port}.token"


def write_token(path: Path) -> str:
    """A fresh token written to ``path`` (0600, in a 0700 directory of this user's); returns it."""
    token = secrets.token_urlsafe(32)
    folder = path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise GuardError(f"{folder}: not a directory of this user's; refusing to put a token there")
        os.chmod(folder, 0o700)  # umask-safe, and tightens a directory made before
        tmp = folder / f".{path.name}.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (token + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        raise GuardError(f"cannot write the token file {path}: {exc.strerror or exc}") from None
    return token


def remove_token(path: Path, token: str) -> None:
    """At exit: remove the token file if it still holds our token (a later server may have replaced it)."""
    with contextlib.suppress(OSError):
        if path.read_text().strip() == token:
            path.unlink()


def read_token(token_file: str | None, env: str = TOKEN_ENV, flag: str = "--token-file") -> str | None:
    """The operator's token, from ``token_file``, else ``$env``; None when neither is given."""
    if token_file:
        try:
            token = Path(token_file).expanduser().read_text().strip()
        except OSError as exc:
            raise GuardError(f"{flag} {token_file}: cannot read the token: {exc.strerror or exc}") from None
        if len(token) < 16:
            raise GuardError(f"{flag} {token_file}: the token must be at least 16 characters")
        return token
    if os.environ.get(env):
        token = os.environ[env].strip()
        if len(token) < 16:
            raise GuardError(f"{env}: the token must be at least 16 characters")
        return token
    return None


def view_token(view_token_file: str | None) -> str | None:
    """The view-only token, when the operator gave one (``--view-token-file``, ``$AERIE_SERVE_VIEW_TOKEN``)."""
    return read_token(view_token_file, VIEW_TOKEN_ENV, "--view-token-file")


NO_TOKEN_RISK = (
    "WARNING: --no-token: anyone with an account on this machine can open this console and pause, kill, "
    "retry or skip stages (a loopback port is open to every local user, and to anyone they forward it "
    "to); the Origin and Host checks are then the only guard against web pages in your browser, and a "
    "browser flaw or extension that gets round them has full control. Use it only on a machine that is "
    "yours alone."
)
