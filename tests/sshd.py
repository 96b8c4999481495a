"""A real OpenSSH ``sshd`` on loopback for tests and benchmarks (no mocks, no system sshd touched).

:class:`LoopbackSshd` generates its own host key and a client key authorised for the current user,
writes a private ``sshd_config`` and runs ``sshd -D -e -f CONFIG -p PORT`` bound to 127.0.0.1. It is
stopped by its own pid; :meth:`LoopbackSshd.drop` also ends the per-connection sshd processes
descended from it (found by walking ``/proc`` from our pid, never by name), so existing client
connections really break — stopping only the listener would leave them open.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def sshd_available() -> str | None:
    """None when a loopback sshd can run here, else why not (for ``pytest.skip``)."""
    if not Path(SSHD).is_file():
        return "OpenSSH server not installed (apt-get install openssh-server)"
    if not shutil.which("ssh-keygen"):
        return "ssh-keygen not installed (apt-get install openssh-client)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str = "aerie-test") -> Path:
    """A fresh ed25519 key pair at ``path`` / ``path.pub``."""
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rfind(")") + 2 :].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


class LoopbackSshd:
    """One private sshd on 127.0.0.1; :meth:`start`, :meth:`drop` (kill it and its connections), restart."""

    def __init__(
        self,
        root: Path,
        port: int | None = None,
        max_sessions: int | None = None,
        listen: str = "127.0.0.1",
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """``listen``/``netns``: bind another address, inside a network namespace the caller made
        (``nsenter --net=/run/netns/NETNS sshd ...``), e.g. behind an impaired veth link (tests/test_ssh_badlink.py).
        ``env``: variables every session gets (sshd's ``SetEnv``), as a login node's profile would set them."""
        self.root = Path(root)
        self.env = dict(env or {})
        self.listen, self.netns = listen, netns
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.max_sessions = max_sessions
        self.user = os.environ.get("USER") or _username()
        self.host_key = keygen(self.root / "host_ed25519", "aerie-test-host")
        self.client_key = keygen(self.root / "client_ed25519", "aerie-test-client")
        self.authorized = self.root / "authorized_keys"
        self.authorized.write_text(self.client_key.with_suffix(".pub").read_text())
        self.config = self.root / "sshd_config"
        self.log = self.root / "sshd.log"
        self.proc: subprocess.Popen | None = None
        self._write_config()

    def _write_config(self) -> None:
        lines = [
            f"ListenAddress {self.listen}",
            f"HostKey {self.host_key}",
            f"PidFile {self.root / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized}",
            "PermitRootLogin prohibit-password",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "StrictModes no",
            "UsePAM no",
            "Subsystem sftp internal-sftp",
            "LogLevel ERROR",
        ]
        if self.max_sessions is not None:
            lines.append(f"MaxSessions {self.max_sessions}")
        if self.env:
            lines.append("SetEnv " + " ".join(f"{k}={v}" for k, v in self.env.items()))
        self.config.write_text("\n".join(lines) + "\n")

    # ------------------------------------------------------------------------------------------
    def host_pubkey(self) -> str:
        return " ".join(self.host_key.with_suffix(".pub").read_text().split()[:2])

    def known_hosts_line(self) -> str:
        return f"[{self.listen}]:{self.port} {self.host_pubkey()}\n"

    def write_known_hosts(self, path: Path) -> Path:
        path.write_text(self.known_hosts_line())
        return path

    def new_host_key(self) -> None:
        """Replace the host key (a rebuilt container); takes effect at the next :meth:`start`."""
        keygen(self.host_key, "aerie-test-host-rebuilt")

    def ssh_config(self, path: Path, alias: str, known_hosts: Path) -> Path:
        """An OpenSSH client config with ``alias`` pointing here (as an operator's ~/.ssh/config would)."""
        path.write_text(
            f"Host {alias}\n  HostName 127.0.0.1\n  Port {self.port}\n  User {self.user}\n"
            f"  IdentityFile {self.client_key}\n  UserKnownHostsFile {known_hosts}\n"
        )
        return path

    def ssh_argv(self, known_hosts: Path) -> list[str]:
        """The OpenSSH client command line that reaches this server (for baselines)."""
        return [
            "ssh",
            "-p",
            str(self.port),
            "-i",
            str(self.client_key),
            "-o",
            f"UserKnownHostsFile={known_hosts}",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "IdentitiesOnly=yes",
            f"{self.user}@{self.listen}",
        ]

    # ------------------------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        with contextlib.suppress(PermissionError):  # not root: sshd says itself if it needs it
            Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation dir sshd insists on
        logfh = open(self.log, "ab")  # noqa: SIM115
        try:
            # nsenter execs sshd (same pid; `ip netns exec` would fork and stand in between)
            prefix = ["nsenter", f"--net=/run/netns/{self.netns}"] if self.netns else []
            self.proc = subprocess.Popen(
                [*prefix, SSHD, "-D", "-e", "-f", str(self.config), "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=logfh,
                stderr=subprocess.STDOUT,
            )
        finally:
            logfh.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection((self.listen, self.port), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.listen}:{self.port} within {timeout_s}s")

    def drop(self) -> None:
        """Stop the server *and* every connection it serves, as a reboot or network cut would.

        The listener's pid is ours; the per-connection sshd processes are its descendants (found
        through ``/proc`` parent links from that pid) whose executable is sshd. Shells and programs
        started by those sessions are not signalled: they see their channel close, as in real life.
        """
        if self.proc is None:
            return
        master = self.proc.pid
        victims: list[int] = []
        frontier = [master]
        while frontier:
            pid = frontier.pop()
            for child in _children(pid):
                if _exe(child) == _exe(master) or _exe(child).endswith("/sshd"):
                    victims.append(child)
                    frontier.append(child)
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def _username() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
