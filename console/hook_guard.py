"""Runs one ``[alerts] command`` so that it cannot outlive the console that started it.

``python console/hook_guard.py CONSOLE_PID COMMAND`` (started by :func:`console.alerts.run_hook` as the leader of
a session of its own). It asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), runs
``/bin/sh -c COMMAND`` in its own process group, and when that signal (or SIGHUP) comes it SIGKILLs that group —
itself, the shell and everything the hook started (``curl`` to a webhook that hangs, a ``sleep``) — so a
console SIGKILLed or closed mid-hook leaves nothing behind. Without it the shell and its children were
left running with parent pid 1 (docs/reliability.md, item 6). Its exit status is the hook's.

Standard library only, and run by path: it must start in any environment the console runs in.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: hook_guard.py CONSOLE_PID COMMAND", file=sys.stderr)
        return 2
    parent, command = int(argv[0]), argv[1]
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the console died before the request took effect
        return 1

    def end(signum: int, frame: object) -> None:
        os.killpg(os.getpgid(0), signal.SIGKILL)  # this session's group: only what this hook started

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGHUP, end)
    rc = subprocess.call(["/bin/sh", "-c", command])
    return 128 - rc if rc < 0 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
