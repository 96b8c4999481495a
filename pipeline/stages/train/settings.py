"""The ``[train]`` settings and the schedule they imply: learning rate per step and the samples of each step."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass
class TrainSettings:
    steps: int = 200
    batch_size: int = 8  # global batch, in sequences
    micro_batch: int = 8  # per rank, per forward
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = -1  # -1: 1.5 % of steps (SpecForge's warmup ratio)
    weight_decay: float = 0.0
    max_grad_norm: float = 0.5
    ttt_steps: int = 7
    loss_decay: float = 0.8
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    log_every: int = 1
    seed: int = 0
    nproc: int = 1
    device: str = ""
    init_lm_head: str = "target"  # "target": rows of the target's LM head; "random"
    max_length: int = 0  # 0: [target] max_length
    target: str = ""  # "online-tp": every rank holds a tensor-parallel shard of the target and captures
    length_grouping: int = 16  # sort rows by length within windows of this many batches (0: plain shuffle)
    prefetch: int = 2  # GPU, offline data: steps assembled ahead on a feeder thread (0: on the step's thread)
    eval_every: int = (
        0  # simulated acceptance on held-out rows every N steps (0: at every checkpoint; -1: never)
    )
    eval_rows: int = 64  # held-out rows it reads (the first N of the extraction's eval split)
    eval_spec_steps: int = (
        0  # draft steps per verification it simulates (--speculative-num-steps); 0: min(3, ttt_steps)
    )
    loss_chunk_tokens: int = 4096  # tokens per soft-label loss chunk (0: every step's full logits at once)

    @classmethod
    def from_section(cls, sec: dict[str, Any], where: str) -> TrainSettings:
        known = {f.name: f for f in fields(cls)}
        vals: dict[str, Any] = {}
        for k, v in sec.items():
            if k == "mode":
                continue
            if k not in known:
                raise ValueError(f"{where}: train.{k}: unknown key (known: mode, {', '.join(sorted(known))})")
            want = type(getattr(cls(), k))
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                v = float(v)
            if not isinstance(v, want) or isinstance(v, bool):
                raise ValueError(f"{where}: train.{k}: expected {want.__name__}, got {v!r}")
            vals[k] = v
        s = cls(**vals)
        for k in (
            "steps",
            "batch_size",
            "micro_batch",
            "ttt_steps",
            "checkpoint_every",
            "log_every",
            "nproc",
        ):
            if getattr(s, k) < 1:
                raise ValueError(f"{where}: train.{k}: must be at least 1")
        if s.loss_chunk_tokens < 0:
            raise ValueError(f"{where}: train.loss_chunk_tokens: must be 0 (no chunking) or more")
        if s.batch_size % s.nproc:
            raise ValueError(
                f"{where}: train.batch_size ({s.batch_size}) must be a multiple of train.nproc ({s.nproc})"
            )
        for k in ("length_grouping", "prefetch", "eval_rows", "eval_spec_steps"):
            if getattr(s, k) < 0:
                raise ValueError(f"{where}: train.{k}: must be 0 or more")
        if s.eval_every < -1:
            raise ValueError(
                f"{where}: train.eval_every: -1 (never), 0 (at every checkpoint) or a number of steps"
            )
        if s.eval_spec_steps > s.ttt_steps:
            raise ValueError(
                f"{where}: train.eval_spec_steps ({s.eval_spec_steps}) cannot exceed train.ttt_steps "
                f"({s.ttt_steps}): the draft is only trained that deep"
            )
        if s.target not in ("", "online-tp"):
            raise ValueError(f'{where}: train.target: "online-tp" (or leave it out), got {s.target!r}')
        if s.init_lm_head not in ("target", "random"):
            raise ValueError(f"{where}: train.init_lm_head: 'target' or 'random', got {s.init_lm_head!r}")
        return s

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else max(1, round(0.015 * self.steps))

    @property
    def spec_steps(self) -> int:
        """Draft tokens per verification the acceptance evaluation simulates."""
        return self.eval_spec_steps or min(3, self.ttt_steps)

    @property
    def eval_interval(self) -> int:
        """Steps between acceptance evaluations (0: never)."""
        if self.eval_every < 0 or self.eval_rows == 0:
            return 0
        return self.eval_every or self.checkpoint_every


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step (1-based)."""
    if step <= s.warmup:
        return s.lr * step / max(1, s.warmup)
    frac = (step - s.warmup) / max(1, s.steps - s.warmup)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def global_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The samples of (1-based) ``step``: a fresh seeded permutation per epoch, last partial batch dropped."""
    per_epoch = n // batch_size
    epoch, b = divmod(step - 1, per_epoch)
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    perm = torch.randperm(n, generator=g)
    return perm[b * batch_size : (b + 1) * batch_size].tolist()


class BatchSchedule:
    """Which rows each (1-based) step trains on: deterministic from the seed, so a resume needs no sampler state.

    With ``window`` > 0 rows are grouped by length: each epoch's seeded permutation is cut into windows
    of ``window`` batches, each window sorted by length and cut into batches, and the epoch's batches
    shuffled (seeded) — batches of similar lengths pad little, and every row is still seen once per
    epoch in a random order of batches. ``window`` = 0 is the plain shuffle of :func:`global_indices`.
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, lengths: list[int] | None = None, window: int = 0
    ) -> None:
        if window and (lengths is None or len(lengths) != n):
            raise ValueError("length grouping needs every row's length")
        self.n, self.batch_size, self.seed, self.lengths, self.window = n, batch_size, seed, lengths, window
        self._epoch: tuple[int, list[list[int]]] | None = None

    def rows(self, step: int) -> list[int]:
        if not self.window:
            return global_indices(step, self.n, self.batch_size, self.seed)
        per_epoch = self.n // self.batch_size
        epoch, b = divmod(step - 1, per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            self._epoch = (epoch, self._batches(epoch))
        return self._epoch[1][b]

    def _batches(self, epoch: int) -> list[list[int]]:
        assert self.lengths is not None
        lengths = self.lengths
        g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        perm = torch.randperm(self.n, generator=g).tolist()[: (self.n // self.batch_size) * self.batch_size]
        span = self.window * self.batch_size
        batches: list[list[int]] = []
        for a in range(0, len(perm), span):
            win = sorted(perm[a : a + span], key=lambda i: lengths[i])  # stable: ties keep the random order
            batches += [win[k : k + self.batch_size] for k in range(0, len(win), self.batch_size)]
        order = torch.randperm(len(batches), generator=g).tolist()
        return [batches[k] for k in order]
