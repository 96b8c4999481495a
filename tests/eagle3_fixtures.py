"""Shared helpers for the EAGLE-3 stage tests: real tokenized shards, plans, and stage runs.

The shards are made exactly as the prep contract says (docs/data-formats.md): the real SmolLM2
tokenizer's chat template, ``loss_mask`` 1 on the assistant tokens, Parquet with ``id``,
``input_ids`` (list<int32>), ``loss_mask`` (list<int8>) and ``num_tokens``, and a ``tokenized``
manifest. Not a test module (no ``test_`` prefix).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_llama import SHAPE as TINY_SHAPE
from tests.tiny_llama import tiny_llama
from tests.tolerance import BF16_STEP, assert_close, reduction_floor

MODEL = "builtin:smollm2-135m-instruct"  # the real model: tests of quality, the tokenizer
HIDDEN = TINY_SHAPE["hidden_size"]  # the hidden size of tiny_llama(), the target of the mechanics tests
ROOT = Path(__file__).resolve().parent.parent

FRUITS = ["apples", "pears", "plums", "cherries", "lemons", "grapes", "mangoes", "peaches"]


def conversations(n: int, prefix: str = "row") -> list[tuple[str, list[dict]]]:
    """Small, regular chats (so a few training steps already learn something)."""
    out = []
    for i in range(n):
        a, b = i % 7 + 2, i % 5 + 3
        fruit = FRUITS[i % len(FRUITS)]
        out.append(
            (
                f"{prefix}-{i:04d}",
                [
                    {
                        "role": "user",
                        "content": f"I have {a} {fruit} and buy {b} more. How many {fruit} do I have?",
                    },
                    {
                        "role": "assistant",
                        "content": f"You have {a} {fruit} and you buy {b} more, so you have "
                        f"{a + b} {fruit} in total. Enjoy your {fruit}!",
                    },
                ],
            )
        )
    return out


def _ids(enc: object) -> list[int]:
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def write_tokenized(out: Path, n: int = 24, rows_per_shard: int = 12, prefix: str = "row") -> Path:
    """A ``tokenized`` out dir with ``n`` rows in Parquet shards; returns ``out``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.data.model_assets import load_tokenizer

    tok = load_tokenizer(MODEL)
    out.mkdir(parents=True, exist_ok=True)
    recs = []
    for rid, msgs in conversations(n, prefix):
        prompt = _ids(tok.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True))
        full = _ids(tok.apply_chat_template(msgs, tokenize=True))
        assert full[: len(prompt)] == prompt
        recs.append((rid, full, [0] * len(prompt) + [1] * (len(full) - len(prompt))))
    shards = []
    for si in range(0, n, rows_per_shard):
        part = recs[si : si + rows_per_shard]
        table = pa.table(
            {
                "id": pa.array([r[0] for r in part], pa.string()),
                "input_ids": pa.array([r[1] for r in part], pa.list_(pa.int32())),
                "loss_mask": pa.array([r[2] for r in part], pa.list_(pa.int8())),
                "num_tokens": pa.array([len(r[1]) for r in part], pa.int32()),
            }
        )
        name = f"shard-{si // rows_per_shard:05d}.parquet"
        pq.write_table(table, out / name)
        shards.append({"file": name, "rows": len(part), "tokens": sum(len(r[1]) for r in part)})
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "kind": "tokenized",
                "dataset": "fixture",
                "rows": n,
                "tokens": sum(s["tokens"] for s in shards),
                "shards": shards,
            }
        )
    )
    return out


def write_plan(path: Path, model: str | None = None, **sections: dict) -> Path:
    """A plan with no stages, the given ``[section]`` tables and ``model`` as its target: by default the tiny
    random-weight Llama (``tests/tiny_llama.py``), since what these plans test is mechanics, not quality."""
    model = model or tiny_llama()
    lines = [
        "[run]",
        'name = "t"',
        f'dir = "{path.parent / "run"}"',
        "",
        "[target]",
        f'model = "{model}"',
        "max_length = 256",
        "",
    ]
    for name, table in sections.items():
        lines.append(f"[{name}]")
        for k, v in table.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def run_stage(
    module: str, plan: Path, out: Path, inputs: list[Path], *extra: str, check: bool = True
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out)]
    for i in inputs:
        argv += ["--input", str(i)]
    p = subprocess.run([*argv, *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)
    if check and p.returncode != 0:
        raise AssertionError(f"{module} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return p


def events(out: Path) -> list:
    from pipeline.run.rundir.events import read_all

    return read_all(out / "events.jsonl")


def metrics(out: Path, name: str) -> list:
    return [e for e in events(out) if e.type == "metric" and e.get("name") == name]


# ------------------------------------------------------------------------------ shared stage outputs
# Tests in several modules need the same real extraction / vocab / training; they are built once per
# pytest run, in a folder all its workers share (a lock keeps two builders from racing).
TEST_SECTIONS = {
    "extract": {"shard_tokens": 900, "batch_tokens": 600},
    "vocab": {"draft_vocab_size": 512},
    "train": {
        "steps": 24,
        "batch_size": 4,
        "micro_batch": 2,
        "ttt_steps": 3,
        "checkpoint_every": 12,
        "lr": 0.005,
        "log_every": 1,
    },
    "bench": {"holdout": 0.2, "prompts": 2, "max_new_tokens": 20, "steps": 3},
}


def session_dir(tmp_path_factory) -> Path:
    """A folder every process of this pytest run shares: the base temp dir, or with pytest-xdist the folder
    above the workers' own (``popen-gw0``, ``popen-gw1``…), so what one worker built the others reuse."""
    import os

    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared(tmp_path_factory, what: str) -> Path:
    """The shared out dir of ``what``: ``tok``, ``plan`` (a file), ``ext``, ``voc`` or ``train``."""
    import fcntl

    base = session_dir(tmp_path_factory) / "eagle3-shared"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(base, what)


def _build(base: Path, what: str) -> Path:
    target = base / ("plan.toml" if what == "plan" else what)
    done = base / f".{what}.done"
    if done.exists():
        return target
    if what == "tok":
        write_tokenized(target, n=32, rows_per_shard=16)
    elif what == "plan":
        write_plan(target, **TEST_SECTIONS)
    elif what == "ext":
        run_stage("pipeline.stages.extract", _build(base, "plan"), target, [_build(base, "tok")])
    elif what == "voc":
        run_stage("pipeline.stages.vocab", _build(base, "plan"), target, [_build(base, "tok")])
    elif what == "train":
        run_stage(
            "pipeline.stages.train", _build(base, "plan"), target, [_build(base, "ext"), _build(base, "voc")]
        )
    else:
        raise ValueError(what)
    done.touch()
    return target


def losses(evs: list) -> dict[int, float]:
    """Step -> loss, from a train stage's events."""
    return {e.get("step"): e.get("value") for e in evs if e.type == "metric" and e.get("name") == "loss"}


def assert_same_training(one: tuple[dict, dict], two: tuple[dict, dict]) -> None:
    """Two train runs of steps 1-3 ((losses, training_state) each) learnt the same: equal losses and weights
    to fp32 reduction-order tolerance (a different world size sums gradients in another order)."""
    (l1, s1), (l2, s2) = one, two
    assert list(l1) == list(l2) == [1, 2, 3]
    for step in (1, 2, 3):
        # A loss is a mean of cross-entropies of a few thousand tokens: order noise ~1e-7 of it; the
        # 1e-6 floor covers a loss that has reached ~0.
        assert l2[step] == pytest.approx(l1[step], rel=1e-5, abs=1e-6)
    for k, v in s1["model"].items():
        if v.is_floating_point():
            # Three AdamW steps of lr ~1e-3 from the same start: the update's own noise is ~1e-4 of each
            # step (Adam divides by sqrt(v), which amplifies order noise in tiny gradients), and weights
            # near zero need the absolute floor of 2e-5 (~2 % of one step), far below a wrong gradient.
            assert_close(v, s2["model"][k], rel=1e-4, floor=2e-5, what=k)


def assert_stores_match(a: Path, b: Path) -> None:
    """Two hidden-state stores hold the same rows: ids and greedy tokens equal, features within one bf16
    step plus fp32 summation noise.

    Both captures compute in fp32 and differ only in the order sums are taken (an all-reduce over ranks,
    another thread count): each hidden value may move by ``reduction_floor`` of its row's magnitude, summed
    over ``hidden`` products. The store keeps bf16, so two values a hair apart may then round to
    neighbouring bf16 numbers: one bf16 step, ``2**-7`` of their magnitude. The floor matters for values near
    zero (+2e-9 here, -1e-9 there), where no relative step is wide enough. A sharding mistake moves values by
    their own size, many orders above this bound."""
    from pipeline.eagle3 import hidden_store as hs

    s1, s2 = hs.HiddenStore(a), hs.HiddenStore(b)
    assert len(s1) == len(s2) > 0
    for i in range(len(s1)):
        r1, r2 = s1[i], s2[i]
        assert torch.equal(r1.input_ids, r2.input_ids), f"row {i}: other token ids"
        # The greedy token may flip where a random-weight target's top two logits tie within the fp32 summation
        # noise (seen: 1 position of 171 once Kimi's own split pattern cut the text differently); a sharding
        # mistake changes most of them. The features below carry the exact check.
        flips = int((r1.target_argmax != r2.target_argmax).sum())
        assert flips <= max(1, r1.target_argmax.numel() // 100), f"row {i}: {flips} greedy tokens differ"
        for name, x, y in (("aux", r1.aux, r2.aux), ("last_hidden", r1.last_hidden, r2.last_hidden)):
            hidden = r1.last_hidden.shape[-1]
            scale = float(torch.maximum(x.float().abs().max(), y.float().abs().max()))
            floor = reduction_floor(scale, terms=hidden)
            assert_close(x.float(), y.float(), rel=BF16_STEP, floor=floor, what=f"row {i} {name}")
