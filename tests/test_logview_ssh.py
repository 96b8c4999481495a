"""The log viewer's model over SSH: a real loopback sshd, the uploaded pipeline, the remote agent.

The stage log lives on the "remote" host; the index counts and the searches run there (the
agent's ``lines``/``find`` requests on the one channel) and only the requested lines come back.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from console.logindex import LogFilter, LogIndex
from console.ssh.transport import SshTransport
from tests.test_ssh import bootstrap

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh, pytest.mark.slow]

TALKER = (
    "import time\nfor i in range(200_000):\n    print(f'remote line {i}' + (' ERROR boom' if i == 150_000 else ''))\n"
    "print('done', flush=True)\ntime.sleep(60)\n"
)


async def test_remote_log_indexed_read_and_searched_on_the_host(ssh_plan, fast_conn, tmp_path: Path) -> None:
    script = tmp_path / "talk.py"
    script.write_text(TALKER)
    plan = ssh_plan(f'[[stage]]\nid = "talk"\ncommand = "{sys.executable} {script}"\nkill_grace_s = 1\n')
    async with fast_conn() as conn:
        transport: SshTransport = await bootstrap(plan, conn)
        ix = LogIndex(transport, "stages/talk/stage.log")
        deadline = time.monotonic() + 120
        while True:
            await ix.update()
            if ix.caught_up and ix.lines >= 200_003:  # the launcher's two banner lines, the lines, "done"
                break
            assert time.monotonic() < deadline, (
                f"remote log never complete: {ix.lines} lines, {ix.size} bytes"
            )
            await asyncio.sleep(0.2)
        rows = await ix.read_lines(ix.lines - 1, 1)
        assert rows[0].text == "done"
        first = next(r.line for r in await ix.read_lines(0, 5) if r.text == "remote line 0")
        rows = await ix.read_lines(first + 123_456, 2)
        assert [r.text for r in rows] == ["remote line 123456", "remote line 123457"]
        f = LogFilter(ix, "ERROR")
        while not f.done:
            await f.update()
        assert f.count == 1 and f.lines[0] == first + 150_000
        assert (await f.read_rows(0, 1))[0].text == "remote line 150000 ERROR boom"
        back = await transport.find_lines(
            ix.path,
            "remote line 1000$",
            0,
            await ix.line_start(first + 5000),
            first + 5000,
            backward=True,
            limit=1,
        )
        assert back["hits"][0][0] == first + 1000
        assert conn.sessions_in_use == 1, "everything went through the agent's one channel"
        await transport.close()
