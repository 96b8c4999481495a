"""Power cuts (issue 18, item 4): SIGKILL every Aerie process at once, at random moments, many times.

A crash-consistency loop on a small real plan — prep (two target-native datasets) → extract → vocab →
train on the tiny SmolLM2-tokenizer Llama (tests/tiny_llama.py). The supervisor is started inside a cgroup this test creates, so every
launcher and stage it starts is in it too; a *cut* freezes the whole cgroup (nobody runs between the
first and the last kill, as in a power loss), SIGKILLs every process in it, thaws, and waits until it
is empty. Then a new supervisor is started on the same run directory, as after a reboot. After at
least ``AERIE_POWER_CUTS`` (default 20) cuts at random moments (seeded; the seed is in the failure
message), at least 3 of them while training runs and one after its first checkpoint, the run is left
to finish, and:

* every stage has succeeded;
* every prep shard's row count and sha256 match its record, and the manifests agree; every extraction
  shard's rows and bytes match the manifest, and the extracted rows are exactly the prepared training
  rows, each once (token sequences compared as a multiset);
* no training step — hence no row — was applied twice: replaying the attempts (each resumes from its
  checkpoint and drops what it had not checkpointed) gives steps 1..N exactly once, and the rows they
  read (the deterministic data order) are counted;
* every ``*.json`` in the run dir parses and every line of every ``events.jsonl`` parses, at every cut.

The number of cuts survived is printed (``-s``) and recorded in docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.eagle3.hidden_store import HiddenStore
from pipeline.run.plan.sections import TrainSection
from pipeline.run.rundir.events import read_all
from pipeline.run.rundir.files import sha256_file
from pipeline.run.rundir.layout import RunDir
from pipeline.stages.train.settings import BatchSchedule
from tests.eagle3_fixtures import TEST_SECTIONS, tiny_llama
from tests.runs import ROOT, make_run, states, wait_done, wait_for

CG = Path("/sys/fs/cgroup")
FIXTURES = ROOT / "pipeline" / "data" / "fixtures" / "datasets"
STEPS, BATCH = 48, 4  # the tiny target trains fast: enough steps that training outlives several cuts


class KillGroup:
    """A cgroup whose every process can be frozen and killed at once (v1 freezer or v2)."""

    def __init__(self) -> None:
        name = f"aerie-cut-{uuid.uuid4().hex[:8]}"
        if (CG / "freezer" / "cgroup.procs").is_file():
            self.v2, self.path = False, CG / "freezer" / name
        elif (CG / "cgroup.controllers").is_file():
            self.v2, self.path = True, CG / name
        else:
            raise OSError("no freezer cgroup")
        self.path.mkdir()

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def _freeze(self, on: bool) -> None:
        if self.v2:
            (self.path / "cgroup.freeze").write_text("1" if on else "0")
        else:
            (self.path / "freezer.state").write_text("FROZEN" if on else "THAWED")

    def cut(self) -> int:
        """Freeze, SIGKILL everything, thaw; returns how many processes were killed."""
        self._freeze(True)
        if not self.v2:
            wait_for(lambda: (self.path / "freezer.state").read_text().strip() == "FROZEN", 10, "the freeze")
        pids = self.pids()
        for pid in pids:  # every process in the cgroup this test made: all of them Aerie's
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._freeze(False)
        wait_for(lambda: not self.pids(), 30, "every process to die")
        return len(pids)

    def remove(self) -> None:
        if self.pids():
            self.cut()
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def plan_text() -> str:
    sections = {
        **TEST_SECTIONS,
        "train": {**TEST_SECTIONS["train"], "steps": STEPS, "batch_size": BATCH, "checkpoint_every": 4},
    }
    body = [
        "[run]",
        'name = "powercut"',
        'dir = "run"',
        "[target]",
        f'model = "{tiny_llama()}"',
        "max_length = 256",
        "[prep]",
        "shard_rows = 6",
        "batch_rows = 6",
        "reject_threshold = 0.5",
    ]
    for name, table in sections.items():
        body.append(f"[{name}]")
        body += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    for ds in ("kimik2-5-2000x", "deepswe-kimi-k2"):
        body += [
            "[[datasets]]",
            f'name = "{ds}"',
            f'source = "{ds}"',
            'kind = "target-native"',
            "quota = 24",
            f'path = "{FIXTURES / (ds + ".jsonl")}"',
        ]
    retry = "retry = { max_attempts = 1000, backoff_s = 0 }"
    body += [
        "[[stage]]",
        'id = "prep"',
        'run = "prep"',
        'for_each = "dataset"',
        retry,
        "[[stage]]",
        'id = "extract"',
        'run = "extract"',
        'after = ["prep.*"]',
        retry,
        "[[stage]]",
        'id = "vocab"',
        'run = "vocab"',
        'after = ["prep.*"]',
        retry,
        "[[stage]]",
        'id = "train"',
        'run = "train"',
        'after = ["extract", "vocab"]',
        "cpu = 2",
        retry,
    ]
    return "\n".join(body) + "\n"


def check_files_whole(root: Path) -> None:
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.name == "events.jsonl":
            data = p.read_text()
            assert not data or data.endswith("\n"), f"{p}: torn last line"
            for line in data.splitlines():
                json.loads(line)


def start(run: RunDir, kg: KillGroup) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.run.supervise.supervisor", str(run.root), "--poll", "0.2"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=kg.join,
    )


def effective_steps(evs: list) -> list[int]:
    """Replay the training attempts: the steps the final model has applied, in order.

    An attempt starts from nothing, or resumes at checkpoint ``s``: it then holds the steps ``<= s`` of the
    latest earlier attempt that trained step ``s`` (the one that wrote that checkpoint), and adds the steps
    it trains. Steps an attempt trained after its last checkpoint are lost with it, as they should be."""
    lineages: list[list[int]] = []
    for e in evs:
        if e.type == "started":
            lineages.append([])
        elif e.type == "message" and e.get("code") == "resumed_from_checkpoint":
            step = e.get("step")
            src = next((lin for lin in reversed(lineages[:-1]) if step in lin), None)
            assert src is not None, f"resumed from step {step}, which no earlier attempt trained"
            assert not lineages[-1], "resumed after training"
            lineages[-1].extend(s for s in src if s <= step)
        elif e.type == "metric" and e.get("name") == "loss":
            lineages[-1].append(e.get("step"))
    return lineages[-1] if lineages else []


def train_checkpointed(run: RunDir) -> bool:
    return any(e.get("code") == "checkpoint" for e in read_all(run.stage("train").events))


def wait_for_train(run: RunDir, need_checkpoint: bool, deadline: float) -> bool:
    """Wait until training runs (and has written a checkpoint, if asked); False if the run finished first."""
    while time.monotonic() < deadline:
        snapshot = states(run)
        if snapshot and all(s == "succeeded" for s in snapshot.values()):
            return False
        if snapshot.get("train") == "running" and (not need_checkpoint or train_checkpointed(run)):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_small_plan_survives_power_cuts_at_random_moments(tmp_path: Path) -> None:
    cuts_wanted = int(os.environ.get("AERIE_POWER_CUTS", "20"))
    seed = int(os.environ.get("AERIE_POWER_SEED", str(random.randrange(1 << 30))))
    rng = random.Random(seed)
    try:
        kg = KillGroup()
    except OSError as exc:
        pytest.skip(f"needs a cgroup (v1 freezer or v2) to cut every process at once: {exc}")
    run = make_run(tmp_path, plan_text())
    cuts, killed, where = 0, 0, Counter()
    try:
        sup = start(run, kg)
        deadline = time.monotonic() + 1800
        # First the wanted number of cuts at random moments: quick ones (within a model load, a shard, a step)
        # and longer ones (a stage gets somewhere). Then, however fast or slow this machine runs the plan,
        # cuts aimed at training: wait until it runs (and, for the last, until it has written a checkpoint)
        # and cut at a random moment within the next second; bounded at 3x the wanted number.
        while (
            (cuts < cuts_wanted or where["train"] < 3 or where["train after a checkpoint"] < 1)
            and cuts < 3 * cuts_wanted
            and time.monotonic() < deadline
        ):
            if cuts < cuts_wanted:
                time.sleep(rng.uniform(0.2, 2) if rng.random() < 0.5 else rng.uniform(2, 6))
            else:
                need_checkpoint = where["train"] >= 2 and where["train after a checkpoint"] < 1
                if not wait_for_train(run, need_checkpoint, deadline):
                    break  # the run finished first: the assertions below say so
                time.sleep(rng.uniform(0.05, 1.0))
            snapshot = states(run)
            if snapshot and all(s == "succeeded" for s in snapshot.values()):
                break  # finished before the cuts ran out: counted below
            where.update(sid for sid, st in snapshot.items() if st == "running")
            if snapshot.get("train") == "running" and train_checkpointed(run):
                where["train after a checkpoint"] += 1
            killed += kg.cut()
            sup.wait(10)
            cuts += 1
            check_files_whole(run.root)
            sup = start(run, kg)
        assert cuts >= cuts_wanted, f"the run finished after {cuts} cuts (seed {seed}); wanted {cuts_wanted}"
        assert where["train"] >= 3, f"training was cut only {where['train']} times (seed {seed})"
        assert where["train after a checkpoint"] >= 1, (
            f"training was never cut after a checkpoint (seed {seed})"
        )
        final = wait_done(run, 1800)
        assert set(final.values()) == {"succeeded"}, (final, seed)
    finally:
        kg.remove()
    check_files_whole(run.root)
    print(
        f"\npower cuts survived: {cuts} (seed {seed}); {killed} processes killed; stages running at the cuts: "
        f"{dict(where)}"
    )

    # prep: every recorded shard is intact and the manifest agrees
    prep_outs = []
    for sid in ("prep.kimik2-5-2000x", "prep.deepswe-kimi-k2"):
        out = run.stage(sid).out
        prep_outs.append(out)
        man = json.loads((out / "manifest.json").read_text())
        for s in man["shards"]:
            assert sha256_file(out / s["file"]) == s["sha256"], (sid, s, seed)
            assert pq.read_metadata(out / s["file"]).num_rows == s["rows"], (sid, s, seed)
        assert man["rows"] == sum(s["rows"] for s in man["shards"])
    # extract: the stored rows are exactly the prepared training rows, each once
    from safetensors import safe_open

    from pipeline.data.shards import iter_rows

    ext = run.stage("extract").out
    man = json.loads((ext / "manifest.json").read_text())
    stored: Counter = Counter()
    for s in man["shards"]:
        assert (ext / s["file"]).stat().st_size == s["bytes"], (s, seed)
        with safe_open(str(ext / s["file"]), framework="pt") as f:
            off, ids = f.get_tensor("offsets").tolist(), f.get_tensor("input_ids").tolist()
        assert len(off) - 1 == s["rows"], (s, seed)
        stored.update(tuple(ids[a:b]) for a, b in zip(off, off[1:], strict=False))
    expected = Counter(
        tuple(r.input_ids.tolist())
        for r in iter_rows(prep_outs, man["holdout"], "train", None, 256)
        if r.num_tokens >= 2 and r.loss_mask.any()
    )
    assert stored == expected and man["rows"] == sum(expected.values()), seed
    # train: every step applied exactly once; count the rows those steps read
    evs = read_all(run.stage("train").events)
    eff = effective_steps(evs)
    assert eff == list(range(1, STEPS + 1)), (eff, seed)
    store = HiddenStore(ext)
    schedule = BatchSchedule(
        man["rows"],
        BATCH,
        TEST_SECTIONS["train"].get("seed", 0),
        [store.length(i) for i in range(len(store))],
        TrainSection().length_grouping,
    )
    rows = Counter(i for step in eff for i in schedule.rows(step))
    clean = Counter(i for step in range(1, STEPS + 1) for i in schedule.rows(step))
    assert rows == clean and sum(rows.values()) == STEPS * BATCH
    attempts = sum(1 for e in evs if e.type == "started")
    resumed = [e.get("step") for e in evs if e.get("code") == "resumed_from_checkpoint"]
    trained = sum(1 for e in evs if e.type == "metric" and e.get("name") == "loss")
    assert resumed, f"no attempt resumed from a checkpoint (seed {seed})"
    print(
        f"train: {attempts} attempts, resumed from steps {resumed}, {trained} steps run in all, {STEPS} applied "
        f"once each; {sum(rows.values())} rows read by the applied steps"
    )
