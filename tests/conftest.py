"""Shared test setup: no hub access, a private AERIE_HOME, the slow and GPU tiers, and CI's "no skips" switch.

The model cache ($AERIE_CACHE, default ~/.cache/aerie) is shared on purpose: the bundled demo model
is converted once per machine, not once per test.

``AERIE_REQUIRE_ALL=1`` (``.ci/run`` sets it) turns every skip into a failure that names what is missing
(sshd, tmux, Slurm, cgroups, a size-limited tmpfs, network namespaces, SpecForge, SGLang's parser…),
except the tests marked ``gpu``, which need a CUDA device CI does not have; those are listed by name at
the end of the run. The test-specific switches (``AERIE_REQUIRE_SSHD`` and the others) still work alone.
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REQUIRE_ALL = os.environ.get("AERIE_REQUIRE_ALL") == "1"
if REQUIRE_ALL:  # the older, per-fixture switches make their fixtures fail with their own message
    for _var in (
        "AERIE_REQUIRE_SSHD",
        "AERIE_REQUIRE_TMUX",
        "AERIE_REQUIRE_SPECFORGE",
        "AERIE_REQUIRE_SLURM",
    ):
        os.environ.setdefault(_var, "1")


@pytest.fixture(autouse=True)
def _aerie_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AERIE_HOME", str(tmp_path_factory.mktemp("aerie-home")))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run tests marked slow (model loads, the whole demo); CI does",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks _schedule adds
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _schedule(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items:
        import torch

        if not torch.cuda.is_available():
            no_gpu = pytest.mark.skip(reason="gpu: needs a CUDA device (run on the lent GPU machine)")
            for item in gpu_items:
                item.add_marker(no_gpu)
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (the README's test command and CI do)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Under pytest-xdist every worker (and all it starts) runs this much nicer than normal, and the demo, the
# suite's longest test and the one CPU-bound for its whole length, gets normal priority back where the OS
# allows it (root: CI): it then takes the cores while it needs them, and the tests that mostly wait fill the
# gaps, instead of everything slowing down together. Nothing a test asserts depends on it.
WORKER_NICE = 5


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.nice(WORKER_NICE)
        # One compute thread per process: four workers each running torch with a thread per core would put
        # eight OpenMP threads on two cores, spinning at every barrier for a descheduled sibling (measured
        # in docs/testing.md: a sixth less CPU for the same tests). The demo test gives its run the default
        # back, so it runs as the README's command does. `.ci/repeat-comparisons` covers 1 and 2 threads.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per core, 2 to 8. Most tests wait on processes, sockets and daemons, not
    the CPU, so one worker per core leaves the cores idle; more than 8 only adds start-up cost."""
    return max(2, min(8, 2 * (os.cpu_count() or 1)))


def _schedule(items: list[pytest.Item]) -> None:
    """Order and group the tests for pytest-xdist (the same on every worker, as xdist requires).

    The longest tests go first, so no worker is left running a long one alone at the end: the demo, then
    every test marked slow, then the rest, each group in collection order. The tests that share the session's
    private Slurm cluster run on one worker (``--dist loadgroup``), so one cluster serves them all; so do the
    tests of one file that share a fixture built once for the file.
    """

    def rank(item: pytest.Item) -> int:
        if item.nodeid.startswith("tests/test_demo.py"):
            return 0
        return 1 if "slow" in item.keywords else 2

    items.sort(key=rank)  # stable: collection order within each rank
    for item in items:
        if {"slurm_cluster", "slurm_accounting_cluster"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module- or session-scoped fixture of its own file (a model loaded, a server
    started, a stage run once for the file's tests). Such tests run on one worker: spread over four, each
    worker would build the fixture again (the GGUF conversion, the CPU server, the online-TP base)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    module = item.nodeid.split("::")[0]
    for defs in info.name2fixturedefs.values():
        for fixturedef in defs:
            if fixturedef.scope in ("module", "session") and fixturedef.baseid == module:
                return True
    return False


def _skip_reason(longrepr: object) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """Under AERIE_REQUIRE_ALL, a skip is a failure unless the test is GPU-only (or slow without --slow)."""
    report: pytest.TestReport = yield
    if not (REQUIRE_ALL and report.skipped) or hasattr(report, "wasxfail"):
        return report
    if "gpu" in item.keywords:
        return report
    if "slow" in item.keywords and not item.config.getoption("--slow"):
        return report
    report.outcome = "failed"
    report.longrepr = (
        f"AERIE_REQUIRE_ALL=1: this test was skipped, and CI must run it: {_skip_reason(report.longrepr)}"
    )
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    """A whole module skipped at import (``importorskip``, ``skip(allow_module_level=True)``) counts too."""
    report: pytest.CollectReport = yield
    if REQUIRE_ALL and report.skipped:
        report.outcome = "failed"
        report.longrepr = (
            f"AERIE_REQUIRE_ALL=1: {collector.nodeid} was skipped at import, and CI must run it: "
            f"{_skip_reason(report.longrepr)}"
        )
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "gpu" in report.keywords and report.when == "setup":
        _GPU_SKIPPED.append(report.nodeid)


_GPU_SKIPPED: list[str] = []


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _GPU_SKIPPED:
        terminalreporter.write_sep("-", f"{len(_GPU_SKIPPED)} GPU-only tests not run here (no CUDA device)")
        for nodeid in sorted(set(_GPU_SKIPPED)):
            terminalreporter.write_line(f"  {nodeid}")
