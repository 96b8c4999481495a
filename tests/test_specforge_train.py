"""SpecForge's own trainer on Aerie's store (issue 27, item 2): ``bench/gpu/specforge_train.py`` trains a draft the
bench stage loads, and SpecForge's first-step loss on a real store batch equals Aerie's with the same weights.

Skips without SpecForge 0.2.0 (fails instead under ``AERIE_REQUIRE_SPECFORGE=1``, as CI sets), like
``tests/test_specforge_oracle.py``. The store and vocabulary are the shared test extraction (tiny target).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from bench.gpu.specforge_peer import specforge_available

WHY = specforge_available()
if WHY and os.environ.get("AERIE_REQUIRE_SPECFORGE") == "1":
    raise RuntimeError(f"AERIE_REQUIRE_SPECFORGE=1 but {WHY}")
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")

from bench.gpu.specforge_train import (  # noqa: E402
    SetupError,
    build,
    load_run,
    main,
    specforge_tensors,
)
from pipeline.drafts.eagle3.loss import ttt_sums  # noqa: E402
from pipeline.eagle3.draft_model import load_draft  # noqa: E402
from pipeline.eagle3.target_capture import load_target_tensors  # noqa: E402
from pipeline.stages.bench.inputs import find_draft  # noqa: E402
from pipeline.stages.train.steps import rank_chunks  # noqa: E402
from tests.eagle3_fixtures import shared  # noqa: E402

TTT = 3
ARGS = dict(steps=6, batch_size=4, lr=0.005, seed=0, ttt_steps=TTT)


def run_dir(tmp_path_factory) -> Path:
    """The shared test extraction's folder: plan.toml beside the extract and vocab out dirs."""
    shared(tmp_path_factory, "voc")
    return shared(tmp_path_factory, "ext").parent


def aerie_loss(draft, b, head_d) -> float:
    """Aerie's training objective (decayed per-step means over the scored tokens) on batch ``b``."""
    with torch.no_grad():
        losses, _ = ttt_sums(draft, draft, b, head_d, TTT, autocast=False)
    counts = [max(float(b.step_mask(j).sum()), 1.0) for j in range(TTT)]
    return sum(0.8**j * float(losses[j]) / counts[j] for j in range(TTT))


def test_a_run_dir_without_a_store_or_vocab_is_named(tmp_path_factory, tmp_path) -> None:
    run = run_dir(tmp_path_factory)
    with pytest.raises(SetupError, match=r"plan\.toml: missing"):
        load_run(tmp_path)
    shutil.copy(run / "plan.toml", tmp_path / "plan.toml")
    shutil.copytree(run / "voc", tmp_path / "voc")
    with pytest.raises(SetupError, match=r"manifest\.json: no extraction .*run the extract stage"):
        load_run(tmp_path)
    shutil.rmtree(tmp_path / "voc")
    shutil.copytree(run / "ext", tmp_path / "ext")
    with pytest.raises(SetupError, match=r"manifest\.json: no draft vocabulary .*run the vocab stage"):
        load_run(tmp_path)
    with pytest.raises(SetupError, match=r"voc/manifest\.json: missing"):
        load_run(store=tmp_path / "ext", vocab=tmp_path / "voc")


def test_specforge_trains_a_draft_the_bench_stage_loads(tmp_path_factory, tmp_path) -> None:
    run = run_dir(tmp_path_factory)
    out = tmp_path / "sf"
    argv = [
        "--run",
        str(run),
        "--out",
        str(out),
        "--steps",
        "6",
        "--batch",
        "4",
        "--micro-batch",
        "4",
        "--lr",
        "0.005",
    ]
    assert main([*argv, "--seed", "0", "--ttt", str(TTT), "--device", "cpu"]) == 0
    inp = load_run(run, **ARGS)
    trainer, init = build(inp, torch.device("cpu"), "sdpa", "aerie")
    # The bench stage's own lookup and loader, as it reads a train stage's out dir.
    man, train_dir = find_draft([out])
    embed = load_target_tensors(inp.model_id)["embed"]
    trained = load_draft(man.draft_path(train_dir), embed=embed)
    assert (man.target, man.aux_layer_ids) == (inp.model_id, inp.manifest.aux_layer_ids)
    config = json.loads((out / "config.json").read_text())  # the folder SGLang loads is --out itself
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert torch.equal(trained.d2t, inp.vocab.d2t) and torch.equal(trained.t2d, inp.vocab.t2d.bool())
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight"):
        # trained in fp32 on the CPU, written in bf16: a change far above bf16 rounding
        moved = (trained.state_dict()[name] - init.state_dict()[name]).abs().max()
        assert moved > 1e-3, name
    # The trained draft fits the store better than its initial weights, by Aerie's own loss on step 1's batch.
    chunk = rank_chunks(trainer.schedule.rows(1), 0, 1, trainer.data.length, 4)[0]
    b = trainer.data.batch(chunk, torch.device("cpu"), torch.float32)
    head_d = trainer.strategy.target_head.fc.weight[inp.vocab.draft_ids].float()
    before, after = aerie_loss(init, b, head_d), aerie_loss(trained, b, head_d)
    assert after < 0.9 * before, (before, after)
    log = json.loads((out / "specforge_train.json").read_text())
    assert [r["step"] for r in log["log"]][:1] == [1] and log["last_loss"] < log["first_loss"]


def test_specforge_first_step_loss_equals_aeries_on_a_store_batch(tmp_path_factory) -> None:
    from specforge.runtime.contracts import TrainBatch

    from bench.gpu.specforge_peer import specforge_eager

    run = run_dir(tmp_path_factory)
    inp = load_run(store=run / "ext", vocab=run / "voc", **ARGS)  # the plan beside the store is found
    trainer, draft = build(inp, torch.device("cpu"), "sdpa", "aerie")
    head_d = trainer.strategy.target_head.fc.weight[inp.vocab.draft_ids]
    first = rank_chunks(trainer.schedule.rows(1), 0, 1, trainer.data.length, 4)[0]  # step 1's batch
    by_length = {trainer.data.length(i): i for i in range(len(trainer.data))}
    padded = [by_length[n] for n in sorted(by_length, reverse=True)[:4]]  # rows of 4 lengths: padding too
    for chunk in (first, padded):
        b = trainer.data.batch(chunk, torch.device("cpu"), torch.float32)
        assert int(b.loss_mask.sum()) > 0
        tensors = specforge_tensors(b)
        tb = TrainBatch(
            sample_ids=[], strategy="eagle3", tensors=tensors, metadata={"target_repr": "hidden_state"}
        )
        with specforge_eager(), torch.no_grad():
            out = trainer.strategy.forward_loss(tb)
            losses, correct = ttt_sums(draft, draft, b, head_d, TTT, autocast=False)
        positions = b.input_ids.numel()  # SpecForge's per-step loss is a mean over every position
        for j in range(TTT):
            sf_sum = float(out.metrics["plosses"][j]) * positions
            assert sf_sum == pytest.approx(float(losses[j]), rel=1e-5), (chunk, j)
            assert float(out.metrics["acc_corrects"][j]) == float(correct[j]), (chunk, j)
            assert float(out.metrics["acc_denoms"][j]) == float(b.step_mask(j).sum()), (chunk, j)
    assert len(set(b.lengths.tolist())) == 4
