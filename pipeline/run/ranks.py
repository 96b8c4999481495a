"""The ranks of a stage that runs as several processes under ``torchrun`` (training, tensor-parallel capture).

Rank and world from torchrun's environment, the process group with a timeout (a rank that dies makes
the others fail within ``AERIE_DIST_TIMEOUT_S`` instead of hanging), collective pause checks, the
re-exec under torchrun, and ranks that die with their agent. torch is imported only when a method
needs it, so the run machinery stays importable without it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from datetime import timedelta
from typing import Any

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

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
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


def reexec_under_torchrun(nproc: int, module: str, argv: list[str]) -> None:
    """Replace this process by ``torchrun`` running ``python -m module argv`` on ``nproc`` ranks.

    ``--max-restarts 0``: a rank that dies ends the stage (its exit code and the rank's last log
    line reach the stage log), and the retry policy, not torchrun, decides what happens next.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--max-restarts=0", "-m", module, *argv]
    os.execv(sys.executable, cmd)


def stage_gpus() -> int:
    """How many GPUs the launcher gave this stage (``CUDA_VISIBLE_DEVICES``)."""
    return len([g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()])


def parallel_settings(plan: Any, section: str) -> tuple[str | None, int]:
    """``([section] parallel, tp_size)`` of a stage that may run its target tensor-parallel.

    ``parallel = "tp"`` runs ``tp_size`` ranks (default: the stage's GPUs, else 1).
    """
    sec = plan.section(section)
    par = sec.get("parallel")
    if par not in (None, "tp"):
        raise ValueError(f"{plan.path}: {section}.parallel: expected \"tp\" (or leave it out), got {par!r}")
    size = sec.get("tp_size", stage_gpus() or 1)
    if par == "tp" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"{plan.path}: {section}.tp_size: expected a number of ranks >= 1, got {size!r}")
    return par, int(size) if par == "tp" else 1


def tp_device(dist: Dist, requested: str | None = None) -> Any:
    """This rank's device: its GPU (torchrun's ``LOCAL_RANK``), or the CPU (gloo) when there is none
    or the plan's ``device`` says ``"cpu"``."""
    import torch

    if torch.cuda.is_available() and (requested is None or torch.device(requested).type != "cpu"):
        dev = torch.device("cuda", dist.local_rank)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")
