"""Draft methods by name (:mod:`pipeline.drafts.registry`): a method written in a folder outside the package,
registered through ``AERIE_DRAFT_METHODS``, with a ``[train]`` key of its own (its folder's ``settings.py``), is
trained, exported and offline-benched by the real stages; the names a plan may say, the method's own keys as
the plan checks them, and the stages that never branch on a method's name."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.drafts.registry import DraftMethodError, draft_method
from pipeline.run.plan import draft_names
from pipeline.run.plan.schema import PlanError
from pipeline.run.plan.sections import TrainSection

ROOT = Path(__file__).resolve().parent.parent

TOY = '''
"""A toy draft method: EAGLE-3's pieces under another name, its export marked as its own."""

import json
import os

from pipeline.drafts.eagle3.loss import TTTLoss
from pipeline.drafts.eagle3.method import build, drafter
from pipeline.drafts.registry import DraftMethod
from pipeline.eagle3.draft_model import save_draft

from .settings import ToySettings


def export(draft, path):
    save_draft(draft, path)
    (path / "toy.json").write_text(json.dumps({"method": "toy"}))


METHOD = DraftMethod(
    name="toy",
    build=build,
    loss=TTTLoss.from_settings,
    export=export,
    drafter=drafter,
    describe=lambda s: f"toy draft, TTT {s.ttt_steps}, {ToySettings.of(s).toy_label}",
    serve_flags=lambda s, d: ("--speculative-algorithm", "TOY"),
    manifest=lambda s: {"block_size": None, "loss": "toy"},
    shape_keys=("ttt_steps",),
)
'''

# The toy's own [train] key: its folder's settings.py, standard library only (the plan loads it without torch).
TOY_SETTINGS = '''
"""The toy draft's own [train] keys."""

from dataclasses import dataclass

from pipeline.run.plan.schema import setting
from pipeline.run.plan.sections import DeepLine, DraftSettings


@dataclass(frozen=True)
class ToySettings(DraftSettings):
    toy_label: str = setting("plain", "toy: a word its start line says", choices=("plain", "fancy"))

    def deep_check(self, train, facts):
        return [DeepLine("toy", True, f"{self.toy_label} over {facts.num_layers} target layers")]


SETTINGS = ToySettings
'''


def write_toy(folder: Path) -> Path:
    pkg = folder / "toy_method"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(TOY))
    (pkg / "settings.py").write_text(textwrap.dedent(TOY_SETTINGS))
    return pkg


def test_names_come_from_the_built_ins_and_the_environment(monkeypatch) -> None:
    assert draft_names.external("toy=/x/toy, other = my_pkg.other@my_pkg.other_settings") == {
        "toy": draft_names.Registration("/x/toy"),
        "other": draft_names.Registration("my_pkg.other", settings="my_pkg.other_settings"),
    }
    for bad in ("toy", "=/x", "eagle3=/x", "a b=/x", "toy=/x@"):
        with pytest.raises(draft_names.DraftNameError, match="AERIE_DRAFT_METHODS"):
            draft_names.external(bad)
    monkeypatch.setenv(draft_names.ENV, "toy=/nowhere/toy_method")
    assert list(draft_names.known()) == ["eagle3", "dflash", "toy"]
    assert TrainSection.parse({"draft": "toy"}, "p.toml").draft == "toy"
    with pytest.raises(PlanError, match=r"p\.toml.*train\.draft.*eagle3, dflash, toy.*'medusa'"):
        TrainSection.parse({"draft": "medusa"}, "p.toml")
    with pytest.raises(DraftMethodError, match="no such file"):
        draft_method("toy")
    monkeypatch.setenv(draft_names.ENV, "eagle3=/x")
    with pytest.raises(PlanError, match="train.draft.*AERIE_DRAFT_METHODS"):
        TrainSection.parse({}, "p.toml")


def test_a_method_declares_its_own_typed_train_keys_in_its_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(draft_names.ENV, f"toy={write_toy(tmp_path)}")
    s = TrainSection.parse({"draft": "toy", "toy_label": "fancy"}, "p.toml")
    assert s.toy_label == "fancy" and s.to_dict()["toy_label"] == "fancy"  # a flat [train] key, typed
    assert TrainSection.parse({"draft": "toy"}, "p.toml").toy_label == "plain"  # its default
    for table, key, words in (
        ({"draft": "toy", "toy_label": "odd"}, "train.toy_label", "plain, fancy"),
        ({"draft": "toy", "toy_label": 3}, "train.toy_label", "expected a string"),
        ({"draft": "toy", "toy_size": 3}, "train.toy_size", "unknown key"),
        (
            {"draft": "toy", "dflash_block_size": 8},
            "train.dflash_block_size",
            "a key of the dflash draft method",
        ),
    ):
        with pytest.raises(PlanError) as exc:
            TrainSection.parse(table, "p.toml")
        msg = str(exc.value)
        assert msg.startswith("p.toml: ") and key in msg and words in msg, msg
    # a plan switched to another method (or that forgot draft) keeps the toy's key: refused, naming the toy
    for table in ({"toy_label": "fancy"}, {"draft": "dflash", "toy_label": "fancy"}):
        with pytest.raises(PlanError, match=r"p\.toml: train\.toy_label: a key of the toy draft method"):
            TrainSection.parse(table, "p.toml")


def test_the_deep_check_asks_the_plans_method_and_no_other(tmp_path: Path, monkeypatch) -> None:
    from pipeline.eagle3 import chain_check
    from pipeline.run.plan import dag as plan_mod
    from tests.eagle3_fixtures import tiny_llama

    monkeypatch.setenv(draft_names.ENV, f"toy={write_toy(tmp_path / 'plugins')}")
    for draft, lines in (("toy", {"toy"}), ("eagle3", set())):
        p = tmp_path / f"{draft}.toml"
        p.write_text(
            f'[run]\nname = "d"\ndir = "{tmp_path / "run"}"\n[target]\nmodel = "{tiny_llama()}"\n'
            f'[train]\ndraft = "{draft}"\n' + ('toy_label = "fancy"\n' if draft == "toy" else "")
        )  # (a toy key in the eagle3 plan is refused at load: tests/test_plan.py)
        checks = chain_check.check(plan_mod.load(p), free_bytes=10**12).checks
        assert {c.name for c in checks} & {"toy", "dflash"} == lines
        said = [c.detail for c in checks if c.name == "toy"]
        assert said == (["fancy over 30 target layers"] if lines else [])


def test_a_methods_settings_module_is_checked_when_the_plan_loads(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("SETTINGS = dict\n")
    monkeypatch.setenv(draft_names.ENV, f"bad=/x/bad@{bad}")
    with pytest.raises(PlanError, match=r"p\.toml: train\.draft: .*bad\.py: SETTINGS is not a DraftSettings"):
        TrainSection.parse({"draft": "bad"}, "p.toml")
    clash = tmp_path / "clash.py"
    clash.write_text(
        "from dataclasses import dataclass\nfrom pipeline.run.plan.schema import setting\n"
        "from pipeline.run.plan.sections import DraftSettings\n"
        "@dataclass(frozen=True)\nclass S(DraftSettings):\n    steps: int = setting(1, 'clash')\nSETTINGS = S\n"
    )
    monkeypatch.setenv(draft_names.ENV, f"clash=/x/clash@{clash}")
    with pytest.raises(PlanError, match=r"train\.draft: .*redeclares \[train\] keys steps"):
        TrainSection.parse({"draft": "clash"}, "p.toml")
    monkeypatch.setenv(draft_names.ENV, f"gone=/x/gone@{tmp_path / 'gone.py'}")
    with pytest.raises(PlanError, match=r"train\.draft: .*gone\.py: no such settings file"):
        TrainSection.parse({"draft": "gone"}, "p.toml")


def test_a_methods_keys_load_without_torch(tmp_path: Path) -> None:
    """The plan layer imports a method's settings (built in, or its folder's) and never torch."""
    toy = write_toy(tmp_path)
    code = (
        "import sys\nfrom pipeline.run.plan.sections import TrainSection\n"
        "assert TrainSection.parse({'draft': 'dflash', 'dflash_block_size': 8}, 'p.toml').spec_steps == 7\n"
        "assert TrainSection.parse({'draft': 'toy', 'toy_label': 'fancy'}, 'p.toml').toy_label == 'fancy'\n"
        "assert 'torch' not in sys.modules, 'loading a draft method\\'s keys imported torch'\n"
    )
    env = {**os.environ, draft_names.ENV: f"toy={toy}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr


def test_a_module_without_a_method_is_refused(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "empty.py").write_text('"""nothing here"""\n')
    monkeypatch.setenv(draft_names.ENV, f"empty={tmp_path / 'empty.py'}")
    with pytest.raises(DraftMethodError, match=r"empty\.py: defines no METHOD"):
        draft_method("empty")


def test_the_built_in_methods_are_found_by_name() -> None:
    assert draft_method("eagle3").name == "eagle3" and draft_method("dflash").name == "dflash"
    assert draft_method("dflash").bench_problem({"block_size": 4}, 4, False) is not None


def test_the_stages_never_branch_on_a_methods_name() -> None:
    """No comparison with a method's name, no isinstance on a method's draft class in the stages that use them,
    in the plan's [train] checks nor in the deep check."""
    names = set(draft_names.BUILT_IN)
    bad = []
    for path in [
        *(ROOT / "pipeline/stages/train").glob("*.py"),
        ROOT / "pipeline/stages/bench/offline.py",
        ROOT / "pipeline/run/plan/sections.py",
        *(ROOT / "pipeline/eagle3").glob("chain_*.py"),
        ROOT / "pipeline/eagle3/serving_checks.py",
        ROOT / "pipeline/eagle3/bench_fit.py",
    ]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in names for c in [node.left, *node.comparators]
            ):
                bad.append(f"{path.name}:{node.lineno}")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "isinstance"
                and any("Draft" in ast.unparse(a) for a in node.args[1:])
            ):
                bad.append(f"{path.name}:{node.lineno}")
    assert not bad, bad


@pytest.mark.slow
def test_a_method_in_a_folder_outside_the_package_trains_exports_and_benches(
    tmp_path_factory, tmp_path, monkeypatch
) -> None:
    from tests.eagle3_fixtures import TEST_SECTIONS, events, run_stage, shared, write_plan

    monkeypatch.setenv(draft_names.ENV, f"toy={write_toy(tmp_path / 'plugins')}")
    plan = write_plan(
        tmp_path / "plan.toml",
        **{
            **TEST_SECTIONS,
            "train": dict(TEST_SECTIONS["train"], draft="toy", steps=12, toy_label="fancy"),
            "bench": {**TEST_SECTIONS["bench"], "check_lossless": True},
        },
    )
    out = tmp_path / "train"
    run_stage(
        "pipeline.stages.train", plan, out, [shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")]
    )
    man = json.loads((out / "manifest.json").read_text())
    assert man["draft"] == "toy" and man["loss"] == "toy"
    assert json.loads((out / "draft" / "toy.json").read_text()) == {"method": "toy"}  # the toy's own export
    said = [e.get("text") or "" for e in events(out) if e.type == "message"]
    assert any("toy draft, TTT 3, fancy" in t for t in said) and any(
        "--speculative-algorithm TOY" in t for t in said
    )
    bench = tmp_path / "bench"
    run_stage("pipeline.stages.bench", plan, bench, [out])
    res = json.loads((bench / "results.json").read_text())
    assert res["draft_kind"] == "toy" and res["lossless_checked"] and res["lossless_mismatches"] == 0
    assert 1.0 <= res["accept_len"] <= 4.0 and res["verify_steps"] > 0
