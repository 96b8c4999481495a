"""A real, private Slurm cluster on this machine for the Slurm executor's tests (no mocks).

It writes a munge key and a ``slurm.conf`` under a temporary folder and starts ``munged``,
``slurmctld`` and two ``slurmd`` daemons (nodes ``n1`` and ``n2``, both on 127.0.0.1 with their own
ports: Debian's Slurm lets ``slurmd -N NAME`` play one node of several on one host), waits until
``sinfo`` shows both nodes idle, and stops every daemon it started (by the pid it recorded) after.

CPU only: ``proctrack/linuxproc`` and ``task/none`` (no cgroups in a container); finished jobs stay
visible to ``squeue``/``scontrol`` for ``MinJobAge`` (an hour). Clients find the cluster through ``SLURM_CONF``, which :meth:`SlurmCluster.env` sets.

With ``accounting`` (where ``slurmdbd`` and MariaDB are installed) it also starts a private MariaDB
server (own datadir, socket and loopback port) and ``slurmdbd`` on it, so ``sacct`` answers as on a
production cluster.

``python tests/slurm_cluster.py DIR [--accounting]`` starts one by hand and keeps it until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
# Job accounting (``sacct``): slurmdbd on a private MariaDB server, when both are installed.
ACCOUNTING_BINARIES = ("slurmdbd", "sacct", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # more than the machine has: Slurm schedules slots, the kernel shares the cores
PARTITION = "debug"
URGENT = "urgent"  # same nodes, higher priority tier: its jobs pre-empt (cancel) debug's


def missing_binaries() -> list[str]:
    found = []
    for b in BINARIES:
        if not (shutil.which(b) or Path(f"/usr/sbin/{b}").exists()):
            found.append(b)
    return found


def accounting_missing() -> list[str]:
    return [b for b in ACCOUNTING_BINARIES if not (shutil.which(b) or Path(f"/usr/sbin/{b}").exists())]


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """munged + slurmctld + one slurmd per node, all under ``root``; :meth:`stop` ends what it started."""

    def __init__(self, root: Path, accounting: bool = False, min_job_age_s: int = 3600) -> None:
        self.root = Path(root)
        self.accounting = accounting
        self.min_job_age_s = min_job_age_s  # how long slurmctld (squeue, scontrol) remembers an ended job
        self.db_port = self.dbd_port = 0
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket.2"
        self.pids: list[int] = []
        self.host = socket.gethostname()

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    # -- configuration --------------------------------------------------------------------------
    def write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        for n in NODES:
            (r / "spool" / n).mkdir(parents=True, exist_ok=True)
        self.db_port, self.dbd_port = _free_port(), _free_port()
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctl_port, node_ports = _free_port(), [_free_port() for _ in NODES]
        lines = [
            "ClusterName=aerie-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctl_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            *(
                [
                    "AccountingStorageType=accounting_storage/slurmdbd",
                    "AccountingStorageHost=127.0.0.1",
                    f"AccountingStoragePort={self.dbd_port}",
                    f"AccountingStoragePass={self.socket}",
                ]
                if self.accounting
                # munge's socket, for slurmdbd
                else ["AccountingStorageType=accounting_storage/none"]
            ),
            "JobCompType=jobcomp/none",
            f"MinJobAge={self.min_job_age_s}",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
            "MessageTimeout=20",
            "PropagateResourceLimits=NONE",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=CANCEL",
        ]
        for n, port in zip(NODES, node_ports, strict=True):
            lines.append(
                f"NodeName={n} NodeHostname={self.host} NodeAddr=127.0.0.1 Port={port} "
                f"CPUs={CPUS_PER_NODE} RealMemory=2000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP "
            "PriorityTier=1"
        )
        lines.append(
            f"PartitionName={URGENT} Nodes={','.join(NODES)} MaxTime=INFINITE State=UP PriorityTier=10"
        )
        self.conf.write_text("\n".join(lines) + "\n")
        if self.accounting:
            dbd = r / "slurmdbd.conf"  # beside slurm.conf: where slurmdbd looks (SLURM_CONF's folder)
            dbd.write_text(
                "\n".join(
                    [
                        "AuthType=auth/munge",
                        f"AuthInfo=socket={self.socket}",
                        "DbdHost=localhost",
                        "DbdAddr=127.0.0.1",
                        f"DbdPort={self.dbd_port}",
                        "SlurmUser=root",
                        f"PidFile={r / 'run' / 'slurmdbd.pid'}",
                        f"LogFile={r / 'log' / 'slurmdbd.log'}",
                        "StorageType=accounting_storage/mysql",
                        "StorageHost=127.0.0.1",
                        f"StoragePort={self.db_port}",
                        "StorageUser=slurm",
                        "StoragePass=aerie",
                        "StorageLoc=slurm_acct",
                    ]
                )
                + "\n"
            )
            os.chmod(dbd, 0o600)

    # -- daemons --------------------------------------------------------------------------------
    def _spawn(self, argv: list[str], pidfile: Path | None = None) -> None:
        log = open(self.root / "log" / f"{Path(argv[0]).name}-{len(self.pids)}.out", "ab")  # noqa: SIM115
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        log.close()
        self.pids.append(p.pid)
        self._procs = [*getattr(self, "_procs", []), p]

    def start(self, timeout_s: float = 120.0) -> None:
        self.write_config()
        r = self.root
        self._spawn(
            [
                _bin("munged"),
                "--foreground",
                "--force",
                f"--key-file={r / 'munge' / 'munge.key'}",
                f"--socket={self.socket}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'munge.seed'}",
            ]
        )
        self._wait(lambda: self.socket.exists(), 15, "munged's socket")
        if self.accounting:
            self._start_accounting()
        self._spawn([_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for n in NODES:
            self._spawn([_bin("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait(self._all_idle, timeout_s, "every node idle in sinfo")

    def _start_accounting(self) -> None:
        """A private MariaDB (its own datadir, socket and port) and slurmdbd on it, then the cluster registered."""
        r = self.root / "db"
        sock = r / "mariadb.sock"
        # Its own temp dir: the bootstrap's temporary tables in the shared /tmp, beside a loaded suite's
        # other tests, once vanished under it ("Could not remove temporary table … Unknown table").
        (r / "tmp").mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                _bin("mariadb-install-db"),
                "--no-defaults",
                "--user=root",
                f"--datadir={r / 'data'}",
                f"--tmpdir={r / 'tmp'}",
                "--auth-root-authentication-method=socket",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
        self._spawn(
            [
                _bin("mariadbd"),
                "--no-defaults",
                "--user=root",
                f"--datadir={r / 'data'}",
                f"--tmpdir={r / 'tmp'}",
                f"--socket={sock}",
                f"--port={self.db_port}",
                "--bind-address=127.0.0.1",
                f"--pid-file={r / 'mariadb.pid'}",
                f"--log-error={self.root / 'log' / 'mariadb.log'}",
                "--innodb-buffer-pool-size=32M",
            ]
        )
        sql = (
            "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'aerie'; "
            "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1';"
        )

        def db_ready() -> bool:
            p = subprocess.run(
                [_bin("mariadb"), "--no-defaults", "-S", str(sock), "-u", "root", "-e", sql],
                capture_output=True,
                timeout=20,
            )
            return p.returncode == 0

        self._wait(db_ready, 60, "MariaDB answering")
        self._spawn([_bin("slurmdbd"), "-D"])

        def registered() -> bool:
            p = subprocess.run(
                [_bin("sacctmgr"), "-i", "add", "cluster", "aerie-test"],
                capture_output=True,
                text=True,
                env=self.env(),
                timeout=30,
            )
            return p.returncode == 0 or "already exists" in (p.stdout + p.stderr)

        self._wait(registered, 60, "slurmdbd accepting the cluster")

    def _all_idle(self) -> bool:
        for p in getattr(self, "_procs", []):
            if p.poll() is not None:
                raise RuntimeError(
                    f"{p.args[0]} exited with {p.returncode}; logs in {self.root / 'log'}:\n"
                    + self.logs_tail()
                )
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env(), timeout=20
        )
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def _wait(self, pred, timeout_s: float, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if pred():
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"test Slurm cluster: no {what} after {timeout_s:g}s; logs in {self.root / 'log'}:\n"
            + self.logs_tail()
        )

    def logs_tail(self, n: int = 15) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        """End the jobs still queued or running, then every daemon this cluster started (by pid)."""
        with contextlib.suppress(Exception):
            subprocess.run(["scancel", "--user=root"], env=self.env(), timeout=20, capture_output=True)
            # Let the jobs' slurmstepd finish (a stopped slurmd leaves its steps running).
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                out = subprocess.run(
                    ["squeue", "--noheader", "--states=running,completing,suspended,pending"],
                    env=self.env(),
                    timeout=20,
                    capture_output=True,
                    text=True,
                ).stdout
                if not out.strip():
                    break
                time.sleep(0.5)
        for p in reversed(getattr(self, "_procs", [])):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in reversed(getattr(self, "_procs", [])):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":

    def _term(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    c = SlurmCluster(Path(sys.argv[1]), accounting="--accounting" in sys.argv[2:])
    try:
        c.start()
        print(f"export SLURM_CONF={c.conf}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
