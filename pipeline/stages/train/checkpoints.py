"""Checkpoints: ``checkpoints/step_NNNNNNNN/`` written atomically (SGLang-loadable draft + training state), the newest kept."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from pipeline.drafts.registry import draft_method
from pipeline.run.plan.sections import TrainSection
from pipeline.run.rundir.files import swap_dir, write_atomic

CKPT_DIR = "checkpoints"
STATE_FILE = "training_state.pt"
FINAL_DIR = "draft"
BEST_DIR = "best"  # the checkpointed draft with the best simulated accept length so far, and best.json
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


def save_checkpoint(
    out: Path,
    step: int,
    draft: Any,
    opt: torch.optim.Optimizer,
    settings: TrainSection,
    extra: dict[str, Any],
) -> Path:
    final = out / CKPT_DIR / f"step_{step:08d}"
    tmp = out / CKPT_DIR / f".step_{step:08d}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    draft_method(settings.draft).export(draft, tmp)  # the SGLang-loadable folder of the plan's draft method
    state = {
        "step": step,
        "model": {k: v.detach().cpu() for k, v in draft.trainable_state().items()},
        "optimizer": opt.state_dict(),
        "settings": asdict(settings),
        **extra,
    }
    torch.save(state, tmp / STATE_FILE)
    swap_dir(tmp, final)
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
        write_atomic(path, "".join(x + "\n" for x in kept))

    def record(self, step: int, rows: list[str]) -> None:
        import json

        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, "rows": rows}) + "\n")


def save_best(out: Path, draft: Any, best: dict[str, Any], export: Callable[[Any, Path], None]) -> None:
    """``best/``: the draft (SGLang-loadable, by its method's ``export``) and ``best.json`` saying its step and
    accept length, atomically."""
    import json

    final, tmp = out / BEST_DIR, out / (BEST_DIR + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    export(draft, tmp)
    (tmp / "best.json").write_text(json.dumps(best) + "\n")
    swap_dir(tmp, final)


def read_best(out: Path) -> dict[str, Any] | None:
    """What ``best/best.json`` says, or None (no evaluation has finished yet, or its write was cut)."""
    import json

    for d in (out / BEST_DIR, out / (BEST_DIR + ".old")):
        try:
            best = json.loads((d / "best.json").read_text())
        except (OSError, ValueError):
            continue
        if d.name != BEST_DIR:
            os.replace(d, out / BEST_DIR)  # cut between the two renames: the previous best is whole
        return best
    return None


def resume_problem(
    path: Path, state: dict[str, Any], settings: TrainSection, trainable: set[str]
) -> str | None:
    """Why the checkpoint at ``path`` cannot be resumed into the draft the plan builds now (None: it can).

    The loader is not strict (the frozen embedding is not saved), so without this a changed switch would load
    what matches, initialise the rest afresh and carry on as if nothing happened."""
    saved = state.get("settings") or {}
    # The [train] keys that decide the draft's modules: a checkpoint made under other values is another model.
    for key in ("draft", *draft_method(settings.draft).shape_keys):
        if key in saved and _plain(saved[key]) != _plain(getattr(settings, key)):
            return (
                f"{path}: trained with train.{key} = {_plain(saved[key])!r}, but the plan now says "
                f"{_plain(getattr(settings, key))!r}: a resume cannot change the draft's shape. Set it back, or "
                "retry the stage with --fresh to start this draft over (the checkpoints stay until then)"
            )
    have = set(state.get("model") or {})
    if have != trainable:
        missing, extra = sorted(trainable - have), sorted(have - trainable)
        return (
            f"{path}: holds another draft than the plan builds (missing {missing[:4]}, unexpected {extra[:4]}); "
            "retry the stage with --fresh to start over, or restore the plan it was trained with"
        )
    return None


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple | list) else v
