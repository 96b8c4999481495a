"""The online deploy benchmark (GPU only): the same held-out prompts against a running SGLang server.

Meant for two bench stages in a plan, each ``uses`` a serve stage (``pipeline.stages.serve --mode plain``,
then ``--mode eagle3`` with the trained draft)::

    [[stage]]  id = "bench-plain"  run = "bench"  args = ["--mode", "online", "--label", "plain"]
               after = ["train"]  uses = ["serve-plain"]
    [[stage]]  id = "bench-eagle3" run = "bench"
               args = ["--mode", "online", "--label", "eagle3", "--baseline", "bench-plain"]
               after = ["bench-plain"]  uses = ["serve-eagle3"]

(``engine = "sglang"`` in ``[bench]`` is the same as ``mode = "online"``.) The endpoint is read from the used serve
stage's ``out/endpoint.json``. Requests go to SGLang's native ``/generate`` with the prompt's token ids and greedy
sampling. After a warm-up, each of ``[bench] batches`` (1, 8, 32) is measured in turn: that many closed-loop
streams, each sending ``requests_per_stream`` requests one after another. Reported per batch: output tok/s
(completion tokens over wall time) and the accept length — from the *deltas* of SGLang's own counters over the
measurement (``sglang:generation_tokens_total`` / ``sglang:spec_verify_calls_total``, with ``--enable-metrics``),
and from the responses (``completion_tokens / spec_verify_ct``, as SGLang's own EAGLE tests compute it) — and,
with ``--baseline``, the speedup over the baseline's tok/s at the same batch: the table a run ends with.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.data.shards import holdout_fraction, iter_rows
from pipeline.manifests import bench as bench_manifest
from pipeline.manifests.bench import BenchManifest
from pipeline.run.rundir.layout import RunDir, write_json
from pipeline.run.stage_side.runtime import StageContext, fail
from pipeline.stages.bench.gap import gap_record, report_gap, train_draft

GEN_TOKENS = "sglang:generation_tokens_total"  # SGLang's counters (--enable-metrics), as 0.5.x names them
VERIFY_CALLS = "sglang:spec_verify_calls_total"
PROMPTS_FILE = "prompts.json"  # the token ids a bench stage sent: a --baseline's are reused by the next stage


def endpoint_url(ctx: StageContext, explicit: str | None) -> str:
    """``--url``, else the URL of the ready serve stage this stage ``uses``."""
    if explicit:
        return explicit.rstrip("/")
    if ctx.run_dir is None:
        raise ValueError("not under the supervisor: pass --url http://HOST:PORT")
    spec = ctx.plan.stage(ctx.stage_id)
    if not spec.uses:
        raise ValueError(f'{ctx.plan.path}: stage {ctx.stage_id!r} uses no serve stage (uses = ["serve-…"])')
    for sid in spec.uses:
        ep = RunDir(ctx.run_dir).stage(sid).out / "endpoint.json"
        try:
            doc = json.loads(ep.read_text())
        except (FileNotFoundError, ValueError):
            continue
        if doc.get("state") == "ready" and doc.get("url"):
            return str(doc["url"]).rstrip("/")
    raise ValueError(f"no ready endpoint.json among the used serve stages {list(spec.uses)}")


def generate_request(input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """The body of one SGLang ``/generate`` call: token ids in, greedy, a fixed length budget."""
    return {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
    }


def post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:  # noqa: S310 - the plan's own server
        return json.loads(r.read())


def summarize(label: str, metas: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
    completion = sum(int(m.get("completion_tokens", 0)) for m in metas)
    verify = sum(int(m.get("spec_verify_ct", 0) or 0) for m in metas)
    return {
        "kind": "bench",
        "mode": "online",
        "label": label,
        "requests": len(metas),
        "completion_tokens": completion,
        "elapsed_s": elapsed_s,
        "output_tok_s": completion / elapsed_s if elapsed_s > 0 else 0.0,
        "accept_len": (completion / verify) if verify else None,
        "spec_verify_ct": verify,
    }


def prompts_for(ctx: StageContext, inputs: list[Path], n: int) -> list[list[int]]:
    from pipeline.stages.bench.inputs import find_draft, heldout_prompts

    try:
        man, _ = find_draft(inputs)
        return [p for _, p in heldout_prompts(man, n, 1 << 31)]
    except ValueError:
        holdout = holdout_fraction(ctx.plan)
        out = []
        for row in iter_rows(inputs, holdout, "heldout"):
            p = row.prompt()
            if 0 < p.size < row.num_tokens:
                out.append(p.astype("int64").tolist())
            if len(out) >= n:
                break
        return out


def baseline_dir(ctx: StageContext, inputs: list[Path], stage: str) -> Path:
    """The out dir of the baseline bench stage: among the inputs (``stages/<id>/out``), else in the run dir."""
    candidates = [d for d in inputs if d.parent.name == stage]
    if ctx.run_dir is not None:
        candidates.append(RunDir(ctx.run_dir).stage(stage).out)
    for d in candidates:
        if (d / "results.json").is_file():
            return d
    raise ValueError(f"baseline {stage!r}: no results.json (is it in 'after' and finished?)")


def baseline_results(ctx: StageContext, inputs: list[Path], stage: str) -> dict[str, Any]:
    return dict(json.loads((baseline_dir(ctx, inputs, stage) / "results.json").read_text()))


def baseline_prompts(ctx: StageContext, inputs: list[Path], stage: str) -> list[list[int]] | None:
    """The prompts the baseline measured (its ``prompts.json``), so both sides of a speedup send the same ones —
    and a bench stage whose only input is the baseline (``after = ["bench-plain"]``) has prompts at all."""
    p = baseline_dir(ctx, inputs, stage) / PROMPTS_FILE
    if not p.is_file():
        return None
    doc = json.loads(p.read_text())
    if not isinstance(doc, list) or not all(isinstance(x, list) for x in doc):
        raise ValueError(f"{p}: expected a list of token-id lists")
    return [[int(t) for t in x] for x in doc]


def read_counters(url: str, timeout_s: float) -> dict[str, float] | None:
    """SGLang's Prometheus counters (``--enable-metrics``), summed over their labels; ``None`` when the server
    exposes none (then the accept length comes from the responses alone)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout_s) as r:  # noqa: S310 - the plan's server
            raw = r.read().decode(errors="replace")
    except OSError:
        return None
    out: dict[str, float] = {}
    for line in raw.splitlines():
        if line.startswith("sglang:") and " " in line:
            key, val = line.rsplit(" ", 1)
            base = key.split("{", 1)[0]
            try:
                out[base] = out.get(base, 0.0) + float(val)
            except ValueError:
                continue
    return out or None


def counter_accept_len(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Tokens generated per verify step over the measurement: the *deltas* of SGLang's counters (its
    cumulative average would mix in the warm-up and every earlier request)."""
    if not before or not after:
        return None
    gen = after.get(GEN_TOKENS, 0.0) - before.get(GEN_TOKENS, 0.0)
    ver = after.get(VERIFY_CALLS, 0.0) - before.get(VERIFY_CALLS, 0.0)
    return gen / ver if ver > 0 else None


def measure_batch(
    url: str,
    prompts: list[list[int]],
    batch: int,
    per_stream: int,
    max_new: int,
    timeout: float,
    done: Callable[[], None],
) -> dict[str, Any]:
    """``batch`` closed-loop streams, each sending ``per_stream`` greedy requests one after another: the server
    sees ``batch`` requests in flight for the whole measurement, as ``batch`` users would keep it."""
    work = [prompts[i % len(prompts)] for i in range(batch * per_stream)]
    lock = threading.Lock()
    metas: list[dict[str, Any]] = []

    def stream(k: int) -> None:
        for j in range(per_stream):
            out = post_json(url + "/generate", generate_request(work[k * per_stream + j], max_new), timeout)
            with lock:
                metas.append(out.get("meta_info", {}) if isinstance(out, dict) else {})
            done()

    before = read_counters(url, timeout)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=batch) as pool:
        list(pool.map(stream, range(batch)))  # re-raises a stream's error
    elapsed = time.monotonic() - t0
    after = read_counters(url, timeout)
    res = summarize("", metas, elapsed)
    row = {
        "batch": batch,
        "requests": res["requests"],
        "completion_tokens": res["completion_tokens"],
        "elapsed_s": elapsed,
        "output_tok_s": res["output_tok_s"],
        "accept_len_responses": res["accept_len"],
        "accept_len_counters": counter_accept_len(before, after),
    }
    row["accept_len"] = row["accept_len_counters"] or row["accept_len_responses"]
    return row


def speedup_rows(rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """Adds ``baseline_tok_s`` and ``speedup`` to each row whose batch the baseline measured too."""
    base_by_batch = {int(r["batch"]): r for r in base.get("batches", []) if r.get("output_tok_s")}
    for r in rows:
        b = base_by_batch.get(int(r["batch"]))
        if b is not None:
            r["baseline_tok_s"] = float(b["output_tok_s"])
            r["speedup"] = r["output_tok_s"] / r["baseline_tok_s"]


def table_lines(label: str, rows: list[dict[str, Any]], baseline: str | None) -> list[str]:
    """The table a run ends with: one line per batch."""
    lines = []
    for r in rows:
        text = f"{label} batch {r['batch']}: {r['output_tok_s']:,.1f} output tok/s"
        if "speedup" in r:
            text += f" ({r['speedup']:.2f}x {baseline}'s {r['baseline_tok_s']:,.1f})"
        if r["accept_len"] is not None:
            how = "SGLang's counters" if r["accept_len_counters"] is not None else "the responses"
            text += f", accept length {r['accept_len']:.2f} ({how})"
        lines.append(text)
    return lines


def run_online(ctx: StageContext, inputs: list[Path], args: argparse.Namespace) -> int:
    sec = ctx.plan.settings.bench
    label = args.label or ctx.stage_id
    url = endpoint_url(ctx, args.url)
    n = sec.prompt_count(online=True)
    prompts = baseline_prompts(ctx, inputs, args.baseline) if args.baseline else None
    if prompts is None:
        prompts = prompts_for(ctx, inputs, n)
    if not prompts:
        fail(ctx, "no held-out prompts for the online benchmark; raise [bench] holdout")
    max_new = sec.new_tokens(online=True)
    batches, per_stream, timeout = list(sec.batches), sec.requests_per_stream, sec.timeout_s
    total = sum(batches) * per_stream
    ctx.message(
        f"{label}: {len(prompts)} held-out prompts against {url}/generate, {max_new} new tokens; "
        f"batches {batches}, {per_stream} requests per stream"
    )
    base = baseline_results(ctx, inputs, args.baseline) if args.baseline else None
    sent = 0

    def done() -> None:
        nonlocal sent
        sent += 1
        ctx.progress(sent, total, unit="requests")

    rows: list[dict[str, Any]] = []
    try:
        warm = min(sec.concurrency, len(prompts))
        with ThreadPoolExecutor(max_workers=warm) as pool:  # compiles, graphs and caches before measuring
            list(
                pool.map(
                    lambda p: post_json(url + "/generate", generate_request(p, 16), timeout), prompts[:warm]
                )
            )
        for b in batches:
            ctx.safe_point()
            rows.append(measure_batch(url, prompts, b, per_stream, max_new, timeout, done))
    except OSError as exc:  # URLError, refused, timeout
        fail(ctx, f"{label}: the server at {url} did not answer /generate: {exc}")
    if base is not None:
        speedup_rows(rows, base)
    first = rows[0]
    res: dict[str, Any] = {
        "kind": "bench",
        "mode": "online",
        "label": label,
        "url": url,
        "max_new_tokens": max_new,
        "batches": rows,
        "output_tok_s": first["output_tok_s"],  # the first batch's (batch 1 by default)
        "accept_len": first["accept_len"],
        "requests": sum(r["requests"] for r in rows),
        "completion_tokens": sum(r["completion_tokens"] for r in rows),
    }
    gap = served_gap(ctx, inputs, label, first)
    if gap is not None:
        res["accept_gap"] = gap
    if base is not None:
        res["baseline"] = {"label": base.get("label"), "output_tok_s": base.get("output_tok_s")}
        if "speedup" in first:
            res["speedup"] = first["speedup"]
    write_json(ctx.out / PROMPTS_FILE, prompts)
    write_json(ctx.out / "results.json", res)
    bench_manifest.write(  # the summary: results.json less the baseline's line
        ctx.out / "manifest.json", BenchManifest.from_dict({k: v for k, v in res.items() if k != "baseline"})
    )
    for r in rows:
        ctx.metric("output_tok_s", r["output_tok_s"], label=label, batch=r["batch"])
        if r["accept_len"] is not None:
            ctx.metric("accept_len", r["accept_len"], label=label, batch=r["batch"])
        if "speedup" in r:
            ctx.metric("speedup", r["speedup"], label=label, batch=r["batch"])
    for line in table_lines(label, rows, args.baseline):
        ctx.message(line)
    report_gap(ctx, gap)
    return 0


def served_gap(
    ctx: StageContext, inputs: list[Path], label: str, first: dict[str, Any]
) -> dict[str, Any] | None:
    """The served accept length (the first batch's) beside the train stage's simulated one for the same draft;
    None for the plain server (no draft) or when either is missing."""
    if label == "plain" or first.get("accept_len") is None:
        return None
    found = train_draft(ctx, inputs)
    if found is None:
        return None
    how = "SGLang's counters" if first.get("accept_len_counters") is not None else "the responses"
    where = f"{ctx.out / 'results.json'}: batches[0] (batch {first.get('batch')}, {how})"
    return gap_record(found[0], found[1], float(first["accept_len"]), where)
