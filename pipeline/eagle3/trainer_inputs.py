"""What any EAGLE-3 trainer reads from a run: the extraction and the draft vocabulary among its inputs (by
manifest kind), and the draft initialised from the target (seeded). Shared by the train stage and
``bench/gpu/specforge_train.py`` (SpecForge's trainer on the same store), so both start from the same draft."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from pipeline.eagle3 import draft_vocab
from pipeline.eagle3.draft_config import DraftConfig
from pipeline.eagle3.draft_model import Eagle3Draft
from pipeline.manifests import hidden_store as hs_manifest
from pipeline.manifests import vocab as vocab_manifest
from pipeline.manifests.base import of_kind
from pipeline.manifests.hidden_store import HiddenStatesManifest
from pipeline.run.plan.sections import TrainSection


def find_inputs(dirs: list[Path]) -> tuple[HiddenStatesManifest, Path, Path]:
    """(extraction manifest, its dir, vocab dir) among the input dirs, by manifest kind; a damaged manifest
    is a :class:`~pipeline.manifests.base.ManifestError` (a ``ValueError``) naming its file and field."""
    ext: tuple[HiddenStatesManifest, Path] | None = None
    vocab: Path | None = None
    for d in dirs:
        for mpath in of_kind(d, (hs_manifest.KIND,)):
            ext = (hs_manifest.read(mpath), mpath.parent)
        for mpath in of_kind(d, (vocab_manifest.KIND,)):
            vocab_manifest.read(mpath)  # checked here, loaded by draft_vocab.load
            vocab = mpath.parent
    if ext is None:
        raise ValueError(
            f"no extraction among the inputs ({', '.join(map(str, dirs))}): put the extract stage in 'after'"
        )
    if vocab is None:
        raise ValueError(
            f"no draft vocabulary among the inputs ({', '.join(map(str, dirs))}): put the vocab stage in 'after'"
        )
    return ext[0], ext[1], vocab


def build_draft(
    model_id: str,
    aux: list[int],
    vm: draft_vocab.VocabMap,
    s: TrainSection,
    trust_remote_code: bool = False,
) -> tuple[Eagle3Draft, torch.Tensor, torch.Tensor]:
    """The draft to train (EAGLE-3.1 switches from ``[train]``), the target's ``lm_head`` rows of the
    draft vocabulary and its whole ``lm_head`` (the LK losses' acceptance is over the whole vocabulary)."""
    from pipeline.eagle3.target_capture import load_target_tensors, target_config

    tcfg = target_config(model_id, trust_remote_code=trust_remote_code)
    cfg = dataclasses.replace(
        DraftConfig.from_target(tcfg, vm.size, aux), fc_norm=s.draft_fc_norm, norm_output=s.draft_norm_output
    )
    torch.manual_seed(s.seed)
    draft = Eagle3Draft(cfg)
    t = load_target_tensors(model_id, trust_remote_code=trust_remote_code)
    draft.embed_tokens.weight.data.copy_(t["embed"])
    draft.set_vocab(vm.d2t, vm.t2d)
    head_d = t["head"][vm.draft_ids].clone()
    if s.init_lm_head == "target":
        draft.lm_head.weight.data.copy_(head_d)
        draft.norm.weight.data.copy_(t["norm"])
    return draft, head_d, t["head"]
