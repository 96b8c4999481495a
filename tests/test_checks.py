"""The preflight report every check prints (deep check, SSH preflight, Slurm preflight): one look."""

from __future__ import annotations

from console.ssh.preflight import PreflightReport
from pipeline.eagle3.chain_check import Report as DeepReport
from pipeline.run.hosts.checks import CheckReport


def test_a_report_lists_each_check_with_its_mark_and_fails_on_any_failure() -> None:
    rep = CheckReport("deep check of plan.toml:")
    rep.add("architecture", True, "deepseek_v3, 61 layers")
    rep.add("versions", True, "transformers 5.25.0 was not tested", warning=True)
    assert rep.ok, "a warning is not a failure"
    rep.add("gpu memory", False, "per rank 250 GiB does not fit 141 GiB")
    assert rep.lines() == [
        "deep check of plan.toml:",
        "  ok   architecture deepseek_v3, 61 layers",
        "  warn versions     transformers 5.25.0 was not tested",
        "  FAIL gpu memory   per rank 250 GiB does not fit 141 GiB",
    ]
    assert not rep.ok and rep.failed == ["gpu memory"]
    assert rep.to_dict()["checks"][2] == {
        "name": "gpu memory",
        "ok": False,
        "detail": "per rank 250 GiB does not fit 141 GiB",
        "warning": False,
    }


def test_a_report_of_nothing_is_not_ok() -> None:
    assert not CheckReport("preflight").ok


def test_the_three_preflights_print_the_same_marks() -> None:
    deep, ssh, slurm = (
        DeepReport.of("p.toml"),
        PreflightReport(host="gpu1", remote_dir="/runs"),
        CheckReport("s"),
    )
    for rep in (deep, ssh, slurm):
        rep.add("python", False, "/no/such/python3: not found")
    assert all("  FAIL python" in "\n".join(rep.lines()) for rep in (deep, ssh, slurm))
    assert ssh.lines()[0] == "preflight gpu1:/runs" and "REFUSED: 1 check(s) failed (python)" in ssh.render()
    assert deep.render().endswith("not ok: fix the FAIL lines above")
