"""A private network link for tests and benchmarks: sshd in a network namespace behind a veth pair.

:class:`BadLink` creates a namespace ``aerie-l<id>`` and a veth pair: one end stays in this (root)
namespace with ``10.219.<n>.1/30``, the other moves into the namespace with ``10.219.<n>.2/30``. Traffic
between the two addresses crosses only that pair — never a real network. On it:

* :meth:`impair` applies ``tc netem`` (delay, jitter, loss) to both directions — when the kernel has
  ``sch_netem``; :attr:`netem_error` says why not otherwise;
* :meth:`cut` / :meth:`restore` take the namespace's end down and up again: packets from this side are
  then silently dropped (no carrier), which is what a dead Wi-Fi link looks like to TCP.

Needs root and iproute2 (``ip``); :func:`badlink_unavailable` says why not, for ``pytest.skip``.
Not a test module.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess


def badlink_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create a network namespace and a veth pair"
    if not shutil.which("ip") or not shutil.which("nsenter"):
        return "needs iproute2 (ip) and util-linux (nsenter)"
    return None


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, check=check)


class BadLink:
    def __init__(self) -> None:
        tag = f"{random.randrange(1 << 24):06x}"
        self.ns = f"aerie-l{tag}"
        self.outer, self.inner = f"aer{tag}a", f"aer{tag}b"
        n = random.randrange(1, 250)
        self.local, self.remote = f"10.219.{n}.1", f"10.219.{n}.2"
        self.netem_error: str | None = None
        self.impairment: str | None = None

    def __enter__(self) -> BadLink:
        _ip("netns", "add", self.ns)
        try:
            _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            _ip("link", "set", self.inner, "netns", self.ns)
            _ip("addr", "add", f"{self.local}/30", "dev", self.outer)
            _ip("addr", "add", f"{self.remote}/30", "dev", self.inner, ns=self.ns)
            _ip("link", "set", self.outer, "up")
            _ip("link", "set", self.inner, "up", ns=self.ns)
            _ip("link", "set", "lo", "up", ns=self.ns)
        except subprocess.CalledProcessError:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        _ip("link", "del", self.outer, check=False)  # removes its peer too
        _ip("netns", "del", self.ns, check=False)

    def impair(self, delay_ms: int = 150, jitter_ms: int = 30, loss_pct: float = 2.0) -> bool:
        """netem on both ends; False (and :attr:`netem_error`) when this kernel has no netem."""
        spec = ["delay", f"{delay_ms}ms", f"{jitter_ms}ms", "loss", f"{loss_pct:g}%"]
        for dev, ns in ((self.outer, None), (self.inner, self.ns)):
            r = subprocess.run(
                ["tc", *(["-n", ns] if ns else []), "qdisc", "replace", "dev", dev, "root", "netem", *spec],
                capture_output=True,
                text=True,
            )
            if r.returncode != 0:
                self.netem_error = (
                    f"tc netem is not available here ({r.stderr.strip() or r.returncode}): the "
                    "kernel lacks sch_netem"
                )
                return False
        self.impairment = f"netem delay {delay_ms} ms ± {jitter_ms} ms, loss {loss_pct:g} % each way"
        return True

    def cut(self) -> None:
        _ip("link", "set", self.inner, "down", ns=self.ns)

    def restore(self) -> None:
        _ip("link", "set", self.inner, "up", ns=self.ns)
