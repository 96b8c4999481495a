"""``aerie serve`` under faults and hostile binds (issue 18, items 5 and 6), with the real server and processes.

* No orphans: a raw websocket client connects (so a console process is started for it), then vanishes —
  without closing its socket (held open, as headless Chromium's screenshot mode did), by a TCP reset, or
  by a plain close with no websocket close frame — and ``aerie serve`` is then sent SIGTERM, or SIGKILL. Every process the server started
  must be gone within a few seconds; none may be left with parent pid 1.
* Binds: a non-loopback address is refused unless ``--allow-remote`` is given, and then every request
  needs the token. The non-loopback address lives on a veth interface in a network namespace this
  test creates, so nothing is ever exposed on, or sent to, a real network.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.runs import ROOT, finished_run, wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a live pid, None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every live descendant of ``root``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st:
                children.setdefault(st[0], []).append(int(name))
    out: dict[int, int] = {}
    todo = [root]
    while todo:
        for c in children.get(todo.pop(), []):
            st = _stat(c)
            if st:
                out[c] = st[1]
                todo.append(c)
    return out


def still_alive(procs: dict[int, int]) -> dict[int, int]:
    """Those of ``procs`` (pid -> start time) that are still the same live process: pid -> ppid."""
    out = {}
    for pid, start in procs.items():
        st = _stat(pid)
        if st and st[1] == start:
            out[pid] = st[0]
    return out


TOKEN = "t0ken-for-the-serve-fault-tests"


def start_serve(tmp: Path, port: int, *extra: str, netns: str | None = None) -> subprocess.Popen:
    run = finished_run(tmp / "r")
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp / "none.toml"), AERIE_SERVE_TOKEN=TOKEN)
    argv = [sys.executable, "-m", "console.cli", "serve", str(run.root), "--port", str(port), *extra]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "serve.err", "wb"),  # noqa: SIM115
        start_new_session=True,
    )


def ws_open(
    host: str, port: int, path: str = f"/ws?width=100&height=30&token={TOKEN}", cookie: str | None = None
) -> socket.socket:
    """A raw websocket client: the HTTP upgrade by hand, then the socket is ours to abandon."""
    sock = socket.create_connection((host, port), timeout=10)
    head = (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        + (f"Cookie: {cookie}\r\n" if cookie else "")
        + "\r\n"
    )
    sock.sendall(head.encode())
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(4096)
        if not chunk:
            break
        reply += chunk
    status = reply.split(b"\r\n", 1)[0].decode(errors="replace")
    if " 101 " not in status:
        sock.close()
        raise ConnectionRefusedError(status)
    return sock


def wait_listening(host: str, port: int, server: subprocess.Popen, netns: str | None = None) -> None:
    def up() -> bool:
        assert server.poll() is None, "aerie serve exited early"
        if netns:
            r = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    netns,
                    sys.executable,
                    "-c",
                    f"import socket; socket.create_connection(({host!r}, {port}), 1).close()",
                ],
                capture_output=True,
            )
            return r.returncode == 0
        try:
            socket.create_connection((host, port), 1).close()
            return True
        except OSError:
            return False

    wait_for(up, 60, "aerie serve to listen")


def reap(server: subprocess.Popen, procs: dict[int, int]) -> None:
    """Cleanup: SIGKILL what this test started and recorded (the server's group, recorded pids if same)."""
    with contextlib.suppress(ProcessLookupError):
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    for pid in still_alive(procs):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("client_end", "server_sig"),
    [
        ("held-open", signal.SIGTERM),
        ("reset", signal.SIGTERM),
        ("reset-then-wait", signal.SIGTERM),
        ("closed", signal.SIGTERM),
        ("held-open", signal.SIGKILL),
    ],
)
def test_no_console_outlives_aerie_serve(tmp_path: Path, client_end: str, server_sig: signal.Signals) -> None:
    port = free_port()
    server = start_serve(tmp_path, port)
    procs: dict[int, int] = {}
    try:
        wait_listening("127.0.0.1", port, server)
        sock = ws_open("127.0.0.1", port)
        # The console process for this client is up (and past its imports) once it draws something.
        sock.settimeout(60)
        got = b""
        while len(got) < 2000:
            chunk = sock.recv(65536)
            assert chunk, "the server closed the websocket before the console drew anything"
            got += chunk
        procs = descendants(server.pid)
        assert procs, "aerie serve started no console process"
        if client_end == "closed":
            sock.close()  # FIN without a websocket close frame: the client process simply went away
            time.sleep(1)
        if client_end.startswith("reset"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()  # RST: the client vanished
            if client_end == "reset-then-wait":
                time.sleep(3)
        # held-open: the socket stays open and silent, like a browser that went away without closing it
        os.kill(server.pid, server_sig)
        server.wait(30)
        try:
            wait_for(lambda: not still_alive(procs), 15, "every process aerie serve started to end")
        except AssertionError:
            left = still_alive(procs)
            raise AssertionError(
                f"left behind after {server_sig.name} to aerie serve ({client_end} client): "
                f"pid -> ppid {left}"
            ) from None
        if client_end == "held-open":
            sock.close()
    finally:
        reap(server, procs)


# ------------------------------------------------------------------------------------------ binds
def test_a_non_loopback_bind_is_refused_without_the_explicit_flag(tmp_path: Path) -> None:
    run = finished_run(tmp_path / "r")
    env = dict(os.environ, PYTHONPATH=str(ROOT), AERIE_CONFIG=str(tmp_path / "none.toml"))
    for host in ("0.0.0.0", "::", "10.1.2.3"):
        r = subprocess.run(
            [sys.executable, "-m", "console.cli", "serve", str(run.root), "--host", host],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        assert "not a loopback address" in r.stderr and "--allow-remote" in r.stderr
    # the flag without any way to get a token is refused too (a token is always required off loopback)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "console.cli",
            "serve",
            str(run.root),
            "--host",
            "0.0.0.0",
            "--allow-remote",
            "--token-file",
            str(tmp_path / "missing"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "token" in r.stderr


def _need_netns() -> None:
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (ip netns) to make a private network namespace")


@pytest.fixture()
def netns() -> str:
    """A private network namespace with loopback and a veth pair, one end at 10.213.0.1/24."""
    _need_netns()
    name = f"aerie-t{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for cmd in (
            ["ip", "link", "set", "lo", "up"],
            ["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
            ["ip", "addr", "add", "10.213.0.1/24", "dev", "v0"],
            ["ip", "link", "set", "v0", "up"],
            ["ip", "link", "set", "v1", "up"],
        ):
            subprocess.run(["ip", "netns", "exec", name, *cmd], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _http(netns: str, url: str, method: str = "GET", body: str = "", **headers: str) -> tuple[int, str, str]:
    """One request from inside the namespace, following no redirect: (status, Set-Cookie, body head)."""
    code = (
        "import sys, json, http.client, urllib.parse\n"
        "u = urllib.parse.urlsplit(sys.argv[1]); c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)\n"
        "c.request(sys.argv[2], u.path + ('?' + u.query if u.query else ''), body=sys.argv[3] or None, "
        "headers=json.loads(sys.argv[4]))\n"
        "r = c.getresponse(); st, h, b = r.status, r.headers, r.read()\n"
        "print(st); print(h.get('Set-Cookie') or ''); print(b[:200].decode(errors='replace'))\n"
    )
    sent = {k.replace("_", "-"): v for k, v in headers.items()}
    r = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code, url, method, body, json.dumps(sent)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    status, set_cookie, text = (r.stdout.split("\n", 2) + ["", ""])[:3]
    return int(status), set_cookie, text


UPGRADE = {
    "Upgrade": "websocket",
    "Connection": "Upgrade",
    "Sec_WebSocket_Key": "dGhlIHNhbXBsZSBub25jZQ==",
    "Sec_WebSocket_Version": "13",
}


def test_allow_remote_requires_the_token_and_checks_the_host(tmp_path: Path, netns: str) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-for-the-test\n")
    token_file.chmod(0o600)
    port = 8123
    server = start_serve(
        tmp_path, port, "--host", "10.213.0.1", "--allow-remote", "--token-file", str(token_file), netns=netns
    )
    try:
        wait_listening("10.213.0.1", port, server, netns=netns)
        base = f"http://10.213.0.1:{port}"
        form = {"Content_Type": "application/x-www-form-urlencoded"}
        assert _http(netns, f"{base}/ws", **UPGRADE)[0] == 401
        assert _http(netns, f"{base}/session", "POST", "token=wrong", **form)[0] == 401
        status, set_cookie, body = _http(
            netns, f"{base}/session", "POST", "token=s3cret-token-for-the-test", **form
        )
        assert status == 200 and not set_cookie  # a session key for the page to hold, never a cookie
        key = json.loads(body)["session"]
        assert _http(netns, f"{base}/session", X_Aerie_Session=key)[0] == 200
        # DNS rebinding on a specific-address bind: a foreign name for this address is refused on every route,
        # the token or key notwithstanding; the address itself (and its loopback spellings) pass
        for path, extra in (("/", {}), ("/session", {"X_Aerie_Session": key}), ("/static/css/xterm.css", {})):
            status, _, text = _http(netns, f"{base}{path}", Host=f"attacker.example:{port}", **extra)
            assert status == 403 and "is not this server's address" in text, (path, status, text)
            assert _http(netns, f"{base}{path}", Host=f"10.213.0.1:{port}", **extra)[0] == 200, path
        status, _, text = _http(
            netns,
            f"{base}/ws",
            Host=f"10.213.0.2:{port}",
            Authorization="Bearer s3cret-token-for-the-test",
            **UPGRADE,
        )
        assert status == 403 and "is not this server's address" in text
    finally:
        reap(server, {})
    err = (tmp_path / "serve.err").read_text()
    assert "s3cret-token-for-the-test" not in err and key not in err  # never echoed


def test_loopback_needs_the_token_too(tmp_path: Path) -> None:
    """Every account on the machine can reach a loopback port: the token is required there by default."""
    port = free_port()
    server = start_serve(tmp_path, port)
    try:
        wait_listening("127.0.0.1", port, server)
        for url in (f"http://127.0.0.1:{port}/session", f"http://127.0.0.1:{port}/ws"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url, timeout=10)
            assert refused.value.code == 401
        login = urllib.request.Request(f"http://127.0.0.1:{port}/session", data=f"token={TOKEN}".encode())
        with urllib.request.urlopen(login, timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["session"]
    finally:
        reap(server, {})
