"""The console's executor seam (console/executors.py): the one place that reads ``[executor] kind``.

Checks that no other console module compares an executor kind against a kind's name, that the seam answers
for local, ssh and slurm plans (with and without a host) as the console behaved before it, and that the
commands follow its answers.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from console import cli, executors
from console.ssh import preflight
from pipeline.run.plan import dag as plan_mod
from tests.runs import ROOT, write_plan

# Names an executor kind goes by in the console: the plan's ``executor.kind``, the run snapshot's ``executor``.
KIND_NAMES = {"kind", "executor", "executor_kind"}


def _names_a_kind(node: ast.expr) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return name in KIND_NAMES


def _kind_literal(node: ast.expr) -> bool:
    """A string constant naming an executor kind, or a tuple, list or set holding one."""
    if isinstance(node, ast.Constant):
        return node.value in plan_mod.EXECUTOR_KINDS
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_kind_literal(e) for e in node.elts)
    return False


def kind_comparisons(source: str) -> list[int]:
    """The lines of ``source`` comparing an executor kind against a kind's name."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_kind(s) for s in sides) and any(_kind_literal(s) for s in sides):
                hits.append(node.lineno)
    return sorted(hits)


def test_the_finder_flags_kind_comparisons_and_only_those() -> None:
    flagged = """
if plan.executor.kind == "ssh" or plan.executor.host: pass
if ex.kind not in ("ssh", "slurm"): pass
tel = t if model.executor != "slurm" else None
if "local" == kind: pass
"""
    assert kind_comparisons(flagged) == [2, 3, 4, 5]
    spared = """
if alert.kind in ("stage-failed", "disk"): pass
if a.kind == FORCED: pass
if kind == "gpu": pass
if ex.host == "slurm-login": pass
"""
    assert kind_comparisons(spared) == []


def test_no_console_module_but_the_seam_compares_an_executor_kind() -> None:
    seam = ROOT / "console" / "executors.py"
    bad = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "console").rglob("*.py"))
        if path != seam
        for line in kind_comparisons(path.read_text())
    ]
    assert not bad, "ask console/executors.py instead: " + ", ".join(bad)


def test_the_seam_knows_every_kind_a_plan_may_name() -> None:
    assert set(executors.TRAITS) == set(plan_mod.EXECUTOR_KINDS)
    for t in executors.TRAITS.values():
        assert set(t.host_checks) <= set(preflight.HOST_CHECKS)  # every check it names is implemented
        assert t.local_preflight is None or importlib.util.find_spec(t.local_preflight) is not None


def plan(tmp_path: Path, executor: str) -> plan_mod.Plan:
    path = write_plan(
        tmp_path,
        f"""
        [run]
        dir = "run"
        [executor]
        {executor}
        [[stage]]
        id = "prep"
        command = "true"
        """,
    )
    return plan_mod.load(path)


PLANS = {
    "local": 'kind = "local"',
    "ssh": 'kind = "ssh"\nhost = "gpu-box"\nremote_dir = "/srv/run"',
    "slurm here": 'kind = "slurm"',
    "slurm over ssh": 'kind = "slurm"\nhost = "login"\nremote_dir = "/shared/run"',
}
# name -> (over ssh, the ssh host, the module `aerie preflight` runs here, checks the kind adds to the ssh
# preflight (run only where there is a host), the supervisor's GPU samples are the stages')
EXPECTED = {
    "local": (False, None, "pipeline.serving.local_preflight", (), True),
    "ssh": (True, "gpu-box", None, (), True),
    "slurm here": (False, None, "pipeline.run.hosts.slurm.preflight", ("slurm",), False),
    "slurm over ssh": (True, "login", None, ("slurm",), False),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_seam_answers_for_each_kind(tmp_path: Path, name: str) -> None:
    ex = plan(tmp_path, PLANS[name]).executor
    got = (
        executors.uses_ssh_transport(ex),
        executors.ssh_host(ex),
        executors.local_preflight_module(ex),
        executors.host_preflight_checks(ex),
        executors.gpu_telemetry_applies(ex.kind),
    )
    assert got == EXPECTED[name]


def test_a_kind_the_console_does_not_know_reads_as_local() -> None:
    assert executors.traits("kubernetes") == executors.traits("local")
    assert executors.gpu_telemetry_applies("kubernetes")


@pytest.mark.parametrize("name", sorted(PLANS))
def test_aerie_run_starts_where_the_seam_says(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    monkeypatch.setattr(cli, "_start_remote", lambda p: started.append("ssh") or 2)
    monkeypatch.setattr(
        cli, "start_local_run", lambda *a: started.append("local") or (0, str(tmp_path / "run"), "")
    )
    cli._start(plan(tmp_path, PLANS[name]).path, None)
    assert started == ["ssh" if EXPECTED[name][0] else "local"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_aerie_preflight_runs_the_kinds_own_program_here_only_without_a_host(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[list[str]] = []

    def fake_run(argv: list[str], **kw: object) -> subprocess.CompletedProcess:
        ran.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr("console.ssh.commands.cmd_preflight", lambda args: ran.append(["ssh"]) or 0)
    path = plan(tmp_path, PLANS[name]).path
    assert cli.main(["preflight", str(path)]) == 0
    module = EXPECTED[name][2]
    assert ran == ([[sys.executable, "-m", module, str(path)]] if module else [["ssh"]])
