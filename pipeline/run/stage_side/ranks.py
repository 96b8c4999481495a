"""The ranks of a stage that runs as several processes under ``torchrun`` (training, tensor-parallel capture).

Rank and world from torchrun's environment, the process group with a timeout (a rank that dies makes
the others fail within ``AERIE_DIST_TIMEOUT_S`` instead of hanging), collective pause checks, the
re-exec under torchrun (under a Slurm job of several nodes: one agent per node through ``srun``), and
ranks that die with their agent. torch is imported only when a method
needs it, so the run machinery stays importable without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from datetime import timedelta
from typing import Any

from pipeline.run.stage_side.env_names import ENV_THREADS

DEFAULT_TIMEOUT_S = 600.0


class Dist:
    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def init(self, device: Any) -> None:
        """Join the process group (NCCL on GPUs, gloo on the CPU), unless something already did."""
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout())

    def sum(self, t: Any) -> Any:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool, device: Any) -> bool:
        import torch

        heartbeat()
        return bool(self.sum(torch.tensor([1.0 if flag else 0.0], device=device)).item() > 0)

    def safe_point(self, ctx: Any, device: Any, poll_s: float = 0.5) -> None:
        """A pause every rank takes together (a rank alone in a collective would hang): blocks while
        the stage's pause is requested on any rank, announcing it once (rank 0 speaks)."""
        import time

        if not self.any(ctx.pause_requested(), device):
            return
        ctx.message("paused at a safe point", code="paused")
        while self.any(ctx.pause_requested(), device):
            time.sleep(poll_s)
        ctx.message("resumed", code="resumed")

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self, finished: bool = False) -> None:
        """Leave the process group. ``finished``: every rank got to the end, so wait for the others first
        (a rank that tears gloo down while a peer still talks to it can abort at exit with "terminate called
        without an active exception", failing a stage whose work is done). After an error no barrier: a dead
        peer would hold it until the timeout."""
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                if finished:
                    dist.barrier()
                dist.destroy_process_group()


def die_with_parent() -> None:
    """torchrun starts workers in their own sessions; tie each to its agent so a SIGKILL of the
    stage's process group can never leave a worker training on (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:
        os._exit(1)


def timeout() -> timedelta:
    """How long a collective waits for a rank that stopped answering (``AERIE_DIST_TIMEOUT_S``)."""
    return timedelta(seconds=float(os.environ.get("AERIE_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ


def rank_threads(env: dict[str, str], nproc: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for each of ``nproc`` ranks on one node: the stage's CPU slots shared out, when the
    launcher chose the threads from them; what the operator set is left alone (``{}``)."""
    slots = env.get(ENV_THREADS)
    if not slots or env.get("OMP_NUM_THREADS") != slots:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, int(slots) // max(1, nproc)))}


def reexec_under_torchrun(nproc: int, module: str, argv: list[str], ctx: Any = None) -> None:
    """Run ``python -m module argv`` on ``nproc`` ranks under ``torchrun`` and exit with its status.

    torchrun is this process's child, in the stage's process group (a kill reaches it; its ranks die
    with it). ``--max-restarts 0``: a rank that dies ends the stage — torchrun stops the others at
    once — and the retry policy, not torchrun, decides what happens next. Each rank's output is kept
    in ``OUT/ranks/`` and echoed to the stage log; when a rank fails, ``ctx`` (rank 0's voice) gets an
    error naming the rank, how it ended and its last log line, instead of a bare exit code.
    """
    import re
    import shutil
    import subprocess
    import tempfile
    import threading
    from pathlib import Path

    log_dir = Path(tempfile.mkdtemp(prefix="aerie-ranks-"))
    beats = log_dir / "heartbeats"
    beats.mkdir()
    nodes = slurm_nodes()
    tail = ["--max-restarts=0", f"--log-dir={log_dir}", "--redirects=3", "--tee=3", "-m", module, *argv]
    env = dict(os.environ)
    if nodes > 1:
        cmd = multi_node_command(nodes, nproc, tail, ctx)
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            *tail,
        ]
        env[HEARTBEAT_ENV] = str(beats)  # the heartbeat folder is on this node only
        env.update(rank_threads(env, nproc))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    stalled: list[str] = []
    if nodes == 1:
        watchdog = threading.Thread(target=_watch_heartbeats, args=(proc, beats, nproc, stalled), daemon=True)
        watchdog.start()
    failed: dict[int, str] = {}  # rank -> exit code, from the agent's lines
    root: list[str] = []  # torchrun's "Root Cause (first observed failure)" block
    in_root = False
    assert proc.stderr is not None
    for line in proc.stderr:
        sys.stderr.write(line)
        m = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", line)
        if m:
            failed.setdefault(int(m.group(2)), m.group(1))
        in_root = in_root or "Root Cause" in line
        if in_root:
            root.append(line)
    m_rank = next((m for x in root if (m := re.search(r"^\s*rank\s*:\s*(\d+)", x))), None)
    m_code = next((m for x in root if (m := re.search(r"^\s*exitcode\s*:\s*(-?\d+)", x))), None)
    if m_rank:  # the first rank to fail, as torchrun observed it
        failed = {int(m_rank.group(1)): m_code.group(1) if m_code else "", **failed}
        failed = {int(m_rank.group(1)): failed[int(m_rank.group(1))]}
    rc = proc.wait()
    if rc != 0 and ctx is not None:
        text = (
            stalled[0] + _last_line(log_dir, int(stalled[0].split()[1]))
            if stalled
            else _rank_failure(failed, log_dir, rc)
        )
        ctx.message(text, level="error", code="rank_failed")
    shutil.rmtree(log_dir, ignore_errors=True)
    sys.exit(rc if rc >= 0 else 128 - rc)  # a signal death as the shell reports it


def slurm_nodes() -> int:
    """How many nodes this stage's Slurm job holds (1 outside Slurm, or for a one-node job)."""
    if os.environ.get("AERIE_EXECUTOR") != "slurm":
        return 1
    n = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or "1"
    return int(n) if n.isdigit() else 1


def multi_node_command(nodes: int, nproc: int, tail: list[str], ctx: Any = None) -> list[str]:
    """``srun`` one torchrun agent per node of the job, ``nproc / nodes`` ranks each, meeting at the job's
    first node (its ``NodeAddr``; port ``AERIE_RDZV_PORT``, else one derived from the job id).

    Static rendezvous: each agent's node rank is Slurm's ``SLURM_NODEID`` (0 on the first node, which
    hosts the store), so global ranks are laid out node by node. ``--kill-on-bad-exit``: a rank that
    dies ends every node's agent, like ``--max-restarts=0`` on one node.
    """
    from pipeline.run.hosts.slurm import commands as slurm

    if nproc % nodes:
        text = f"{nproc} ranks cannot be spread evenly over the job's {nodes} nodes: make nproc a multiple of nodes"
        if ctx is not None:
            ctx.message(text, level="error", code="rank_failed")
        print(f"aerie: {text}", file=sys.stderr, flush=True)
        sys.exit(2)
    first = slurm.hostnames(os.environ["SLURM_JOB_NODELIST"])[0]
    addr = slurm.node_address(first)
    job = os.environ.get("SLURM_JOB_ID", "0")
    port = int(os.environ.get("AERIE_RDZV_PORT") or 20000 + (int(job) if job.isdigit() else 0) % 20000)
    if ctx is not None:
        ctx.message(
            f"{nodes} nodes x {nproc // nodes} ranks under torchrun, rendezvous at {addr}:{port} ({first})"
        )
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    agent = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc_per_node={nproc // nodes}",
        f"--master_addr={addr}",
        f"--master_port={port}",
        *tail,
    ]
    # The node rank differs per node, so a tiny shell puts Slurm's SLURM_NODEID in front of the rest.
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        *([f"--cpus-per-task={cpus}"] if cpus else []),
        "/bin/sh",
        "-c",
        'p=$0 m=$1 r=$2; shift 2; exec "$p" "$m" "$r" --node_rank="$SLURM_NODEID" "$@"',
        *agent[:3],
        *agent[3:],
    ]


HEARTBEAT_ENV = "AERIE_HEARTBEAT_DIR"


def heartbeat() -> None:
    """A rank says it is making progress (touches its file in the stage's heartbeat folder)."""
    d = os.environ.get(HEARTBEAT_ENV)
    if d:
        with open(os.path.join(d, f"rank-{os.environ.get('RANK', '0')}"), "w") as fh:
            fh.write(str(os.getpid()))


def _watch_heartbeats(proc: Any, beats: Any, nproc: int, stalled: list[str], poll_s: float = 1.0) -> None:
    """Stop the ranks when none has made progress for the collective timeout.

    A rank that hangs (a stuck GPU, a frozen process) blocks every other rank in its next collective;
    the backends' own timeouts do not cover every group (a tensor-parallel target's mesh has its
    own). Once every rank has beaten at least once, no beat for ``timeout()`` seconds ends torchrun;
    the rank named is the one whose last beat is the oldest: it stopped first.
    """
    import signal as _signal
    import time as _time

    limit = timeout().total_seconds()
    while proc.poll() is None:
        _time.sleep(poll_s)
        files = list(beats.glob("rank-*"))
        if len(files) < nproc:
            continue
        ages = {int(f.name.split("-")[1]): _time.time() - f.stat().st_mtime for f in files}
        if min(ages.values()) > limit:
            rank = max(ages, key=lambda r: ages[r])
            stalled.append(
                f"rank {rank} stalled: no rank made progress for {min(ages.values()):.0f} s "
                f"(AERIE_DIST_TIMEOUT_S = {limit:g}); the ranks were stopped"
            )
            proc.send_signal(_signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - then it is killed
                proc.kill()
            return


def _last_line(log_dir: Any, rank: int) -> str:
    lines: list[str] = []
    for f in sorted(log_dir.rglob(f"*/{rank}/std*.log")):
        lines += [x for x in f.read_text(errors="replace").splitlines() if x.strip()]
    return f"; its last line: {lines[-1].strip()[-300:]}" if lines else "; it wrote nothing"


def _rank_failure(failed: dict[int, str], log_dir: Any, rc: int) -> str:
    """ "rank 1 was killed by signal 9; its last line: ..." from torchrun's summary and the rank logs."""
    import signal as _signal

    if not failed:
        return f"torchrun exited with status {rc} (no rank reported a failure)"
    rank = next(iter(failed))
    code = failed[rank]
    how = "failed"
    if code.lstrip("-").isdigit():
        c = int(code)
        how = f"was killed by {_signal.Signals(-c).name}" if c < 0 else f"exited with status {c}"
    last = ""
    for f in sorted(log_dir.rglob(f"*/{rank}/std*.log")):
        lines = [x for x in f.read_text(errors="replace").splitlines() if x.strip()]
        if lines:
            last = lines[-1].strip()
    return f"rank {rank} {how}" + (f"; its last line: {last[-300:]}" if last else "; it wrote nothing")


def stage_gpus() -> int:
    """How many GPUs the launcher gave this stage (``CUDA_VISIBLE_DEVICES``)."""
    return len([g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()])


def parallel_settings(plan: Any, section: str) -> tuple[str | None, int]:
    """``([section] parallel, tp_size)`` of a stage that may run its target tensor-parallel.

    ``parallel = "tp"`` runs ``tp_size`` ranks (default: the stage's GPUs, else 1).
    """
    sec = getattr(plan.settings, section)
    par: str | None = sec.parallel
    size: int = sec.tp_size or stage_gpus() or 1
    return par, size if par == "tp" else 1


def tensor_parallel_rank(ctx: Any, section: str, module: str, argv: list[str]) -> bool:
    """For a stage whose ``[section] parallel = "tp"``: re-run it under torchrun (this call then never
    returns: the process exits with torchrun's status) or, in a rank, tie it to its agent and say so.
    False when the stage runs its target in one process."""
    par, size = parallel_settings(ctx.plan, section)
    if par != "tp":
        return False
    if not under_torchrun():
        ctx.message(f"tensor-parallel target: starting {size} ranks under torchrun")
        reexec_under_torchrun(size, module, argv, ctx)
    die_with_parent()
    return True


def tp_device(dist: Dist, requested: str | None = None) -> Any:
    """This rank's device: its GPU (torchrun's ``LOCAL_RANK``), or the CPU (gloo) when there is none
    or the plan's ``device`` says ``"cpu"`` (``"auto"`` under tensor parallelism: the rank's GPU)."""
    import torch

    if torch.cuda.is_available() and (requested in (None, "auto") or torch.device(requested).type != "cpu"):
        dev = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")
