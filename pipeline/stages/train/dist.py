"""Several training processes: torchrun re-exec, the process group, and ranks that die with their agent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import torch


class Dist:
    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def init(self, device: torch.device) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        return bool(self.sum(torch.tensor([1.0 if flag else 0.0], device=device)).item() > 0)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

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


def reexec_under_torchrun(nproc: int, argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pipeline.stages.train", *argv]
    os.execv(sys.executable, cmd)
