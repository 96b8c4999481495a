"""The methods harness's pure parts: the held-out prompt file, the packed token-id data, recipes, the table.

The harness's CPU smoke run (every phase through the real stages, ~6 minutes on two cores) is not repeated
here; docs/performance.md gives its command. What is tested is what a wrong result would come from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from bench.gpu import methods_gen, methods_stages
from bench.gpu import methods_report as mr
from bench.gpu.methods_data import (
    KINDS,
    Conversations,
    PromptFileError,
    interleave,
    load_prompts,
    pack,
    sha256,
    unpack,
)
from pipeline.run.plan import dag as plan_mod


def test_the_repo_prompts_are_64_of_four_kinds_and_distinct() -> None:
    prompts = load_prompts()
    assert [sum(p.kind == k for p in prompts) for k in KINDS] == [16, 16, 16, 16]
    assert len({p.text for p in prompts}) == 64


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("{not json", "not valid JSON"),
        ('{"prompt_id": "a", "kind": "poetry", "messages": [{"role": "user", "content": "x"}]}', "'kind'"),
        ('{"prompt_id": "a", "kind": "chat", "messages": [{"role": "assistant", "content": "x"}]}', "role"),
        ('{"prompt_id": "a", "kind": "chat", "messages": [{"role": "user", "content": " "}]}', "content"),
        (
            '{"prompt_id": "chat-01", "kind": "chat", "messages": [{"role": "user", "content": "again"}]}',
            "repeats",
        ),
    ],
)
def test_a_malformed_prompt_line_names_file_line_and_field(tmp_path: Path, line: str, field: str) -> None:
    f = tmp_path / "p.jsonl"
    good = '{"prompt_id": "chat-01", "kind": "chat", "messages": [{"role": "user", "content": "Hi there"}]}'
    f.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(PromptFileError) as e:
        load_prompts(f)
    assert f"{f}:3" in str(e.value) and field in str(e.value)


def test_packed_ids_round_trip_and_the_digest_is_of_the_file(tmp_path: Path) -> None:
    train = Conversations([[1, 2, 3], [65535]], [[4, 5], [0, 7, 9]])
    held = Conversations([[10]], [[11, 12]])
    digest = pack(tmp_path / "d.npz", train, held, {"model": "m"})
    back, held_back, meta = unpack(tmp_path / "d.npz")
    assert (back.prompts, back.answers) == (train.prompts, train.answers)
    assert (held_back.prompts, held_back.answers) == (held.prompts, held.answers)
    assert meta["conversations"] == 2 and meta["model"] == "m"
    assert digest == sha256(tmp_path / "d.npz")
    with np.load(tmp_path / "d.npz") as z:
        assert z["tokens"].dtype == np.uint16 and z["offsets"].tolist() == [0, 5, 9]


def test_an_id_over_uint16_is_refused_not_wrapped(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="65536 does not fit uint16"):
        pack(tmp_path / "d.npz", Conversations([[65536]], [[1]]), Conversations([], []), {})


def test_interleave_gives_every_kind_in_the_first_n() -> None:
    kinds = ["a"] * 3 + ["b"] * 3 + ["c"] * 2
    order = interleave(kinds)
    assert sorted(order) == list(range(8))
    assert [kinds[i] for i in order[:3]] == ["a", "b", "c"]


def test_recipes_parse_add_and_refuse_unknown_names() -> None:
    got = mr.parse_recipes("eagle3,lk2", ['lk2={"loss": "lk"}'])
    assert got == {"eagle3": {}, "lk2": {"loss": "lk"}}
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        mr.parse_recipes("nope")
    with pytest.raises(ValueError, match="unknown placeholder {store_dir}"):
        mr.check_command("sf", "python x.py --store {store_dir}")
    mr.check_command("sf", "python x.py --store {store} --out {out} --steps {steps}")


def test_accept_length_per_kind_and_the_table() -> None:
    per_prompt = [{"id": "heldout-0", "accepted": [3, 1]}, {"id": "heldout-1", "accepted": [0, 0, 2]}]
    al = mr.accept_by_kind(per_prompt, {"heldout-0": "chat", "heldout-1": "code"})
    assert al == {"chat": 3.0, "code": pytest.approx(5 / 3), "all": 2.2}
    with pytest.raises(ValueError, match="heldout-9"):
        mr.accept_by_kind([{"id": "heldout-9", "accepted": [1]}], {})
    rows = [
        {"recipe": "lk", "seed": 0, "spec": "3/1/4", "accept_len": al, "verify_steps": 5, "train_s": 61.2},
        {"recipe": "eagle3", "seed": 0, "spec": "3/1/4", "accept_len": {"all": 1.9}, "verify_steps": 9},
    ]
    lines = mr.table(rows, ["chat", "code"]).splitlines()
    assert lines[0].split() == [
        "recipe",
        "seed",
        "spec",
        "chat",
        "code",
        "all",
        "verify",
        "sim",
        "train",
        "s",
        "bench",
        "s",
    ]
    assert lines[2].split()[:6] == ["eagle3", "0", "3/1/4", "-", "-", "1.90"]
    assert lines[3].split()[:9] == ["lk", "0", "3/1/4", "3.00", "1.67", "2.20", "5", "-", "61"]


def test_every_recipe_plan_passes_the_plan_check(tmp_path: Path) -> None:
    """A recipe's overrides land in a plan the stages accept (a misspelt key would fail the run on the GPU)."""
    ns = argparse.Namespace(
        steps=640,
        batch=32,
        ttt=7,
        lr=3e-4,
        checkpoint_every=160,
        max_tokens=6_000_000,
        draft_vocab=8192,
        holdout=0.01,
        bench_prompts=64,
        bench_tokens=96,
        check_lossless=False,
    )
    for name, spec in mr.RECIPES.items():
        for run_spec in mr.recipe_specs(name, spec, list(mr.SPECS)):  # a DFlash block is benched at its spec
            steps = mr.SPECS[run_spec]
            keys = {**mr.train_keys(spec), "seed": 1}
            text = methods_stages.plan_text(ns, tmp_path, keys, steps, {"self": 10, "heldout": 64})
            (tmp_path / f"{name}.toml").write_text(text)
            p = plan_mod.load(tmp_path / f"{name}.toml")
            train = p.settings.train
            assert (train.steps, train.batch_size, train.ttt_steps, train.seed) == (640, 32, 7, 1), name
            for key, value in mr.train_keys(spec).items():
                assert getattr(train, key) == value, (name, key)
            assert p.settings.bench.steps == steps


def test_a_recipe_s_specs_narrow_where_it_is_benched() -> None:
    assert mr.recipe_specs("dflash4", mr.RECIPES["dflash4"], ["3/1/4", "7/1/8"]) == ["3/1/4"]
    assert mr.recipe_specs("eagle3", mr.RECIPES["eagle3"], ["3/1/4", "7/1/8"]) == ["3/1/4", "7/1/8"]
    assert "specs" not in mr.train_keys(mr.RECIPES["dflash8"])
    with pytest.raises(ValueError, match="recipe bad: specs"):
        mr.recipe_specs("bad", {"specs": ["9/9/9"]}, ["3/1/4"])


def test_a_data_file_over_a_returned_file_s_limit_goes_back_in_pieces(tmp_path: Path) -> None:
    src = tmp_path / "d.npz"
    src.write_bytes(bytes(range(256)) * 10)  # 2,560 bytes, pieces of 1,000
    names = methods_gen.to_out(src, tmp_path / "out", piece=1000)
    assert names == ["methods_data.npz.00", "methods_data.npz.01", "methods_data.npz.02"]
    assert b"".join((tmp_path / "out" / n).read_bytes() for n in names) == src.read_bytes()
    assert methods_gen.to_out(src, tmp_path / "out2") == ["methods_data.npz"]


def test_seeds_of_gives_one_recipe_its_own_seeds_and_a_wrong_name_is_refused() -> None:
    seeds = mr.parse_seeds("0", ["eagle3=0,1,2", "specforge=1,2"], ["eagle3", "lk", "specforge"])
    assert seeds == {"eagle3": [0, 1, 2], "lk": [0], "specforge": [1, 2]}
    # a recipe not being run: the message lists those that are
    with pytest.raises(ValueError, match="eagle31"):
        mr.parse_seeds("0", ["eagle31=1"], ["eagle3", "lk"])
    with pytest.raises(ValueError, match="distinct"):
        mr.parse_seeds("0,0", [], ["eagle3"])
    with pytest.raises(ValueError, match="integers"):
        mr.parse_seeds("0", ["eagle3=one"], ["eagle3"])


def test_the_seed_summary_gives_mean_spread_and_ratio_to_plain_eagle3_per_spec() -> None:
    def row(recipe: str, seed: int, spec: str, acc: float) -> dict[str, object]:
        return {"recipe": recipe, "seed": seed, "spec": spec, "accept_len": {"all": acc}}

    rows = [
        row("eagle3", 0, "3/1/4", 1.50),
        row("eagle3", 1, "3/1/4", 1.54),
        row("specforge", 0, "3/1/4", 1.40),
        row("specforge", 1, "3/1/4", 1.48),
        row("eagle31", 0, "7/1/8", 1.60),  # no eagle3 at 7/1/8: no ratio
    ]
    lines = {ln.split()[0] + " " + ln.split()[1]: ln.split() for ln in mr.seed_summary(rows).splitlines()[2:]}
    assert lines["eagle3 3/1/4"][2:] == ["2", "1.520", "1.500-1.540", "1.000x"]
    assert lines["specforge 3/1/4"][2:] == ["2", "1.440", "1.400-1.480", f"{1.44 / 1.52:.3f}x"]
    assert lines["eagle31 7/1/8"][-1] == "-"
