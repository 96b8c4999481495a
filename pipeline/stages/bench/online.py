"""The online deploy benchmark (GPU only): the same held-out prompts against a running SGLang server.

Meant for two bench stages in a plan, each ``uses`` a serve stage (``pipeline.stages.serve --mode plain``,
then ``--mode eagle3`` with the trained draft)::

    [[stage]]  id = "bench-plain"  run = "bench"  args = ["--mode", "online", "--label", "plain"]
               after = ["train"]  uses = ["serve-plain"]
    [[stage]]  id = "bench-eagle3" run = "bench"
               args = ["--mode", "online", "--label", "eagle3", "--baseline", "bench-plain"]
               after = ["bench-plain"]  uses = ["serve-eagle3"]

The endpoint is read from the used serve stage's ``out/endpoint.json``. Requests go to SGLang's
native ``/generate`` with the prompt's token ids and greedy sampling, ``[bench] concurrency`` at a
time. Reported: output tok/s (completion tokens over wall time), the accept length SGLang measured
(``completion_tokens / spec_verify_ct`` summed over requests, as SGLang's own EAGLE tests compute
it) and, with ``--baseline``, the speedup over the baseline's tok/s.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pipeline.data.shards import holdout_fraction, iter_rows
from pipeline.run.rundir import RunDir, write_json
from pipeline.run.runtime import StageContext, fail


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


def baseline_results(ctx: StageContext, inputs: list[Path], stage: str) -> dict[str, Any]:
    candidates = [d for d in inputs if d.parent.name == stage]
    if ctx.run_dir is not None:
        candidates.append(RunDir(ctx.run_dir).stage(stage).out)
    for d in candidates:
        p = d / "results.json"
        if p.is_file():
            return json.loads(p.read_text())
    raise ValueError(f"baseline {stage!r}: no results.json (is it in 'after' and finished?)")


def _drive(
    ctx: StageContext,
    url: str,
    prompts: list[list[int]],
    max_new: int,
    conc: int,
    warm: int,
    timeout: float,
    label: str,
) -> dict[str, Any]:
    with ThreadPoolExecutor(max_workers=conc) as pool:
        list(
            pool.map(lambda p: post_json(url + "/generate", generate_request(p, 16), timeout), prompts[:warm])
        )
        t0 = time.monotonic()
        metas = []
        for i, out in enumerate(
            pool.map(lambda p: post_json(url + "/generate", generate_request(p, max_new), timeout), prompts)
        ):
            metas.append(out.get("meta_info", {}) if isinstance(out, dict) else {})
            ctx.progress(i + 1, len(prompts), unit="requests")
        elapsed = time.monotonic() - t0
    res = summarize(label, metas, elapsed)
    res["url"] = url
    return res


def run_online(ctx: StageContext, inputs: list[Path], args: argparse.Namespace) -> int:
    sec = ctx.plan.settings.bench
    label = args.label or ctx.stage_id
    url = endpoint_url(ctx, args.url)
    prompts = prompts_for(ctx, inputs, sec.prompt_count(online=True))
    if not prompts:
        fail(ctx, "no held-out prompts for the online benchmark; raise [bench] holdout")
    max_new = sec.new_tokens(online=True)
    conc = sec.concurrency
    timeout = sec.timeout_s
    ctx.message(
        f"{label}: {len(prompts)} prompts against {url}/generate, concurrency {conc}, {max_new} new tokens"
    )
    warm = min(conc, len(prompts))
    try:
        res = _drive(ctx, url, prompts, max_new, conc, warm, timeout, label)
    except OSError as exc:  # URLError, refused, timeout
        fail(ctx, f"{label}: the server at {url} did not answer /generate: {exc}")
    if args.baseline:
        base = baseline_results(ctx, inputs, args.baseline)
        res["baseline"] = {"label": base.get("label"), "output_tok_s": base.get("output_tok_s")}
        if base.get("output_tok_s"):
            res["speedup"] = res["output_tok_s"] / float(base["output_tok_s"])
    write_json(ctx.out / "results.json", res)
    write_json(ctx.out / "manifest.json", {k: v for k, v in res.items() if k != "baseline"})
    ctx.metric("output_tok_s", res["output_tok_s"], label=label)
    if res["accept_len"] is not None:
        ctx.metric("accept_len", res["accept_len"], label=label)
    if "speedup" in res:
        ctx.metric("speedup", res["speedup"], label=label)
    ctx.message(
        f"{label}: {res['output_tok_s']:.1f} output tok/s"
        + (f", accept length {res['accept_len']:.2f}" if res["accept_len"] else "")
        + (f", {res['speedup']:.2f}x over {args.baseline}" if "speedup" in res else "")
    )
    return 0
