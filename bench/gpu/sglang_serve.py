"""SGLang on the lent H200 (issue 26): start it with the serve stage's own argv, measure plain vs EAGLE-3 decoding.

``python -m bench.gpu.sglang_serve --stage-from .gpu-stage/c1 --stage-from .gpu-stage/c2 [--phases smollm2,plain,data,train,eagle3]
[--batches 1,8,32] [--specs 3/1/4,...]`` — on the device, one ``run`` call carrying ``.gpu-stage/c1`` and
``.gpu-stage/c2`` (~57 MB together with the repo), made by ``bash bench/gpu/stage_sglang.sh`` here; all phases take
~10 minutes, so split them over back-to-back calls (``--phases smollm2,plain,data`` then ``--phases train,eagle3``,
issued within the 30 s the machine stays warm; later calls need no ``--stage-from``).

SGLang itself is assembled here by ``bench/gpu/stage_sglang.sh`` (wheels → one trimmed site folder → xz → chunk
folders ``.gpu-stage/cN`` of ≤ 56 MiB, each carried by one ``run`` call; the machine keeps /tmp while warm). The
server runs under the image's python3 (torch 2.11+cu130) with that site folder first on ``PYTHONPATH``;
everything else (model building, Aerie's stages, this client) runs on the image's own packages.

Phases (each resumable on a warm machine: what it made stays under ``--work``):

- ``smollm2``: the demo model's shape, tokenizer and chat template (SmolLM2-135M-Instruct's real files; random
  weights, its 270 MB of weights do not travel), served; one chat completion and plain tokens/s at batch 1.
- ``plain``: a random-weight Llama-3.1-8B-shaped target (32 layers, hidden 4096, GQA 32/8, the SmolLM2 tokenizer
  so vocabulary 49,152), served plainly; client tokens/s at each batch.
- ``data``: the same server writes the draft's training data: it samples user prompts from its own chat template
  and answers them greedily (the regen stage's job), as an UltraChat-schema JSONL.
- ``train``: Aerie's real stages by their command lines: prep → extract → vocab → train (→ offline bench with
  ``--offline-bench``); the train stage writes ``train/draft``.
- ``eagle3``: the target served with ``--speculative-algorithm EAGLE3 --speculative-draft-model-path
  <train/draft>`` as written (3/1/4 by default), tokens/s at each batch, and the accept length from SGLang's own
  counters: Δ``sglang:generation_tokens_total`` / Δ``sglang:spec_verify_calls_total`` over the measurement
  (``--enable-metrics``), and the same ratio from the responses' ``completion_tokens``/``spec_verify_ct``.

``--target structured`` runs plain/data/train/eagle3 on ``llama8b_structured`` instead: the same 8B shape,
restructured by ``bench/gpu/structured_target.py`` so its greedy text is mostly a fixed map of the current token
(``--follow``: the share calibrated on the device), prompted with random word strings, under ``work_structured``
and ``structured_*`` result keys (``docs/performance.md`` has its table). ``--no-prefill-graph`` skips the
piecewise prefill CUDA graphs (~35 s a server start).

The launch argv is ``pipeline.serving.sglang_args.sglang_argv`` (the serve and deploy stages' builder) with the
bench's backend choices as ``extra_args``. While a server starts, its pid is watched with ``/health``: a dead server
fails at once with its log tail; one still silent after ``--dump-after`` s gets a py-spy stack dump of every
process. Results go to ``$OUT/gpu_sglang.json``, server logs to ``$OUT/server_<name>.log``.

The harness (``runner``, ``staging``, ``server``, ``results``) starts, watches and stops the servers and keeps
the result file; ``sglang_setup`` (targets, keys, settings), ``sglang_models`` and ``sglang_client``
(measurement) are shared with the ``ab`` (``sglang_ab``) and ``stages``/``stages2`` (``sglang_stages``) phases.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from typing import Any

from bench.gpu import sglang_ab, sglang_stages
from bench.gpu.results import MERGED, RESULTS, save_results, stage_metrics
from bench.gpu.runner import BASE, OUT, SITE, kill_leftover, kill_started, log, run_stage
from bench.gpu.server import Server, http_post
from bench.gpu.sglang_client import chat_prompts, sample_questions, throughput
from bench.gpu.sglang_models import build_models
from bench.gpu.sglang_setup import key, plain_key, settings, target_name, training_sections, work_dir
from bench.gpu.staging import stage


def questions(srv: Server, model: Path, n: int, seed: int, args: argparse.Namespace) -> list[str]:
    """The random target writes its own user turns; the structured one gets random word strings (it has no
    chat-like text of its own to sample: its sampled turns would be walks of its word cycle)."""
    if args.target != "structured":
        return sample_questions(srv, model, n, seed)
    from transformers import AutoTokenizer

    from bench.gpu.structured_target import word_prompts

    return word_prompts(AutoTokenizer.from_pretrained(str(model)), n, seed)


def phase_smollm2(args: argparse.Namespace) -> None:
    model = build_models(["smollm2"])["smollm2"]
    srv = Server("smollm2", settings(model, 30001, args), args.start_timeout, args.dump_after)
    try:
        r: dict[str, Any] = {"start_s": round(srv.start_s, 1)}
        chat = http_post(
            f"{srv.s.url}/v1/chat/completions",
            {"model": str(model), "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16},
        )
        r["chat_completion_tokens"] = chat["usage"]["completion_tokens"]
        prompts = chat_prompts(model, ["Tell me about the sea.", "Write a poem about rain."])
        r["throughput"] = [throughput(srv, prompts, 1, args.max_new_tokens, 3)]
        RESULTS["smollm2"] = r
    finally:
        srv.stop()
    save_results()


def phase_plain_and_data(args: argparse.Namespace, phases: list[str]) -> None:
    name = target_name(args)
    model = build_models([name], args)[name]
    srv = Server(f"{name}_plain", settings(model, 30002, args), args.start_timeout, args.dump_after)
    try:
        work = work_dir(args)
        work.mkdir(parents=True, exist_ok=True)
        held = work / "heldout.json"
        if not held.exists():
            qs = questions(srv, model, args.bench_prompts, 12345, args)
            held.write_text(json.dumps(qs))
        prompts = chat_prompts(model, json.loads(held.read_text()))
        if "plain" in phases:
            RESULTS[plain_key(args)] = {
                "start_s": round(srv.start_s, 1),
                "throughput": [
                    throughput(srv, prompts, b, args.max_new_tokens, args.per_stream, args.warmup)
                    for b in args.batches
                    for _ in range(args.repeats)
                ],
            }
            if args.profile_batch:
                RESULTS[plain_key(args)]["profile"] = sglang_ab.profile_rounds(
                    srv, prompts, args.profile_batch, f"{name}_plain"
                )
            save_results()
        if "data" in phases and not (work / "self.jsonl").exists():
            write_self_data(srv, model, work, args)
    finally:
        srv.stop()


def write_self_data(srv: Server, model: Path, work: Path, args: argparse.Namespace) -> None:
    """The served target writes the draft's training data: its own user turns answered greedily (``self.jsonl``)."""
    t = time.monotonic()
    qs = questions(srv, model, args.prompts, args.seed, args)
    texts = chat_prompts(model, qs)
    r = srv.generate(
        {
            "text": texts,
            "sampling_params": {"max_new_tokens": args.answer_tokens, "temperature": 0.0},
        }
    )
    rows = []
    for i, (q, item) in enumerate(zip(qs, r, strict=True)):
        a = item["text"].strip()
        if a:
            rows.append(
                {
                    "prompt": q,
                    "prompt_id": f"q{i:06d}",
                    "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                }
            )
    (work / "self.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
    toks = sum(item["meta_info"]["completion_tokens"] for item in r)
    RESULTS[key(args, "data")] = {
        "conversations": len(rows),
        "answer_tokens": toks,
        "seconds": round(time.monotonic() - t, 1),
    }
    if (model / "structure.json").exists():
        RESULTS[key(args, "data")]["stats"] = answer_stats(model, r)
        log(f"data: {RESULTS[key(args, 'data')]['stats']}")
    log(f"data: {len(rows)} conversations, {toks:,} answer tokens in {time.monotonic() - t:.0f} s")
    save_results()


def answer_stats(model: Path, items: list[dict]) -> dict[str, Any]:
    """``text_stats`` of the greedy answers (their token ids), against the target's own successor map."""
    from transformers import AutoTokenizer

    from bench.gpu.structured_target import text_stats

    succ = json.loads((model / "structure.json").read_text())["succ"]
    tok = AutoTokenizer.from_pretrained(str(model))
    seqs = [
        list(it["output_ids"])
        if it.get("output_ids")
        else tok(it["text"], add_special_tokens=False).input_ids
        for it in items
    ]
    return text_stats(seqs, succ)


def phase_train(args: argparse.Namespace) -> None:
    work = work_dir(args)
    if (work / "train" / "draft" / "config.json").exists():
        return
    model = BASE / "models" / target_name(args)
    data = work / "self.jsonl"
    n = sum(1 for _ in data.open())
    plan = work / "plan.toml"
    plan.write_text(f"""[run]
name = "sglang-bench"
dir = "{work / "run"}"
[target]
model = "{model}"
max_length = 1024
{training_sections(args)}[bench]
holdout = 0.05
prompts = 8
max_new_tokens = 128
steps = 3
[[datasets]]
name = "self"
source = "ultrachat"
kind = "target-native"
path = "{data}"
quota = {n}
""")
    t: dict[str, Any] = {}
    t["prep_s"] = run_stage("pipeline.stages.prep", plan, work / "tok", [], "--dataset", "self")
    t["extract_s"] = run_stage("pipeline.stages.extract", plan, work / "ext", [work / "tok"])
    t["vocab_s"] = run_stage("pipeline.stages.vocab", plan, work / "voc", [work / "tok"])
    t["train_s"] = run_stage("pipeline.stages.train", plan, work / "train", [work / "ext", work / "voc"])
    man = json.loads((work / "train" / "manifest.json").read_text())
    curve = {e.step: e.value for e in stage_metrics(work / "train", "accept_length")}
    t.update(
        kept_step=man["step"],
        sim_accept_by_step=curve,
        extract_tokens=json.loads((work / "ext" / "manifest.json").read_text())["tokens"],
        draft_config=json.loads((work / "train" / "draft" / "config.json").read_text()),
    )
    if args.offline_bench:
        t["bench_s"] = run_stage("pipeline.stages.bench", plan, work / "bench", [work / "train"])
        b = json.loads((work / "bench" / "results.json").read_text())
        t["offline_accept_len"] = b["accept_len"]
    RESULTS[key(args, "train")] = t
    save_results()


def phase_eagle3(args: argparse.Namespace) -> None:
    name = target_name(args)
    model = BASE / "models" / name
    draft = work_dir(args) / "train" / "draft"
    prompts = chat_prompts(model, json.loads((work_dir(args) / "heldout.json").read_text()))
    out = RESULTS.setdefault(key(args, "eagle3"), {})
    for spec in args.specs:
        k = "/".join(map(str, spec))
        srv = Server(
            f"{name}_eagle3_{k.replace('/', '-')}",
            settings(model, 30003, args, draft, spec),
            args.start_timeout,
            args.dump_after,
        )
        try:
            out[k] = {
                "start_s": round(srv.start_s, 1),
                "throughput": [
                    throughput(srv, prompts, b, args.max_new_tokens, args.per_stream, args.warmup)
                    for b in args.batches
                ],
            }
        finally:
            srv.stop()
        save_results()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage-from", action="append", default=[], type=Path, help="a carried chunk folder")
    ap.add_argument("--phases", default="smollm2,plain,data,train,eagle3")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--specs", default="3/1/4", help="steps/topk/draft-tokens, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--per-stream", type=int, default=2)
    ap.add_argument("--bench-prompts", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=1024, help="training conversations the target writes")
    ap.add_argument("--answer-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline-bench", action="store_true")
    ap.add_argument("--regen-prompts", type=int, default=2000, help="stages: prompts the regen stage answers")
    ap.add_argument(
        "--hf-prompts", type=int, default=256, help="stages: of those, through transformers generate"
    )
    ap.add_argument("--hf-batch", type=int, default=128)
    ap.add_argument("--target", choices=["random", "structured"], default="random")
    ap.add_argument(
        "--follow", type=float, default=0.85, help="structured: share of tokens that follow the map"
    )
    ap.add_argument("--cycle-words", type=int, default=4096, help="structured: tokens on the word cycle")
    ap.add_argument("--no-prefill-graph", action="store_true", help="skip the piecewise prefill CUDA graphs")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument(
        "--warmup",
        type=int,
        default=64,
        help="new tokens of one unmeasured request a stream before each batch (0: none)",
    )
    ap.add_argument(
        "--variants",
        default="plain:triton,eagle3:triton",
        help="ab: MODE:BACKEND[:FLAG=VALUE...], comma-separated (bench/gpu/sglang_ab.py)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="ab: measurements of each batch")
    ap.add_argument(
        "--profile-batch", type=int, default=8, help="ab: torch-profile decode rounds at this batch (0: off)"
    )
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--dump-after", type=float, default=120)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.specs = [tuple(int(x) for x in s.split("/")) for s in args.specs.split(",")]
    return args


def run_phases(args: argparse.Namespace, phases: list[str]) -> None:
    if "smollm2" in phases:
        phase_smollm2(args)
    if "plain" in phases or "data" in phases:
        phase_plain_and_data(args, phases)
    if "train" in phases:
        phase_train(args)
    if "eagle3" in phases:
        phase_eagle3(args)
    if "ab" in phases:
        sglang_ab.phase_ab(args)
    if "stages" in phases:
        sglang_stages.phase_stages(args)
    if "stages2" in phases:
        sglang_stages.phase_stages2(args)


def main() -> int:
    args = parse_args()
    phases = [p for p in args.phases.split(",") if p]
    OUT.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, kill_started)
    kill_leftover()
    stage(args.stage_from)
    if not (SITE / ".complete").exists():
        return 0
    import torch

    RESULTS["device"] = torch.cuda.get_device_name(0)
    RESULTS["torch"] = torch.__version__
    try:
        run_phases(args, phases)
    except Exception as e:  # noqa: BLE001 - report, keep what was measured
        RESULTS.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        log(f"FAILED: {type(e).__name__}: {e}")
        save_results()
        kill_started()
        return 1
    finally:
        kill_started()
    save_results()
    summary(json.loads(MERGED.read_text()), args)
    return 0


def summary(doc: dict, args: argparse.Namespace) -> None:
    print("\nbatch | plain tok/s | eagle3 tok/s (spec) | speedup | accept length (metrics / responses)")
    plain = {r["batch"]: r for r in doc.get(key(args, "plain"), {}).get("throughput", [])}
    for spec, e in doc.get(key(args, "eagle3"), {}).items():
        for r in e["throughput"]:
            p = plain.get(r["batch"])
            sp = f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x" if p else "-"
            print(
                f"{r['batch']:5} | {p['tokens_per_s'] if p else '-':>11} | {r['tokens_per_s']:>9} ({spec}) | {sp} | "
                f"{r.get('accept_length_metrics')} / {r.get('accept_length_responses')}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
