"""The deep check's token estimate: counted where prep ran, sampled from local rows, assumed only where neither."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.data import token_estimate
from pipeline.data.tokenise import load_chat_tokenizer
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parent.parent


def test_tokens_are_sampled_from_local_rows_and_counted_once_prep_has_run(tmp_path: Path) -> None:
    plan = plan_mod.load(ROOT / "pipeline" / "plans" / "demo.toml", run_dir=tmp_path / "run")
    max_len = plan.target.row_length
    ct = load_chat_tokenizer(str(plan.target.model), max_len)
    answer = plan.settings.regen.max_tokens
    est = {d.name: d for d in token_estimate.estimate(plan, ct.encode, max_len, answer)}
    assert set(est) == {d.name for d in plan.datasets}

    native = plan.dataset("deepswe-kimi-k2")  # target-native: whole conversations, from the fixture file
    got = est[native.name]
    assert got.how.startswith("sampled") and not got.assumed, got
    assert 0 < got.tokens < native.quota * max_len  # real rows, not quota x max_length
    prompt_only = plan.dataset("ultrachat")  # prompts, plus at most the answer regen may add
    assert est[prompt_only.name].how.startswith("sampled") and "answer tokens" in est[prompt_only.name].how
    assert est[prompt_only.name].tokens <= prompt_only.quota * min(max_len, answer + max_len)
    # swe-agent's prompts hold a token SmolLM2 reserves: none can be tokenised, so it is assumed, saying why
    assert est["swe-agent"].assumed and "special token" in est["swe-agent"].how

    # Once prep has written its manifest, its count is the estimate.
    sid = next(s.id for s in plan.stages if s.run == "prep" and s.dataset == native.name)
    out = RunDir(plan.run_dir).stage(sid).out
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(
        json.dumps({"kind": "tokenized", "tokens": 1234, "rows": 10, "shards": []})
    )
    again = {d.name: d for d in token_estimate.estimate(plan, ct.encode, max_len, answer)}
    assert again[native.name].tokens == 1234 and again[native.name].how.startswith("counted")
