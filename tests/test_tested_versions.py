"""The tested-versions table (pipeline/tested_versions.py): the verdicts on an installed SGLang stack, the deep
check's ``sglang`` line, and that the locks, pyproject and docs say what the table says."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from pipeline import tested_versions as tv
from pipeline.eagle3 import chain_check
from pipeline.run.plan import dag as plan_mod

ROOT = Path(__file__).resolve().parent.parent
TESTED = next(s for s in tv.SGLANG_STACKS if s.status == tv.TESTED_STATUS)
BROKEN = next(s for s in tv.SGLANG_STACKS if s.status == tv.KNOWN_BROKEN)


def host(
    sglang: str | None, torch: str | None = None, transformers: str | None = None, kernel: str | None = None
):
    row = tv.stack_of(sglang) if sglang else None
    have = {
        "sglang": sglang,
        "torch": torch or (row.torch + "+cu130" if row else "2.11.0"),
        "transformers": transformers or (row.transformers if row else "5.8.1"),
        "sglang-kernel": kernel or (row.sglang_kernel if row else None),
    }
    return have.get


def test_the_stack_that_ran_passes_and_names_every_package() -> None:
    v = tv.classify_sglang(("serve", "capture"), host(TESTED.sglang))
    assert v.level == "ok" and v.ok and not v.warning
    assert f"SGLang {TESTED.sglang}" in v.detail and f"torch {TESTED.torch}+cu130" in v.detail
    assert f"sglang-kernel {TESTED.sglang_kernel}" in v.detail and "tested" in v.detail


def test_a_tested_sglang_beside_another_torch_or_transformers_warns_naming_both() -> None:
    v = tv.classify_sglang(("capture",), host(TESTED.sglang, torch="2.13.0+cpu", transformers="5.17.0"))
    assert v.level == "warn" and v.ok and v.warning
    assert f"torch 2.13.0+cpu (ran with {TESTED.torch})" in v.detail
    assert f"transformers 5.17.0 (ran with {TESTED.transformers})" in v.detail
    assert "constraints-gpu.txt" in v.detail


def test_an_unknown_release_warns_and_a_known_broken_one_refuses_what_it_breaks() -> None:
    v = tv.classify_sglang(("serve",), host("0.6.0"))
    assert v.level == "warn" and "SGLang 0.6.0 is not a release Aerie was tested with" in v.detail
    assert TESTED.sglang in v.detail
    refused = tv.classify_sglang(("capture", "serve"), host(BROKEN.sglang))
    assert refused.level == "refuse" and not refused.ok
    assert (
        f"SGLang {BROKEN.sglang} is known broken for capture" in refused.detail
        and BROKEN.why in refused.detail
    )
    served = tv.classify_sglang(("serve",), host(BROKEN.sglang))
    assert served.level == "warn" and served.ok and f"untested for serve: {BROKEN.why}" in served.detail
    absent = tv.classify_sglang(("serve",), host(None))
    assert (
        absent.level == "absent"
        and "not installed" in absent.detail
        and "constraints-gpu.txt" in absent.detail
    )


def _plan(tmp_path: Path, engine: str, stages: str) -> plan_mod.Plan:
    p = tmp_path / "plan.toml"
    p.write_text(
        f'[run]\nname = "v"\ndir = "run"\n[target]\nmodel = "{tmp_path}/none"\nengine = "{engine}"\n' + stages
    )
    return plan_mod.load(p)


EXTRACT = '[[stage]]\nid = "extract"\nrun = "extract"\n'
SERVE = '[[stage]]\nid = "serve"\nrun = "serve"\nservice = true\n'


def test_what_a_plan_asks_of_sglang(tmp_path: Path) -> None:
    assert tv.sglang_uses(_plan(tmp_path, "transformers", EXTRACT)) == set()
    assert tv.sglang_uses(_plan(tmp_path, "sglang", EXTRACT)) == {"capture"}
    assert tv.sglang_uses(_plan(tmp_path, "transformers", EXTRACT + SERVE)) == {"serve"}


@pytest.mark.parametrize("stack", [TESTED, BROKEN], ids=lambda s: s.sglang)
def test_the_deep_check_reports_the_installed_sglang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stack: tv.SGLangStack
) -> None:
    monkeypatch.setattr(tv, "installed", host(stack.sglang))
    plan = _plan(tmp_path, "sglang", EXTRACT)
    rep = chain_check.check(plan, free_bytes=10**12)
    line = next(c for c in rep.checks if c.name == "sglang")
    if stack is TESTED:
        assert line.ok and not line.warning and f"SGLang {stack.sglang}" in line.detail
    else:
        assert not line.ok and line.detail.startswith(f"{plan.path}: SGLang {stack.sglang} is known broken")
    monkeypatch.setattr(tv, "installed", host(None))
    line = next(c for c in chain_check.check(plan, free_bytes=10**12).checks if c.name == "sglang")
    assert line.ok and line.warning and "aerie preflight checks it there" in line.detail
    assert not [
        c for c in chain_check.check(_plan(tmp_path, "transformers", EXTRACT)).checks if c.name == "sglang"
    ]


def _pins(path: Path) -> dict[str, str]:
    return dict(re.findall(r"^([a-z0-9-]+)==(\S+)$", path.read_text(), re.M))


def test_the_gpu_lock_pins_a_stack_that_ran_and_the_extras_carry_ranges_only() -> None:
    gpu = _pins(ROOT / "constraints-gpu.txt")
    row = tv.stack_of(gpu["sglang"])
    assert row is not None and row.status == tv.TESTED_STATUS, (
        f"constraints-gpu.txt pins sglang {gpu['sglang']}"
    )
    assert (gpu["torch"], gpu["transformers"], gpu["sglang-kernel"]) == (
        row.torch,
        row.transformers,
        row.sglang_kernel,
    )
    assert _pins(ROOT / "constraints.txt")["torch"] == "2.13.0"  # the CPU lock: the README's install
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    exact = [r for name in ("pipeline", "gpu") for r in extras[name] if "==" in r]
    assert not exact, f"exact pins belong in the locks, not the extras: {exact}"


def test_the_docs_carry_the_table_as_the_module_has_it() -> None:
    assert tv.markdown_table() in (ROOT / "docs" / "operating.md").read_text(), (
        "docs/operating.md's tested-versions table differs from pipeline/tested_versions.py; paste "
        "`python -c 'from pipeline.tested_versions import markdown_table; print(markdown_table())'`"
    )


@pytest.mark.parametrize("release", ["0.5.23.post1", "0.5.24", "0.6.0"])
def test_a_release_newer_than_the_last_tested_is_refused_for_capture_unless_the_plan_allows_it(
    tmp_path: Path, release: str
) -> None:
    v = tv.classify_sglang(("capture",), host(release))
    assert v.level == "refuse" and not v.ok
    assert (
        f"SGLang {release} is newer than the last release Aerie was tested with ({TESTED.sglang})" in v.detail
    )
    assert "target.allow_untested_sglang = true" in v.detail  # the refusal names the key that allows it
    allowed = tv.classify_sglang(("capture",), host(release), allow_untested=True)
    assert allowed.level == "warn" and "allowed by target.allow_untested_sglang" in allowed.detail
    assert tv.classify_sglang(("serve",), host(release)).level == "warn"  # serving only: a warning
    p = _plan(tmp_path, "sglang", EXTRACT)
    assert tv.plan_sglang(p, host(release)).level == "refuse"
    assert f"{tv.ALLOW_UNTESTED_KEY} = true" in (tv.stage_refusal(p, "capture", host(release)) or "")
    p.path.write_text(
        p.path.read_text().replace('engine = "sglang"', 'engine = "sglang"\nallow_untested_sglang = true')
    )
    allowing = plan_mod.load(p.path)
    assert tv.plan_sglang(allowing, host(release)).level == "warn"
    assert tv.stage_refusal(allowing, "capture", host(release)) is None


def test_the_gpu_extra_admits_only_tested_releases() -> None:
    """An install without the lock cannot land on a release the table does not call tested: the extra's range is
    the table's (oldest to newest tested), so 0.5.23 (known broken) and anything newer are out."""
    from packaging.requirements import Requirement

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["gpu"] if r.startswith("sglang")]
    assert req.specifier == Requirement(tv.gpu_extra_requirement()).specifier, (
        "the gpu extra is not the table's range"
    )
    assert req.specifier.contains(TESTED.sglang)
    for other in (BROKEN.sglang, "0.5.23.post1", "0.5.24", "0.6.0", "0.5.13"):
        assert not req.specifier.contains(other), other


@pytest.mark.parametrize(
    "version,impl,ok",
    [
        ((3, 12, 1), "cpython", True),
        ((3, 11, 7), "cpython", False),
        ((3, 13, 0), "cpython", False),
        ((3, 12, 1), "pypy", False),
    ],
)
def test_the_gpu_lock_names_the_python_it_needs(version, impl, ok) -> None:
    problem = tv.gpu_python_problem(version, impl)
    assert (problem is None) == ok
    if not ok:
        assert "CPython 3.12 only" in problem and f"this is {impl} {'.'.join(map(str, version))}" in problem
