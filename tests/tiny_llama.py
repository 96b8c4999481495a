"""A tiny random-weight Llama with SmolLM2's real tokenizer: the target of the tests that check mechanics.

Resume, the write path, a full disk, an OOM kill, a power cut, torchrun 2 == 1, the feeder against the
inline path: what those tests prove does not depend on the target being any good, only on it being a real
``LlamaForCausalLM`` that the stages load, shard, capture and serve as they would SmolLM2. This one has
SmolLM2-135M's architecture, tokenizer, chat template, end-of-turn tokens and layer count (30, so the
default aux layers are the same ``[1, 14, 26]``), and is ~20x smaller where the cost is: hidden 96 instead
of 576, an MLP of 256 instead of 1536. Its weights are random (seed 0, std 0.1), so every test of quality (the demo's
accept length, a draft that learns the real model) keeps ``builtin:smollm2-135m-instruct``.

Built once per machine under ``$AERIE_CACHE/models`` (like the converted demo model), behind a lock and an
atomic rename, so parallel test workers share it. Not a test module.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

NAME = "tiny-llama-smollm2-tokenizer-v3"
SHAPE = {
    "hidden_size": 96,
    "intermediate_size": 256,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,  # grouped-query attention, 3 query heads per KV head as in SmolLM2
    "head_dim": 16,
    # At Llama's usual 0.02 a model this narrow repeats one token whatever the prompt; at 0.1 its greedy
    # answers depend on the prompt (12 distinct tokens in 12), so a test that compares outputs compares
    # something, and the top two logits are far apart, so reduction-order noise never flips a greedy token.
    "initializer_range": 0.1,
}
# A random LM head spreads greedy answers over all 49,152 tokens, most of which no draft vocabulary holds
# (the vocab stage keeps the tokens the training answers use most), so a draft trained on them would get
# almost no loss to learn from. The head's rows of the 1,024 tokens the bundled datasets use most are made 4x
# longer (the head is not tied to the embeddings here), so the greedy answers fall among those tokens, as a
# real model's do, and what decides each one is still the prompt.
COMMON_TOKENS = 1024
COMMON_BOOST = 4.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def tiny_llama_dir() -> Path:
    """The folder of the tiny model (a local path a plan's ``target.model`` can name)."""
    from pipeline.data import model_assets

    dest = model_assets.cache_dir() / "models" / NAME
    if (dest / "model.safetensors").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / "model.safetensors").is_file():
            _build(dest, model_assets.builtin_model_dir())
    return dest


def _build(dest: Path, smollm2: Path) -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    cfg = AutoConfig.from_pretrained(str(smollm2))
    for key, value in SHAPE.items():
        setattr(cfg, key, value)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # greedy answers in the tokens English text uses most (see COMMON_TOKENS)
        model.lm_head.weight[_common_ids(smollm2)] *= COMMON_BOOST
    model = model.to(torch.bfloat16)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, tmp / name)
    os.replace(tmp, dest)


def _common_ids(smollm2: Path) -> list[int]:
    """The ``COMMON_TOKENS`` ids SmolLM2's tokenizer uses most on the bundled dataset fixtures' text."""
    import json
    from collections import Counter

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2))
    fixtures = Path(__file__).resolve().parent.parent / "pipeline" / "data" / "fixtures" / "datasets"
    texts: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, str):
            texts.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    for path in sorted(fixtures.glob("*.jsonl")):
        for line in path.read_text().split("\n"):  # not splitlines(): text holds U+2028
            try:
                walk(json.loads(line))
            except json.JSONDecodeError:  # blank lines, and the rows left malformed for the prep tests
                continue
    counts = Counter(i for text in texts for i in tok(text)["input_ids"])
    return [i for i, _ in counts.most_common(COMMON_TOKENS)]


def tiny_llama() -> str:
    """``tiny_llama_dir()`` as the string a plan or ``load_target`` takes."""
    return str(tiny_llama_dir())
