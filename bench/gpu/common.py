"""Shared pieces of the EAGLE-3 GPU benchmarks: realistic model shapes, the bf16 matmul ceiling, timing.

The ceiling is measured in the same run as the workload (an 8192³ bf16 product on fresh random
data, median of CUDA-event timings after a warm-up), so MFU is always against this card as found.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

# Llama-3.1-8B's decoder shape (random weights: throughput only), and a tiny one for CPU smoke runs.
SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    # SmolLM2-135M's (the demo target): the issue-15 measurement of the data path (12k vs 93-98k tok/s) was this shape.
    "smollm2": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        rope_theta=10000.0,
    ),
}


def pinned_problem(dist: str, pinned: str, modules: tuple[str, ...], install: str, wrong: str) -> str | None:
    """None when distribution ``dist`` is installed at ``pinned`` and ``modules`` import; else why not (a
    skip reason): not installed (``install`` says how), another version (``wrong`` says what is pinned), or
    the import error."""
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version(dist)
    except PackageNotFoundError:
        return f"{dist} is not installed ({install})"
    if v != pinned:
        return f"{dist} {v} is installed; {wrong} {pinned}"
    try:
        for m in modules:
            importlib.import_module(m)
    except ImportError as exc:
        return f"{dist} does not import: {exc}"
    return None


def llama_config(shape: str, layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **SHAPES[shape])


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn: Any, dev: torch.device, warmup: int = 2, reps: int = 5) -> list[float]:
    """Wall times (ms) of ``fn()``; CUDA events on a GPU."""
    import time

    for _ in range(warmup):
        fn()
    sync(dev)
    out = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return out


def matmul_ceiling_tflops(dev: torch.device, n: int = 8192, reps: int = 20) -> float:
    """Median bf16 (fp32 on CPU) n³ matmul rate, TFLOP/s, over rotating random inputs."""
    if dev.type != "cuda":
        n = min(n, 1024)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    xs = [torch.randn(n, n, device=dev, dtype=dt) for _ in range(3)]
    i = [0]

    def one() -> None:
        a, b = xs[i[0] % 3], xs[(i[0] + 1) % 3]
        i[0] += 1
        a @ b

    ms = statistics.median(time_ms(one, dev, warmup=3, reps=reps if dev.type == "cuda" else 3))
    return 2 * n**3 / (ms / 1e3) / 1e12


def device_info(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"device": str(dev), "torch": torch.__version__}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def random_draft(cfg: Any, dev: torch.device) -> tuple[Any, torch.Tensor]:
    """An ``Eagle3Draft`` of ``cfg`` (seeded random weights) with a random draft vocabulary; (draft, its target ids)."""
    from pipeline.eagle3.draft_model import Eagle3Draft

    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    vd, v = cfg.draft_vocab_size, cfg.vocab_size
    ids = torch.sort(torch.randperm(v)[:vd]).values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(vd), t2d)
    return draft.to(dev), ids


def synthetic_batch(
    cfg: Any, ids: torch.Tensor, b: int, s: int, dev: torch.device, dtype: torch.dtype
) -> Any:
    """A full (no padding) training batch of random features, targets in the draft vocabulary."""
    from pipeline.drafts.batch import Batch

    vd, v, h = cfg.draft_vocab_size, cfg.vocab_size, cfg.hidden_size
    return Batch(
        torch.randn(b, s, 3 * h, device=dev, dtype=dtype),
        torch.randn(b, s, h, device=dev, dtype=dtype),
        ids.to(dev)[torch.randint(0, vd, (b, s), device=dev)],
        torch.randint(0, v, (b, s), device=dev),
        torch.ones(b, s, dtype=torch.bool, device=dev),
        torch.full((b,), s, device=dev),
    )
