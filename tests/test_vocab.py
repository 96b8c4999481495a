"""Draft vocabulary: top-K selection, d2t/t2d round trip and coverage, and the vocab stage itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.data.shards import iter_rows
from pipeline.eagle3 import draft_vocab
from tests.eagle3_fixtures import metrics, run_stage, shared, write_plan, write_tokenized


def test_top_k_sorted_with_sglang_offsets() -> None:
    counts = np.zeros(20, dtype=np.int64)
    counts[[3, 17, 5, 9]] = [10, 50, 7, 30]
    vm = draft_vocab.build(counts, 3)
    assert vm.draft_ids.tolist() == [3, 9, 17]  # the 3 most frequent, in id order
    assert vm.d2t.tolist() == [3, 8, 15]  # d2t[i] = target_id - i
    assert vm.d2t.dtype == torch.int64 and vm.t2d.dtype == torch.bool
    assert torch.nonzero(vm.t2d).flatten().tolist() == [3, 9, 17]
    assert vm.coverage() == pytest.approx(90 / 97)


def test_ties_and_top_up_take_the_lowest_ids() -> None:
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 4]] = [2, 2]
    vm = draft_vocab.build(counts, 4)
    # 4 and 7 are counted; the zero-count top-up takes ids 0 and 1 (SpecForge's rule)
    assert vm.draft_ids.tolist() == [0, 1, 4, 7]
    assert vm.coverage() == 1.0
    with pytest.raises(draft_vocab.VocabError, match="exceeds"):
        draft_vocab.build(counts, 11)


def test_save_load_round_trip(tmp_path) -> None:
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 100, 300)
    vm = draft_vocab.build(counts, 64)
    draft_vocab.save(vm, tmp_path)
    back = draft_vocab.load(tmp_path)
    assert torch.equal(back.d2t, vm.d2t) and torch.equal(back.t2d, vm.t2d)
    # the mapping round-trips both ways: t2d marks exactly arange(K) + d2t
    assert torch.equal(torch.nonzero(back.t2d).flatten(), torch.arange(64) + back.d2t)
    assert back.coverage() == pytest.approx(vm.coverage())


def test_load_rejects_an_inconsistent_mapping(tmp_path) -> None:
    vm = draft_vocab.build(np.arange(50), 8)
    vm.t2d[0] = True  # marks a 9th id that d2t does not map to
    draft_vocab.save(vm, tmp_path)
    with pytest.raises(draft_vocab.VocabError, match="t2d does not mark exactly"):
        draft_vocab.load(tmp_path)


@pytest.mark.slow
def test_vocab_stage_counts_assistant_tokens_of_training_rows(tmp_path_factory) -> None:
    out = shared(tmp_path_factory, "voc")
    tok = shared(tmp_path_factory, "tok")
    vm = draft_vocab.load(out)
    assert vm.size == 512
    counts = np.zeros(49152, dtype=np.int64)
    n_rows = 0
    for row in iter_rows([tok], 0.2, "train"):
        counts += np.bincount(row.input_ids[row.loss_mask == 1], minlength=49152)
        n_rows += 1
    assert 0 < n_rows < 32  # some rows are held out
    assert np.array_equal(vm.counts.numpy(), counts)
    # every counted token fits in 512 ids here, so coverage is complete and the board says so
    assert set(np.flatnonzero(counts)) <= set(vm.draft_ids.tolist())
    cov = metrics(out, "vocab_coverage")
    assert cov and cov[-1].get("value") == pytest.approx(1.0)


@pytest.mark.slow
def test_vocab_stage_reports_partial_coverage(tmp_path) -> None:
    tok = write_tokenized(tmp_path / "tok", n=8, rows_per_shard=8)
    plan = write_plan(tmp_path / "plan.toml", vocab={"draft_vocab_size": 8}, bench={"holdout": 0.0})
    run_stage("pipeline.stages.vocab", plan, tmp_path / "voc", [tok])
    vm = draft_vocab.load(tmp_path / "voc")
    counts = vm.counts.numpy()
    top8 = np.sort(counts)[::-1][:8].sum()
    assert metrics(tmp_path / "voc", "vocab_coverage")[-1].get("value") == pytest.approx(top8 / counts.sum())
    assert vm.coverage() < 1.0
