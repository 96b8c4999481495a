"""Who may use ``aerie serve``: the request guard (Host, Origin, token, page-held session key), the session slots
and the token file (its log lines are ``console/serve_log.py``'s, its page ``console/serve_page.py``'s).

The browser console can kill stages, so every request passes, in this order (as Jupyter server does):

1. **Host** (against DNS rebinding): the ``Host`` header must name this server as it is reached — a loopback
   spelling (``127.0.0.1``, ``localhost``, ``[::1]``) or the bound address, with the server's port — or the
   host of an ``--allow-origin`` URL (an SSH forward to another local port). A wildcard bind
   (``--allow-remote --host 0.0.0.0``) cannot know its names: any Host passes there, and the token guards.
2. **Origin** (against other web pages): when a request carries ``Origin`` it must be the server's own
   origin — ``http://`` + the request's (already checked) Host, or a loopback spelling of the same port —
   or one the operator allowed with ``--allow-origin``. Browsers send ``Origin`` on every WebSocket upgrade
   and every POST, so a page of another origin never logs in nor gets a console. ``null`` is refused.
3. **A credential the browser never sends anywhere else.** There is no cookie: browsers send a cookie to
   every port of a host (RFC 6265 §8.5), ``HttpOnly`` and ``SameSite`` do not change that, so any server on
   another port of 127.0.0.1 that the operator's browser visits would receive it. Instead:

   * ``/`` and ``/static/`` are public files, the same for everyone and holding no secret: the console page
     with a login box (``console/serve_page.py``).
   * The page sends the token once, in the body of ``POST /session``; the answer is a fresh random session
     key, which the page's own script keeps in ``sessionStorage`` (per tab and per origin: scheme, host
     *and port*) and sends itself: in the header ``X-Aerie-Session`` of ``GET /session`` and in the
     console's WebSocket URL, ``/ws/<key>``. The token is never in a URL, so never in history, and no
     request the browser makes on its own (a navigation, a link, a popup) carries either.
   * ``/ws`` also takes the token itself from a non-browser client (``Authorization: Bearer``, or
     ``?token=``), compared in constant time. ``?token=`` on a page URL is refused (it would land in the
     browser's history) with a sentence saying to paste it into the box instead.

   The token is required by default, on loopback too (a loopback port is open to every account on the
   machine). ``--no-token`` (loopback only) lets ``POST /session`` hand out keys without one, and says what
   that risks; the page asks for it only in a tab the user opened or clicked (see the session slots).

Failures are 403 (Host, Origin) or 401 (token, session key) with a plain sentence saying what to do. Every
response forbids framing (no clickjacking of the console by another page), sends no ``Referer`` and, but the
static files, may not be stored (``Cache-Control: no-store``); a redirect, should one ever be sent, may only
name a path of this origin.

**Session slots** (:class:`Slots`): at most ``--max-sessions`` consoles run at once, and the view token's
watchers may hold all but one of them: the last slot is always free for the control token, so watchers
cannot lock the operator out. Other pages cannot either, with or without a token: a tab that another page
opened or navigated (a popup, ``noopener`` or not, a ``target=_blank`` link; the browser's ``Sec-Fetch-Site``
says so) starts no console and — under ``--no-token`` — creates no session key until the user clicks "Open
the console here" on it, a click no other origin can make for them (``serve_page.py``); and a session key
holds one console at a time — a newer page with it replaces the older console (``browser_server.py``) — so a
page that copied the operator's key cannot fill the slots with it either. Why a click rather than evicting an
idle console when the slots are full: an operator who watches without typing is idle too, and eviction would
let any page close the operator's console; the click keeps every console one the user asked for, and the
tabs that hold them are in the operator's own browser to close. (A local account can still fill the slots
with plain WebSocket clients under ``--no-token``, which already lets it kill stages: that flag's stated risk.)

A generated token is written to ``<state dir>/serve/<host>-<port>.token`` (``~/.local/state/aerie/serve``
unless ``$AERIE_STATE_DIR``, ``$AERIE_HOME`` or ``$XDG_STATE_HOME`` say otherwise): the directory 0700,
the file 0600, both checked to be this user's; the operator is shown only ``cat PATH``. No token and no
session key reaches a log, and nothing a request carries reaches the terminal raw: ``console/serve_log.py``.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
ROLE_KEY = "aerie_role"  # the request's Role, set by the guard
SESSION_HEADER = "X-Aerie-Session"  # the page-held session key, sent by the page's own script
TOKEN_ENV, VIEW_TOKEN_ENV = "AERIE_SERVE_TOKEN", "AERIE_SERVE_VIEW_TOKEN"
MAX_KEYS = 64  # session keys kept (each login makes one); the oldest is forgotten first
_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-_]+)(:[0-9]{1,5})?$")
log = logging.getLogger("aerie.serve")


class GuardError(ValueError):
    """A setting the guard cannot work with (a bad ``--allow-origin``, an unsafe token directory)."""


@dataclass(frozen=True)
class Role:
    """What a credential opens: a read-only console or not, and whether it is the view token's (a watcher)."""

    read_only: bool
    watcher: bool = False


OPERATOR = Role(read_only=False)


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
class Slots:
    """The consoles running now, by role: at most ``limit``, and watchers at most ``limit - 1`` (the last
    slot is kept for the control token, so watchers never lock the operator out)."""

    limit: int = 4
    running: list[Role] = field(default_factory=list)

    def problem(self, role: Role) -> str | None:
        """Why a console for ``role`` cannot start now (a sentence), or None."""
        if len(self.running) >= self.limit:
            return (
                f"aerie serve: {len(self.running)} browser consoles are open, the most this server runs "
                f"(--max-sessions {self.limit}). Close one (each tab is a console), then reload.\n"
            )
        watchers = sum(r.watcher for r in self.running)
        if role.watcher and watchers >= self.limit - 1:
            return (
                f"aerie serve: {watchers} view-only consoles are open, the most watchers may hold: the last "
                f"of the {self.limit} slots (--max-sessions) is kept for the control token. Close one, "
                "then reload.\n"
            )
        return None

    def take(self, role: Role) -> None:
        self.running.append(role)

    def give_back(self, role: Role) -> None:
        self.running.remove(role)


@dataclass
class Guard:
    """What this server accepts, the session keys it handed out, and the consoles it runs now."""

    port: int
    bound: str  # the --host it listens on
    allow_origins: tuple[str, ...] = ()  # normalized --allow-origin values
    tokens: dict[str, Role] = field(default_factory=dict)  # token -> role; empty: --no-token
    any_host: bool = False  # a wildcard bind with --allow-remote: its names are unknown
    max_sessions: int = 4
    token_hint: str = ""  # how the operator reads the token (shown on the login box)

    def __post_init__(self) -> None:
        names = {*LOOPBACK_NAMES, url_host(self.bound)}
        self.hosts = {f"{n}:{self.port}" for n in names}
        self.hosts |= {o.split("://", 1)[1] for o in self.allow_origins}
        self.origins = {f"http://{n}:{self.port}" for n in names} | set(self.allow_origins)
        self._known = [(t.encode(), role) for t, role in self.tokens.items()]
        self.keys: dict[str, Role] = {}  # session key -> role, oldest first
        self.slots = Slots(self.max_sessions)

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

    def role(self, given: str) -> Role | None:
        """The role ``given`` opens (every token compared, each in constant time); None if it is no token.
        With ``--no-token`` every request is the operator's."""
        if not self.tokens:
            return OPERATOR
        role = None
        for expected, r in self._known:
            if hmac.compare_digest(given.encode(), expected):
                role = r
        return role

    def new_key(self, role: Role) -> str:
        """A fresh session key for ``role`` (a login), the oldest forgotten past :data:`MAX_KEYS`."""
        key = secrets.token_urlsafe(32)
        self.keys[key] = role
        while len(self.keys) > MAX_KEYS:
            del self.keys[next(iter(self.keys))]
        return key

    def key_role(self, given: str) -> Role | None:
        """The role of a session key this server handed out (compared in constant time); None if it is none."""
        role = None
        for key, r in self.keys.items():
            if hmac.compare_digest(given.encode(), key.encode()):
                role = r
        return role


def middleware(guard: Guard) -> Any:
    """The aiohttp middleware that applies the checks to every route, ``/ws`` and ``/static`` included."""
    from aiohttp import hdrs, web

    from console.serve_page import TOKEN_IN_URL

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        problem = guard.host_problem(request.headers.get(hdrs.HOST)) or guard.origin_problem(
            request.headers.get(hdrs.ORIGIN), request.headers.get(hdrs.HOST)
        )
        if problem:
            log.warning("%s %s: %s", request.method, request.path, problem.strip())
            raise web.HTTPForbidden(text=problem)
        if "token" in request.query and not _is_upgrade(request):  # it would stay in the browser's history
            raise web.HTTPBadRequest(text=TOKEN_IN_URL, content_type="text/html")
        if request.path in ("/", "/session") or request.path.startswith("/static/"):
            return await handler(request)  # public files, and the login that checks the token itself
        if request.path.startswith("/ws/"):
            role = guard.key_role(request.path[4:])
        else:
            auth = request.headers.get(hdrs.AUTHORIZATION, "")
            role = guard.role(auth[7:] if auth.startswith("Bearer ") else request.query.get("token", ""))
        if role is None:
            raise web.HTTPUnauthorized(
                text="aerie serve: this console needs its token: open its page in the browser and paste the "
                f"token there (a script sends Authorization: Bearer TOKEN; {guard.token_hint})\n"
            )
        request[ROLE_KEY] = role
        return await handler(request)

    return check


def _is_upgrade(request: Any) -> bool:
    return str(request.headers.get("Upgrade", "")).lower() == "websocket"


async def session_answer(guard: Guard, request: Any, title: str) -> Any:
    """``/session``: ``POST`` the token (form field ``token``) for a session key; ``GET`` with the key in
    ``X-Aerie-Session`` says whether a console may start now (200 and the title, 401, or 503 and why)."""
    from aiohttp import web

    if request.method == "POST":
        role = guard.role(str((await request.post()).get("token", "")))
        if role is None:
            return web.json_response({"error": "That token is not this server's."}, status=401)
        return web.json_response({"session": guard.new_key(role)})
    role = guard.key_role(request.headers.get(SESSION_HEADER, ""))
    if role is None:
        return web.json_response({"token": bool(guard.tokens), "hint": guard.token_hint}, status=401)
    problem = guard.slots.problem(role)
    if problem:
        return web.Response(text=problem, status=503, headers={"Retry-After": "30"})
    return web.json_response({"title": title, "read_only": role.read_only})


async def safe_headers(request: Any, response: Any) -> None:
    """``on_response_prepare``: no page may frame the console (clickjacking), no Referer leaves it, nothing but
    the static files may be stored, and a redirect may only name a path of this origin."""
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cross-Origin-Resource-Policy"] = "same-origin"
    if not request.path.startswith("/static/"):
        response.headers["Cache-Control"] = "no-store"
    location = response.headers.get("Location")
    if location is not None and not same_origin_path(location):
        response.headers["Location"] = "/"


def same_origin_path(location: str) -> bool:
    """Whether a ``Location`` names a path of this origin: ``/x``, never ``//host`` or ``/\\host`` (which
    browsers read as another host) nor a scheme."""
    return location.startswith("/") and not location.startswith(("//", "/\\")) and "\\" not in location


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
