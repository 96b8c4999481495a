"""Does the draft speed its target up? Accept length vs training steps, on a real small target, in one GPU call.

``python -m bench.gpu.quality [--prompts 6144] [--answer-tokens 256] [--steps 2400] [--work /tmp/gpu_quality]``

The target is the real SmolLM2-135M-Instruct (``builtin:smollm2-135m-instruct``, the demo model). Its training
data is its own, made here as the regen stage would make it: the target invents user prompts (sampled from
the chat template's user turn), then answers them greedily — the draft must learn the *target's* outputs.
The conversations are written as an UltraChat-schema JSONL and the real stages run on them through their
command lines: ``prep`` (tokenise) → ``extract`` → ``vocab`` → ``train`` → ``bench`` (offline speculative decoding
of held-out prompts; ``--check-lossless`` also compares each with plain greedy decoding). Reported: the
train stage's simulated accept length on held-out rows at every checkpoint (``accept_length`` metric,
steps = 3), the checkpoint it kept, and the bench stage's measured accept length at steps = 3, top-k 1,
4 draft tokens (SGLang's ``3/1/4``). Each phase's wall time is printed as it ends and written to
``$OUT/gpu_quality.json`` so a call cut at its limit still says where it got.
Without a GPU it runs on the CPU (a smoke run: ``--prompts 16 --answer-tokens 24 --steps 4 --checkpoint-every 2
--gen-batch 8 --bench-prompts 2``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu.results import stage_metrics, write_out
from bench.gpu.runner import ROOT

MODEL = "builtin:smollm2-135m-instruct"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def generate_conversations(n: int, answer_tokens: int, batch: int, seed: int) -> list[dict]:
    """``n`` conversations the target wrote both sides of (prompts sampled, answers greedy)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.data.model_assets import load_tokenizer, resolve, turn_tokens

    tok = load_tokenizer(MODEL)
    facts = turn_tokens(MODEL)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        resolve(MODEL), dtype=torch.bfloat16 if dev == "cuda" else torch.float32
    )
    model = model.to(dev).eval()
    tok.padding_side = "left"
    mark = "AERIE-PROMPT-MARK"
    head = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head = head[: head.index(mark)]  # system turn + "<|im_start|>user\n": the target writes the question
    torch.manual_seed(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    t0 = time.monotonic()
    while len(prompts) < n:
        enc = tok([head] * batch, return_tensors="pt", add_special_tokens=False).to(dev)
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                max_new_tokens=64,
                eos_token_id=facts.end_of_turn,
                pad_token_id=facts.pad,
            )
        for row in out[:, enc["input_ids"].shape[1] :]:
            text = tok.decode(row, skip_special_tokens=True).strip()
            if len(text) >= 12 and text not in seen:
                seen.add(text)
                prompts.append(text)
    prompts = prompts[:n]
    log(f"{n} prompts sampled from the target in {time.monotonic() - t0:.0f} s")
    t0 = time.monotonic()
    convs = []
    order = sorted(range(n), key=lambda i: len(prompts[i]))  # similar lengths per batch: less padding
    for a in range(0, n, batch):
        idx = order[a : a + batch]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": prompts[i]}], tokenize=False, add_generation_prompt=True
            )
            for i in idx
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=answer_tokens,
                eos_token_id=facts.end_of_turn,
                pad_token_id=facts.pad,
            )
        for i, row in zip(idx, out[:, enc["input_ids"].shape[1] :], strict=True):
            answer = tok.decode(row, skip_special_tokens=True).strip()
            if answer:
                convs.append(
                    {
                        "prompt": prompts[i],
                        "prompt_id": f"q{i:06d}",
                        "messages": [
                            {"role": "user", "content": prompts[i]},
                            {"role": "assistant", "content": answer},
                        ],
                    }
                )
    log(f"{len(convs)} greedy answers from the target in {time.monotonic() - t0:.0f} s")
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return convs


def stage(module: str, plan: Path, out: Path, inputs: list[Path], *extra: str) -> float:
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out), *extra]
    for i in inputs:
        argv += ["--input", str(i)]
    t = time.monotonic()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stderr[-3000:])
        raise SystemExit(f"{module} failed ({p.returncode})")
    dt = time.monotonic() - t
    log(f"{module} {dt:.0f} s")
    return dt


def events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6144)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--checkpoint-every", type=int, default=300)
    ap.add_argument("--bench-prompts", type=int, default=48)
    ap.add_argument(
        "--check-lossless",
        action="store_true",
        help="also decode each bench prompt plainly and compare (doubles the bench phase; the equality "
        "itself is tested by tests/test_bench.py)",
    )
    ap.add_argument("--work", default="/tmp/gpu_quality")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def plan_text(args: argparse.Namespace, work: Path, data: Path, n: int) -> str:
    """The run's plan: the self-generated conversations through prep, extract, vocab, train and bench."""
    return f"""[run]
name = "quality"
dir = "{work / "run"}"
[target]
model = "{MODEL}"
max_length = 1024
[prep]
reject_threshold = 0.5
[extract]
batch_tokens = 65536
shard_tokens = 1048576
eval_rows = 64
[vocab]
draft_vocab_size = 8192
[train]
steps = {args.steps}
batch_size = {args.batch}
micro_batch = {args.batch}
ttt_steps = {args.ttt}
lr = {args.lr}
checkpoint_every = {args.checkpoint_every}
keep_checkpoints = 2
log_every = 50
eval_spec_steps = 3
[bench]
holdout = 0.05
prompts = {args.bench_prompts}
max_new_tokens = 128
steps = 3
check_lossless = {"true" if args.check_lossless else "false"}
[[datasets]]
name = "self"
source = "ultrachat"
kind = "target-native"
path = "{data}"
quota = {n}
"""


def main() -> int:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"bench": "gpu_quality", "args": vars(args)}
    t_all = time.monotonic()
    convs = generate_conversations(args.prompts, args.answer_tokens, args.gen_batch, args.seed)
    random.Random(args.seed).shuffle(convs)
    data = work / "self.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convs))
    res["conversations"] = len(convs)
    res["generate_s"] = time.monotonic() - t_all
    write_out("gpu_quality.json", res)
    plan = work / "plan.toml"
    plan.write_text(plan_text(args, work, data, len(convs)))
    times = {}
    times["prep_s"] = stage("pipeline.stages.prep", plan, work / "tok", [], "--dataset", "self")
    times["extract_s"] = stage("pipeline.stages.extract", plan, work / "ext", [work / "tok"])
    times["vocab_s"] = stage("pipeline.stages.vocab", plan, work / "voc", [work / "tok"])
    res.update(times)
    write_out("gpu_quality.json", res)
    times["train_s"] = stage("pipeline.stages.train", plan, work / "train", [work / "ext", work / "voc"])
    met = stage_metrics(work / "train")
    curve = {e.step: e.value for e in met if e.name == "accept_length"}
    tps = sorted(e.value for e in met if e.name == "tokens_per_s")
    man = json.loads((work / "train" / "manifest.json").read_text())
    res.update(
        times,
        sim_accept_by_step=curve,
        kept_step=man["step"],
        train_tok_s_median=tps[len(tps) // 2] if tps else None,
        extract_tokens=json.loads((work / "ext" / "manifest.json").read_text())["tokens"],
    )
    write_out("gpu_quality.json", res)
    log(
        "simulated accept length (steps=3) by training step: "
        + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(curve.items()))
    )
    res["bench_s"] = stage("pipeline.stages.bench", plan, work / "bench", [work / "train"])
    bench = json.loads((work / "bench" / "results.json").read_text())
    res.update(
        accept_len=bench["accept_len"], verify_steps=bench["verify_steps"], total_s=time.monotonic() - t_all
    )
    write_out("gpu_quality.json", res)
    print_summary(res, args, len(convs), man["step"], bench)
    os.sync()
    return 0


def print_summary(res: dict, args: argparse.Namespace, n_convs: int, kept_step: int, bench: dict) -> None:
    print(
        f"\ngpu_quality: SmolLM2-135M-Instruct, {n_convs} self-generated conversations "
        f"({res['extract_tokens']:,} training tokens), {args.steps} steps x {args.batch}, TTT {args.ttt}, lr {args.lr}"
    )
    for k in ("generate_s", "prep_s", "extract_s", "vocab_s", "train_s", "bench_s", "total_s"):
        print(f"  {k:<11} {res[k]:7.1f} s")
    print(
        f"  train {res['train_tok_s_median'] or 0:,.0f} tok/s (median logged step); kept checkpoint step {kept_step}"
    )
    print(
        f"  accept length at steps=3 (bench stage, held-out prompts, 3/1/4): {bench['accept_len']:.2f} "
        f"over {bench['verify_steps']} verify steps"
    )


if __name__ == "__main__":
    raise SystemExit(main())
