"""A retry of the train stage resumes only a checkpoint of the draft the plan builds now.

The checkpoint loader is not strict (the frozen embedding is not saved), so a plan edited between attempts —
EAGLE-3.1's switches turned on, or the draft kind changed — would have loaded what matched and silently started
the rest afresh. These tests write real checkpoints of tiny real drafts with the stage's own writer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from pipeline.eagle3.draft_model import Eagle3Draft
from pipeline.run.plan.sections import TrainSection
from pipeline.stages.train.checkpoints import STATE_FILE, resume_problem, save_checkpoint
from tests.test_eagle3_model import tiny_config


def _checkpoint(tmp_path: Path, settings: TrainSection, draft: Eagle3Draft) -> tuple[Path, dict]:
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    path = save_checkpoint(tmp_path, 4, draft, opt, settings, {"world_size": 1})
    return path, torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


def test_the_same_plan_resumes(tmp_path: Path) -> None:
    s = TrainSection()
    draft = Eagle3Draft(tiny_config())
    path, state = _checkpoint(tmp_path, s, draft)
    assert resume_problem(path, state, s, set(draft.trainable_state())) is None


def test_eagle31_switches_turned_on_between_attempts_are_refused_naming_the_key(tmp_path: Path) -> None:
    plain = TrainSection()
    path, state = _checkpoint(tmp_path, plain, Eagle3Draft(tiny_config()))
    now = replace(plain, draft_fc_norm=True)
    new_draft = Eagle3Draft(tiny_config(fc_norm=True))
    problem = resume_problem(path, state, now, set(new_draft.trainable_state()))
    assert problem is not None
    assert str(path) in problem and "train.draft_fc_norm = False" in problem and "--fresh" in problem
    assert (path / STATE_FILE).is_file()  # refused, not deleted: setting the key back resumes it


def test_a_checkpoint_of_another_draft_is_refused_even_without_recorded_settings(tmp_path: Path) -> None:
    """An older checkpoint (no settings recorded) is judged by the tensors it holds."""
    s = TrainSection()
    path, state = _checkpoint(tmp_path, s, Eagle3Draft(tiny_config()))
    del state["settings"]
    new_draft = Eagle3Draft(tiny_config(fc_norm=True))
    problem = resume_problem(path, state, s, set(new_draft.trainable_state()))
    assert problem is not None and "missing" in problem and "fc_norm" in problem
