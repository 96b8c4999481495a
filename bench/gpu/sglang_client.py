"""How the SGLang bench measures a server: chat prompts, closed-loop streams of greedy requests (tokens/s and the
accept length from SGLang's own counters), the server log's decode lines, and user turns the target writes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.gpu.runner import log
from bench.gpu.server import Server


def chat_prompts(model_dir: Path, questions: list[str]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def log_window(srv: Server, start: int) -> dict[str, Any]:
    """The server's own decode lines written since byte ``start`` of its log: SGLang's ``gen throughput``
    (a steady-state rate over its last log interval, no client or prefill time in it) and the running batch."""
    from pipeline.serving.sglang_log import parse_line

    srv.logf.flush()
    with srv.log_path.open("rb") as f:
        f.seek(start)
        text = f.read()
    gen: list[float] = []
    running: list[float] = []
    acc: list[float] = []
    graph = {"True": 0, "False": 0}
    for raw in text.splitlines():
        rec = parse_line(raw)
        if rec is None or rec.kind != "decode":
            continue
        if isinstance(rec.fields.get("cuda_graph"), bool):
            graph[str(rec.fields["cuda_graph"])] += 1
        m = rec.metrics()
        if "gen_throughput" in m:
            gen.append(m["gen_throughput"])
            running.append(m.get("running_req", 0.0))
            if "accept_len" in m:
                acc.append(m["accept_len"])
    out: dict[str, Any] = {"log_decode_lines": len(gen), "log_cuda_graph_lines": graph}
    if gen:
        top = max(running)
        full = sorted(g for g, r in zip(gen, running, strict=True) if r == top)
        out["log_gen_throughput_median"] = round(full[len(full) // 2], 1)  # lines with the full batch running
        out["log_running_req_max"] = top
        out["log_gen_throughput_all"] = gen
    if acc:
        out["log_accept_len_median"] = sorted(acc)[len(acc) // 2]
    return out


def throughput(
    srv: Server, prompts: list[str], batch: int, max_new: int, per_stream: int, warmup: int = 0
) -> dict[str, Any]:
    """``batch`` closed-loop streams, each sending ``per_stream`` greedy requests one after another; first, with
    ``warmup`` > 0, one unmeasured request a stream of ``warmup`` new tokens, so the first use of this batch size
    (kernels compiled on first call, allocator growth) stays out of the measured window."""
    if warmup:
        warm_streams(srv, prompts, batch, warmup)
    srv.logf.flush()
    log_start = srv.log_path.stat().st_size
    n = batch * per_stream
    work = [prompts[i % len(prompts)] for i in range(n)]
    m0 = srv.metrics()
    lock = threading.Lock()
    agg: dict[str, Any] = {"tokens": 0, "verify": 0, "lat": []}

    def stream(k: int) -> None:
        for j in range(per_stream):
            t = time.monotonic()
            r = srv.generate(
                {
                    "text": work[k * per_stream + j],
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
                }
            )
            mi = r["meta_info"]
            with lock:
                agg["tokens"] += mi["completion_tokens"]
                agg["verify"] += mi.get("spec_verify_ct", 0) or 0
                agg["lat"].append(time.monotonic() - t)

    t0 = time.monotonic()
    with ThreadPoolExecutor(batch) as ex:
        list(ex.map(stream, range(batch)))
    wall = time.monotonic() - t0
    m1 = srv.metrics()
    d_gen = m1.get("sglang:generation_tokens_total", 0) - m0.get("sglang:generation_tokens_total", 0)
    d_ver = m1.get("sglang:spec_verify_calls_total", 0) - m0.get("sglang:spec_verify_calls_total", 0)
    lat = sorted(agg["lat"])
    res = {
        "batch": batch,
        "requests": n,
        "max_new_tokens": max_new,
        "completion_tokens": agg["tokens"],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(agg["tokens"] / wall, 1),
        "per_stream_tokens_per_s": round(agg["tokens"] / wall / batch, 1),
        "median_request_s": round(lat[len(lat) // 2], 3),
        "metrics_generation_tokens": d_gen,
        "metrics_spec_verify_calls": d_ver,
    }
    res["warmup_new_tokens"] = warmup
    res.update(log_window(srv, log_start))
    if d_ver:
        res["accept_length_metrics"] = round(d_gen / d_ver, 3)
    if agg["verify"]:
        res["accept_length_responses"] = round(agg["tokens"] / agg["verify"], 3)
    log_throughput(srv.name, res, bool(d_ver))
    return res


def warm_streams(srv: Server, prompts: list[str], batch: int, warmup: int) -> None:
    """One unmeasured request a stream of ``warmup`` new tokens, all ``batch`` streams at once."""
    with ThreadPoolExecutor(batch) as ex:
        list(
            ex.map(
                lambda k: srv.generate(
                    {
                        "text": prompts[(k + 7) % len(prompts)],
                        "sampling_params": {"max_new_tokens": warmup, "temperature": 0.0, "ignore_eos": True},
                    }
                ),
                range(batch),
            )
        )


def log_throughput(name: str, res: dict[str, Any], speculative: bool) -> None:
    log(
        f"{name} batch {res['batch']}: {res['tokens_per_s']:,.0f} tok/s ({res['per_stream_tokens_per_s']:,.0f} per stream"
        f"; server log {res.get('log_gen_throughput_median')})"
        + (
            f", accept length {res.get('accept_length_metrics')} (metrics) / {res.get('accept_length_responses')}"
            if speculative
            else ""
        )
    )


def sample_questions(srv: Server, model_dir: Path, n: int, seed: int) -> list[str]:
    """User turns the target writes itself from its chat template's user header (sampled, T=1, top-p 0.95)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    mark = "AERIE-PROMPT-MARK"
    head = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head = head[: head.index(mark)]
    out: list[str] = []
    seen: set[str] = set()
    k = 0
    while len(out) < n and k < 5:
        r = srv.generate(
            {
                "text": [head] * (n - len(out) + 16),
                "sampling_params": {
                    "max_new_tokens": 48,
                    "temperature": 1.0,
                    "top_p": 0.95,
                    "stop": ["<|im_end|>"],
                },
            }
        )
        for item in r:
            t = item["text"].strip()
            if len(t) >= 12 and t not in seen:
                seen.add(t)
                out.append(t)
        k += 1
    return out[:n]
