"""Issue 15: the training data path (length-grouped batches, the background feeder, mapped shards) and
acceptance measured while training (the best checkpoint becomes ``draft/``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipeline.eagle3 import hidden_store as hs
from pipeline.run.plan.sections import TrainSection
from pipeline.stages.train.batches import OfflineData
from pipeline.stages.train.feeder import Feeder
from pipeline.stages.train.settings import BatchSchedule, global_indices
from tests.eagle3_fixtures import TEST_SECTIONS, events, run_stage, shared, write_plan


def padded(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def test_length_grouping_sees_every_row_once_per_epoch_and_pads_less() -> None:
    g = torch.Generator().manual_seed(3)
    lengths = (torch.randint(20, 2000, (400,), generator=g) ** 1).tolist()
    sched = BatchSchedule(400, 8, seed=5, lengths=lengths, window=16)
    epoch = [sched.rows(step) for step in range(1, 51)]
    assert sorted(i for b in epoch for i in b) == list(range(400))  # each row once in the epoch
    assert BatchSchedule(400, 8, 5, lengths, 16).rows(37) == epoch[36]  # a resume recomputes the same batch
    second = [sched.rows(step) for step in range(51, 101)]
    assert second != epoch and sorted(i for b in second for i in b) == list(range(400))
    plain = [global_indices(step, 400, 8, 5) for step in range(1, 51)]
    real = sum(lengths)
    # padding: the share of padded tokens that are not real tokens
    assert (padded(epoch, lengths) - real) / padded(epoch, lengths) < 0.5 * (
        padded(plain, lengths) - real
    ) / padded(plain, lengths)
    assert BatchSchedule(400, 8, 5, lengths, 0).rows(7) == plain[6]


def test_length_grouping_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="train.length_grouping: must be 0 or more"):
        TrainSection.parse({"length_grouping": -1}, "plan.toml")
    with pytest.raises(ValueError, match=r"train.eval_spec_steps: 5 cannot exceed train.ttt_steps \(3\)"):
        TrainSection.parse({"eval_spec_steps": 5, "ttt_steps": 3}, "plan.toml")
    assert TrainSection.parse({"checkpoint_every": 40}, "p").eval_interval == 40
    assert TrainSection.parse({"eval_every": -1}, "p").eval_interval == 0
    # unset, it follows a shallow TTT instead of refusing a plan that never asked for it
    assert TrainSection.parse({"ttt_steps": 2}, "p").spec_steps == 2
    assert TrainSection.parse({}, "p").spec_steps == 3


@pytest.mark.slow
def test_the_feeder_gives_the_same_batches_as_reading_on_the_step_thread(tmp_path_factory) -> None:
    data = OfflineData(hs.HiddenStore(shared(tmp_path_factory, "ext")))
    lengths = [data.length(i) for i in range(len(data))]
    sched = BatchSchedule(len(data), 4, 0, lengths, 2)

    def chunks(step: int) -> list[list[int]]:
        idx = sched.rows(step)
        return [idx[:2], idx[2:]]

    feeder = Feeder(data, range(1, 9), chunks, torch.device("cpu"), torch.float32, depth=2)
    try:
        for step in range(1, 9):
            got = feeder.next(step)
            want = [data.batch(c, torch.device("cpu"), torch.float32) for c in chunks(step)]
            for g, w in zip(got, want, strict=True):
                for name in ("aux", "last_hidden", "target_argmax", "input_ids", "loss_mask", "lengths"):
                    assert torch.equal(getattr(g, name), getattr(w, name)), (step, name)
    finally:
        feeder.close()
    # every row read back equals what the store holds (padding is zero)
    b = data.batch([0, 1], torch.device("cpu"), torch.float32)
    n0 = data.length(0)
    assert torch.equal(b.aux[0, :n0], data.store[0].aux.float()) and not b.aux[0, n0:].any()


def test_a_feeder_error_is_raised_at_the_step_that_needed_it(tmp_path) -> None:
    class Unreadable:
        """Rows that cannot be read from step 3 on, as a shard gone bad would."""

        def host_batch(self, idx: list[int], pin: bool = False):  # noqa: ANN201
            if idx[0] >= 3:
                raise hs.StoreError(f"{tmp_path / 'hs-00003.safetensors'}: unreadable")
            from pipeline.drafts.batch import Batch

            z = torch.zeros(1, 2, dtype=torch.long)
            return Batch(torch.zeros(1, 2, 3), torch.zeros(1, 2, 1), z, z, z.bool(), torch.tensor([2]))

    feeder = Feeder(Unreadable(), range(1, 6), lambda step: [[step]], torch.device("cpu"), torch.float32)
    try:
        assert len(feeder.next(1)) == 1 and len(feeder.next(2)) == 1
        with pytest.raises(hs.StoreError, match="hs-00003.safetensors"):
            feeder.next(3)
    finally:
        feeder.close()


@pytest.mark.slow
def test_a_truncated_shard_is_named_when_training_opens_the_store(tmp_path_factory, tmp_path) -> None:
    import shutil

    src = shared(tmp_path_factory, "ext")
    ext = tmp_path / "ext"
    shutil.copytree(src, ext)
    man = json.loads((ext / "manifest.json").read_text())
    victim = ext / man["shards"][1]["file"]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(hs.StoreError, match=f"{victim}: tensor .* runs past the end of the file"):
        hs.HiddenStore(ext)


@pytest.mark.slow
def test_training_measures_acceptance_and_keeps_the_best_checkpoint(tmp_path_factory, tmp_path) -> None:
    ext, voc = shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")
    sections = {
        **TEST_SECTIONS,
        "train": {
            **TEST_SECTIONS["train"],
            "steps": 24,
            "checkpoint_every": 6,
            "keep_checkpoints": 10,
            "eval_spec_steps": 3,
        },
    }
    plan = write_plan(tmp_path / "plan.toml", **sections)
    out = tmp_path / "train"
    run_stage("pipeline.stages.train", plan, out, [ext, voc])
    acc = {
        e.get("step"): e.get("value")
        for e in events(out)
        if e.type == "metric" and e.get("name") == "accept_length"
    }
    assert sorted(acc) == [6, 12, 18, 24]
    assert all(1.0 <= v <= 4.0 for v in acc.values())
    assert acc[24] > acc[6] or max(acc.values()) > min(acc.values())  # it moves as the draft trains
    man = json.loads((out / "manifest.json").read_text())
    best = max(acc, key=lambda s: (acc[s], -s))
    assert man["step"] == best and man["last_step"] == 24
    assert man["accept_length"] == pytest.approx(acc[best]) and "accept length" in man["chosen_by"]
    # draft/ holds exactly the weights of that checkpoint
    from safetensors.torch import load_file

    drafted = load_file(str(out / "draft" / "model.safetensors"))
    ckpt = load_file(str(out / "checkpoints" / f"step_{best:08d}" / "model.safetensors"))
    assert drafted.keys() == ckpt.keys() and all(torch.equal(drafted[k], ckpt[k]) for k in drafted)
    msgs = [e.get("text", "") for e in events(out) if e.type == "message"]
    assert any(f"step-{best} checkpoint" in m for m in msgs)


@pytest.mark.slow
def test_without_held_out_rows_training_says_acceptance_is_not_tracked(tmp_path_factory, tmp_path) -> None:
    tok, voc = shared(tmp_path_factory, "tok"), shared(tmp_path_factory, "voc")
    sections = {
        **TEST_SECTIONS,
        "extract": {**TEST_SECTIONS["extract"], "eval_rows": 0},
        "train": {**TEST_SECTIONS["train"], "steps": 2, "checkpoint_every": 2},
    }
    plan = write_plan(tmp_path / "plan.toml", **sections)
    run_stage("pipeline.stages.extract", plan, tmp_path / "ext", [tok])
    assert not json.loads((tmp_path / "ext" / "manifest.json").read_text())["eval_shards"]
    run_stage("pipeline.stages.train", plan, tmp_path / "train", [tmp_path / "ext", voc])
    warn = [e for e in events(tmp_path / "train") if e.type == "message" and e.get("level") == "warning"]
    assert any("acceptance is not tracked" in e.get("text", "") for e in warn)
    man = json.loads((tmp_path / "train" / "manifest.json").read_text())
    assert man["step"] == 2 and man["chosen_by"] == "last step"


def test_shard_names_keep_the_eval_split_apart() -> None:
    assert hs.is_eval_shard(hs.eval_shard_name(3)) and not hs.is_eval_shard(hs.shard_name(3))
    assert Path(hs.eval_shard_name(0)).suffix == ".safetensors"
