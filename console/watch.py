"""``aerie watch RUN``: a headless notifier that follows a run's alert records from anywhere and runs the user's
own hooks — for a container that cannot reach the team's webhook, or a page to a laptop's own notifier.

RUN is a local run directory or ``ssh://[user@]host[:port]/path`` (the console's SSH transport: one connection,
kept alive, re-established after a drop). It reads ``RUN/alerts.jsonl`` (:class:`~console.alert_feed.AlertFeed`)
every ``--poll`` seconds and, for each record with an id above the last one it delivered, in id order:
records that id as delivered (``$AERIE_HOME/watch/<run>.json``, written atomically), prints a line, then runs
each hook (``--command``, else the user's config ``[alerts] command``) with the alert in ``AERIE_ALERT_*``,
bounded by ``--timeout`` (:func:`pipeline.run.alerts.hooks.run_hook`: the runner the executing host uses). The
id is recorded *before* the hooks run, so a record is never delivered twice — not across a dropped connection
(the read resumes where it was), nor across a restarted ``aerie watch`` (it resumes after the recorded id); a
watcher killed in the middle of a hook does not run that hook again. Exit 0 with ``--until-done`` once the run has
finished and every record is delivered; otherwise it runs until interrupted (``systemd --user`` or tmux:
docs/operating.md, "Paged when it goes wrong").
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TextIO

from console.alert_feed import AlertFeed
from console.transport import Transport
from pipeline.run.alerts.hooks import hook_env, run_hook
from pipeline.run.alerts.record import AlertRecord
from pipeline.run.projection.text import span
from pipeline.run.rundir.layout import write_atomic

RETRY_S = (
    1.0,
    10.0,
)  # a failed read waits this long (doubling from the first to the second), then tries again


class Delivered:
    """The last alert id delivered for one run, persisted (one small JSON file per run under AERIE_HOME)."""

    def __init__(self, home: Path, run_key: str) -> None:
        digest = hashlib.sha256(run_key.encode()).hexdigest()[:16]
        self.path = home / "watch" / f"{digest}.json"
        self.run_key = run_key
        try:
            raw = json.loads(self.path.read_text())
            self.last_id = int(raw.get("last_id", 0)) if raw.get("run") == run_key else 0
        except (OSError, ValueError, AttributeError):
            self.last_id = 0

    def mark(self, alert_id: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.last_id = alert_id
        doc = {"run": self.run_key, "last_id": alert_id, "t": round(time.time(), 3)}
        write_atomic(self.path, json.dumps(doc) + "\n")


class Watch:
    def __init__(
        self,
        transport: Transport,
        delivered: Delivered,
        hooks: list[str],
        timeout_s: float,
        out: TextIO = sys.stdout,
    ) -> None:
        self.transport, self.delivered, self.hooks, self.timeout_s, self.out = (
            transport,
            delivered,
            hooks,
            timeout_s,
            out,
        )
        self.feed = AlertFeed()
        self.run_label = delivered.run_key
        self.done = False  # the run's state.json says it finished
        self.down_since: float | None = None

    def say(self, text: str) -> None:
        self.out.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.out.flush()

    async def poll(self) -> bool:
        """Read what is new; False when the run could not be read (said once per outage)."""
        try:
            await self.feed.load(self.transport)  # once: the first read takes the rotated generations too
            res = await self.transport.read_many(
                [self.feed.read_request(), ("state.json", 0)], max_bytes=4 << 20
            )
        except Exception as exc:  # noqa: BLE001 - a dropped connection: said, then tried again
            if self.down_since is None:
                self.down_since = time.monotonic()
                self.say(f"cannot read the run ({type(exc).__name__}: {exc}); retrying")
            return False
        if self.down_since is not None:
            self.say(f"reading the run again after {span(time.monotonic() - self.down_since)}")
            self.down_since = None
        alerts, state = res
        self.feed.ingest(alerts.data, alerts.size, alerts.ino)
        try:
            self.done = bool(json.loads(state.data or b"{}").get("done")) if state.size >= 0 else False
        except ValueError:
            self.done = False
        return True

    async def deliver_new(self) -> int:
        """Deliver every record above the last delivered id, in id order; how many."""
        todo = sorted(i for i in self.feed.book if i > self.delivered.last_id)
        for rid in todo:
            rec = self.feed.book[rid]
            self.delivered.mark(rid)  # first: never twice, whatever happens to this process next
            self.say(f"alert #{rid} {rec.kind} {rec.stage or '-'}: {rec.text}")
            for cmd in self.hooks:
                await self._hook(cmd, rec)
        return len(todo)

    async def _hook(self, cmd: str, rec: AlertRecord) -> None:
        try:
            res = await asyncio.to_thread(run_hook, cmd, hook_env(rec, self.run_label), self.timeout_s)
        except OSError as exc:
            self.say(f"  hook `{cmd}` could not start: {exc}")
            return
        how = "timed out (killed)" if res.rc is None else f"exit {res.rc}"
        self.say(f"  hook `{cmd}`: {how} in {res.duration_s:.1f}s" + (f": {res.output}" if res.rc else ""))


async def watch(w: Watch, poll_s: float, until_done: bool, max_s: float | None = None) -> int:
    """Follow until interrupted (or, ``until_done``, until the run finished and everything was delivered)."""
    start, wait = time.monotonic(), RETRY_S[0]
    while True:
        if await w.poll():
            wait = RETRY_S[0]
            await w.deliver_new()
            if until_done and w.done:
                w.say(f"the run finished; {len(w.feed.book)} alert(s), last delivered #{w.delivered.last_id}")
                return 0
            await asyncio.sleep(poll_s)
        else:
            await asyncio.sleep(wait)
            wait = min(RETRY_S[1], wait * 2)
        if max_s is not None and time.monotonic() - start > max_s:
            w.say(f"stopped after {max_s:g}s")
            return 1


async def run_watch(
    transport: Transport,
    run_key: str,
    home: Path,
    hooks: list[str],
    timeout_s: float,
    poll_s: float,
    until_done: bool,
) -> int:
    delivered = Delivered(home, run_key)
    w = Watch(transport, delivered, hooks, timeout_s)
    w.say(
        f"watching {run_key}: alerts after #{delivered.last_id}; "
        + (f"{len(hooks)} hook(s) per alert" if hooks else "no hook configured: printing only")
    )
    try:
        return await watch(w, poll_s, until_done)
    finally:
        await transport.close()
