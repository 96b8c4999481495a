"""The DFlash draft method's spec (``METHOD``): its parts as the train and bench stages call them."""

from __future__ import annotations

from typing import Any

from pipeline.drafts.dflash.build import build_dflash
from pipeline.drafts.dflash.decode import dflash_drafter
from pipeline.drafts.dflash.loss import BlockLoss
from pipeline.drafts.dflash.model import save_dflash
from pipeline.drafts.dflash.settings import DFlashSettings
from pipeline.drafts.registry import BuildInputs, BuiltDraft, DraftMethod
from pipeline.run.plan.sections import DeploySection, TrainSection


def build(inp: BuildInputs) -> BuiltDraft:
    """The draft sized from the target; it holds the target's LM head itself (no head rows beside it)."""
    draft, cols = build_dflash(inp.model_id, inp.aux_layer_ids, inp.settings, inp.trust_remote_code)
    return BuiltDraft(draft=draft, aux_cols=cols)


def describe(s: TrainSection) -> str:
    d = DFlashSettings.of(s)
    return f"DFlash: {d.dflash_layers} layer(s), blocks of {d.dflash_block_size}, {d.dflash_anchors} anchors per row"


def serve_flags(s: TrainSection, d: DeploySection) -> tuple[str, ...]:
    """One block per verification: its size is the draft's, not [deploy]'s chain settings (which it ignores)."""
    block = DFlashSettings.of(s).dflash_block_size
    return ("--speculative-algorithm", "DFLASH", "--speculative-num-draft-tokens", str(block))


def manifest(s: TrainSection) -> dict[str, Any]:
    return {"block_size": DFlashSettings.of(s).dflash_block_size, "loss": "dflash"}


def bench_problem(man: dict[str, Any], steps: int, tensor_parallel: bool) -> str | None:
    """The offline bench runs the target on one device or spread, and drafts at most a block's tokens."""
    if tensor_parallel:
        return (
            "the offline bench of a DFlash draft runs the target on one device or spread "
            '(device = "auto"), not tensor-parallel'
        )
    block = int(man.get("block_size") or 0)
    if steps > block - 1:
        return f"[bench] steps is {steps} but the DFlash draft's blocks of {block} draft {block - 1}: set it to {block - 1}"
    return None


METHOD = DraftMethod(
    name="dflash",
    build=build,
    loss=BlockLoss.from_settings,
    export=save_dflash,
    drafter=dflash_drafter,
    describe=describe,
    serve_flags=serve_flags,
    manifest=manifest,
    shape_keys=(
        "dflash_block_size",
        "dflash_layers",
        "dflash_target_layers",
        "dflash_mask_token_id",
    ),  # its own keys
    bench_problem=bench_problem,
)
