"""Kimi-K2.5's architecture as a test fixture: its published config, and a tiny random-weight model of it.

:data:`KIMI_K25_CONFIG` is ``moonshotai/Kimi-K2.5``'s ``config.json`` as published (vision-language
wrapper ``kimi_k25`` around a DeepSeek-V3-class text model). Each value says where it came from:

* [dump] a printout of a local copy of ``moonshotai/Kimi-K2.5``'s config and weight table after
  transformers 5.7.0 loaded it (stored public file, found with the library's ``search`` tool);
* [mlx] a verbatim slice of ``mlx-community/Kimi-K2.5``'s ``config.json`` (the raw text config says
  ``model_type = "kimi_k2"`` and ``rope_scaling``, which transformers renames on load);
* [weights] the same dump's tensor table (shapes that pin the sizes: q_b_proj [12288, 1536] = 64 heads
  × (128 + 64); kv_b_proj [16384, 512] = 64 × (128 + 128); layer 0 dense, layers 1..60 MoE).

The chat template (``fixtures/kimi_k25/chat_template.jinja``) is Kimi-K2.5's ``chat_template.jinja``
byte for byte, as vendored by lightseekorg/smg (crates/tokenizer/tests/fixtures/kimi_k25/, commit
a18d64f5), which took it from huggingface.co/moonshotai/Kimi-K2.5. Kimi's real tokenizer (tiktoken,
163,840 ids) cannot be shipped; :func:`build_tiny_tokenizer` trains a small byte-level BPE with
Kimi's special tokens and attaches that template, so prep renders exactly what Kimi-K2.5 renders. The tokenizer's real *format* is fixed too:
:func:`build_tiktoken_kimi` lays out ``tiktoken.model`` (synthetic ranks) and ``tokenizer_config.json`` with
Kimi-K2.5's special tokens at their offsets (``tests/fixtures/kimi_k25_tiktoken``).

The quantisation block (compressed-tensors INT4, group 32, the routed experts only) is part of the
real-size config (the memory estimate of ``aerie plan check --deep`` reads it); the tiny model drops
it: its random weights are plain fp32, not packed INT4.

:func:`tiny_kimi_config` shrinks *only sizes* (layers, hidden, heads, LoRA ranks, head dims, experts,
vocabulary) and keeps every other field — YaRN with Kimi's factors, sigmoid routing with
``noaux_tc``, a shared expert, ``first_k_dense_replace = 1``, the routed scaling factor.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

KIMI_K25_TEXT: dict[str, Any] = {
    "model_type": "kimi_k2",  # [mlx] (transformers maps kimi_k2 -> deepseek_v3)
    "architectures": ["DeepseekV3ForCausalLM"],  # [dump]
    "vocab_size": 163840,  # [dump] [weights] embed/lm_head [163840, 7168]
    "hidden_size": 7168,  # [dump]
    "intermediate_size": 18432,  # [dump] [weights] layer 0 mlp.gate_proj [18432, 7168]
    "moe_intermediate_size": 2048,  # [dump] [weights] shared_experts [2048, 7168]
    "num_hidden_layers": 61,  # [dump]
    "num_attention_heads": 64,  # [dump] [weights]
    "num_key_value_heads": 64,  # [dump]
    "n_routed_experts": 384,  # [dump] [weights] gate.weight [384, 7168]
    "n_shared_experts": 1,  # [dump]
    "num_experts_per_tok": 8,  # [dump]
    "first_k_dense_replace": 1,  # [dump] [weights] layer 0 dense, 1..60 MoE
    "moe_layer_freq": 1,  # [dump]
    "q_lora_rank": 1536,  # [dump] [weights] q_a_proj [1536, 7168]
    "kv_lora_rank": 512,  # [dump] [weights] kv_a_proj_with_mqa [576, 7168] = 512 + 64
    "qk_nope_head_dim": 128,  # [dump]
    "qk_rope_head_dim": 64,  # [dump]
    "v_head_dim": 128,  # [dump] [weights] o_proj [7168, 8192] = 64 x 128
    "rope_theta": 50000.0,  # [dump] [mlx]
    "rope_scaling": {  # [dump] [mlx]
        "type": "yarn",
        "factor": 64.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 262144,  # [dump]
    "routed_scaling_factor": 2.827,  # [dump]
    "scoring_func": "sigmoid",  # [dump]
    "topk_method": "noaux_tc",  # [dump]
    "n_group": 1,  # [dump]
    "topk_group": 1,  # [dump]
    "norm_topk_prob": True,  # [dump]
    "rms_norm_eps": 1e-05,  # [dump] [mlx] (Kimi-K2 had 1e-06)
    "hidden_act": "silu",  # [dump]
    "attention_bias": False,  # [dump]
    "attention_dropout": 0.0,  # [dump]
    "initializer_range": 0.02,  # [dump]
    "tie_word_embeddings": False,  # [dump] [weights] embed and lm_head stored separately
    "num_nextn_predict_layers": 0,  # [dump]
    "bos_token_id": 163584,  # [dump]
    "eos_token_id": 163585,  # [dump]
    "pad_token_id": 163839,  # [dump]
    "torch_dtype": "bfloat16",  # [dump]
}

KIMI_K25_VISION: dict[str, Any] = {  # [dump]; the tiny model shrinks these too (sizes only)
    "patch_size": 14,
    "pos_emb_height": 64,
    "pos_emb_width": 64,
    "pos_emb_time": 4,
    "num_attention_heads": 16,
    "num_hidden_layers": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "merge_kernel_size": [2, 2],
}

KIMI_K25_CONFIG: dict[str, Any] = {
    "architectures": ["KimiK25ForConditionalGeneration"],  # [dump]
    "model_type": "kimi_k25",  # [dump]
    "bos_token_id": 163584,  # [dump]
    "eos_token_id": 163585,  # [dump]
    "pad_token_id": 163839,  # [dump]
    "media_placeholder_token_id": 163605,  # [dump]
    "tie_word_embeddings": False,  # [dump]
    "torch_dtype": "bfloat16",  # [dump]
    "text_config": KIMI_K25_TEXT,
    "vision_config": KIMI_K25_VISION,
    "quantization_config": {  # [dump]: INT4 routed experts; attention, shared experts, dense MLP, head in bf16
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "dynamic": False,
                    "observer": "minmax",
                },
            }
        },
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
        ],
        "kv_cache_scheme": None,
    },
}

# What "tiny" changes: sizes only. Every key not listed here keeps Kimi-K2.5's value.
TINY_TEXT_SIZES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 6,  # layer 0 dense, 1..5 MoE; EAGLE-3 needs >= 5 for low/mid/high
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "bos_token_id": 1,  # ids must exist in the tiny vocabulary
    "eos_token_id": 2,
    "pad_token_id": 0,
}
TINY_VISION_SIZES: dict[str, Any] = {
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
}


def kimi_config(tiny: bool = False, **text_overrides: Any) -> dict[str, Any]:
    """Kimi-K2.5's ``config.json`` as a dict; ``tiny`` shrinks sizes only."""
    cfg = copy.deepcopy(KIMI_K25_CONFIG)
    if tiny:
        cfg["text_config"].update(TINY_TEXT_SIZES)
        cfg["vision_config"].update(TINY_VISION_SIZES)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            cfg[k] = TINY_TEXT_SIZES[k]
        cfg.pop("media_placeholder_token_id", None)
        cfg.pop("quantization_config", None)
    cfg["text_config"].update(text_overrides)
    return cfg


def write_config(folder: Path, tiny: bool = False, **text_overrides: Any) -> Path:
    """A model folder holding only ``config.json`` (shape-only checks: nothing is loaded)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(kimi_config(tiny, **text_overrides), indent=2))
    return folder


TEMPLATE = Path(__file__).parent / "fixtures" / "kimi_k25" / "chat_template.jinja"
# Kimi-K2.5's special tokens (tokenizer_config.json of the K2 family); the tiny tokenizer numbers them
# from 0 so they fit its 512-id vocabulary: [PAD] 0, [BOS] 1, [EOS] 2 (as TINY_TEXT_SIZES says).
SPECIAL_TOKENS = [
    "[PAD]",
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "[EOT]",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<think>",
    "</think>",
    "[UNK]",
]


def build_tiny_tokenizer(folder: Path, vocab_size: int = 512) -> Path:
    """A byte-level BPE tokenizer with Kimi-K2.5's special tokens and chat template, ids < ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        line
        for f in sorted(
            (Path(__file__).resolve().parents[1] / "pipeline" / "data" / "fixtures" / "datasets").glob(
                "*.jsonl"
            )
        )
        for line in f.read_text().splitlines()[:40]
    ]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    )
    fast.add_special_tokens(
        {
            "additional_special_tokens": [
                t for t in SPECIAL_TOKENS if t not in ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
            ]
        }
    )
    fast.chat_template = TEMPLATE.read_text()
    fast.save_pretrained(str(folder))
    assert len(fast) <= vocab_size, len(fast)
    return folder


def build_tiny_kimi(folder: Path, seed: int = 0, dtype: str = "float32", **text_overrides: Any) -> Path:
    """A random-weight Kimi-K2.5-architecture model, saved with transformers' own classes in the layout
    Kimi-K2.5's own files use (``language_model.model.layers.N``), with the tiny Kimi tokenizer."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForImageTextToText

    write_config(folder, tiny=True, **text_overrides)
    cfg = AutoConfig.from_pretrained(str(folder))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=getattr(torch, dtype))
    model.eval()
    model.save_pretrained(str(folder))
    # transformers 5.24 writes the text layers back as ``blocks.N`` (a vision rename applied in reverse);
    # Kimi-K2.5's checkpoint says ``layers.N``, and both load. Keep what the real files say.
    for f in folder.glob("*.safetensors"):
        sd = load_file(str(f))
        sd = {
            k.replace("language_model.model.blocks.", "language_model.model.layers."): v
            for k, v in sd.items()
        }
        save_file(sd, str(f), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        d = json.loads(index.read_text())
        d["weight_map"] = {
            k.replace("language_model.model.blocks.", "language_model.model.layers."): v
            for k, v in d["weight_map"].items()
        }
        index.write_text(json.dumps(d))
    write_config(folder, tiny=True, **text_overrides)  # the published config.json, not transformers' rewrite
    build_tiny_tokenizer(folder, int(TINY_TEXT_SIZES["vocab_size"]))
    return folder


def build_tiny_kimi_int4(folder: Path, seed: int = 0) -> Path:
    """:func:`build_tiny_kimi` with its routed experts stored as Kimi-K2.5's checkpoint stores them:
    compressed-tensors ``pack-quantized`` INT4, symmetric, group 32 (``weight_packed`` int32,
    ``weight_scale`` bf16 per group, ``weight_shape``), and the real ``quantization_config``. The tiny
    vision tower stays dense (added to ``ignore``) so the fixture is about the experts."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import load_file, save_file

    build_tiny_kimi(folder, seed=seed, dtype="bfloat16")
    quant = copy.deepcopy(KIMI_K25_CONFIG["quantization_config"])
    group = quant["config_groups"]["group_0"]["weights"]["group_size"]
    for f in folder.glob("*.safetensors"):
        out: dict[str, torch.Tensor] = {}
        for k, v in load_file(str(f)).items():
            if ".mlp.experts." not in k or not k.endswith(".weight"):
                out[k] = v
                continue
            rows, cols = v.shape
            g = v.float().reshape(rows, cols // group, group)
            scale = g.abs().amax(-1).clamp(min=1e-8) / 7  # symmetric INT4: -8..7
            q = torch.round(g / scale[..., None]).clamp(-8, 7).to(torch.int8).reshape(rows, cols)
            base = k[: -len(".weight")]
            out[base + ".weight_packed"] = pack_to_int32(q, 4)
            out[base + ".weight_scale"] = scale.to(torch.bfloat16)
            out[base + ".weight_shape"] = torch.tensor([rows, cols], dtype=torch.int32)
        save_file(out, str(f), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        index.unlink()  # one file: no map of the renamed keys is needed
    cfg = json.loads((folder / "config.json").read_text())
    quant["ignore"] = [*quant["ignore"], "re:.*vision_tower.*", "re:.*mm_projector.*"]
    cfg["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


# ------------------------------------------------------------------ Kimi's real tokenizer format (tiktoken)
# Kimi-K2/K2.5 ship no tokenizer.json: ``tiktoken.model`` holds one ``<base64 token bytes> <rank>`` line per
# mergeable token (163,584 of them), ``tokenizer_config.json`` names the class of the checkpoint's own
# ``tokenization_kimi.py`` (``TikTokenTokenizer``, through ``auto_map``) and lists the special tokens in
# ``added_tokens_decoder``. That class numbers the special tokens after the mergeable ones: id = number of
# ranks + offset, 256 reserved slots, a slot without a name being ``<|reserved_token_ID|>``. The ids and
# names below are Kimi-K2.5's (163584 = [BOS] ... 163839 = [PAD]); facts gathered from public copies of the
# checkpoint's files. The fixture keeps the format and the special tokens at their offsets, with synthetic
# ranks: the 256 bytes, then byte-pair merges learnt from a few sentences (so text encodes to real merges).
TIKTOKEN_DIR = Path(__file__).parent / "fixtures" / "kimi_k25_tiktoken"
KIMI_FIRST_SPECIAL = 163584  # len(ranks) of the real tiktoken.model
KIMI_SPECIAL_IDS: dict[int, str] = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
_MERGE_TEXT = (
    "The user asks what two plus two is. The answer is four. Let me think about the question and then answer "
    "it: the assistant thinks, then answers the user. What is three and three? Six. "
)
_MERGES = 64


def tiktoken_ranks() -> dict[bytes, int]:
    """The synthetic mergeable ranks: every byte, then the most frequent adjacent pair, ``_MERGES`` times."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([c]) for c in w.encode()] for w in _MERGE_TEXT.replace(" ", "  ").split(" ") if w]
    for _ in range(_MERGES):
        pairs: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for a, b in zip(w, w[1:], strict=False):
                pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        ranks[best[0] + best[1]] = len(ranks)
        merged = []
        for w in words:
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged.append(out)
        words = merged
    return ranks


def tiktoken_special_tokens(n_ranks: int) -> dict[int, str]:
    """Kimi-K2.5's named special tokens at their offsets after ``n_ranks`` mergeable tokens."""
    return {n_ranks + i - KIMI_FIRST_SPECIAL: name for i, name in KIMI_SPECIAL_IDS.items()}


# Kimi-K2/K2.5's own split pattern: ``TikTokenTokenizer.pat_str`` of the checkpoint's ``tokenization_kimi.py``
# (public copies of moonshotai's file agree on it). Han runs apart, CamelCase split, contractions on the word.
KIMI_PAT_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]
KIMI_PAT_STR = "|".join(KIMI_PAT_PARTS)

# The checkpoint's tokenizer code as Aerie meets it: read for its pat_str, never run. Executing it would
# leave CODE_RAN beside it (tests assert it never appears).
KIMI_TOKENIZER_CODE = (
    '''"""Kimi's tokenizer class, as the checkpoint ships it (fixture: only its shape and pat_str)."""
import pathlib

pathlib.Path(__file__).with_name("CODE_RAN").write_text("tokenization_kimi.py was executed")


class TikTokenTokenizer:
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    num_reserved_special_tokens = 256

    pat_str = "|".join(
        [
'''
    + "".join(f'            r"""{p}""",\n' for p in KIMI_PAT_PARTS)
    + "        ]\n    )\n"
)


def tiktoken_model_text(ranks: dict[bytes, int]) -> str:
    import base64

    lines = [
        f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda t: t[1])
    ]
    return "\n".join(lines) + "\n"


def write_tiktoken_fixture(folder: Path = TIKTOKEN_DIR, ranks: dict[bytes, int] | None = None) -> Path:
    """Write ``tiktoken.model`` and ``tokenizer_config.json`` in Kimi-K2.5's format (the committed fixture;
    ``ranks`` replaces the fixture's, the special tokens moving after them as in the real file)."""
    folder.mkdir(parents=True, exist_ok=True)
    ranks = ranks or tiktoken_ranks()
    (folder / "tiktoken.model").write_text(tiktoken_model_text(ranks))
    specials = tiktoken_special_tokens(len(ranks))
    names = dict(zip(KIMI_SPECIAL_IDS.values(), specials, strict=True))
    config = {
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, name in specials.items()
        },
        "additional_special_tokens": [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "[EOT]",
            "<|im_system|>",
            "<|im_middle|>",
        ],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "extra_special_tokens": {},
        "model_max_length": 1000000000000000019884624838656,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    assert names["[BOS]"] == len(ranks)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def build_tiktoken_kimi(folder: Path) -> Path:
    """A Kimi-K2.5 folder as the checkpoint lays out its tokenizer: the tiny config (its vocabulary and
    special ids moved to the fixture's), ``tiktoken.model``, ``tokenizer_config.json``, ``chat_template.jinja``."""
    import shutil

    n = len(tiktoken_ranks())
    ids = {name: i for i, name in tiktoken_special_tokens(n).items()}
    sizes = {
        "vocab_size": n + 256,
        "bos_token_id": ids["[BOS]"],
        "eos_token_id": ids["[EOS]"],
        "pad_token_id": ids["[PAD]"],
    }
    cfg = kimi_config(tiny=True, **sizes)
    cfg.update({k: v for k, v in sizes.items() if k != "vocab_size"})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(TIKTOKEN_DIR / f, folder / f)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    (folder / "tokenization_kimi.py").write_text(KIMI_TOKENIZER_CODE)
    return folder
