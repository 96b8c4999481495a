"""The tensor-parallel offline bench: every rank verifies the tokens rank 0 drafted (issue 25, item 6).

Two real gloo processes. Each rank is given a drafter whose tokens name its rank, so a rank that verified
drafts of its own would show it; :class:`~pipeline.eagle3.spec_decode.RankZeroDrafter` hands every rank
rank 0's tokens, and a non-zero rank cannot be given a drafter at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

WORLD = 2
KS = (1, 3, 4)


class RankDrafter:
    """Proposes ``100 + rank, 101 + rank, ...``: its rank is readable in every token."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def start(self, tokens: list[int], feats: torch.Tensor) -> None:
        pass

    def propose(self, k: int) -> list[int]:
        return [100 + self.rank + j for j in range(k)]

    def accept(self, n: int, feats: torch.Tensor, new_tokens: list[int]) -> None:
        pass


def _rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from pipeline.eagle3.spec_decode import RankZeroDrafter

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        mine = RankDrafter(rank)
        try:  # only rank 0 may draft
            RankZeroDrafter(mine, rank, torch.device("cpu"))
            refused = False
        except ValueError:
            refused = True
        drafter = RankZeroDrafter(mine if rank == 0 else None, rank, torch.device("cpu"))
        drafter.start([1, 2], torch.zeros(1, 3))
        got = [drafter.propose(k) for k in KS]
        drafter.accept(0, torch.zeros(1, 3), [5])
        Path(out, f"{rank}.json").write_text(json.dumps({"got": got, "refused": refused}))
    finally:
        dist.destroy_process_group()


def test_every_rank_verifies_the_tokens_rank_0_drafted(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    rank0 = [[100 + j for j in range(k)] for k in KS]
    assert [r["got"] for r in ranks] == [rank0] * WORLD
    assert [r["refused"] for r in ranks] == [False, True]


def test_a_rank_other_than_0_cannot_be_given_a_drafter_nor_rank_0_go_without() -> None:
    from pipeline.eagle3.spec_decode import RankZeroDrafter

    with pytest.raises(ValueError, match="rank 0, and only rank 0"):
        RankZeroDrafter(None, 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="rank 0, and only rank 0"):
        RankZeroDrafter(RankDrafter(1), 1, torch.device("cpu"))
