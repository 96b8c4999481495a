"""What the train stage leaves: ``draft/`` (the best checkpoint's export, or the last step's, with its
provenance), the stage's ``manifest.json`` (:mod:`pipeline.manifests.train`) and the closing line saying how to serve it."""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.drafts.registry import DraftMethod
from pipeline.eagle3 import provenance
from pipeline.manifests import train as train_manifest
from pipeline.manifests.train import DraftManifest
from pipeline.run.plan.sections import TrainSection
from pipeline.run.rundir.files import swap_dir
from pipeline.stages.train.checkpoints import BEST_DIR, FINAL_DIR, STEPS_FILE
from pipeline.stages.train.inputs import Inputs


def write_final_draft(
    method: DraftMethod,
    draft: Any,
    best: dict[str, Any] | None,
    out: Path,
    found: Inputs,
    s: TrainSection,
    mode: str,
    world: int,
) -> Path:
    """``draft/``: the best checkpoint's export (or the last step's), with its provenance, swapped in whole."""
    final = out / FINAL_DIR
    tmp = out / (FINAL_DIR + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if best is not None:
        shutil.copytree(out / BEST_DIR, tmp)
        (tmp / "best.json").unlink(missing_ok=True)
    else:
        method.export(draft, tmp)
    provenance.write(  # which target, tokenizer, data and recipe this draft is for: the serve stage checks it
        tmp,
        model=found.model_id,
        aux_layer_ids=found.aux,
        vocab_dir=found.vocab_dir,
        manifests={"extract": found.ext_dir / "manifest.json", "vocab": found.vocab_dir / "manifest.json"},
        sources=list(found.man.sources or ()),
        recipe={"draft": s.draft, "mode": mode, "world_size": world, "train": asdict(s)},
        accept_length={
            "held_out": best["accept_length"] if best else None,
            "step": best["step"] if best else None,
            "spec_steps": s.spec_steps if best else None,
            "by_category": None,  # not measured per category in training; the bench stage's results.json
        },
    )
    swap_dir(tmp, final)
    return final


def write_manifest(
    out: Path,
    found: Inputs,
    s: TrainSection,
    method: DraftMethod,
    best: dict[str, Any] | None,
    last_saved: int,
    stopped: str | None,
    draft_vocab_size: int,
    mode: str,
    world: int,
) -> None:
    """The stage's ``manifest.json``: which step ``draft/`` is, why, and the recipe the bench and serve read."""
    man = found.man
    train_manifest.write(
        out / "manifest.json",
        DraftManifest(
            kind=train_manifest.KIND,
            path=FINAL_DIR,
            step=best["step"] if best else last_saved,
            last_step=last_saved,
            stopped_early=stopped,  # why training ended before [train] steps, or null
            chosen_by="simulated accept length on held-out rows" if best else "last step",
            accept_length=best["accept_length"] if best else None,
            eval_spec_steps=s.spec_steps if best else None,
            target=found.model_id,
            aux_layer_ids=tuple(found.aux),
            steps_log=STEPS_FILE,
            draft_vocab_size=draft_vocab_size,
            draft=s.draft,
            ttt_steps=s.ttt_steps,
            method=method.manifest(s),  # the method's own keys (block_size, loss): top-level keys on disk
            fc_norm=s.draft_fc_norm,
            norm_output=s.draft_norm_output,
            mode=mode,
            token_sources=tuple(man.sources or ()),
            holdout=man.holdout,
            max_length=man.max_length,
            world_size=world,
            provenance=f"{FINAL_DIR}/{provenance.PROVENANCE_FILE}",
        ),
    )


def finished_message(
    final: Path, best: dict[str, Any] | None, last_saved: int, serve_flags: tuple[str, ...]
) -> str:
    which = (
        f"the step-{best['step']} checkpoint, best simulated accept length {best['accept_length']:.3f}"
        if best
        else f"step {last_saved}"
    )
    flags = " ".join(serve_flags)
    return f"draft written to {final} ({which}; SGLang: {flags} --speculative-draft-model-path {final})"
