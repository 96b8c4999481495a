"""Where a profiled SGLang decode spends its time: a summary of a torch-profiler trace (issue 38, item 4).

``python -m bench.gpu.sglang_trace TRACE.json.gz [TRACE2 ...] [--steps N] [--json OUT]`` — for traces written by SGLang's
``/start_profile`` (``bench/gpu/sglang_ab.py`` copies them to ``$OUT/trace_<variant>.json.gz``). Reads, on the CPU:

* the GPU's busy time (kernels + copies, overlaps merged) over the window from the first to the last GPU event,
  and the idle rest: a GPU that waits on the host is the signature of launch-bound or synchronising code;
* kernel time by kind, from the kernel names: GEMM, attention, norm, rotary, activation, sampling/verify
  (argmax, top-k, softmax, tree verify), elementwise/copy, other;
* how kernels were launched: ``cudaGraphLaunch`` (a captured CUDA graph) vs ``cudaLaunchKernel`` and friends
  (eager), and the host-side ``cudaStreamSynchronize``/``cudaMemcpy`` waits;
* the largest idle gaps of the GPU and the CPU operators running during them.

Divide by the number of profiled scheduler steps (``--steps``, 12 in the bench) for per-round figures.
Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

KINDS: list[tuple[str, re.Pattern[str]]] = [
    ("sampling/verify", re.compile(r"argmax|topk|top_k|softmax|sampl|verify|tree|accept|cumsum|sort", re.I)),
    (
        "attention",
        re.compile(r"attn|attention|flash|fmha|_fwd_kernel|decode_kernel|extend|paged|mla|prefill", re.I),
    ),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|sm90_|cublas|matmul|wgmma|splitk", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("activation", re.compile(r"silu|gelu|act_and_mul|swiglu", re.I)),
    (
        "elementwise/copy",
        re.compile(r"elementwise|copy|fill|cat|index|gather|scatter|reduce|memcpy|memset", re.I),
    ),
]
LAUNCH = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
}


def kind_of(name: str) -> str:
    for k, pat in KINDS:
        if pat.search(name):
            return k
    return "other"


def load(path: Path) -> list[dict[str, Any]]:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    doc = json.loads(raw)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def summarise(events: list[dict[str, Any]], steps: int, gaps: int = 8) -> dict[str, Any]:
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    rt = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    cpu = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation")
    ]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    iv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    busy = merged(iv)
    t0, t1 = busy[0][0], busy[-1][1]
    busy_us = sum(b - a for a, b in busy)
    by_kind: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for e in gpu:
        name = str(e.get("name", ""))
        d = float(e.get("dur", 0))
        by_kind["copy/memset" if e["cat"] != "kernel" else kind_of(name)] += d
        top[name[:90]] += d
    launches = Counter(str(e.get("name")) for e in rt)
    graph = launches.get("cudaGraphLaunch", 0)
    eager = sum(v for k, v in launches.items() if k in LAUNCH)
    syncs = {k: v for k, v in launches.items() if "Synchronize" in k or k.startswith("cudaMemcpy")}
    sync_us = sum(float(e.get("dur", 0)) for e in rt if str(e.get("name")) in syncs)
    # idle gaps of the GPU and what the host ran meanwhile
    holes = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)), reverse=True)[
        :gaps
    ]
    gap_rows = []
    for length, a, b in holes:
        ops = Counter(
            str(e.get("name"))[:60]
            for e in cpu
            if float(e["ts"]) < b
            and float(e["ts"]) + float(e.get("dur", 0)) > a
            and float(e.get("dur", 0)) < 5e5
        )
        gap_rows.append({"us": round(length, 1), "cpu_ops": ops.most_common(4)})
    per = max(1, steps)
    return {
        "window_ms": round((t1 - t0) / 1e3, 2),
        "gpu_busy_ms": round(busy_us / 1e3, 2),
        "gpu_busy_share": round(busy_us / (t1 - t0), 3),
        "per_step_window_ms": round((t1 - t0) / 1e3 / per, 3),
        "per_step_busy_ms": round(busy_us / 1e3 / per, 3),
        "kernel_ms_by_kind": {k: round(v / 1e3, 2) for k, v in sorted(by_kind.items(), key=lambda x: -x[1])},
        "kernels": sum(1 for e in gpu if e["cat"] == "kernel"),
        "graph_launches": graph,
        "eager_launches": eager,
        "host_sync_calls": syncs,
        "host_sync_ms": round(sync_us / 1e3, 2),
        "top_kernels_ms": [(n, round(v / 1e3, 2)) for n, v in sorted(top.items(), key=lambda x: -x[1])[:12]],
        "largest_gaps": gap_rows,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument(
        "--steps", type=int, default=12, help="profiled scheduler steps (the bench's PROFILE_STEPS)"
    )
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = {str(p): summarise(load(p), args.steps) for p in args.traces}
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    for p, s in out.items():
        print(f"== {p}")
        for k, v in s.items():
            print(f"  {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
