"""A real headless Chromium, driven over the DevTools protocol (CDP) with aiohttp's websocket client.

No playwright (it downloads its own browsers; nothing can be downloaded here): the system's
``chromium --headless=new`` with ``--remote-debugging-port=0`` writes the port it chose into
``DevToolsActivePort`` in its profile directory; we attach to its one page and send CDP commands —
navigate, evaluate a JavaScript expression, read the frame tree. A test without Chromium skips, naming it
(``.ci/run`` installs it; under ``AERIE_REQUIRE_ALL=1`` that skip is a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("chromium: not installed (apt-get install chromium; .ci/run installs it)")
    return path


class Chromium:
    """One headless Chromium with a fresh profile (its own cookie jar), in its own process group."""

    def __init__(self, profile: Path) -> None:
        self.profile = profile
        self.proc: subprocess.Popen[bytes] | None = None
        self._http: Any = None
        self._ws: Any = None
        self._id = 0

    async def start(self, timeout: float = 60) -> Chromium:
        import aiohttp

        self.profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                chromium_path(),
                "--headless=new",
                "--no-sandbox",  # the tests may run as root; they load only loopback pages they serve
                "--disable-gpu",
                "--no-first-run",
                "--no-default-browser-check",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.profile.parent / "chromium.err", "wb"),  # noqa: SIM115
            start_new_session=True,
        )
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert self.proc.poll() is None, "chromium exited at start"
            assert time.monotonic() < deadline, "chromium never opened its DevTools port"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        self._http = aiohttp.ClientSession()
        async with self._http.get(f"http://127.0.0.1:{port}/json/list") as resp:
            pages = [t for t in await resp.json() if t["type"] == "page"]
        self._ws = await self._http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        return self

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One CDP command; its result (events that arrive meanwhile are dropped)."""
        self._id += 1
        await self._ws.send_json({"id": self._id, "method": method, "params": params})
        while True:
            msg = json.loads((await self._ws.receive(timeout=60)).data)
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"CDP {method}: {msg['error']}")
                return dict(msg.get("result", {}))

    async def navigate(self, url: str) -> None:
        await self.send("Page.navigate", url=url)

    async def eval(self, expression: str, user_gesture: bool = False) -> Any:
        """``expression``'s value in the page; ``user_gesture`` runs it as if from a click (popups allowed)."""
        result = await self.send(
            "Runtime.evaluate",
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
            userGesture=user_gesture,
        )
        return result.get("result", {}).get("value")

    async def wait_eval(self, expression: str, timeout: float, what: str) -> Any:
        """Poll ``expression`` in the page until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):  # the page may be navigating
                value = await self.eval(expression)
                if value:
                    return value
            await asyncio.sleep(0.25)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    async def close(self, graceful: bool = False) -> None:
        """End the browser: SIGKILL to its group, or with ``graceful`` first ``Browser.close`` (it then writes
        its profile — History and the rest — to disk as a user's browser does when it quits)."""
        if graceful and self._ws is not None and self.proc is not None:
            with contextlib.suppress(Exception):  # the connection drops as the browser exits
                await self.send("Browser.close")
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, 30)
        if self._ws is not None:
            await self._ws.close()
        if self._http is not None:
            await self._http.close()
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group we started, recorded at start
            self.proc.wait(10)
