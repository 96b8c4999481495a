"""Fixtures for the Slurm tests: one real private Slurm cluster per test session (see ``slurm_cluster``).

Loaded by the Slurm test modules with ``pytest_plugins = ["conftest_slurm"]``. The cluster's
``SLURM_CONF`` is put in this process's environment while it runs, so the supervisors, ``sbatch``
and every other Slurm client the tests start talk to it and to nothing else. Skipped, with the
reason, where Slurm or munge is not installed; CI sets ``AERIE_REQUIRE_SLURM=1`` so there it fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from slurm_cluster import SlurmCluster, missing_binaries


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = missing_binaries()
    why = ""
    if missing:
        why = (f"Slurm is not installed here (missing {', '.join(missing)}): "
               "apt-get install slurm-wlm munge (.ci/run does)")
    elif os.geteuid() != 0:
        why = "the test Slurm cluster runs its daemons as root (SlurmUser=root); run the Slurm tests as root"
    if why:
        if os.environ.get("AERIE_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
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
