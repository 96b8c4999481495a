"""Fixtures for the Slurm tests: one real private Slurm cluster per test session (see ``slurm_cluster``).

Loaded by the Slurm test modules with ``pytest_plugins = ["conftest_slurm"]``. The cluster's
``SLURM_CONF`` is put in this process's environment while it runs, so the supervisors, ``sbatch``
and every other Slurm client the tests start talk to it and to nothing else. Skipped, with the
reason, where Slurm or munge is not installed; CI sets ``AERIE_REQUIRE_SLURM=1`` so there it fails.
A second, module-scoped cluster keeps job accounting (``slurmdbd`` on a private MariaDB) for the
``sacct`` tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, accounting_missing, missing_binaries


def _cluster(tmp_path_factory: pytest.TempPathFactory, name: str, **kw: object) -> Iterator[SlurmCluster]:
    missing = missing_binaries() + (accounting_missing() if kw.get("accounting") else [])
    why = ""
    if missing:
        why = (
            f"Slurm is not installed here (missing {', '.join(missing)}): "
            "apt-get install slurm-wlm munge slurmdbd mariadb-server (.ci/run does)"
        )
    elif os.geteuid() != 0:
        why = "the test Slurm cluster runs its daemons as root (SlurmUser=root); run the Slurm tests as root"
    if why:
        if os.environ.get("AERIE_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp(name), **kw)  # type: ignore[arg-type]
    old = os.environ.get("SLURM_CONF")
    try:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
        yield cluster
    finally:
        cluster.stop()
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """No accounting database: job states come from ``scontrol`` (finished jobs kept an hour)."""
    yield from _cluster(tmp_path_factory, "slurm")


@pytest.fixture(scope="module")
def slurm_accounting_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """With ``slurmdbd`` on a private MariaDB: ``sacct`` answers, and slurmctld forgets an ended job after
    2 s (its next purge), as a busy production cluster does; its own ``SLURM_CONF`` while the module runs."""
    yield from _cluster(tmp_path_factory, "slurm-acct", accounting=True, min_job_age_s=2)
