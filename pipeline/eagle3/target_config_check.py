"""The target's ``config.json`` checked field by field, before transformers builds anything from it.

The deep check (:mod:`pipeline.eagle3.chain_check`) builds the target on the meta device from its config;
a malformed config made that crash with a traceback (a YaRN ``rope_scaling`` without ``factor``, a rope
type nobody implements, a vocabulary smaller than the pad id) or, worse, pass: transformers fills a
missing field with its class default, so a ``kimi_k25`` wrapper without ``text_config`` was checked as a
default DeepSeek-V3. Here every field Aerie or the model class reads is checked on the raw JSON, and every
problem is one line naming the file and the field::

    /models/kimi/config.json: text_config.rope_scaling.factor: missing (YaRN needs it)

What is checked: the JSON itself; ``model_type`` (one transformers knows); a wrapper's ``text_config``
(present, a table); the fields that size the model (present: no silent defaults); every field's type
against the config class's own annotations; ranges (sizes positive, counts and rates not negative, the
heads and experts consistent with each other); the rope scaling the draft must reproduce (a supported
type, the keys it needs); the token ids within the vocabulary; ``architectures`` a class of this model
type (it picks SGLang's rule for the capture ids). :func:`tokenizer_problems` checks the vocabulary
against the tokenizer once the check has loaded it.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, TypeGuard

# transformers' Kimi_K25Config renames its remote-code text model type on load (kimi_k2 is DeepSeek-V3).
TEXT_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
# Fields that size the model: where the class declares one, the config must say it (a default is another
# model). MLA and MoE fields only where the class has them.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
# Integer fields that may be 0 (counts of optional parts); every other integer field must be positive.
MAY_BE_ZERO = frozenset(
    {
        "first_k_dense_replace",
        "n_shared_experts",
        "num_nextn_predict_layers",
        "num_mtp_layers",
        "chunk_size_feed_forward",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "pretraining_tp",
        "shared_expert_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "sliding_window",
        "max_window_layers",
    }
)
# Fields whose null means something (no query LoRA: DeepSeek-V2-Lite; as many KV heads as heads); any other
# field the class gives a non-null default needs a value (a null crashes the model or SGLang).
NULL_OK = frozenset({"q_lora_rank", "num_key_value_heads", "bos_token_id", "eos_token_id", "pad_token_id"})
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
ROPE_KEYS = ("rope_scaling", "rope_parameters")
# Per rope type: the keys the draft's rotary embedding reads (pipeline.eagle3.rope), as SGLang does.
ROPE_NEEDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}
ROPE_POSITIVE = (
    "factor",
    "beta_fast",
    "beta_slow",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
    "rope_theta",
)
ROPE_NUMBERS = (*ROPE_POSITIVE, "mscale", "mscale_all_dim", "attn_factor", "extrapolation_factor")


def _hints(cls: Any) -> dict[str, Any]:
    """The config class's annotated fields (its own types: what transformers expects in each)."""
    import torch

    try:
        return typing.get_type_hints(cls, localns={"torch": torch})
    except Exception:  # noqa: BLE001 - an annotation this Python cannot resolve: no type checks
        return {}


def _accepts(value: Any, hint: Any) -> bool:
    """``value`` (from JSON) fits the annotation ``hint``; anything this does not know is accepted."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin is list:
        (inner,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_accepts(v, inner) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # transformers' strict dataclass check refuses an int here, as this does
        return isinstance(value, float)
    if hint is str:
        return isinstance(value, str)
    if isinstance(hint, type) and (hasattr(hint, "__total__") or hasattr(hint, "model_type")):
        return isinstance(value, dict)  # a TypedDict (RopeParameters) or a sub-config: a JSON table
    if isinstance(hint, type):
        return isinstance(value, hint)  # torch.dtype and the like: no JSON value is one
    return True


def _type_name(hint: Any) -> str:
    return str(hint).replace("typing.", "").replace("transformers.modeling_rope_utils.", "")


def _default(cls: Any, name: str) -> Any:
    f = (getattr(cls, "__dataclass_fields__", None) or {}).get(name)
    default = getattr(f, "default", None)
    return None if default is None or type(default).__name__ == "_MISSING_TYPE" else default


def _is_dtype(name: str) -> bool:
    import torch

    return name == "auto" or isinstance(getattr(torch, name, None), torch.dtype)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def config_problems(path: Path, trust_remote_code: bool = False) -> list[str]:
    """Every problem of the config file at ``path``, one line each, naming the file and the field."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [f"{path}: not a readable JSON file: {exc}"]
    if not isinstance(raw, dict):
        return [f"{path}: must be a JSON object (a table of fields), got {type(raw).__name__}"]
    from transformers import CONFIG_MAPPING

    out: list[str] = []
    mt = raw.get("model_type")
    if isinstance(raw.get("auto_map"), dict) and (trust_remote_code or mt not in CONFIG_MAPPING):
        if trust_remote_code:
            return []  # the model's own code defines its fields: transformers' classes cannot check them
        return [
            f"{path}: auto_map: the model needs code of its own ({', '.join(map(str, raw['auto_map'].values()))}); "
            "set target.trust_remote_code = true if you trust it"
        ]
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        what = "missing" if "model_type" not in raw else f"{mt!r} is not a model type transformers knows"
        return [f"{path}: model_type: {what} (the installed transformers builds the model from it)"]
    cls = CONFIG_MAPPING[mt]
    sub = getattr(cls, "sub_configs", None) or {}
    text: Any = raw
    prefix, text_cls = "", cls
    if "text_config" in sub:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            what = "missing" if "text_config" not in raw else f"must be a table, got {text!r}"
            return [
                f"{path}: text_config: {what} (a {mt!r} wrapper holds its language model there; without it "
                "transformers would check a default model of its class instead)"
            ]
        prefix = "text_config."
        tmt = text.get("model_type")
        if "model_type" not in text:  # transformers takes the wrapper's default text model type
            spec = (getattr(cls, "sub_configs_defaults", None) or {}).get("text_config")
            tmt = getattr(spec, "model_type", None)
        tmt = TEXT_TYPE_ALIASES.get(tmt, tmt) if isinstance(tmt, str) else tmt
        if not isinstance(tmt, str) or tmt not in CONFIG_MAPPING:
            return [
                f"{path}: text_config.model_type: {text.get('model_type')!r} is not a model type transformers "
                "knows"
            ]
        text_cls = CONFIG_MAPPING[tmt]
        out += _typed(path, raw, cls, "", skip={"text_config", "vision_config"})
    out += _typed(path, text, text_cls, prefix)
    if out:
        return out  # ranges and consistency assume the types are right
    out += _sizes(path, text, text_cls, prefix)
    out += _rope(path, text, prefix)
    vocab = text.get("vocab_size")
    if _is_int(vocab) and vocab > 0:
        for where, table in (("", raw), (prefix, text)) if prefix else (("", raw),):
            out += _token_ids(path, table, where, vocab, prefix)
    out += _architectures(path, raw, "", mt)
    if prefix:
        out += _architectures(path, text, prefix, text_cls.model_type)
    return out


def _typed(path: Path, table: dict, cls: Any, prefix: str, skip: set[str] | None = None) -> list[str]:
    """Each field of ``table`` against ``cls``'s annotation for it (the raw name, or its attribute_map)."""
    hints = _hints(cls)
    amap = getattr(cls, "attribute_map", None) or {}
    out = []
    for key, value in table.items():
        if key in (skip or set()) or key in ROPE_KEYS:
            continue
        name = "dtype" if key == "torch_dtype" else amap.get(key, key)
        hint = hints.get(name)
        if hint is not None and not _accepts(value, hint):
            out.append(f"{path}: {prefix}{key}: {value!r} is not {_type_name(hint)}")
        elif value is None and hint is not None and name not in NULL_OK and _default(cls, name) is not None:
            out.append(
                f"{path}: {prefix}{key}: null, but the model needs a value (the class default is "
                f"{_default(cls, name)!r}, another model's)"
            )
        elif name == "dtype" and isinstance(value, str) and not _is_dtype(value):
            out.append(
                f"{path}: {prefix}{key}: {value!r} is not a torch dtype (bfloat16, float16, float32 ...)"
            )
    return out


def _sizes(path: Path, text: dict, cls: Any, prefix: str) -> list[str]:
    hints = _hints(cls)
    amap = getattr(cls, "attribute_map", None) or {}
    names = {amap.get(k, k): k for k in text}  # class name -> the name the file uses
    out = []
    for f in SIZE_FIELDS:
        if f in hints and f not in names:
            out.append(
                f"{path}: {prefix}{f}: missing (it sizes the model; transformers would use its default)"
            )
    for cname, key in names.items():
        v = text[key]
        hint = hints.get(cname)
        ints = hint is not None and _accepts(1, hint) and not _accepts(0.5, hint)
        if ints and _is_int(v) and (v < 0 or (v == 0 and cname not in MAY_BE_ZERO)):
            out.append(
                f"{path}: {prefix}{key}: {v} out of range (must be {'>= 0' if cname in MAY_BE_ZERO else '>= 1'})"
            )
        elif hint is not None and _accepts(0.5, hint) and _is_number(v) and not _is_int(v) and v < 0:
            out.append(f"{path}: {prefix}{key}: {v} out of range (must be >= 0)")
        elif cname.endswith("_eps") and _is_number(v) and v <= 0:
            out.append(f"{path}: {prefix}{key}: {v} out of range (must be > 0)")
    if out:
        return out
    heads, kv = (
        text.get("num_attention_heads"),
        text.get(next((k for c, k in names.items() if c == "num_key_value_heads"), "")),
    )
    if _is_int(heads) and _is_int(kv) and heads % kv:
        out.append(
            f"{path}: {prefix}num_key_value_heads: {kv} does not divide {prefix}num_attention_heads ({heads})"
        )
    experts = next((text[k] for c, k in names.items() if c in ("n_routed_experts", "num_experts")), None)
    topk = text.get("num_experts_per_tok")
    if _is_int(experts) and _is_int(topk) and topk > experts:
        out.append(
            f"{path}: {prefix}num_experts_per_tok: {topk} is more than the {experts} experts "
            f"({prefix}n_routed_experts)"
        )
    groups, topk_group = text.get("n_group"), text.get("topk_group")
    if _is_int(experts) and _is_int(groups) and groups and experts % groups:
        out.append(f"{path}: {prefix}n_group: {groups} does not divide the {experts} routed experts")
    if _is_int(groups) and _is_int(topk_group) and topk_group > groups:
        out.append(f"{path}: {prefix}topk_group: {topk_group} is more than {prefix}n_group ({groups})")
    act = text.get("hidden_act")
    if isinstance(act, str):
        from transformers.activations import ACT2FN

        if act not in ACT2FN:
            out.append(f"{path}: {prefix}hidden_act: {act!r} is not an activation transformers knows")
    return out


def _rope(path: Path, text: dict, prefix: str) -> list[str]:
    """The rope scaling the draft must reproduce as SGLang computes it (:mod:`pipeline.eagle3.rope`)."""
    out = []
    theta = text.get("rope_theta")
    if "rope_theta" in text and not (_is_number(theta) and theta > 0):
        out.append(f"{path}: {prefix}rope_theta: {theta!r} must be a number > 0")
    for key in ROPE_KEYS:
        if key not in text or text[key] is None:
            continue
        sc, where = text[key], f"{path}: {prefix}{key}"
        if not isinstance(sc, dict):
            out.append(f"{where}: must be a table or null, got {sc!r}")
            continue
        tkey = "rope_type" if "rope_type" in sc else "type" if "type" in sc else None
        if tkey is None and set(sc) - {"rope_theta"}:
            out.append(
                f"{where}.type: missing, nor rope_type (the table sets {', '.join(sorted(sc))} for no type)"
            )
            continue
        rtype = sc.get(tkey, "default") if tkey else "default"
        if not isinstance(rtype, str) or rtype not in ROPE_NEEDS:
            out.append(
                f"{where}.{tkey or 'rope_type'}: {rtype!r} is not supported: the draft must compute positions "
                f"as SGLang does, for {', '.join(ROPE_NEEDS)}"
            )
            continue
        for k in ROPE_NEEDS[rtype]:
            if k not in sc:
                out.append(f"{where}.{k}: missing ({rtype} scaling needs it)")
        for k in ROPE_NUMBERS:
            if k in sc and not _is_number(sc[k]):
                out.append(f"{where}.{k}: {sc[k]!r} is not a number")
            elif k in ROPE_POSITIVE and k in sc and sc[k] <= 0:
                out.append(f"{where}.{k}: {sc[k]} out of range (must be > 0)")
        fast, slow = sc.get("beta_fast"), sc.get("beta_slow")
        if rtype == "yarn" and _is_number(fast) and _is_number(slow) and fast <= slow:
            out.append(f"{where}.beta_fast: {fast} must be above beta_slow ({slow})")
    return out


def _token_ids(path: Path, table: dict, where: str, vocab: int, prefix: str) -> list[str]:
    out = []
    for f in TOKEN_ID_FIELDS:
        v = table.get(f)
        ids = v if isinstance(v, list) and f == "eos_token_id" else [v]  # several ends of a turn, one pad
        for i in ids:
            if i is None:
                continue
            if not _is_int(i):
                out.append(f"{path}: {where}{f}: {v!r} is not a token id")
            elif not 0 <= i < vocab:
                out.append(
                    f"{path}: {where}{f}: {i} is outside the vocabulary ({prefix}vocab_size {vocab}: ids 0..{vocab - 1})"
                )
    return out


def _architectures(path: Path, table: dict, where: str, model_type: str) -> list[str]:
    """``architectures[0]`` names a class of this model type: SGLang picks its model (and its rule for the
    capture ids) by it, transformers by ``model_type``; a mismatch trains on layers SGLang will not feed."""
    archs = table.get("architectures")
    if archs is None:
        return []
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        return [f"{path}: {where}architectures: {archs!r} must be a list of class names"]
    from transformers.models.auto import modeling_auto

    from pipeline.serving.sglang_capture import architecture_of

    raw_type = table.get("model_type")
    known = {
        names[model_type]
        for n in dir(modeling_auto)
        if n.endswith("_MAPPING_NAMES")
        and "CONFIG" not in n
        and isinstance(names := getattr(modeling_auto, n), dict)
        and isinstance(names.get(model_type), str)
    }
    for t in (model_type, raw_type):  # SGLang's class for the type, where its capture rule is known
        if isinstance(t, str) and (sg := architecture_of(types.SimpleNamespace(model_type=t))):
            known.add(sg)
    # transformers' class names drop the underscore SGLang's keep (Kimi_K25... / KimiK25...)
    if not known or archs[0].replace("_", "") in {k.replace("_", "") for k in known}:
        return []
    return [
        f"{path}: {where}architectures: {archs[0]!r} is not a class of model type {raw_type or model_type!r} "
        f"(expected one of {', '.join(sorted(known))}); SGLang picks its model class, and which layers it "
        "captures for the draft, by this name"
    ]


def tokenizer_problems(path: Path, text_prefix: str, vocab: int, tokenizer: Any) -> list[str]:
    """The tokenizer's ids must exist in the model's vocabulary (embedding rows)."""
    n = len(tokenizer)
    if n <= vocab:
        return []
    return [
        f"{path}: {text_prefix}vocab_size: {vocab} is smaller than the tokenizer's {n} ids (ids "
        f"{vocab}..{n - 1} would index past the embedding)"
    ]
