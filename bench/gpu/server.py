"""The SGLang server wrapper: start one with the serve stage's own argv (``sglang_argv``) and SGLang's site folder
first on ``PYTHONPATH``, wait until ``/health`` answers (a dead server fails at once with its log tail; a silent
one gets a py-spy dump of every process), read its ``/metrics``, and stop it by its own recorded process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.gpu.results import RESULTS
from bench.gpu.runner import BASE, OUT, PIDS, SITE, log, track
from pipeline.serving.sglang_args import ServerSettings, sglang_argv


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except Exception:
        return 0, b""


def http_post(url: str, body: dict, timeout: float = 600) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metrics_at(url: str) -> dict[str, float]:
    """The server's ``sglang:*`` Prometheus counters, summed over their labels."""
    st, raw = http_get(f"{url}/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("sglang:") and " " in line:
            key, val = line.rsplit(" ", 1)
            base = key.split("{", 1)[0]
            with contextlib.suppress(ValueError):
                out[base] = out.get(base, 0.0) + float(val)
    return out


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out += _tree(int(k))
    return out


def _pyspy(pid: int, name: str, tag: str) -> None:
    spy = SITE / "bin" / "py-spy"
    with (OUT / f"pyspy_{name}.txt").open("a") as f:
        f.write(f"==== {tag}\n")
        for p in _tree(pid):
            f.flush()
            subprocess.run(
                [str(spy), "dump", "--pid", str(p)], stdout=f, stderr=subprocess.STDOUT, timeout=30
            )


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(SITE),
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        SGLANG_DISABLE_REQUEST_LOGGING="1",
        SGLANG_TORCH_PROFILER_DIR=str(BASE / "prof"),
    )
    return env


class Server:
    """One SGLang server, healthy once constructed; its argv is kept in ``RESULTS['argv'][name]``."""

    def __init__(self, name: str, settings: ServerSettings, start_timeout: float, dump_after: float) -> None:
        self.name, self.s = name, settings
        argv = sglang_argv(settings, python=sys.executable)
        RESULTS.setdefault("argv", {})[name] = argv
        self.log_path = OUT / f"server_{name}.log"
        self.logf = self.log_path.open("w")
        log(f"{name}: {' '.join(argv)}")
        self.t0 = time.monotonic()
        self.p = track(
            subprocess.Popen(
                argv,
                env=server_env(),
                stdout=self.logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd="/tmp",
            )
        )
        PIDS.write_text(str(self.p.pid))
        self._wait_healthy(start_timeout, dump_after)
        self.start_s = time.monotonic() - self.t0
        log(f"{name}: healthy after {self.start_s:.0f} s")

    def _wait_healthy(self, start_timeout: float, dump_after: float) -> None:
        dumped = False
        while True:
            if self.p.poll() is not None:
                self.logf.flush()
                print(self.log_path.read_text()[-4000:])
                raise RuntimeError(
                    f"{self.name}: server exited with {self.p.returncode} before /health answered"
                )
            st, _ = http_get(f"{self.s.url}/health", timeout=2)
            if st == 200:
                return
            el = time.monotonic() - self.t0
            if el > dump_after and not dumped:
                dumped = True
                log(f"{self.name}: no /health after {el:.0f} s: py-spy dump to pyspy_{self.name}.txt")
                _pyspy(self.p.pid, self.name, f"{el:.0f} s")
            if el > start_timeout:
                _pyspy(self.p.pid, self.name, f"timeout {el:.0f} s")
                self.stop()
                raise RuntimeError(f"{self.name}: no /health after {start_timeout:.0f} s")
            time.sleep(1)

    def generate(self, body: dict) -> Any:
        return http_post(f"{self.s.url}/generate", body)

    def metrics(self) -> dict[str, float]:
        return metrics_at(self.s.url)

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=30)
        self.logf.close()
        PIDS.unlink(missing_ok=True)
