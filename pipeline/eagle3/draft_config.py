"""The EAGLE-3 draft's configuration: its sizes from the target's config, the aux layers it fuses, and the
``config.json`` SGLang's ``LlamaForCausalLMEagle3`` loader reads (fields as SpecForge writes them).

Standard library only (no torch): the deep check and the extraction read it before any model exists.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.serving import sglang_capture

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# SpecForge's Kimi-K2 / K2.5 draft configs (configs/kimi-k2*-eagle3.json): an MLA target's draft is a
# plain Llama layer with 128-wide heads, as many heads as the target (MHA), the target's dense MLP width.
MLA_DRAFT_HEAD_DIM = 128


class DraftModelError(ValueError):
    """A draft checkpoint or config that cannot be used; names the file and field."""


def parse_layer_shape(
    d: dict[str, Any], architecture: str, int_keys: tuple[str, ...], where: str
) -> dict[str, Any]:
    """What every draft ``config.json`` SGLang loads shares: the architecture check, the integer fields
    ``int_keys`` (each named in the error when missing or not an integer) and one Llama-style layer's shape
    and RoPE, with SGLang's defaults for what a config leaves out (kv heads = heads, head dim = hidden / heads)."""
    if architecture not in (d.get("architectures") or []):
        raise DraftModelError(
            f"{where}: architectures is {d.get('architectures')!r}, expected [{architecture!r}]"
        )
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", *int_keys):
        if not isinstance(d.get(key), int):
            raise DraftModelError(f"{where}: {key} must be an integer, got {d.get(key)!r}")
    heads = d["num_attention_heads"]
    return {
        "hidden_size": d["hidden_size"],
        "intermediate_size": d["intermediate_size"],
        "num_attention_heads": heads,
        "num_key_value_heads": int(d.get("num_key_value_heads") or heads),
        "head_dim": int(d.get("head_dim") or d["hidden_size"] // heads),
        "vocab_size": d["vocab_size"],
        "rope_theta": float(d.get("rope_theta", 10000.0)),
        "rope_scaling": d.get("rope_scaling"),
        "max_position_embeddings": int(d.get("max_position_embeddings", 4096)),
        "hidden_act": d.get("hidden_act", "silu"),
        **{k: d[k] for k in int_keys},
    }


def default_aux_layers(num_layers: int) -> list[int]:
    """SpecForge's HF-backend default ``[1, L//2-1, L-4]``: the 0-based layers whose *output* is fused.

    SGLang captures the input of layer ``id+1`` (``set_eagle3_layers_to_capture`` adds 1), which is
    the output of layer ``id``; with no ids in the draft config it uses ``[2, L//2, L-3]`` as
    inputs, i.e. these same outputs.
    """
    if num_layers < 5:
        raise DraftModelError(
            f"target has {num_layers} layers; EAGLE-3 needs at least 5 to pick low/mid/high"
        )
    return [1, num_layers // 2 - 1, num_layers - 4]


def normalise_aux_layers(ids: list[int], num_layers: int, where: str = "extract.aux_layers") -> list[int]:
    """The aux layers as SGLang captures them: ascending, each once, in range, three of them.

    SGLang concatenates the captured states in layer order whatever order the draft config lists,
    so a draft trained on ``[26, 1, 14]`` in that order would be fed scrambled features when served.
    """
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DraftModelError(f"{where}: expected a list of layer ids, got {ids!r}")
    for i in ids:
        if not 0 <= i < num_layers:
            raise DraftModelError(
                f"{where}: layer {i} out of range (the target has {num_layers} layers, 0..{num_layers - 1})"
            )
    out = sorted(set(ids))
    if len(out) != 3:
        raise DraftModelError(f"{where}: EAGLE-3 fuses 3 distinct layers (low, mid, high), got {ids!r}")
    return out


def sglang_capture_ids(aux_layer_ids: list[int], architecture: str | None = None) -> list[int]:
    """The layers whose *input* SGLang hooks to feed the outputs of ``aux_layer_ids`` (``id + 1``); raises
    :class:`DraftModelError` where SGLang cannot be told to (see :mod:`pipeline.serving.sglang_capture`)."""
    try:
        ids = sglang_capture.config_layer_ids(aux_layer_ids, architecture)
    except sglang_capture.CaptureError as exc:
        raise DraftModelError(str(exc)) from None
    return sglang_capture.layers_to_capture(ids, architecture)


def is_mla(cfg: Any) -> bool:
    """A DeepSeek-V2/V3-class target (multi-head latent attention: Kimi-K2/K2.5, DeepSeek-V3/R1)."""
    return (
        getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None
    )


def _target_rope(cfg: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers config of either the 4.x or the 5.x layout."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        rtype = params.get("rope_type", "default")
        scaling = None if rtype == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
        return float(params["rope_theta"]), scaling
    theta = float(getattr(cfg, "rope_theta", 10000.0))
    scaling = getattr(cfg, "rope_scaling", None)
    return theta, (dict(scaling) if scaling else None)


@dataclass
class DraftConfig:
    """What the draft needs; serialised as an SGLang-loadable ``config.json``."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    aux_layer_ids: list[int]
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # The target's model class as SGLang picks it: its rule for which layers the config's ids capture.
    target_architecture: str | None = None
    # EAGLE-3.1 (config keys as SGLang's llama_eagle3.py reads them, top level of config.json):
    # fc_norm: an RMSNorm on each of the low/mid/high target states before ``fc`` (``fc_norm.{0,1,2}``);
    # norm_output: the next draft step is fed the final-normed hidden instead of the pre-norm one.
    fc_norm: bool = False
    norm_output: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_target(cls, cfg: Any, draft_vocab_size: int, aux_layer_ids: list[int]) -> DraftConfig:
        """A draft sized like the target's decoder layer (SpecForge's convention)."""
        arch = sglang_capture.architecture_of(cfg)  # the wrapper's class (Kimi-K2.5), not its text model's
        cfg = getattr(cfg, "text_config", None) or cfg
        arch = arch or sglang_capture.architecture_of(cfg)
        theta, scaling = _target_rope(cfg)
        heads = int(cfg.num_attention_heads)
        if is_mla(cfg):
            # MLA's per-head dims (qk_rope 64 + nope 128, v 128) and its latent KV do not fit a Llama
            # layer: the draft takes SpecForge's Kimi-K2/K2.5 layout (see MLA_DRAFT_HEAD_DIM).
            head_dim, kv_heads = MLA_DRAFT_HEAD_DIM, heads
        else:
            head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
            kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        return cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(cfg.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=normalise_aux_layers([int(i) for i in aux_layer_ids], int(cfg.num_hidden_layers)),
            target_hidden_size=int(cfg.hidden_size),
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 4096)),
            hidden_act=str(getattr(cfg, "hidden_act", "silu")),
            bos_token_id=getattr(cfg, "bos_token_id", None),
            eos_token_id=getattr(cfg, "eos_token_id", None),
            pad_token_id=getattr(cfg, "pad_token_id", None),
            target_architecture=arch,
        )

    def sglang_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The ``config.json`` SGLang's EAGLE3 loader reads (fields as in SpecForge's draft configs)."""
        out = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            # A tied draft would make SGLang use embed_tokens (full vocab) as the lm_head.
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": dtype,
            # EAGLE-3.1 switches; SGLang reads both with getattr(config, ..., False): written either way.
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "eagle_config": {
                # The ids that make SGLang feed the outputs of aux_layer_ids, by the target's rule.
                "eagle_aux_hidden_state_layer_ids": self.sglang_layer_ids(),
                "use_aux_hidden_state": True,
                # What SGLang hooks for those ids and the target class whose rule that is (Aerie reads the
                # class back to recover aux_layer_ids); the layers are for the operator, not read back.
                "sglang_layers_to_capture": sglang_capture_ids(self.aux_layer_ids, self.target_architecture),
                "target_architecture": self.target_architecture,
            },
        }
        out.update(self.extra)
        return out

    def sglang_layer_ids(self) -> list[int]:
        """``eagle_aux_hidden_state_layer_ids`` for this target (raises where SGLang cannot capture them)."""
        try:
            return sglang_capture.config_layer_ids(self.aux_layer_ids, self.target_architecture)
        except sglang_capture.CaptureError as exc:
            raise DraftModelError(str(exc)) from None

    @classmethod
    def from_sglang_config(cls, d: dict[str, Any], where: str = CONFIG_FILE) -> DraftConfig:
        shape = parse_layer_shape(d, ARCHITECTURE, ("draft_vocab_size",), where)
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise DraftModelError(
                f"{where}: num_hidden_layers is {d.get('num_hidden_layers')}; only 1 is supported"
            )
        eagle = d.get("eagle_config")
        if not isinstance(eagle, dict):
            eagle = {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            raise DraftModelError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is missing")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise DraftModelError(
                f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must be a list of ids"
            )
        arch = eagle.get("target_architecture")  # absent in other trainers' drafts: plus-one rule
        return cls(
            **shape,
            aux_layer_ids=sglang_capture.fed_outputs([int(i) for i in ids], arch),
            target_hidden_size=int(d.get("target_hidden_size") or d["hidden_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            target_architecture=arch,
            # SGLang also takes the legacy ``use_aux_norm`` for fc_norm (drafts of other trainers).
            fc_norm=bool(d.get("fc_norm") or d.get("use_aux_norm")),
            norm_output=bool(d.get("norm_output", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
