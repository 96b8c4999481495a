"""Kimi-K2.5's weights per GPU, per engine and GPU count, as the deep check computes them (no GPU needed).

    python bench/kimi_memory.py [--gpus 8 16 24 32] [--gpu-gb 141]

Builds Kimi-K2.5 from its published config on the meta device (tests/kimi_fixture.py holds the config) and
prints, for each GPU count, the bytes each rank holds under transformers (the model put through the
checkpoint's compressed-tensors quantizer: routed experts dequantized to bf16, sharded by the installed
transformers' TP plan) and under SGLang (INT4 experts kept packed, SGLang's DeepSeek-V2/V3 sharding), weights
only (capture activations and the draft come on top: `aerie plan check --deep` adds them). Documented in
docs/eagle3.md, "DeepSeek-V3-class targets".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.data import model_assets  # noqa: E402
from pipeline.eagle3.target_memory import sglang_layout, transformers_layout  # noqa: E402
from tests.kimi_fixture import kimi_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 24, 32])
    ap.add_argument("--gpu-gb", type=float, default=141.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(kimi_config()))
        cfg = model_assets.model_config(tmp)
        cls = model_assets.model_class(cfg)
        with torch.device("meta"):
            plain = cls.from_config(cfg, dtype=torch.bfloat16)
        sg = sglang_layout(plain, cfg)
        import transformers

        print(
            f"Kimi-K2.5 weights per GPU (GiB), transformers {transformers.__version__}, vs {args.gpu_gb:g} GB GPUs"
        )
        print("| GPUs | transformers (experts dequantized) | SGLang (INT4 packed) |")
        print("| ---: | ---: | ---: |")
        for n in args.gpus:
            tf = transformers_layout(cfg, cls, n)
            cells = []
            for per in (tf.per_rank(n), sg.per_rank(n)):
                fits = "fits" if per <= args.gpu_gb * 1e9 else "does not fit"
                cells.append(f"{per / 2**30:,.1f} ({fits})")
            if tf.problem:
                cells[0] += " — cannot load TP"
            print(f"| {n} | {cells[0]} | {cells[1]} |")
        print(
            f"total: transformers {tf.per_rank(1) / 2**40:.2f} TiB, SGLang {sg.per_rank(1) / 2**40:.2f} TiB; "
            f"experts held dequantized: {tf.dequantized / 2**40:.2f} TiB"
        )


if __name__ == "__main__":
    main()
