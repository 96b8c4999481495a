"""The EAGLE-3 draft method's spec (``METHOD``): its parts as the train and bench stages call them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.drafts.eagle3.loss import TTTLoss
from pipeline.drafts.registry import BuildInputs, BuiltDraft, DrafterInputs, DraftMethod
from pipeline.eagle3.draft_model import load_draft, save_draft
from pipeline.eagle3.spec_decode import Eagle3Drafter
from pipeline.eagle3.trainer_inputs import build_draft
from pipeline.run.plan.sections import DeploySection, TrainSection


def build(inp: BuildInputs) -> BuiltDraft:
    """The draft initialised from the target, with the target's LM head over the draft vocabulary."""
    draft, head_d, head_full = build_draft(
        inp.model_id, inp.aux_layer_ids, inp.vocab, inp.settings, inp.trust_remote_code
    )
    return BuiltDraft(draft=draft, head_d=head_d, head_full=head_full)


def drafter(inp: DrafterInputs) -> Eagle3Drafter:
    """The saved draft beside the target's embedding, drafting a chain per verify step."""
    return Eagle3Drafter(load_draft(inp.path, embed=inp.embed, dtype=inp.dtype).to(inp.device))


def eagle31_note(s: TrainSection) -> str:
    """The startup note for the EAGLE-3.1 switches that are on, e.g. " (EAGLE-3.1: fc_norm)"; empty if none."""
    on = [k for k, v in (("fc_norm", s.draft_fc_norm), ("norm_output", s.draft_norm_output)) if v]
    return f" (EAGLE-3.1: {', '.join(on)})" if on else ""


def describe(s: TrainSection) -> str:
    return f"TTT {s.ttt_steps}, loss {s.loss}{eagle31_note(s)}"


def manifest(s: TrainSection) -> dict[str, Any]:
    return {"block_size": None, "loss": s.loss}


def serve_flags(s: TrainSection, d: DeploySection) -> tuple[str, ...]:
    """A chain drafter: [deploy]'s steps, top-k and draft tokens per verification."""
    return (
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        str(d.speculative_num_steps),
        "--speculative-eagle-topk",
        str(d.speculative_eagle_topk),
        "--speculative-num-draft-tokens",
        str(d.speculative_num_draft_tokens),
    )


def export(draft: Any, path: Path) -> None:
    save_draft(draft, path)


METHOD = DraftMethod(
    name="eagle3",
    build=build,
    loss=TTTLoss.from_settings,
    export=export,
    drafter=drafter,
    describe=describe,
    serve_flags=serve_flags,
    manifest=manifest,
    shape_keys=("draft_fc_norm", "draft_norm_output"),
)
