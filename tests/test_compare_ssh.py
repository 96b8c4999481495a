"""``aerie attach RUN --compare ssh://host/path``: the other run read over SSH (a real sshd on 127.0.0.1, reached
through a ~/.ssh/config alias as an operator writes it), its curve there for the metrics view."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from console.compare import CompareError, OtherRun, open_other
from tests.test_ssh_cli import aerie, alias_plan, home  # noqa: F401 (fixtures: the alias, a run over SSH)

TRAIN = (
    "from pipeline.run.stage_side.runtime import StageContext\nctx = StageContext.from_env()\n"
    "for step in range(0, 2001, 100):\n    ctx.metric('loss', 3.0 - 2.1 * step / 2000, step=step)\nctx.close()\n"
)

pytest_plugins = ["conftest_ssh"]
pytestmark = [pytest.mark.ssh, pytest.mark.slow]


async def _read(other: OtherRun) -> float | None:
    try:
        for _ in range(3):
            await other.refresh()
        st = other.model.stages.get("train")
        s = st.history.get("loss") if st else None
        return s.last if s is not None and len(s) else None
    finally:
        await other.model.transport.close()


def test_compare_with_a_run_over_ssh(alias_plan, tmp_path: Path) -> None:  # noqa: ANN001, F811
    import sys

    (tmp_path / "train.py").write_text(TRAIN)
    plan, remote = alias_plan(
        f'[[stage]]\nid = "train"\ncommand = "{sys.executable} {tmp_path / "train.py"}"\n'
    )
    p = aerie("run", str(plan), "--headless", "--poll", "0.2")
    assert p.returncode == 0, p.stdout + p.stderr
    url = f"ssh://aerie-box{remote}"
    other = open_other(url)
    assert other.root == url
    assert asyncio.run(_read(other)) == pytest.approx(0.9), "the other run's loss, read over SSH"
    assert other.model.run_name == "cli"

    with pytest.raises(CompareError, match="cannot open that run over SSH"):
        open_other(f"ssh://aerie-box{tmp_path / 'nowhere'}")


async def test_inside_the_console_an_ssh_compare_says_where_to_ask_for_it() -> None:
    with pytest.raises(CompareError, match="aerie attach RUN --compare ssh://h/r"):
        open_other("ssh://h/r")
