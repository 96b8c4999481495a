"""``aerie serve`` that no web page can drive (issue 37, item 1): the real server, real requests.

Plain HTTP (raw requests with the headers a browser or an attacker would send): a foreign ``Host`` (DNS
rebinding) and a foreign ``Origin`` are refused on every route; a token is required by default on loopback,
generated into a 0600 file in a 0700 directory and shown only as ``cat PATH``; the first ``?token=`` visit
sets the cookie and redirects the token out of the URL; no token reaches the server's log; sessions are
capped with a clear refusal and no process started; ``--no-token`` says what it risks; a busy port is one
line. Then a real headless Chromium (tests/chromium.py): a page of another origin opens the websocket and
sends "down, k, y" to a live run — refused, nothing happens to the run — and the operator's own page loads
the console and shows the board.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import re
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp import web

from pipeline.run.rundir import audit
from tests.chromium import Chromium, chromium_path
from tests.runs import ROOT, finished_run, kill_run_stages, make_run, start_supervisor, states, stop, wait_for
from tests.test_serve_faults import _stat, descendants, free_port, reap, wait_listening, ws_open

TOKEN = "s3cret-serve-token-0123456789"


def token_path(port: int) -> Path:
    """Where ``aerie serve`` on 127.0.0.1:``port`` writes the token it generates, as docs/operating.md says
    (the state directory under this test's AERIE_HOME)."""
    return Path(os.environ["AERIE_HOME"]) / "state" / "serve" / f"127.0.0.1-{port}.token"


def generated_token(port: int) -> str:
    """The token ``aerie serve`` generated for ``port`` (its 0600 file, :func:`token_path`)."""
    return token_path(port).read_text().strip()


def spawn(
    tmp: Path, run: Path, port: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``aerie serve`` in its own session; its stdout and stderr (where its log goes) kept in files."""
    full = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp / "none.toml"), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "console.cli", "serve", str(run), "--port", str(port), *extra],
        env=full,
        stdout=open(tmp / "serve.out", "wb"),  # noqa: SIM115
        stderr=open(tmp / "serve.err", "wb"),  # noqa: SIM115
        start_new_session=True,
    )


def start(
    tmp: Path, run: Path, port: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``aerie serve`` (:func:`spawn`), once it listens and has printed its first lines."""
    server = spawn(tmp, run, port, *extra, env=env)
    wait_listening("127.0.0.1", port, server)
    # it listens before it speaks (a busy port must end before any URL is printed): wait for its lines
    wait_for(
        lambda: "paste it into the page" in logs(tmp) or "WARNING" in logs(tmp),
        30,
        "aerie serve's first lines",
    )
    return server


def get(port: int, path: str, **headers: str) -> tuple[int, dict[str, str], str]:
    """One raw GET to the server (headers exactly as given; Host defaults to the bound address)."""
    headers.setdefault("Host", f"127.0.0.1:{port}")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={k.replace("_", "-"): v for k, v in headers.items()})
        resp = conn.getresponse()
        body = resp.read().decode(errors="replace") if resp.status != 101 else ""
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


UPGRADE = {
    "Upgrade": "websocket",
    "Connection": "Upgrade",
    "Sec_WebSocket_Key": "dGhlIHNhbXBsZSBub25jZQ==",
    "Sec_WebSocket_Version": "13",
}
UPGRADE_HEADERS = {k.replace("_", "-"): v for k, v in UPGRADE.items()}


def logs(tmp: Path) -> str:
    return (tmp / "serve.out").read_text(errors="replace") + (tmp / "serve.err").read_text(errors="replace")


# ---------------------------------------------------------------------------------- Host and Origin
def test_a_foreign_host_or_origin_is_refused_on_every_route(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(
        tmp_path,
        run.root,
        port,
        *("--allow-origin", "http://localhost:9000", "--allow-origin", "https://aerie.example"),
        env={"AERIE_SERVE_TOKEN": TOKEN},
    )
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        for path in ("/", "/ws", "/static/css/xterm.css"):
            # DNS rebinding: a name the attacker controls, resolved to 127.0.0.1, with our port
            status, _, body = get(port, path, Host=f"attacker.example:{port}", **auth)
            assert status == 403 and "is not this server's address" in body, (path, status, body)
            # a page of another origin (another port of localhost is "same-site": it would carry our cookie)
            for origin in (f"http://127.0.0.1:{port + 1}", "http://attacker.example", "null"):
                status, _, body = get(port, path, Origin=origin, **auth)
                assert status == 403 and "may not use this console" in body, (path, origin, status, body)
        status, _, body = get(port, "/ws", Origin="http://localhost:18800", **UPGRADE, **auth)
        assert status == 403 and "--allow-origin" in body
        # our own origin, in each loopback spelling of our port, and the forwarded one the operator allowed
        for host, origin in (
            (f"127.0.0.1:{port}", f"http://127.0.0.1:{port}"),
            (f"localhost:{port}", f"http://localhost:{port}"),
            (f"127.0.0.1:{port}", f"http://localhost:{port}"),
            ("localhost:9000", "http://localhost:9000"),
            ("aerie.example", "https://aerie.example"),  # behind a TLS proxy the operator named
        ):
            status, headers, page = get(port, "/", Host=host, Origin=origin)
            assert status == 200 and 'id="aerie-token"' in page, (host, origin, page)
            # the page's websocket goes where the browser reached it (its script builds it from location)
            assert '"/ws/" + encodeURIComponent(key)' in page and "location.host" in page
            assert headers["x-frame-options"] == "DENY"  # no other page may frame (clickjack) the console
            assert "frame-ancestors 'none'" in headers["content-security-policy"]
        # a websocket without Origin is no browser: it still needs the token
        assert get(port, "/ws", **UPGRADE)[0] == 401
        assert get(port, "/ws", **UPGRADE, **auth)[0] == 101
    finally:
        reap(server, {})
    assert "refused" in logs(tmp_path) and "attacker.example" in logs(tmp_path)  # the refusals are logged


# ------------------------------------------------------------------------------------------- token
def log_in(port: int, token: str) -> str:
    """What the page's script does once: the token in a POST body for a session key."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "POST",
            "/session",
            body=urlencode({"token": token}),
            headers={"Host": f"127.0.0.1:{port}", "Content-Type": "application/x-www-form-urlencoded"},
        )
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200, body
        assert resp.getheader("Cache-Control") == "no-store" and resp.getheader("Set-Cookie") is None
        return str(body["session"])
    finally:
        conn.close()


def test_a_token_is_required_by_default_and_never_shown_or_logged(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(tmp_path, run.root, port)
    try:
        err = (tmp_path / "serve.err").read_text()
        path = token_path(port)
        folder = path.parent
        assert f"cat {path}" in err and f"http://127.0.0.1:{port}/ " in err  # the URL, without a token
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
        token = path.read_text().strip()
        assert len(token) >= 32

        # the page is public and the same for everyone: a login box, no secret, stored nowhere
        status, headers, page = get(port, "/")
        assert status == 200 and 'id="aerie-token"' in page and token not in page
        assert headers["cache-control"] == "no-store" and headers["referrer-policy"] == "no-referrer"
        assert "set-cookie" not in headers
        # nothing from another origin (textual-serve's page asks Google Fonts): no one learns who opened a
        # console, and an air-gapped cluster's page does not stall
        assert not re.findall(r"(?:src|href)\s*=\s*[\"']?(?:https?:)?//", page), page[:400]
        assert get(port, "/session")[0] == 401  # no key: the page shows its box, naming where the token is
        assert f"cat {path}" in get(port, "/session")[2]
        assert get(port, "/ws", **UPGRADE)[0] == 401
        assert get(port, "/ws/not-a-key", **UPGRADE)[0] == 401
        # a token in a page's URL would stay in the browser's history: refused, saying where to paste it
        status, headers, page = get(port, f"/?token={token}")
        assert status == 400 and "history" in page and "set-cookie" not in headers

        # the page's login: the token in a POST body, a session key back, which only the page sends
        with pytest.raises(AssertionError, match="not this server's"):
            log_in(port, "not-the-token")
        key = log_in(port, token)
        status, headers, body = get(port, "/session", X_Aerie_Session=key)
        assert status == 200 and json.loads(body)["title"].startswith("Aerie — ")
        assert headers["cache-control"] == "no-store"
        assert get(port, f"/ws/{key}?width=80&height=24", **UPGRADE)[0] == 101
        assert get(port, f"/ws/{key[:-1]}", **UPGRADE)[0] == 401
        assert get(port, f"/ws?token={token}", **UPGRADE)[0] == 101  # a script may give the token itself
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(90)  # two consoles were starting: under a loaded CI their stop can take a while
    out = logs(tmp_path)
    assert '"GET /?token=[redacted]" 400' in out and '"GET /ws/[session]?width=80&height=24" 101' in out
    assert token not in out and key not in out and TOKEN not in out
    assert not path.exists()  # the token dies with its server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_generated_token_file_is_removed_however_the_server_is_stopped(tmp_path: Path, sig: int) -> None:
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(tmp_path, run.root, port)
    path = token_path(port)
    try:
        assert path.exists()
        os.kill(server.pid, sig)  # as a closed terminal (SIGHUP), Ctrl-C or a service manager would
        assert server.wait(30) == 0
    finally:
        reap(server, {})
    assert not path.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_the_server_starts_is_as_clean_as_one_while_it_serves(tmp_path: Path, sig: int) -> None:
    """The signal comes as soon as the port listens, before the server has printed its address or taken
    its signals into its loop (a service manager stopping it at once): exit 0, no token file left."""
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = spawn(tmp_path, run.root, port)
    try:
        wait_listening("127.0.0.1", port, server)
        os.kill(server.pid, sig)
        assert server.wait(30) == 0, logs(tmp_path)
        assert "Traceback" not in logs(tmp_path)
    finally:
        reap(server, {})
    assert not token_path(port).exists()


# ------------------------------------------------------------------------ what a request carries in
def raw_request(port: int, head: bytes) -> bytes:
    """One request exactly as given (bytes a client library would refuse to send); the reply's head."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    return reply.split(b"\r\n\r\n", 1)[0]


def test_nothing_a_request_carries_reaches_the_terminal_raw_and_no_redirect_leaves(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(tmp_path, run.root, port, env={"AERIE_SERVE_TOKEN": TOKEN})
    try:
        # the probe: escape codes and a newline in the path, refused for its Origin and logged
        assert get(port, "/%1b%5b31mRED%0afake", Origin="http://x")[0] == 403
        # the same in a User-Agent and an Origin header, and raw (not %-encoded) in the request line
        # (aiohttp itself answers 400 to a control byte in a header; what it lets through is escaped by us)
        assert get(port, "/", User_Agent="curl\x1b]0;owned\x07\x1b[2J")[0] == 400
        assert get(port, "/", Origin="http://\x1b[31mred\x1b[0m")[0] in (400, 403)
        ua = "curl\u202e\u2028fake\u009b31m".encode()  # RTL override, line separator, C1 CSI: let through
        head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nUser-Agent: %s\r\n\r\n" % (port, ua)
        assert raw_request(port, head).startswith(b"HTTP/1.1 200")
        raw_request(port, b"GET /\x1b[32mGREEN\rfake HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port)
        raw_request(
            port, b"GET /\xc2\x9b31m\xe2\x80\xae HTTP/1.1\r\nHost: \x1b[7m\r\n\r\n"
        )  # C1 CSI, RTL override
        # no redirect to another host, however the path is spelled (once /%2fhost answered Location: //host)
        for path in (
            "/%2fevil.example:80/?token=x",
            "//evil.example/",
            "/%5cevil.example/",
            "/static/..%2f..",
        ):
            status, headers, _ = get(port, path)
            assert status < 300 or status >= 400 or headers["location"].startswith("/"), (path, headers)
            assert not headers.get("location", "/").startswith(("//", "/\\")), (path, headers)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    out = (tmp_path / "serve.out").read_bytes() + (tmp_path / "serve.err").read_bytes()
    assert b"\x1b" not in out and b"\x07" not in out and b"\r" not in out and b"\xc2\x9b" not in out
    assert b"\xe2\x80\xae" not in out  # no raw control character of any kind
    lines = out.decode().splitlines()
    assert all(line.startswith("aerie serve: ") for line in lines), lines  # no forged line, no traceback
    assert (
        "aiohttp.server: Error handling request from 127.0.0.1: 400, message: Invalid char in url path"
        in out.decode()
    )
    text = out.decode()
    assert "GET /\\x1b[31mRED\\nfake: aerie serve: refused: a page from http://x" in text  # shown, escaped
    assert '"curl\\u202e\\u2028fake\\x9b31m"' in text  # the User-Agent in the access log, escaped


@pytest.mark.slow  # a console started cold, which fails
def test_a_console_that_fails_to_start_is_reported_escaped(tmp_path: Path) -> None:
    """textual-serve copies a console's stderr to the server's stdout when it fails to start: escaped too."""
    run = finished_run(tmp_path / "r\x1b[31mred")  # a hostile name (an ssh:// run's names come from afar)
    port = free_port()
    server = start(tmp_path, run.root, port, env={"AERIE_SERVE_TOKEN": TOKEN})
    try:
        run.root.rename(run.root.with_name("moved"))  # so its console fails: "no such run"
        sock = ws_open("127.0.0.1", port, f"/ws?width=80&height=24&token={TOKEN}")
        assert ended_by_server(sock, 120), "the failed console's session did not end"
        sock.close()
        wait_for(lambda: "no such run" in (tmp_path / "serve.out").read_text(), 30, "the console's error")
    finally:
        reap(server, {})
    out = (tmp_path / "serve.out").read_text()
    assert "\x1b" not in out and "r\\x1b[31mred" in out, out


def test_a_redirect_to_another_origin_is_rewritten_to_this_one() -> None:
    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from console.serve_guard import safe_headers, same_origin_path

    assert same_origin_path("/?fontsize=14") and same_origin_path("/static/x")
    for bad in ("//evil.example/", "/\\evil.example", "http://evil.example/", "/%2f/..\\x", "evil/"):
        assert not same_origin_path(bad), bad
    response = web.HTTPSeeOther(location="//evil.example:80/")
    asyncio.run(safe_headers(make_mocked_request("GET", "/%2fevil.example:80/"), response))
    assert response.headers["Location"] == "/" and response.headers["Cache-Control"] == "no-store"


# ------------------------------------------------------------------------------------- session cap
def consoles(server: int) -> set[int]:
    """The server's own children: one console process per session (their own children are theirs)."""
    return {pid for pid in descendants(server) if (_stat(pid) or (0, 0))[0] == server}


def test_sessions_past_the_cap_are_refused_and_start_no_console(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(tmp_path, run.root, port, "--max-sessions", "1", env={"AERIE_SERVE_TOKEN": TOKEN})
    procs: dict[int, int] = {}
    try:
        first = ws_open("127.0.0.1", port, f"/ws?token={TOKEN}")
        wait_for(lambda: consoles(server.pid), 30, "the first console process")
        first_console = consoles(server.pid)
        status, headers, body = get(port, f"/ws?token={TOKEN}", **UPGRADE)
        assert status == 503 and "(--max-sessions 1)" in body and "Close one" in body
        assert headers["retry-after"]
        key = log_in(port, TOKEN)
        status, _, page = get(port, "/session", X_Aerie_Session=key)  # a new tab says so at once
        assert status == 503 and "(--max-sessions 1)" in page
        time.sleep(1)
        assert consoles(server.pid) == first_console  # no console was started for the refused one
        procs = descendants(server.pid)
        first.close()  # the slot frees when its browser goes away
        wait_for(lambda: get(port, "/session", X_Aerie_Session=key)[0] == 200, 30, "the session slot to free")
    finally:
        reap(server, procs)


def ended_by_server(sock: socket.socket, timeout: float = 60) -> bool:
    """Whether the server closes this raw websocket within ``timeout`` (what it drew before is skipped)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    with contextlib.suppress(OSError):
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    return False


@pytest.mark.slow  # five console processes, each started cold
def test_watchers_and_pages_that_copied_a_key_never_lock_the_operator_out(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    port = free_port()
    view = "v1ew-only-token-0123456789"
    server = start(tmp_path, run.root, port, env={"AERIE_SERVE_TOKEN": TOKEN, "AERIE_SERVE_VIEW_TOKEN": view})
    socks: list[socket.socket] = []
    procs: dict[int, int] = {}
    try:
        for _ in range(3):  # watchers take all but the last of the 4 slots (--max-sessions 4) ...
            socks.append(ws_open("127.0.0.1", port, f"/ws?width=80&height=24&token={view}"))
        wait_for(lambda: len(consoles(server.pid)) == 3, 60, "three watchers' consoles")
        status, _, body = get(port, f"/ws?token={view}", **UPGRADE)
        assert status == 503 and "kept for the control token" in body  # ... a fourth watcher is refused
        view_key = log_in(port, view)
        assert get(port, "/session", X_Aerie_Session=view_key)[0] == 503  # its page says so before connecting
        # ... and the operator gets the last one
        key = log_in(port, TOKEN)
        assert get(port, "/session", X_Aerie_Session=key)[0] == 200
        operator = ws_open("127.0.0.1", port, f"/ws/{key}?width=80&height=24")
        wait_for(lambda: len(consoles(server.pid)) == 4, 60, "the operator's console")
        # A page that copied the operator's key (a popup clones its opener's sessionStorage, a reload reuses
        # it) replaces that key's console instead of taking another slot: one console per key.
        first = set(consoles(server.pid))
        again = ws_open("127.0.0.1", port, f"/ws/{key}?width=80&height=24")
        assert ended_by_server(operator), "the key's older console was not ended"
        wait_for(
            lambda: len(consoles(server.pid)) == 4 and consoles(server.pid) != first, 60, "the new console"
        )
        procs = descendants(server.pid)
        socks += [operator, again]
    finally:
        for sock in socks:
            sock.close()
        reap(server, procs)
    assert view not in logs(tmp_path) and key not in logs(tmp_path)


def test_slots_keep_the_last_one_for_the_control_token() -> None:
    from console.serve_guard import OPERATOR, Role, Slots

    watcher = Role(read_only=True, watcher=True)
    slots = Slots(limit=3)
    for _ in range(2):
        assert slots.problem(watcher) is None
        slots.take(watcher)
    assert "kept for the control token" in (slots.problem(watcher) or "")
    assert slots.problem(OPERATOR) is None  # the operator's slot
    slots.take(OPERATOR)
    assert "(--max-sessions 3)" in (slots.problem(OPERATOR) or "")  # full: the operator's own tabs
    slots.give_back(watcher)
    assert slots.problem(OPERATOR) is None  # a watcher left: a second operator console may take its slot
    assert slots.problem(watcher) is None  # or a watcher: the operator holds one slot already
    read_only_operator = Role(read_only=True)  # --read-only: the operator's token is read-only, not a watcher
    assert slots.problem(read_only_operator) is None


# ---------------------------------------------------------------------------------------- opt-outs
def test_no_token_says_what_it_risks_and_is_loopback_only(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp_path / "none.toml"))
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "serve", str(run.root), "--no-token"]
        + ["--host", "0.0.0.0", "--allow-remote"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--no-token is only allowed on a loopback address" in r.stderr
    port = free_port()
    server = start(tmp_path, run.root, port, "--no-token")
    try:
        err = (tmp_path / "serve.err").read_text()
        assert "WARNING: --no-token: anyone with an account on this machine" in err
        assert "cat " not in err and not (Path(os.environ["AERIE_HOME"]) / "state" / "serve").exists()
        assert get(port, "/")[0] == 200
        assert log_in(port, "")  # the page gets a key without a token
        assert get(port, "/ws", Origin=f"http://localhost:{port + 1}", **UPGRADE)[0] == 403  # pages still not
    finally:
        reap(server, {})


def test_a_busy_port_is_one_line_naming_it(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp_path / "none.toml"))
    with socket.socket() as other:  # another server holds the port
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "console.cli", "serve", str(run.root), "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        f"aerie: error: port {port} on 127.0.0.1 is already in use: is another aerie serve running? pick --port"
    ]
    assert r.stdout == ""  # no URL (it would be the other server's), no traceback
    assert not (Path(os.environ["AERIE_HOME"]) / "state" / "serve").exists()  # no token file written

    # the port held by another aerie serve: that server's token file is left alone
    port = free_port()
    first = start(tmp_path, run.root, port)
    try:
        token_file = token_path(port)
        token = token_file.read_text()
        r = subprocess.run(
            [sys.executable, "-m", "console.cli", "serve", str(run.root), "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "http" not in r.stderr + r.stdout
        assert token_file.read_text() == token and first.poll() is None
    finally:
        reap(first, {})


# ---------------------------------------------------------------------------------- real Chromium
ATTACK_PAGE = """<!DOCTYPE html><html><body><pre id="log"></pre><script>
const log = (m) => { document.getElementById("log").textContent += m + "\\n"; };
for (const url of URLS) {
  const ws = new WebSocket(url);
  let typed = false;
  ws.onopen = () => log("open " + url);
  ws.onmessage = () => {  // the console drew: type as the operator would, a key at a time
    if (typed) return;
    typed = true;
    log("message " + url);
    setTimeout(async () => {
      for (const key of ["\\u001b[B", "k", "y"]) {  // down, kill, yes
        ws.send(JSON.stringify(["stdin", key]));
        await new Promise((r) => setTimeout(r, 1000));
      }
      log("typed " + url);
    }, 3000);
  };
  ws.onclose = (e) => log("close " + url + " " + e.code);
}
</script><iframe id="frame" src="CONSOLE"></iframe></body></html>"""


@pytest.fixture
def live_run(tmp_path: Path):  # noqa: ANN201
    run = make_run(
        tmp_path,
        """
        [run]
        name = "target"
        dir = "run"
        [[stage]]
        id = "work"
        command = "sleep 600"
        """,
    )
    sup = start_supervisor(run)
    wait_for(lambda: states(run).get("work") == "running", 60, "the stage to run")
    yield run
    stop(sup)
    kill_run_stages(run)


@pytest.mark.slow  # a browser, a server and a console, each started cold
async def test_chromium_page_of_another_origin_cannot_drive_the_console(tmp_path: Path, live_run) -> None:  # noqa: ANN001
    chromium_path()
    port, evil_port = free_port(), free_port()
    server = start(tmp_path, live_run.root, port, env={"AERIE_SERVE_TOKEN": TOKEN})
    # The attacker's page, served from another origin on this machine (another loopback port).
    targets = [f"ws://127.0.0.1:{port}/ws?width=80&height=24", f"ws://localhost:{port}/ws?width=80&height=24"]
    page = ATTACK_PAGE.replace("URLS", json.dumps(targets)).replace("CONSOLE", f"http://127.0.0.1:{port}/")

    async def attack(_request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    evil = web.Application()
    evil.router.add_get("/", attack)
    runner = web.AppRunner(evil)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", evil_port).start()
    browser = await Chromium(tmp_path / "profile").start()
    try:
        # The operator opened the console in this browser before: the tab holds a session key (no cookie to
        # carry); a page on another port of the same host is "same-site" — only the Origin check stops it.
        await browser_log_in(browser, port, TOKEN)
        await browser.wait_eval(
            "sessionStorage.getItem('aerie-session') && document.getElementById('aerie-login').hidden",
            60,
            "the operator's console page, logged in",
        )
        await browser.navigate(f"http://127.0.0.1:{evil_port}/")
        log = await browser.wait_eval(
            "(t => (t.match(/^(open|close) /gm) || []).length >= 2 && t)"
            "((document.getElementById('log') || {}).textContent || '')",
            60,
            "both websockets of the attacker's page to open or close",
        )
        assert "open" not in log and "message" not in log, log  # never connected, nothing typed
        frames = (await browser.send("Page.getFrameTree"))["frameTree"].get("childFrames", [])
        assert frames and all(
            f["frame"].get("unreachableUrl") or "chrome-error" in f["frame"]["url"] for f in frames
        )
        await asyncio.sleep(2)  # (with the Origin check off, this page kills `work` within ~10 s)
        assert states(live_run)["work"] == "running"
        assert not (live_run.root / audit.AUDIT_FILE).exists()  # no action, not even a refused one
        out = logs(tmp_path)
        assert out.count('"GET /ws?width=80&height=24" 403') == 2, out
        assert f"a page from http://127.0.0.1:{evil_port} may not use this console" in out
        assert TOKEN not in out
    finally:
        await browser.close()
        await runner.cleanup()
        reap(server, {})


RECORD_WEBSOCKETS = """
window.__rx = "";
const Native = window.WebSocket;
window.WebSocket = class extends Native {
  constructor(...args) {
    super(...args);
    this.addEventListener("message", (e) => {
      if (typeof e.data !== "string") window.__rx += new TextDecoder().decode(e.data);
    });
  }
};
"""


@pytest.mark.slow  # a browser, a server and a console, each started cold
async def test_chromium_operator_page_loads_the_console_and_shows_the_board(tmp_path: Path) -> None:
    chromium_path()
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(tmp_path, run.root, port)
    token = generated_token(port)
    browser = await Chromium(tmp_path / "profile").start()
    try:
        # What the terminal receives, recorded as the page's own xterm gets it (it draws on a canvas).
        await browser.send("Page.addScriptToEvaluateOnNewDocument", source=RECORD_WEBSOCKETS)
        await browser_log_in(browser, port, token, host="localhost")  # the forwarded-port spelling
        await browser.wait_eval(
            "window.__rx && window.__rx.includes('prep.sharegpt')", 120, "the board in the browser's terminal"
        )
        assert await browser.eval("location.href") == f"http://localhost:{port}/"
        assert await browser.eval("document.cookie") == ""  # no cookie at all
        assert await browser.eval("document.getElementById('aerie-token').value") == ""  # the box forgot it
        assert await browser.eval("document.title") == f"Aerie — {run.root}"
        assert await browser.eval("document.body.classList.contains('-first-byte')")  # the terminal shows
        assert not await browser.eval("document.body.classList.contains('-closed')")
        # a reload (the "Session ended: Restart" button is one) keeps the tab's key: no second login
        await browser.eval("window.__rx = ''; location.reload(); true")
        await browser.wait_eval(
            "window.__rx && window.__rx.includes('prep.sharegpt')", 120, "the board again after a reload"
        )
    finally:
        await browser.close()
        reap(server, {})
    assert token not in logs(tmp_path)


async def browser_log_in(browser: Chromium, port: int, token: str, host: str = "127.0.0.1") -> None:
    """As the operator does: open the console's page, paste the token into its box, press Open."""
    await browser.navigate(f"http://{host}:{port}/")
    await browser.wait_eval(
        "(b => b && !b.hidden)(document.getElementById('aerie-form'))", 60, "the console page's login box"
    )
    await browser.eval(
        f"document.getElementById('aerie-token').value = {json.dumps(token)};"
        "document.getElementById('aerie-form').requestSubmit(); true"
    )


LISTENER_PAGE = """<!DOCTYPE html><html><body><img src="/image.png"><script>
// everything a page on this port can make the browser send: to itself, with credentials, and a websocket
(async () => {
  const tries = [
    fetch("/fetch", {credentials: "include"}).catch(() => null),
    fetch("http://localhost:PORT/cross", {credentials: "include", mode: "no-cors"}).catch(() => null),
    new Promise((done) => {
      const ws = new WebSocket("ws://127.0.0.1:PORT/ws");
      ws.onerror = ws.onclose = () => done(null);
    }),
  ];
  await Promise.all(tries);
  window.__done = true;
})();
</script></body></html>"""


async def listener(port: int, recorded: list[dict[str, Any]]) -> web.AppRunner:
    """A server on another port of this host that records every request it receives, whole."""

    async def record(request: web.Request) -> web.Response:
        recorded.append(
            {
                "method": request.method,
                "path": request.path_qs,
                "headers": list(request.headers.items()),
                "body": (await request.read()).decode(errors="replace"),
            }
        )
        if request.path == "/":
            return web.Response(text=LISTENER_PAGE.replace("PORT", str(port)), content_type="text/html")
        if request.path == "/launder":  # a popup that cuts its opener, then goes to the console
            to = json.dumps(request.query["to"])
            page = f"<script>window.opener = null; location.replace({to});</script>"
            return web.Response(text=page, content_type="text/html")
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def replay(port: int, request: dict[str, Any], path: str, **extra: str) -> int:
    """``request``'s headers (all of them, cookies included), sent to our server as its own page would."""
    headers = {k: v for k, v in request["headers"] if k.lower() not in ("host", "origin", "content-length")}
    headers |= {"Host": f"127.0.0.1:{port}", "Origin": f"http://127.0.0.1:{port}", **extra}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        return conn.getresponse().status
    finally:
        conn.close()


def profile_files_holding(profile: Path, secret: str) -> list[str]:
    """Every file of the browser's profile whose bytes hold ``secret`` (as UTF-8 or UTF-16)."""
    needles = (secret.encode(), secret.encode("utf-16-le"))
    return [
        str(p.relative_to(profile))
        for p in profile.rglob("*")
        if p.is_file() and any(n in p.read_bytes() for n in needles)
    ]


@pytest.mark.slow  # a browser, a server and consoles, each started cold
async def test_chromium_another_port_gets_nothing_to_replay_and_history_never_the_token(
    tmp_path: Path,
) -> None:
    chromium_path()
    run = finished_run(tmp_path / "r")
    port, other = free_port(), free_port()
    server = start(tmp_path, run.root, port, env={"AERIE_SERVE_TOKEN": TOKEN})
    recorded: list[dict[str, Any]] = []
    runner = await listener(other, recorded)
    browser = await Chromium(tmp_path / "profile").start()
    try:
        await browser.send("Page.addScriptToEvaluateOnNewDocument", source=RECORD_WEBSOCKETS)
        await browser_log_in(browser, port, TOKEN)
        await browser.wait_eval("window.__rx && window.__rx.includes('prep.sharegpt')", 120, "the board")
        key = await browser.eval("sessionStorage.getItem('aerie-session')")
        assert key and await browser.eval("location.href") == f"http://127.0.0.1:{port}/"
        assert (await browser.send("Storage.getCookies"))[
            "cookies"
        ] == []  # the browser holds no cookie at all

        # The logged-in operator visits another server on this host: it gets all the browser will send it.
        await browser.navigate(f"http://127.0.0.1:{other}/")
        await browser.wait_eval("window.__done === true", 60, "the listener page's requests")
        assert {r["path"] for r in recorded} >= {"/", "/fetch", "/cross", "/ws", "/image.png"}, recorded
        everything = json.dumps(recorded)
        assert TOKEN not in everything and key not in everything
        assert "cookie" not in everything.lower()  # no cookie of ours, none at all
        for request in recorded:  # replayed whole, as our own page: no session from any of it
            assert replay(port, request, "/session") == 401, request
            assert replay(port, request, "/ws?width=80&height=24", **UPGRADE_HEADERS) == 401, request
        # (the key is what opens one: the same replay with the page's key added gets a console)
        assert replay(port, recorded[0], f"/ws/{key}?width=80&height=24", **UPGRADE_HEADERS) == 101

        # Popups of the console opened by that page start no console (they cannot fill the slots) ...
        wait_for(lambda: not consoles(server.pid), 60, "the consoles of the page and the replay to end")
        for _ in range(4):  # four clicks: a click lets a page open one popup
            await browser.eval(f"!!window.open('http://127.0.0.1:{port}/', '_blank')", user_gesture=True)
        await asyncio.sleep(10)  # a popup that connected would have started its console by now
        targets = (await browser.send("Target.getTargets"))["targetInfos"]
        popups = [t for t in targets if t["url"] == f"http://127.0.0.1:{port}/" and t.get("openerId")]
        assert len(popups) == 4, targets
        assert not consoles(server.pid)
        # Popups that cut their opener first still start nothing: another page sent them there.
        for _ in range(4):
            url = f"http://127.0.0.1:{other}/launder?to=http://127.0.0.1:{port}/"
            await browser.eval(f"!!window.open({json.dumps(url)}, '_blank')", user_gesture=True)
        await asyncio.sleep(15)
        assert not consoles(server.pid)  # another page navigated them there: each waits for a click
        # ... and the operator, back in the tab, gets the console at once, without logging in again
        await browser.navigate(f"http://127.0.0.1:{port}/")
        await browser.wait_eval(
            "window.__rx && window.__rx.includes('prep.sharegpt')", 120, "the board again"
        )
    finally:
        await browser.close(graceful=True)  # a browser that quits writes its History
        await runner.cleanup()
        reap(server, {})
    history = tmp_path / "profile" / "Default" / "History"
    with contextlib.closing(sqlite3.connect(f"file:{history}?mode=ro", uri=True)) as db:
        urls = [row[0] for row in db.execute("SELECT url FROM urls")]
    assert f"http://127.0.0.1:{port}/" in urls, urls  # the visit is recorded (the database was written) ...
    assert not [u for u in urls if TOKEN in u or key in u or "token" in u]  # ... and holds no token
    assert profile_files_holding(tmp_path / "profile", TOKEN) == []  # nor any file of the profile (no cache)
    assert TOKEN not in logs(tmp_path)


OPEN_FROM_THIS_PAGE = """((url, how) => {  // what a page does on a click: a popup without opener, or a link
  if (how === "noopener") return (window.open(url, "_blank", "noopener"), true);
  const a = Object.assign(document.createElement("a"), {href: url, target: "_blank"});
  document.body.append(a);
  a.click();
  return true;
})"""


@pytest.mark.slow  # a browser, a server and a console, each started cold
async def test_chromium_no_token_tabs_opened_by_another_port_never_lock_the_operator_out(
    tmp_path: Path,
) -> None:
    """Issue 47 item 3 under ``--no-token``: a page on another loopback port opens the console in four tabs
    (noopener popups and ``target=_blank`` links, each on a click): none creates a session key or a
    console by itself, so the operator's own typed address still gets the board."""
    chromium_path()
    run = finished_run(tmp_path / "r")
    port, other = free_port(), free_port()
    server = start(tmp_path, run.root, port, "--no-token")
    runner = await listener(other, [])
    browser = await Chromium(tmp_path / "profile").start()
    console = f"http://127.0.0.1:{port}/"
    try:
        await browser.send("Page.addScriptToEvaluateOnNewDocument", source=RECORD_WEBSOCKETS)
        await browser.navigate(f"http://127.0.0.1:{other}/")
        await browser.wait_eval("window.__done === true", 60, "the other port's page")
        main = next(
            t["targetId"]
            for t in (await browser.send("Target.getTargets"))["targetInfos"]
            if t["type"] == "page"
        )
        for how in ("noopener", "link", "noopener", "link"):  # four clicks, four tabs of the console
            opened = f"{OPEN_FROM_THIS_PAGE}({json.dumps(console)}, {json.dumps(how)})"
            assert await browser.eval(opened, user_gesture=True)

        async def tabs() -> list[dict[str, Any]]:
            targets = (await browser.send("Target.getTargets"))["targetInfos"]
            return [t for t in targets if t["type"] == "page" and t["url"] == console]

        deadline = time.monotonic() + 60
        while len(await tabs()) < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert len(await tabs()) == 4, await tabs()
        await asyncio.sleep(15)  # a tab that went on by itself has its console by now (it did before)
        assert not consoles(server.pid)
        # The operator types the console's address: the board, at once.
        await browser.navigate(console)
        await browser.wait_eval(
            "window.__rx && window.__rx.includes('prep.sharegpt')", 120, "the operator's board"
        )
        assert get(port, "/session", X_Aerie_Session=log_in(port, ""))[0] == 200  # and a slot to spare
        # A tab another page opened is not dead: the user's own click on its button opens the console there.
        assert len(consoles(server.pid)) == 1
        popup = next(t for t in await tabs() if t["targetId"] != main)
        await click_in_tab(browser, popup["targetId"], "aerie-open")
        wait_for(
            lambda: len(consoles(server.pid)) == 2, 60, "the console of the tab whose button was clicked"
        )
    finally:
        await browser.close()
        await runner.cleanup()
        reap(server, {})


async def click_in_tab(browser: Chromium, target: str, element: str) -> None:
    """A user's click (trusted input, through the tab's own DevTools connection) on ``element`` in the tab
    ``target``, once the element is enabled."""
    import aiohttp

    port = int((browser.profile / "DevToolsActivePort").read_text().splitlines()[0])
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            page = next(t for t in await resp.json() if t["id"] == target)
        async with http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            sent = 0

            async def send(method: str, **params: Any) -> dict[str, Any]:
                nonlocal sent
                sent += 1
                await ws.send_json({"id": sent, "method": method, "params": params})
                while True:
                    msg = json.loads((await ws.receive(timeout=60)).data)
                    if msg.get("id") == sent:
                        return dict(msg.get("result", {}))

            async def click(x: float, y: float) -> None:
                for kind in ("mousePressed", "mouseReleased"):
                    await send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

            await click(2, 2)  # the tab takes the input (a focus re-arms the button's one-second delay)
            where = (
                f"(b => !b.hidden && !b.disabled && (r => [r.x + r.width / 2, r.y + r.height / 2])"
                f"(b.getBoundingClientRect()))(document.getElementById({json.dumps(element)}))"
            )
            deadline = time.monotonic() + 30
            while not (
                value := (await send("Runtime.evaluate", expression=where, returnByValue=True))["result"].get(
                    "value"
                )
            ):
                assert time.monotonic() < deadline, f"#{element} never enabled in the tab"
                await asyncio.sleep(0.25)
            await click(*value)


def _close_code(sock: socket.socket, within_s: float) -> int | None:
    """Read server frames (unmasked) until a close frame; its status code, or None at end of stream."""
    sock.settimeout(within_s)
    buf = b""
    while True:
        while len(buf) >= 2:
            op, n, at = buf[0] & 0x0F, buf[1] & 0x7F, 2
            if n == 126:
                n, at = int.from_bytes(buf[2:4], "big"), 4
            elif n == 127:
                n, at = int.from_bytes(buf[2:10], "big"), 10
            if len(buf) < at + n:
                break
            if op == 0x8:
                return int.from_bytes(buf[at : at + 2], "big") if n >= 2 else 1005
            buf = buf[at + n :]
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf += chunk


def test_stopping_aerie_serve_tells_each_open_session_it_went_away(tmp_path: Path) -> None:
    """A browser tab holding a console when the server is stopped (systemd, Ctrl-C) is told at once, with the
    WebSocket's "going away", and the server ends without waiting out its open sessions."""
    run = finished_run(tmp_path / "r")
    port = free_port()
    server = start(tmp_path, run.root, port)
    token = generated_token(port)
    sock = ws_open("127.0.0.1", port, f"/ws/{log_in(port, token)}?width=80&height=24")
    try:
        time.sleep(1.0)  # the console is starting behind the session
        os.killpg(server.pid, signal.SIGTERM)
        assert _close_code(sock, 60) == 1001  # WSCloseCode.GOING_AWAY
        assert server.wait(60) == 0
    finally:
        sock.close()
        reap(server, {})
