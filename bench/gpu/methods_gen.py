"""The methods harness's data phase: the demo target writes conversations, in resumable chunks, then packs them.

The target (SmolLM2-135M-Instruct under transformers ``generate``, as ``bench/gpu/quality.py`` uses it) samples
user turns from its chat template's user turn and answers them greedily; each chunk of ``--chunk`` conversations
is written under ``WORK/chunks`` as it finishes, and a call starts no chunk that would pass ``--gen-budget-s``, so
the next call goes on where it stopped. The held-out prompts are answered too (prep needs whole turns). When every
chunk is there they are packed into one ``.npz`` of token ids (:mod:`bench.gpu.methods_data`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu.methods_data import Conversations, load_prompts, pack

MODEL = "builtin:smollm2-135m-instruct"
T0 = time.monotonic()  # the budget counts from the process's start (this module is imported at once)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


class Target:
    """The demo target under transformers ``generate``: sampled user turns, greedy answers, as token ids."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from pipeline.data.model_assets import load_tokenizer, resolve, turn_tokens

        self.torch = torch
        self.tok = load_tokenizer(MODEL)
        self.tok.padding_side = "left"
        self.facts = turn_tokens(MODEL)
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch.bfloat16 if self.dev == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(resolve(MODEL), dtype=dtype).to(self.dev).eval()
        mark = "AERIE-PROMPT-MARK"
        head = self.tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
        self.head = head[
            : head.index(mark)
        ]  # system turn + "<|im_start|>user\n": the target writes the question

    def _generate(self, texts: list[str], **kw: Any) -> list[list[int]]:
        torch = self.torch
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.dev)
        with torch.no_grad():
            out = self.model.generate(
                **enc, eos_token_id=self.facts.end_of_turn, pad_token_id=self.facts.pad, **kw
            )
        stop = set(self.facts.stop_ids) | {self.facts.pad}
        rows = []
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            cut = next((i for i, t in enumerate(row) if t in stop), len(row))
            rows.append(row[:cut])
        return rows

    def sample_prompts(self, n: int, batch: int, seed: int) -> list[list[int]]:
        """``n`` distinct user turns the target wrote, as the ids of their stripped text (canonical)."""
        self.torch.manual_seed(seed)
        seen: set[str] = set()
        out: list[list[int]] = []
        while len(out) < n:
            for row in self._generate(
                [self.head] * batch, do_sample=True, temperature=1.0, top_p=0.95, max_new_tokens=64
            ):
                text = self.tok.decode(row, skip_special_tokens=True).strip()
                if len(text) >= 12 and text not in seen:
                    seen.add(text)
                    out.append(self.tok.encode(text, add_special_tokens=False))
        return out[:n]

    def answer(self, prompts: list[list[int]], batch: int, max_new: int) -> list[list[int]]:
        """Greedy answers (ids as generated, end of turn excluded), in ``prompts``' order."""
        answers: list[list[int]] = [[] for _ in prompts]
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths: less padding
        for a in range(0, len(order), batch):
            idx = order[a : a + batch]
            texts = [self.chat(self.tok.decode(prompts[i])) for i in idx]
            for i, row in zip(
                idx, self._generate(texts, do_sample=False, max_new_tokens=max_new), strict=True
            ):
                answers[i] = row
        return answers

    def chat(self, user: str) -> str:
        return str(
            self.tok.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
            )
        )


def make_data(
    args: argparse.Namespace, work: Path, dest: Path, chunk_s: dict[str, float], save: Callable[[], None]
) -> dict[str, Any]:
    """Chunks of conversations under ``work/chunks`` until ``--gen-budget-s``; once all are there, ``dest``.
    Returns the results' ``data`` entry (``complete`` false: call again); ``chunk_s`` gets each chunk's seconds."""
    chunks = work / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    n_chunks = -(-args.conversations // args.chunk)
    held_prompts = load_prompts(Path(args.prompts_file))
    t = time.monotonic()
    target = Target()
    log(f"data: target loaded on {target.dev} in {time.monotonic() - t:.0f} s")
    held_file = chunks / "held.npz"
    if not held_file.exists():
        ids = [target.tok.encode(p.text, add_special_tokens=False) for p in held_prompts]
        held = Conversations(ids, target.answer(ids, args.gen_batch, args.answer_tokens))
        import numpy as np

        np.savez(held_file, **held.arrays())
    last = 0.0
    for c in range(n_chunks):
        f = chunks / f"chunk_{c:04d}.npz"
        if f.exists():
            continue
        spent = time.monotonic() - T0
        if spent + last > args.gen_budget_s:
            log(
                f"data: {spent:.0f} s spent; chunk {c}/{n_chunks} would pass --gen-budget-s: call again to go on"
            )
            return {"chunks_done": c, "chunks": n_chunks, "complete": False}
        t = time.monotonic()
        n = min(args.chunk, args.conversations - c * args.chunk)
        prompts = target.sample_prompts(n, args.gen_batch, args.seed * 100_003 + c)
        t_sample = time.monotonic() - t
        conv = Conversations(prompts, target.answer(prompts, args.gen_batch, args.answer_tokens))
        import numpy as np

        np.savez(chunks / f"chunk_{c:04d}.partial.npz", **conv.arrays())
        os.replace(chunks / f"chunk_{c:04d}.partial.npz", f)
        last = time.monotonic() - t
        toks = sum(len(a) for a in conv.answers)
        log(
            f"data: chunk {c + 1}/{n_chunks}: {n} prompts sampled in {t_sample:.0f} s, {toks:,} answer tokens "
            f"in {last - t_sample:.0f} s ({toks / max(last - t_sample, 1e-9):,.0f} tok/s)"
        )
        chunk_s[str(c)] = round(last, 1)
        save()
    # Questions repeated across chunks and empty answers are dropped when packing: top up until the kept
    # conversations reach --conversations (a few more chunks at most; each is the shortfall plus 10 %).
    res = _pack(args, work, n_chunks, dest)
    for extra in range(3):
        short = args.conversations - res["conversations"]
        if short <= 0:
            break
        c = n_chunks
        n = short + short // 10 + 8
        prompts = target.sample_prompts(n, args.gen_batch, args.seed * 100_003 + 7_919 * (extra + 1) + c)
        conv = Conversations(prompts, target.answer(prompts, args.gen_batch, args.answer_tokens))
        import numpy as np

        np.savez(chunks / f"chunk_{c:04d}.partial.npz", **conv.arrays())
        os.replace(chunks / f"chunk_{c:04d}.partial.npz", chunks / f"chunk_{c:04d}.npz")
        log(
            f"data: {short} short of {args.conversations:,} after dropping repeats and empty answers: topped up {n}"
        )
        n_chunks += 1
        res = _pack(args, work, n_chunks, dest)
    return res


def _pack(args: argparse.Namespace, work: Path, n_chunks: int, dest: Path) -> dict[str, Any]:
    import numpy as np

    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for c in range(n_chunks):
        with np.load(work / "chunks" / f"chunk_{c:04d}.npz") as z:
            conv = Conversations.from_arrays(z)
        for p, a in zip(conv.prompts, conv.answers, strict=True):
            if a and tuple(p) not in seen:  # across chunks a sampled question can repeat: keep it once
                seen.add(tuple(p))
                prompts.append(p)
                answers.append(a)
    with np.load(work / "chunks" / "held.npz") as z:
        held = Conversations.from_arrays(z)
    meta = {
        "model": MODEL,
        "answer_tokens": args.answer_tokens,
        "seed": args.seed,
        "made": time.strftime("%F %T"),
    }
    digest = pack(dest, Conversations(prompts, answers), held, meta)
    size = dest.stat().st_size
    log(f"data: {len(prompts):,} conversations packed in {size / 2**20:.1f} MiB (sha256 {digest[:16]}…)")
    return {
        "complete": True,
        "conversations": len(prompts),
        "answer_tokens_total": sum(map(len, answers)),
        "tokens_total": sum(map(len, prompts)) + sum(map(len, answers)),
        "npz_bytes": size,
        "sha256": digest,
    }


def to_out(src: Path, out: Path, piece: int = 15 << 20) -> list[str]:
    """Copy ``src`` to ``$OUT`` as ``methods_data.npz``, or in pieces ``methods_data.npz.00``, ``.01`` … of at most
    15 MiB when larger (a device call returns files of at most 16 MiB): ``cat methods_data.npz.* > data.npz``."""
    out.mkdir(parents=True, exist_ok=True)
    data = src.read_bytes()
    if len(data) <= piece:
        shutil.copy2(src, out / "methods_data.npz")
        return ["methods_data.npz"]
    names = []
    for i in range(0, len(data), piece):
        names.append(f"methods_data.npz.{i // piece:02d}")
        (out / names[-1]).write_bytes(data[i : i + piece])
    return names
