"""Draft methods by name (:mod:`pipeline.drafts.registry`): a method written in a folder outside the package,
registered through ``AERIE_DRAFT_METHODS``, is trained, exported and offline-benched by the real stages; the
names a plan may say, and the stages that never branch on a method's name."""

from __future__ import annotations

import ast
import json
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

from pipeline.drafts.eagle3.loss import TTTLoss
from pipeline.drafts.eagle3.method import build, drafter
from pipeline.drafts.registry import DraftMethod
from pipeline.eagle3.draft_model import save_draft


def export(draft, path):
    save_draft(draft, path)
    (path / "toy.json").write_text(json.dumps({"method": "toy"}))


METHOD = DraftMethod(
    name="toy",
    build=build,
    loss=TTTLoss.from_settings,
    export=export,
    drafter=drafter,
    describe=lambda s: f"toy draft, TTT {s.ttt_steps}",
    serve_flags=lambda s: "--speculative-algorithm TOY",
    manifest=lambda s: {"block_size": None, "loss": "toy"},
    shape_keys=("ttt_steps",),
)
'''


def write_toy(folder: Path) -> Path:
    pkg = folder / "toy_method"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(TOY))
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


def test_a_module_without_a_method_is_refused(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "empty.py").write_text('"""nothing here"""\n')
    monkeypatch.setenv(draft_names.ENV, f"empty={tmp_path / 'empty.py'}")
    with pytest.raises(DraftMethodError, match=r"empty\.py: defines no METHOD"):
        draft_method("empty")


def test_the_built_in_methods_are_found_by_name() -> None:
    assert draft_method("eagle3").name == "eagle3" and draft_method("dflash").name == "dflash"
    assert draft_method("dflash").bench_problem({"block_size": 4}, 4, False) is not None


def test_the_stages_never_branch_on_a_methods_name() -> None:
    """No comparison with a method's name, no isinstance on a method's draft class in the stages that use them."""
    names = set(draft_names.BUILT_IN)
    bad = []
    for path in [*(ROOT / "pipeline/stages/train").glob("*.py"), ROOT / "pipeline/stages/bench/offline.py"]:
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
            "train": dict(TEST_SECTIONS["train"], draft="toy", steps=12),
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
    assert any("toy draft, TTT 3" in t for t in said) and any(
        "--speculative-algorithm TOY" in t for t in said
    )
    bench = tmp_path / "bench"
    run_stage("pipeline.stages.bench", plan, bench, [out])
    res = json.loads((bench / "results.json").read_text())
    assert res["draft_kind"] == "toy" and res["lossless_checked"] and res["lossless_mismatches"] == 0
    assert 1.0 <= res["accept_len"] <= 4.0 and res["verify_steps"] > 0
