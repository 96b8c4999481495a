"""What the train stage trains from: its inputs (the extraction and the draft vocabulary, checked against the
plan) and the data source over them, the stored hidden states (offline) or the rows with the target run
over them as training goes (online)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3.trainer_inputs import find_inputs
from pipeline.manifests.hidden_store import HiddenStatesManifest
from pipeline.run.plan.sections import TrainSection
from pipeline.stages.train.batches import OfflineData, OnlineData
from pipeline.stages.train.components import Runtime, TrainData


@dataclass(frozen=True)
class Inputs:
    """What the stage trains from: the extraction (its manifest and folder), the draft vocabulary's folder,
    and the plan's target."""

    man: HiddenStatesManifest
    ext_dir: Path
    vocab_dir: Path
    model_id: str

    @property
    def aux(self) -> list[int]:
        return list(self.man.aux_layer_ids)

    @classmethod
    def find(cls, dirs: list[Path], model_id: str, s: TrainSection) -> Inputs:
        """The inputs among ``dirs``, refused where they do not fit the plan."""
        man, ext_dir, vocab_dir = find_inputs(dirs)
        if man.target not in (None, model_id):
            raise ValueError(
                f"{ext_dir / 'manifest.json'}: extracted from {man.target!r} but the plan's target is {model_id!r}"
            )
        if s.online_tp and man.mode != "online":
            raise ValueError(
                f'{ext_dir / "manifest.json"}: train.target = "online-tp" needs the extraction in online mode '
                f"(rows only), but it stored hidden states ({man.mode}); retry extract with --fresh"
            )
        return cls(man, ext_dir, vocab_dir, model_id)


def load_data(
    rt: Runtime,
    s: TrainSection,
    man: HiddenStatesManifest,
    ext_dir: Path,
    model_id: str,
    aux: list[int],
    target_max_length: int | None,
    trust_remote_code: bool = False,
    engine: str = "transformers",
) -> TrainData:
    """The data source: the extraction's stored hidden states (offline), or its rows with the target run
    over them as training goes (online; tensor-parallel over the ranks under ``online-tp``; by SGLang's model
    runner in this process with ``engine = "sglang"``)."""
    mode = "online-tp" if s.online_tp else man.mode
    if man.mode == "offline":
        data = TrainData(source=OfflineData(hs.HiddenStore(ext_dir)), mode=mode)
        if s.eval_interval and man.eval_shards:
            data.eval_source = OfflineData(hs.HiddenStore(ext_dir, split="eval"))
    else:
        rows, held = online_rows(s, man, ext_dir, target_max_length)
        target = online_target(rt, s, model_id, aux, rows + held, trust_remote_code, engine)
        data = TrainData(source=OnlineData(rows, target), mode=mode, online_tp=s.online_tp)
        data.eval_source = OnlineData(held, target) if held else None  # the same target, whichever engine
    if data.eval_source is not None:
        data.eval_rows = list(range(min(s.eval_rows, len(data.eval_source))))
    return data


def online_rows(
    s: TrainSection, man: HiddenStatesManifest, ext_dir: Path, target_max_length: int | None
) -> tuple[list[Any], list[Any]]:
    """(the rows the extraction lists, in training order; the held-out rows acceptance is simulated on)."""
    from pipeline.data.shards import iter_rows, training_order

    max_len = man.max_length or s.max_length or target_max_length
    sources = man.source_dirs
    wanted = set(man.row_ids or ())
    holdout = man.holdout or 0.0
    rows = training_order([r for r in iter_rows(sources, holdout, "train", None, max_len) if r.id in wanted])
    if len(rows) != len(wanted):
        raise ValueError(
            f"{ext_dir / 'manifest.json'}: lists {len(wanted)} rows but the sources now hold "
            f"{len(rows)} of them; rerun extraction with --fresh"
        )
    held: list[Any] = []
    if s.eval_interval and holdout > 0:
        held = training_order(list(iter_rows(sources, holdout, "heldout", None, max_len)))
        held = [r for r in held if r.num_tokens >= 2 and r.loss_mask.any()][: s.eval_rows]
    return rows, held


def online_target(
    rt: Runtime,
    s: TrainSection,
    model_id: str,
    aux: list[int],
    rows: list[Any],
    trust_remote_code: bool,
    engine: str,
) -> Any:
    """The target the online rows are run through: SGLang's model runner in this process, transformers
    tensor-parallel over the ranks (``online-tp``), or transformers on this rank's device."""
    from pipeline.eagle3.target_capture import load_target

    if engine == "sglang":  # the plan refuses it with online-tp and with several ranks
        from pipeline.eagle3.sglang_target import load_for_training

        longest = max(r.num_tokens for r in rows) if rows else 1
        runner = load_for_training(
            model_id, aux, rt.device, longest, s.micro_batch, trust_remote_code, str(rt.plan_ctx.plan.path)
        )
        if rt.ctx:
            rt.ctx.message(f"target loaded by SGLang's model runner in this process, capturing layers {aux}")
        return runner
    if s.online_tp:
        target = load_target(
            model_id,
            aux,
            dtype=rt.dtype,
            device=rt.device,
            parallel="tp",
            trust_remote_code=trust_remote_code,
        )
        rt.dist.init(rt.device)  # a no-op where transformers started the group
        return target
    return load_target(model_id, aux, dtype=rt.dtype, device=rt.device, trust_remote_code=trust_remote_code)
