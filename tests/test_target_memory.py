"""The deep check's target memory against what transformers really holds, on a Kimi-K2.5-format checkpoint
whose routed experts are packed INT4 as the real one stores them (compressed-tensors, group 32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.data import model_assets
from pipeline.eagle3.target_memory import quantization_of, sglang_layout, transformers_layout
from tests.kimi_fixture import build_tiny_kimi_int4

ROOT = Path(__file__).resolve().parent.parent
HELD = """
import json, os, sys, torch
from pipeline.data import model_assets
kw = {"tp_plan": "auto"} if os.environ.get("WORLD_SIZE") else {}
m = model_assets.load_model(sys.argv[1], dtype=torch.bfloat16, **kw)
local = lambda t: (t.to_local() if hasattr(t, "to_local") else t)
held = sum(local(t).numel() * local(t).element_size() for t in [*m.parameters(), *m.buffers()])
print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "held": held}))
"""


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip(
        "compressed_tensors", reason="the INT4 checkpoint needs compressed-tensors (pipeline extra)"
    )
    return build_tiny_kimi_int4(tmp_path_factory.mktemp("kimi-int4"))


def _held(folder: Path, ranks: int) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", HELD, str(folder)]
    if ranks > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                "--no-python", sys.executable, "-c", HELD, str(folder)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_the_estimate_is_what_transformers_holds_once_it_dequantizes_the_int4_experts(
    kimi_int4: Path,
) -> None:
    cfg = model_assets.model_config(str(kimi_int4))
    layout = transformers_layout(cfg, model_assets.model_class(cfg), tp=1)
    p = _held(kimi_int4, 1)
    assert p.returncode == 0, p.stderr[-2000:]
    held = json.loads(p.stdout.strip().splitlines()[-1])["held"]
    estimate = layout.per_rank(1)
    assert abs(estimate - held) <= 0.10 * held, (estimate, held)
    # The experts are held as bf16: 2 bytes a weight where the checkpoint stores 0.5 + a bf16 scale per 32.
    q = quantization_of(cfg)
    assert q is not None and (q.bits, q.group) == (4, 32)
    stored = sum(
        t.numel() * t.element_size()
        for f in kimi_int4.glob("*.safetensors")
        for k, t in load_file(str(f)).items()
        if ".mlp.experts." in k and (k.endswith("weight_packed") or k.endswith("weight_scale"))
    )
    assert layout.dequantized == pytest.approx(stored * 2 / (0.5 + 2 / 32), rel=0.01)
    # SGLang keeps them packed: its layout of the same experts is the checkpoint's own bytes.
    with torch.device("meta"):
        plain = model_assets.model_class(cfg).from_config(cfg, dtype=torch.bfloat16)
    sg = sglang_layout(plain, cfg)
    assert sg.per_rank(1) < estimate - layout.dequantized + stored * 1.01


@pytest.mark.slow
def test_transformers_cannot_load_the_int4_checkpoint_tensor_parallel_and_the_check_says_so(
    kimi_int4: Path,
) -> None:
    cfg = model_assets.model_config(str(kimi_int4))
    layout = transformers_layout(cfg, model_assets.model_class(cfg), tp=2)
    p = _held(kimi_int4, 2)
    assert p.returncode != 0, (
        "transformers loaded the packed checkpoint tensor-parallel: update target_memory"
    )
    assert "sharding_utils" in p.stderr, p.stderr[-2000:]  # it fails in the loader's sharding, not elsewhere
    assert layout.problem and "cannot load this checkpoint tensor-parallel" in layout.problem
