"""Random-weight checkpoints for the SGLang bench, saved once under ``/tmp/sgl/models`` of the warm machine."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from bench.gpu.results import RESULTS
from bench.gpu.runner import BASE, log


def build_models(which: list[str], args: argparse.Namespace | None = None) -> dict[str, Path]:
    """Random-weight checkpoints (image's transformers) with the SmolLM2 tokenizer and chat template;
    ``llama8b_structured`` is the 8B shape restructured by ``bench/gpu/structured_target.py`` (``--follow``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu.common import SHAPES

    tok_dir = BASE / "smollm2"
    tok_files = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    smol_cfg = json.loads((tok_dir / "config.json").read_text())
    paths = {}
    for name in which:
        dest = BASE / "models" / name
        paths[name] = dest
        if (dest / ".complete").exists():
            continue
        t = time.monotonic()
        if name == "smollm2":
            raw = {
                k: v for k, v in smol_cfg.items() if k not in ("quantization_config", "_model_name_or_path")
            }
            cfg = LlamaConfig(**raw)
        else:  # llama8b: Llama-3.1-8B's decoder, the SmolLM2 vocabulary (its tokenizer and chat template)
            shape = dict(SHAPES["llama8b"], vocab_size=smol_cfg["vocab_size"])
            cfg = LlamaConfig(
                num_hidden_layers=32,
                tie_word_embeddings=False,
                bos_token_id=smol_cfg["bos_token_id"],
                eos_token_id=smol_cfg["eos_token_id"],
                pad_token_id=smol_cfg["pad_token_id"],
                **shape,
            )
        cfg.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        structure = None
        if name == "llama8b_structured":
            from transformers import AutoTokenizer

            from bench.gpu import structured_target

            assert args is not None
            model.eval()
            structure = structured_target.build(
                model, AutoTokenizer.from_pretrained(str(tok_dir)), args.follow, args.cycle_words
            )
            RESULTS["structure"] = {k: v for k, v in structure.items() if k != "succ"}
            log(f"structured: {RESULTS['structure']}")
        model.config.dtype = torch.bfloat16
        tmp = dest.with_name(name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        for f in tok_files:
            shutil.copy2(tok_dir / f, tmp / f)
        if structure is not None:
            (tmp / "structure.json").write_text(json.dumps(structure))
        n = sum(p.numel() for p in model.parameters())
        del model
        torch.cuda.empty_cache()
        (tmp / ".complete").write_text(str(n))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        log(f"model {name}: {n / 1e9:.2f} B params, random bf16, saved in {time.monotonic() - t:.0f} s")
    return paths
