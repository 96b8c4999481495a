"""Checkpoints: ``checkpoints/step_NNNNNNNN/`` written atomically (SGLang-loadable draft + training state), the newest kept."""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pipeline.eagle3.draft_model import Eagle3Draft, save_draft
from pipeline.stages.train.settings import TrainSettings

CKPT_DIR = "checkpoints"
STATE_FILE = "training_state.pt"
FINAL_DIR = "draft"
STEPS_FILE = "steps.jsonl"


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    d = out / CKPT_DIR
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        if p.name.startswith("step_") and (p / STATE_FILE).is_file():
            try:
                found.append((int(p.name[5:]), p))
            except ValueError:
                continue
    return sorted(found)


def save_checkpoint(out: Path, step: int, draft: Eagle3Draft, opt: torch.optim.Optimizer, settings: TrainSettings,
                    extra: dict[str, Any]) -> Path:
    final = out / CKPT_DIR / f"step_{step:08d}"
    tmp = out / CKPT_DIR / f".step_{step:08d}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp)
    state = {"step": step, "model": {k: v.detach().cpu() for k, v in draft.trainable_state().items()},
             "optimizer": opt.state_dict(), "settings": asdict(settings), **extra}
    torch.save(state, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in checkpoints(out)[: -settings.keep_checkpoints]:
        if old.resolve().is_relative_to(out.resolve()):
            shutil.rmtree(old)
    return final


class StepLog:
    """``steps.jsonl``: one line per optimizer step, the global batch's row ids (rank 0 writes).

    A resume from the checkpoint at step ``k`` first drops the lines after ``k`` (those steps are
    trained again), so the file always says exactly which rows the draft has been trained on.
    """

    def __init__(self, path: Path, resume_step: int) -> None:
        import json

        self.path = path
        kept = []
        if resume_step and path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line)
                except (ValueError, KeyError):
                    break  # a torn last line from a kill
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)

    def record(self, step: int, rows: list[str]) -> None:
        import json

        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, "rows": rows}) + "\n")
