"""The DFlash draft's own ``[train]`` keys (``dflash_*``), typed, and their rules against the rest of ``[train]``
and, in the deep check, against the target: :class:`DFlashSettings`, registered as the method's ``SETTINGS``
(:mod:`pipeline.run.plan.draft_names`).

Standard library only: the plan loads this module when ``[train] draft = "dflash"`` without importing torch
(nor anything else of :mod:`pipeline.drafts`). The keys stay flat in ``[train]`` (``dflash_block_size = 8``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.run.plan.schema import setting
from pipeline.run.plan.sections import DeepFacts, DeepLine, DraftSettings, TrainSection


@dataclass(frozen=True)
class DFlashSettings(DraftSettings):
    """``[train] dflash_*``: the block, the draft's depth, the target layers it reads and its objective."""

    dflash_block_size: int = setting(
        16,
        "dflash: slots per drafted block (the last token + block_size-1 drafts; SGLang's draft tokens)",
        lo=2,
        hi=64,
    )
    dflash_layers: int = setting(1, "dflash: draft decoder layers", lo=1, hi=64)
    dflash_target_layers: tuple[int, ...] | None = setting(
        None,
        "dflash: target layers it conditions on, among the extraction's aux layers (unset: all of them)",
        lo=0,
        hi=4096,
    )
    dflash_anchors: int = setting(64, "dflash: blocks (anchor positions) trained per row", lo=1, hi=65536)
    dflash_loss_gamma: float = setting(
        7.0, "dflash: slot k's loss weight is exp(-(k-1)/gamma) (0: all slots equal)", lo=0, hi=1e6
    )
    dflash_mask_token_id: int = setting(
        -1,
        "dflash: the token id whose embedding fills the drafted slots (-1: the target's last vocabulary id)",
        lo=-1,
    )

    @property
    def drafts_per_block(self) -> int:
        """Tokens a block drafts: every slot but the first (the last verified token)."""
        return self.dflash_block_size - 1

    def target_layers(self, aux_layers: list[int]) -> list[int]:
        """The target layers the draft reads: ``dflash_target_layers``, else every aux layer."""
        return list(self.dflash_target_layers) if self.dflash_target_layers is not None else list(aux_layers)

    def mask_token_id(self, vocab_size: int) -> int:
        """The id filling the drafted slots: ``dflash_mask_token_id``, else the target's last vocabulary id."""
        return self.dflash_mask_token_id if self.dflash_mask_token_id >= 0 else vocab_size - 1

    def check(self, file: Path | str, name: str) -> None:
        ids = self.dflash_target_layers
        if ids is not None and (not ids or list(ids) != sorted(set(ids))):
            self.bad(
                file,
                f"{name}.dflash_target_layers",
                f"{list(ids)} must be a non-empty list of distinct ascending layer ids (SGLang concatenates in layer order)",
            )

    def check_train(self, train: TrainSection, file: Path | str, name: str) -> None:
        """Keys that mean nothing to (or contradict) the DFlash draft."""
        if train.loss != "kl":
            self.bad(
                file,
                f"{name}.loss",
                f'"{train.loss}" trains EAGLE-3 only; DFlash trains block cross-entropy (leave it "kl")',
            )
        for key in ("draft_fc_norm", "draft_norm_output"):
            if getattr(train, key):
                self.bad(file, f"{name}.{key}", f'an EAGLE-3.1 switch; {name}.draft is "dflash"')

    def spec_steps_limit(self, train: TrainSection, name: str) -> tuple[int, str]:
        return (
            self.drafts_per_block,
            f"{name}.dflash_block_size - 1 ({self.drafts_per_block}): a block drafts that many tokens",
        )

    def default_spec_steps(self, train: TrainSection) -> int:
        """A whole block's drafts: what SGLang verifies."""
        return self.drafts_per_block

    def deep_check(self, train: TrainSection, facts: DeepFacts) -> list[DeepLine]:
        """The target layers it reads are captured and exist, its mask token is in the target's vocabulary, and
        the offline bench asks for no more drafts than a block holds."""
        where, problems = facts.plan_file, []
        layers = self.target_layers(list(facts.aux_layers))
        key = "train.dflash_target_layers" if self.dflash_target_layers is not None else "extract.aux_layers"
        past = [i for i in layers if not 0 <= i < facts.num_layers]
        missing = [i for i in layers if i not in facts.aux_layers]
        if past:
            problems.append(
                f"{where}: {key}: layers {past} are past the target's last layer "
                f"({facts.config_file}: {facts.text_prefix}num_hidden_layers is {facts.num_layers})"
            )
        elif missing:
            problems.append(
                f"{where}: train.dflash_target_layers: layers {missing} are not captured by the extraction (it "
                f"stores {list(facts.aux_layers)}); add them to extract.aux_layers"
            )
        mask = self.mask_token_id(facts.vocab_size)
        if not 0 <= mask < facts.vocab_size:
            problems.append(
                f"{where}: train.dflash_mask_token_id: {mask} is outside the target's vocabulary (0..{facts.vocab_size - 1}: "
                f"{facts.config_file}: {facts.text_prefix}vocab_size)"
            )
        if facts.offline_bench_stages and facts.bench_steps > self.drafts_per_block:
            problems.append(
                f"{where}: bench.steps: {facts.bench_steps} but the DFlash draft's blocks of {self.dflash_block_size} "
                f"draft {self.drafts_per_block} (stage {', '.join(facts.offline_bench_stages)}): set it to "
                f"{self.drafts_per_block} or less"
            )
        if problems:
            return [DeepLine("dflash", False, p) for p in problems]
        return [
            DeepLine(
                "dflash",
                True,
                f"blocks of {self.dflash_block_size} ({self.drafts_per_block} drafts per verification; SGLang "
                f"{facts.sglang_release}: --speculative-algorithm DFLASH --speculative-num-draft-tokens "
                f"{self.dflash_block_size}), {self.dflash_layers} layer(s) reading target layers {layers}, "
                f"mask token {mask}",
            )
        ]


SETTINGS = DFlashSettings
