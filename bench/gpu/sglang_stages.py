"""``python -m bench.gpu.sglang_serve --phases stages``: Aerie's real serve, regen and online bench stages against SGLang (issue 26).

Every stage runs by its command line (``python -m pipeline.stages.<x> --plan P --out D``), as the supervisor
would start it, on the structured 8B target (``--target structured``): a plain serve stage in the background
(SGLang's site folder on its ``PYTHONPATH``), prep of random word prompts, the regen stage through it — killed
with SIGTERM part-way and restarted, to check it resumes — then the online bench stage (``--mode online``),
the serve stage stopped, and the same prompts through the transformers ``generate`` path ``bench/gpu/quality.py``
uses, for tokens/s. ``stages2`` trains a draft on regen's output (extract → vocab → train) and runs the
``--mode eagle3`` serve stage and the online bench stage with ``--baseline bench-plain``. Results go to
``RESULTS['stages']``; every stage's ``events.jsonl`` is copied to ``$OUT/stages/``.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.results import MERGED, RESULTS, save_results, stage_events
from bench.gpu.runner import BASE, OUT, ROOT, SITE, log, track
from bench.gpu.server import metrics_at
from bench.gpu.sglang_models import build_models
from bench.gpu.sglang_setup import training_sections
from pipeline.run.rundir.protocol import Health, Metric, kind_of


def _plan(w: Path, model: Path, n: int, args: Any) -> Path:
    extra = [
        "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
        "--enable-metrics", "--cuda-graph-max-bs", "32", "--log-level", "info",
        "--cuda-graph-backend-prefill", "disabled",
    ]  # fmt: skip
    plan = w / "plan.toml"
    plan.write_text(f"""[run]
name = "sglang-stages"
dir = "{w / "run"}"
[target]
model = "{model}"
max_length = 1024
[serve]
backend = "sglang"
port = 30010
mem_fraction_static = 0.8
context_length = 2048
startup_timeout_s = 400
extra_args = {json.dumps(extra)}
[deploy]
draft_model_path = "{w / "train" / "draft"}"
port = 30011
[regen]
concurrency = 256
temperature = 0.0
max_tokens = {args.answer_tokens}
{training_sections(args)}[bench]
holdout = 0.05
prompts = 32
batches = [1, 8, 32]
requests_per_stream = 2
[[datasets]]
name = "words"
source = "ultrachat"
kind = "prompt-only"
path = "{w / "prompts.jsonl"}"
quota = {n}
""")
    return plan


def _env(site: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = str(SITE) if site else str(BASE / "extra")
    return env


def _start(module: str, plan: Path, out: Path, *extra: str, site: bool = False) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out), *extra]
    log("$ " + " ".join(argv[1:]))
    logf = (OUT / "stages" / f"{out.name}.log").open("a")
    p = subprocess.Popen(
        argv, cwd=ROOT, env=_env(site), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
    )
    return track(p)  # killed by the runner's kill_started if this phase fails


def _wait_ready(out: Path, p: subprocess.Popen, timeout: float) -> str:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if p.poll() is not None:
            raise RuntimeError(f"serve stage {out.name} exited with {p.returncode} before ready")
        try:
            ep = json.loads((out / "endpoint.json").read_text())
            if ep.get("state") == "ready":
                log(f"{out.name}: ready after {time.monotonic() - t:.0f} s at {ep['url']}")
                return str(ep["url"])
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError(f"serve stage {out.name}: not ready after {timeout:.0f} s")


def _stop(p: subprocess.Popen, name: str) -> dict[str, Any]:
    t = time.monotonic()
    os.killpg(p.pid, signal.SIGTERM)
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
    log(f"{name}: stopped, rc {rc}, {time.monotonic() - t:.1f} s")
    return {"rc": rc, "stop_s": round(time.monotonic() - t, 1)}


def _events(out: Path) -> dict[str, Any]:
    """What the console would read: counts of event types / metric names, health states in order."""
    f = out / "events.jsonl"
    if not f.exists():
        return {"missing": str(f)}
    ev = stage_events(out)
    shutil.copy2(f, OUT / "stages" / f"{out.name}.events.jsonl")
    kinds = collections.Counter(kind_of(e) for e in ev)
    metrics = collections.Counter(e.name for e in ev if isinstance(e, Metric))
    health = [e.state for e in ev if isinstance(e, Health)]
    last = {e.name: e.value for e in ev if isinstance(e, Metric)}
    return {"types": dict(kinds), "metrics": dict(metrics), "health": health, "last_metric": last}


def _run(module: str, plan: Path, out: Path, *extra: str) -> float:
    t = time.monotonic()
    p = _start(module, plan, out, *extra)
    rc = p.wait()
    if rc != 0:
        print((OUT / "stages" / f"{out.name}.log").read_text()[-3000:])
        raise RuntimeError(f"{module} --out {out.name} failed ({rc})")
    dt = time.monotonic() - t
    log(f"{module} -> {out.name}: {dt:.0f} s")
    return dt


def _lines(f: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def phase_stages(args: Any) -> None:
    from transformers import AutoTokenizer

    from bench.gpu.structured_target import word_prompts

    (OUT / "stages").mkdir(parents=True, exist_ok=True)
    name = "llama8b_structured"
    model = build_models([name], args)[name]
    w = BASE / "work_stages"
    w.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = RESULTS.setdefault("stages", {})
    n = args.regen_prompts
    if not (w / "prompts.jsonl").exists():
        qs = word_prompts(AutoTokenizer.from_pretrained(str(model)), n, args.seed)
        rows = [
            {"prompt_id": f"w{i:06d}", "messages": [{"role": "user", "content": q}]} for i, q in enumerate(qs)
        ]
        (w / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plan = _plan(w, model, n, args)
    if not (w / "prep" / "manifest.json").exists():
        res["prep_s"] = _run("pipeline.stages.prep", plan, w / "prep", "--dataset", "words")
    serve = _start("pipeline.stages.serve", plan, w / "serve-plain", "--mode", "plain", site=True)
    t = time.monotonic()
    try:
        url = _wait_ready(w / "serve-plain", serve, 400)
        res["serve_plain_ready_s"] = round(time.monotonic() - t, 1)
        res["regen"] = regen_resumes(plan, w, url, n)
        log(
            f"regen: {json.dumps({k: v for k, v in res['regen'].items() if k not in ('events', 'manifest')})}"
        )
        save_results()
        res["bench_plain_s"] = _run("pipeline.stages.bench", plan, w / "bench-plain" / "out", "--mode", "online",
                                    "--label", "plain", "--url", url, "--input", str(w / "regen"))  # fmt: skip
        res["bench_plain"] = json.loads((w / "bench-plain" / "out" / "results.json").read_text())
        save_results()
    finally:
        res["serve_plain_stop"] = _stop(serve, "serve-plain")
        res["serve_plain_events"] = _events(w / "serve-plain")
        save_results()
    res["transformers_generate"] = hf_generate(model, w, args)
    save_results()


def regen_resumes(plan: Path, w: Path, url: str, n: int) -> dict[str, Any]:
    """The regen stage through the plain server: SIGTERM part-way, then restarted; what each run answered."""
    rg = w / "regen"
    answers = rg / "responses.jsonl"
    t0 = time.monotonic()
    p = _start("pipeline.stages.regen", plan, rg, "--dataset", "words", "--input", str(w / "prep"),
               "--server-url", url)  # fmt: skip
    while p.poll() is None and len(_lines(answers)) < n * 0.4:
        time.sleep(0.5)
    killed_at = len(_lines(answers))
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    rc1 = p.wait(timeout=120)
    first_s = time.monotonic() - t0
    before = _lines(answers)
    log(f"regen: SIGTERM at {killed_at} answers; rc {rc1}; {len(before)} answers kept")
    m0 = metrics_at(url)
    t1 = time.monotonic()
    p = _start("pipeline.stages.regen", plan, rg, "--dataset", "words", "--input", str(w / "prep"),
               "--server-url", url)  # fmt: skip
    rc2 = p.wait()
    second_s = time.monotonic() - t1
    m1 = metrics_at(url)
    after = _lines(answers)
    ids = [r.get("id") for r in after]
    tok2 = sum(int(r.get("completion_tokens") or 0) for r in after[len(before) :])
    tok1 = sum(int(r.get("completion_tokens") or 0) for r in before)
    return {
        "prompts": n,
        "sigterm_at_answers": killed_at,
        "first_rc": rc1,
        "first_s": round(first_s, 1),
        "first_answers": len(before),
        "first_completion_tokens": tok1,
        "second_rc": rc2,
        "second_s": round(second_s, 1),
        "second_answers": len(after) - len(before),
        "second_completion_tokens": tok2,
        "second_tokens_per_s": round(tok2 / second_s, 1),
        "server_requests_during_second": m1.get("sglang:num_requests_total", 0)
        - m0.get("sglang:num_requests_total", 0),
        "answers_total": len(after),
        "distinct_ids": len(set(ids)),
        "manifest": json.loads((rg / "manifest.json").read_text())
        if (rg / "manifest.json").exists()
        else None,
        "events": _events(rg),
    }


def hf_generate(model: Path, w: Path, args: Any) -> dict[str, Any]:
    """The regen prompts' first ``hf_prompts`` through ``model.generate`` (quality.py's answer path: chat
    template, left-padded batches of similar length, greedy), tokens/s."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    t = time.monotonic()
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).to("cuda").eval()
    load_s = time.monotonic() - t
    rows = _lines(w / "prompts.jsonl")[: args.hf_prompts]
    texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) for r in rows]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out_tokens = 0
    torch.cuda.synchronize()
    t = time.monotonic()
    for a in range(0, len(order), args.hf_batch):
        idx = order[a : a + args.hf_batch]
        enc = tok([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False).to(
            "cuda"
        )
        with torch.no_grad():
            o = m.generate(
                **enc, do_sample=False, max_new_tokens=args.answer_tokens, pad_token_id=tok.pad_token_id
            )
        gen = o[:, enc["input_ids"].shape[1] :]
        out_tokens += int((gen != tok.pad_token_id).sum())
    torch.cuda.synchronize()
    dt = time.monotonic() - t
    r = {"prompts": len(texts), "batch": args.hf_batch, "max_new_tokens": args.answer_tokens, "load_s": round(load_s, 1),
         "generate_s": round(dt, 1), "tokens": out_tokens, "tokens_per_s": round(out_tokens / dt, 1)}  # fmt: skip
    log(f"transformers generate: {r}")
    del m
    torch.cuda.empty_cache()
    return r


def phase_stages2(args: Any) -> None:
    (OUT / "stages").mkdir(parents=True, exist_ok=True)
    w = BASE / "work_stages"
    plan = w / "plan.toml"
    old = MERGED  # keep the first call's rows: save_results replaces top-level keys
    prev = json.loads(old.read_text()).get("stages", {}) if old.exists() else {}
    res: dict[str, Any] = RESULTS.setdefault("stages", prev)
    rg = w / "regen"
    if not (w / "train" / "draft" / "config.json").exists():
        res["extract_s"] = _run("pipeline.stages.extract", plan, w / "ext", "--input", str(rg))
        res["vocab_s"] = _run("pipeline.stages.vocab", plan, w / "voc", "--input", str(rg))
        res["train_s"] = _run("pipeline.stages.train", plan, w / "train", "--input", str(w / "ext"),
                              "--input", str(w / "voc"))  # fmt: skip
        res["train_events"] = _events(w / "train")
        save_results()
    serve = _start("pipeline.stages.serve", plan, w / "serve-eagle3", "--mode", "eagle3", site=True)
    t = time.monotonic()
    try:
        url = _wait_ready(w / "serve-eagle3", serve, 400)
        res["serve_eagle3_ready_s"] = round(time.monotonic() - t, 1)
        # as the supervisor would: the bench stage's inputs are its `after` (bench-plain) only
        res["bench_eagle3_s"] = _run("pipeline.stages.bench", plan, w / "bench-eagle3" / "out", "--mode", "online",
                                     "--label", "eagle3", "--url", url, "--baseline", "bench-plain",
                                     "--input", str(w / "bench-plain" / "out"))  # fmt: skip
        res["bench_eagle3"] = json.loads((w / "bench-eagle3" / "out" / "results.json").read_text())
    finally:
        res["serve_eagle3_stop"] = _stop(serve, "serve-eagle3")
        res["serve_eagle3_events"] = _events(w / "serve-eagle3")
        save_results()
