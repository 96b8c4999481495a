"""The target's weights per rank as the loading engine really lays them out — read from the engine where it can be.

**transformers** (what the extract and train stages load today): the model is built on the meta device and put
through the checkpoint's own quantizer (``compressed-tensors``), the same step ``from_pretrained`` takes before
it reads a weight, so every parameter carries the dtype and shape transformers will hold. For Kimi-K2.5 that
shows what its published config hides: the routed experts are fused bf16 tensors that the packed INT4
checkpoint is *dequantized* into — 2 bytes a weight against 0.5625 packed (3.56×), ≈ 2 TB for a 595 GB
checkpoint. Which parameters a rank shards is the installed transformers' own TP plan. transformers 5.24 cannot
load such a packed checkpoint tensor-parallel at all (its loader fails sharding the packed expert tensors;
``tests/test_target_memory.py`` runs it), so with quantized experts TP > 1 is a failure, not a number.

**sglang** (the engine that can hold Kimi-K2.5; capture through it is issue 26): packed weights stay packed
(``num_bits``/8 bytes plus a bf16 scale per group), and SGLang's DeepSeek-V2/V3 model shards every projection
over the TP ranks (column/row-parallel attention and MLP, vocabulary-parallel embedding and head, experts
split by TP or EP) except the low-rank ``q_a``/``kv_a`` projections, the router and the norms, which every
rank replicates (``sglang/srt/models/deepseek_v2.py``); the vision tower is replicated.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any

# SGLang's DeepSeek-V2/V3 modules every TP rank holds whole (ReplicatedLinear, the router, norms, biases).
SGLANG_REPLICATED = (
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "mlp.gate.",
    "layernorm",
    "norm.weight",
    "e_score_correction",
)


@dataclass(frozen=True)
class Layout:
    """One engine's weights of the target: what the ranks split, what each holds whole, and why it cannot load."""

    engine: str
    sharded: int
    replicated: int
    dequantized: int = 0  # bytes held dequantized of weights the checkpoint stores quantized
    problem: str | None = None  # set when this engine cannot load the target tensor-parallel

    def per_rank(self, tp: int) -> int:
        return self.replicated + math.ceil(self.sharded / max(1, tp))

    def min_ranks(self, budget: int) -> int | None:
        """The fewest ranks whose share fits ``budget`` bytes each (None: the replicated part alone does not)."""
        room = budget - self.replicated
        return math.ceil(self.sharded / room) if room > 0 else None


@dataclass(frozen=True)
class Quantization:
    bits: int
    group: int
    ignore: tuple[
        str, ...
    ]  # module name patterns ("re:..." regexes or exact names) the checkpoint keeps dense

    def covers(self, name: str) -> bool:
        """Whether the checkpoint stores module ``name``'s weight quantized (a routed expert, not an ignored one)."""
        for pat in self.ignore:
            if pat.startswith("re:") and re.match(pat[3:], name) or name == pat:
                return False
        return True


def quantization_of(cfg: Any) -> Quantization | None:
    """The weight quantization a compressed-tensors ``quantization_config`` declares (None: a dense checkpoint)."""
    tcfg = getattr(cfg, "text_config", None) or cfg
    q = getattr(cfg, "quantization_config", None) or getattr(tcfg, "quantization_config", None)
    if not q:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    for g in (q.get("config_groups") or {}).values():
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict) and isinstance(w.get("num_bits"), int):
            return Quantization(
                int(w["num_bits"]), int(w.get("group_size") or 32), tuple(q.get("ignore") or ())
            )
    return None


def _tp_sharded(name: str, tp_plan: dict[str, Any]) -> bool:
    tail = name.split("layers.", 1)[-1] if "layers." in name else name
    return any(
        fnmatch.fnmatch("layers." + tail, pat) or fnmatch.fnmatch("layers." + tail.rsplit(".", 1)[0], pat)
        for pat in tp_plan
    )


def transformers_layout(cfg: Any, model_class: Any, tp: int) -> Layout:
    """What ``from_pretrained(dtype=bfloat16)`` holds: the model built on meta and put through the checkpoint's
    quantizer. Raises ``ImportError`` naming the package when the checkpoint's quantizer is not installed."""
    import torch

    with torch.device("meta"):
        model = model_class.from_config(cfg, dtype=torch.bfloat16)
    quant = quantization_of(cfg)
    if getattr(cfg, "quantization_config", None) is not None:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(cfg.quantization_config)  # imports compressed-tensors
        with contextlib.suppress(
            ImportError
        ):  # which logs a line per odd-sized vision layer: not our finding
            from loguru import logger

            logger.disable("compressed_tensors")
        quantizer.validate_environment()  # ImportError: compressed-tensors is missing
        quantizer.preprocess_model(model)
    tcfg = getattr(cfg, "text_config", None) or cfg
    plan = dict(getattr(tcfg, "base_model_tp_plan", None) or {})
    sharded = replicated = dequantized = 0
    packed_experts = False
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        b = t.numel() * t.element_size()
        if _tp_sharded(name, plan):
            sharded += b
        else:
            replicated += b
        routed = ".mlp.experts." in f".{name}." and "shared_experts" not in name
        if quant is not None and routed and t.is_floating_point() and quant.covers(name.rsplit(".", 1)[0]):
            dequantized += (
                b  # stored packed, held as this dtype: the quantizer had no module to keep it packed in
            )
            packed_experts = True
    problem = None
    if packed_experts and tp > 1:
        import transformers

        problem = (
            f"transformers {transformers.__version__} cannot load this checkpoint tensor-parallel: its packed INT4 "
            "experts fail in the loader's sharding (tests/test_target_memory.py)"
        )
    return Layout("transformers", sharded, replicated, dequantized, problem)


def sglang_layout(model: Any, cfg: Any) -> Layout:
    """SGLang's layout of the same parameters (``model``: the plain model on the meta device)."""
    quant = quantization_of(cfg)
    sharded = replicated = 0
    for name, p in model.named_parameters():
        n = p.numel()
        routed = ".mlp.experts." in f".{name}." and "shared_experts" not in name
        packed = quant is not None and routed and quant.covers(name.rsplit(".", 1)[0])
        b = n * quant.bits // 8 + (n // quant.group) * 2 if packed and quant else n * 2
        whole = "vision_tower" in name or "mm_projector" in name or any(k in name for k in SGLANG_REPLICATED)
        if whole:
            replicated += b
        else:
            sharded += b
    return Layout("sglang", sharded, replicated)
