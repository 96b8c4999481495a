"""The console in a real terminal: ``aerie attach`` inside tmux at 120x40 and 200x50, driven with send-keys.

What the operator sees is read back with ``capture-pane``: the board, a stage paused and resumed
with ``p``, the log viewer opened with ``l`` following the stage's output, and ``q`` leaving the
stage running. tmux runs on a private socket (``-L``) and only that server is killed afterwards.
Without tmux the test is skipped — unless ``AERIE_REQUIRE_TMUX`` is set (CI), where it fails.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.runs import ROOT, kill_run_stages, make_run, start_supervisor, states, stop

TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(
    TMUX is None and not os.environ.get("AERIE_REQUIRE_TMUX"),
    reason="tmux is not installed (Debian: apt-get install tmux); CI sets AERIE_REQUIRE_TMUX=1 so it runs there",
)

WORKER = (
    "import sys, time\nfrom pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "n = int(sys.argv[1])\nfor i in range(n):\n    ctx.safe_point()\n"
    "    ctx.progress(i + 1, n, unit='steps', force=True)\n    print(f'worker step {i + 1}', flush=True)\n"
    "    time.sleep(0.1)\n"
)


class Tmux:
    def __init__(self, tmp: Path) -> None:
        assert TMUX is not None, "AERIE_REQUIRE_TMUX is set but tmux is not installed"
        self.sock = f"aerie-test-{uuid.uuid4().hex[:10]}"
        self.tmp = tmp

    def __call__(self, *args: str) -> str:
        p = subprocess.run(
            [TMUX, "-L", self.sock, "-f", "/dev/null", *args], capture_output=True, text=True, timeout=30
        )
        assert p.returncode == 0, f"tmux {' '.join(args)}: {p.stderr}"
        return p.stdout

    def start(self, command: list[str], env: dict[str, str], size: tuple[int, int] = (120, 40)) -> None:
        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # COLUMNS/LINES may be inherited from the test runner; a stale pair would pin the console to it.
        self(
            "new-session",
            "-d",
            "-s",
            "aerie",
            "-x",
            str(size[0]),
            "-y",
            str(size[1]),
            f"env -u COLUMNS -u LINES {envs} {shlex.join(command)}",
        )
        self("set-option", "-g", "remain-on-exit", "on")

    def screen(self, history: bool = False) -> str:
        """The visible pane; with ``history`` also what scrolled off its top (text printed after the UI ended)."""
        return self("capture-pane", "-p", "-t", "aerie", *(("-S", "-") if history else ()))

    def wait(
        self, pred: Callable[[str], object], what: str, timeout: float = 60.0, history: bool = False
    ) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen(history)
            if pred(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; the screen was:\n{text}")

    def keys(self, *keys: str) -> None:
        self("send-keys", "-t", "aerie", *keys)

    def kill(self) -> None:
        subprocess.run([TMUX, "-L", self.sock, "kill-server"], capture_output=True, timeout=30)


def state_of(screen: str, stage: str) -> str | None:
    for line in screen.splitlines():
        m = re.match(rf"^\s*{re.escape(stage)}\s+(\S+)", line)
        if m:
            return m.group(1)
    return None


@pytest.mark.parametrize("size", [(120, 40), (200, 50)], ids=["120x40", "200x50"])
def test_console_in_tmux_pause_resume_log_and_quit(tmp_path: Path, size: tuple[int, int]) -> None:
    cols, rows = size
    (tmp_path / "w.py").write_text(WORKER)
    run = make_run(
        tmp_path,
        f"""
        [run]
        name = "tmux"
        dir = "run"
        [resources]
        cpu_slots = 2
        [[stage]]
        id = "work"
        command = "{sys.executable} {tmp_path / "w.py"} 3000"
        kill_grace_s = 2
        [[stage]]
        id = "after-work"
        command = "echo done"
        after = ["work"]
    """,
    )
    sup = start_supervisor(run)
    tmux = Tmux(tmp_path)
    env = {
        "PYTHONPATH": str(ROOT),
        "AERIE_CONFIG": str(tmp_path / "none.toml"),
        "AERIE_HOME": str(tmp_path / "home"),
        "TERM": "tmux-256color",
        "COLORTERM": "truecolor",
    }
    try:
        tmux.start([sys.executable, "-m", "console.cli", "attach", str(run.root), "--poll", "0.3"], env, size)
        screen = tmux.wait(
            lambda s: (
                state_of(s, "work") == "running"
                and "%" in s
                and "Pause/resume" in s.rstrip("\n").split("\n")[-1]
                and len(s.rstrip("\n").split("\n")) == rows
            ),
            f"the board at {cols}x{rows} with work running and the footer on the last line",
        )
        assert max(len(x) for x in screen.split("\n")) <= cols
        assert (
            tmux("display", "-p", "-t", "aerie", "#{window_width}x#{window_height}").strip()
            == f"{cols}x{rows}"
        )
        assert state_of(screen, "after-work") == "pending"
        # The detail pane's log, beside the facts, is wide enough to read (it was 15 columns at 120).
        screen = tmux.wait(lambda s: "worker step" in s, "the stage's log tail in the detail pane")
        log_line = next(x for x in screen.split("\n") if "│worker step" in x)
        assert cols - log_line.index("│worker step") - 1 >= 70, log_line

        tmux.keys("p")
        tmux.wait(lambda s: state_of(s, "work") == "paused", "work paused on screen")
        assert states(run)["work"] == "paused"
        tmux.keys("p")
        tmux.wait(lambda s: state_of(s, "work") == "running", "work running again")

        tmux.keys("l")
        screen = tmux.wait(
            lambda s: "stages/work/stage.log" in s and "FOLLOW" in s and "worker step" in s,
            "the log viewer following the stage",
        )
        step = max(int(n) for n in re.findall(r"worker step (\d+)", screen))
        tmux.wait(
            lambda s: max(map(int, re.findall(r"worker step (\d+)", s) or [0])) > step, "new lines followed"
        )
        tmux.keys("Up")
        tmux.wait(lambda s: "paused" in s.splitlines()[-2], "follow paused by scrolling up")
        tmux.keys("Escape")
        tmux.wait(lambda s: state_of(s, "work") == "running", "back on the board")

        tmux.keys("q")
        tmux.wait(
            lambda s: "Aerie console closed; the run keeps going." in s, "the quit message", history=True
        )
        assert states(run)["work"] == "running", "quitting the console leaves the stage running"
    finally:
        tmux.kill()
        stop(sup)
        kill_run_stages(run)
