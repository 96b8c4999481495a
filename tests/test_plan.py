"""The plan: validation errors name the file and key; expansion and the DAG are right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.run.plan import dag as plan_mod
from tests.runs import ROOT, write_plan

BASE = """
[run]
name = "t"
dir = "run"
[resources]
cpu_slots = 4
gpus = [0, 1]
[[datasets]]
name = "chat"
source = "HuggingFaceH4/ultrachat_200k"
kind = "prompt-only"
quota = 100
[[datasets]]
name = "kimi"
source = "kimi"
kind = "target-native"
quota = 50
"""


def load(tmp_path: Path, stages: str, base: str = BASE) -> plan_mod.Plan:
    return plan_mod.load(write_plan(tmp_path, base + stages))


def error(tmp_path: Path, stages: str, base: str = BASE) -> str:
    with pytest.raises(plan_mod.PlanError) as exc:
        load(tmp_path, stages, base)
    return str(exc.value)


def test_for_each_expands_per_dataset_with_filter_and_globs(tmp_path: Path) -> None:
    plan = load(
        tmp_path,
        """
[[stage]]
id = "prep"
command = "echo {dataset}"
for_each = "dataset"
[[stage]]
id = "regen"
command = "echo regen {dataset}"
for_each = "dataset"
when = { kind = "prompt-only" }
after = ["prep.{dataset}"]
[[stage]]
id = "extract"
command = "true"
after = ["prep.*", "regen.*"]
gpus = "all"
""",
    )
    ids = [s.id for s in plan.stages]
    assert ids == ["prep.chat", "prep.kimi", "regen.chat", "extract"]
    assert plan.stage("regen.chat").after == ("prep.chat",)
    assert plan.stage("prep.kimi").command == "echo kimi"
    assert set(plan.stage("extract").after) == {"prep.chat", "prep.kimi", "regen.chat"}
    assert plan.stage("extract").gpus == (0, 1)
    assert plan.order().index("extract") > plan.order().index("regen.chat")
    dag = plan_mod.render_dag(plan)
    assert "regen.chat" in dag and "prep.*" not in dag.splitlines()[0]


def test_unknown_builtin_stage_is_named_with_the_known_names(tmp_path: Path) -> None:
    msg = error(tmp_path, '[[stage]]\nid = "x"\nrun = "nosuchstage"\n')
    assert "plan.toml" in msg and "stage[0].run" in msg and "'nosuchstage'" in msg
    for name in plan_mod.BUILTIN_STAGES:
        assert name in msg


def test_a_module_path_is_refused_with_the_short_name_to_use(tmp_path: Path) -> None:
    # Plans written for the old flat layout said run = "pipeline.train"; the error says what to write now.
    msg = error(tmp_path, '[[stage]]\nid = "x"\nrun = "pipeline.train"\n')
    assert "stage[0].run" in msg and "run = 'train'" in msg


def test_every_short_name_runs_a_module_that_exists() -> None:
    import importlib.util

    for name, module in plan_mod.BUILTIN_STAGES.items():
        assert importlib.util.find_spec(module) is not None, name
        assert plan_mod.stage_module(name) == module


def test_a_run_dir_frozen_with_module_names_reattaches() -> None:
    # A run dir created before short names stored "pipeline.prep" in each stage's spec.json.
    spec = plan_mod.StageSpec.from_dict({"id": "prep.a", "run": "pipeline.prep"})
    assert spec.run == "prep"


def test_missing_dependency_is_named(tmp_path: Path) -> None:
    msg = error(
        tmp_path,
        '[[stage]]\nid = "a"\ncommand = "true"\n[[stage]]\nid = "b"\ncommand = "true"\nafter = ["prepp"]\n',
    )
    assert "stage[1].after" in msg and "'prepp'" in msg


def test_cycle_is_reported_with_its_path(tmp_path: Path) -> None:
    msg = error(
        tmp_path,
        """
[[stage]]
id = "a"
command = "true"
after = ["c"]
[[stage]]
id = "b"
command = "true"
after = ["a"]
[[stage]]
id = "c"
command = "true"
after = ["b"]
""",
    )
    assert "dependency cycle: a -> c -> b -> a" in msg


@pytest.mark.parametrize(
    ("snippet", "key"),
    [
        ('[[stage]]\nid = "a"\ncommand = "true"\ncpu = "two"\n', "stage[0].cpu"),
        ('[[stage]]\nid = "a"\ncommand = "true"\ngpus = [7]\n', "stage[0].gpus[0]"),
        ('[[stage]]\nid = "a"\ncommand = "true"\nafterr = ["b"]\n', "stage[0].afterr"),
        ('[[stage]]\nid = "a"\n', "stage[0]"),
        ('[[stage]]\nid = "a"\ncommand = "true"\nuses = ["a"]\n', "stage[0].uses"),
    ],
)
def test_bad_stage_fields_are_named(tmp_path: Path, snippet: str, key: str) -> None:
    assert f"{key}:" in error(tmp_path, snippet)


def test_bad_dataset_field_is_named(tmp_path: Path) -> None:
    base = BASE.replace("quota = 100", 'quota = "lots"')
    assert "datasets[0].quota" in error(tmp_path, '[[stage]]\nid = "a"\ncommand = "true"\n', base)
    base = BASE.replace('kind = "prompt-only"', 'kind = "prompt_only"')
    assert "datasets[0].kind" in error(tmp_path, '[[stage]]\nid = "a"\ncommand = "true"\n', base)


def test_toml_syntax_error_names_the_file(tmp_path: Path) -> None:
    path = write_plan(tmp_path, "[run\nname=1\n")
    with pytest.raises(plan_mod.PlanError) as exc:
        plan_mod.load(path)
    assert str(path) in str(exc.value) and "TOML" in str(exc.value)


def test_uses_must_name_a_service(tmp_path: Path) -> None:
    msg = error(
        tmp_path,
        '[[stage]]\nid = "srv"\ncommand = "true"\n[[stage]]\nid = "a"\ncommand = "true"\nuses = ["srv"]\n',
    )
    assert "stage[1].uses" in msg and "not a service" in msg


def test_plan_check_cli(tmp_path: Path) -> None:
    good = write_plan(
        tmp_path, BASE + '[[stage]]\nid = "prep"\ncommand = "true"\nfor_each = "dataset"\n', "good.toml"
    )
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "plan", "check", str(good)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "prep.chat" in out.stdout and "prep.kimi" in out.stdout and "ok: 2 stages" in out.stdout
    bad = write_plan(tmp_path, BASE + '[[stage]]\nid = "a"\ncommand = "true"\nafter = ["zzz"]\n', "bad.toml")
    out = subprocess.run(
        [sys.executable, "-m", "console.cli", "plan", "check", str(bad)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert "bad.toml" in out.stderr and "stage[0].after" in out.stderr


def test_plan_check_shows_every_resolved_setting_without_torch(tmp_path: Path) -> None:
    plan = write_plan(
        tmp_path,
        BASE
        + '[train]\nsteps = 30\nloss = "lk"\n[[stage]]\nid = "prep"\ncommand = "true"\nfor_each = "dataset"\n',
        "p.toml",
    )
    code = (
        "import sys\nfrom console.cli import main\n"
        f"rc = main(['plan', 'check', {str(plan)!r}, '--show-defaults'])\n"
        "assert 'torch' not in sys.modules, 'plan check imported torch'\nsys.exit(rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    steps = next(x for x in lines if x.startswith("steps = "))
    micro = next(x for x in lines if x.startswith("micro_batch = "))
    assert steps.startswith("steps = 30 ") and "(default)" not in steps  # the plan's value
    assert micro.startswith("micro_batch = 8 ") and micro.endswith("(default)")  # the default, marked
    assert "sequences per rank per forward" in micro  # with its doc
    for name in ("target", "resources", "prep", "regen", "serve", "extract", "vocab", "train", "bench"):
        assert f"[{name}]" in lines, name
    assert "# [wandb] is not in the plan: off" in lines
    # issue 27: the LK losses and EAGLE-3.1's switches, each with its doc
    loss = next(x for x in lines if x.startswith("loss = "))
    assert loss.startswith('loss = "lk" ') and "-log acceptance" in loss and "(default)" not in loss
    for key, doc in (
        ("lk_kl_decay = 1.0 ", "KL weight falls as acceptance rises"),
        ("draft_fc_norm = false ", "RMSNorm on each fused target state before fc"),
        ("draft_norm_output = false ", "final-normed hidden"),
    ):
        line = next(x for x in lines if x.startswith(key.split()[0] + " = "))
        assert line.startswith(key) and doc in line and line.endswith("(default)"), line


def test_an_unknown_training_loss_is_named_with_the_choices(tmp_path: Path) -> None:
    msg = error(tmp_path, '[train]\nloss = "tv"\n[[stage]]\nid = "a"\ncommand = "true"\n')
    assert "train.loss" in msg and "lk_adaptive" in msg, msg


def test_shipped_plans_validate() -> None:
    for path in [ROOT / "pipeline" / "plans" / "demo.toml", *sorted((ROOT / "examples").glob("*.toml"))]:
        plan = plan_mod.load(path)
        assert plan.stages, path


def test_reference_plan_settings_pass_each_stages_own_checks() -> None:
    """The reference run's [prep]/[serve]/[regen]/[train]/[deploy] settings are what the stages accept."""
    from pipeline.serving.sglang_args import settings_from_plan, sglang_argv
    from pipeline.stages.prep.settings import PrepSettings
    from pipeline.stages.regen.stage import regen_settings

    plan = plan_mod.load(ROOT / "examples" / "kimi-k2.5.toml")
    assert len([s for s in plan.stages if s.family == "prep"]) == 10
    assert sum(d.quota for d in plan.datasets) == 100_000
    assert {s.id for s in plan.stages if s.family == "regen"} == {
        f"regen.{d.name}" for d in plan.datasets if d.kind == "prompt-only"
    }
    assert "serve" in plan.stage("extract").after  # the GPUs are free of the server before extraction
    for ds in plan.datasets:
        PrepSettings.from_plan(plan, ds)
    assert regen_settings(plan).concurrency == 64
    plain = sglang_argv(settings_from_plan(plan, mode="plain", gpus=plan.stage("serve").gpus))
    assert plain[plain.index("--tp-size") + 1] == "8" and "--trust-remote-code" in plain
    spec = sglang_argv(settings_from_plan(plan, mode="eagle3", gpus=plan.stage("serve").gpus))
    assert spec[spec.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert spec[spec.index("--speculative-draft-model-path") + 1].endswith("stages/train/out/draft")
    # The run ends with SGLang's own speedup table: the plain server, then the one with the draft once the
    # plain one is down (both hold all 8 GPUs); no offline bench, which would load Kimi-K2.5 through transformers.
    assert plan.settings.bench.online
    eagle3, bench_plain, bench_eagle3 = (
        plan.stage(x) for x in ("serve-eagle3", "bench-plain", "bench-eagle3")
    )
    assert "serve-plain" in eagle3.after and bench_eagle3.uses == ("serve-eagle3",)
    assert "--baseline" in bench_eagle3.args and bench_plain.uses == ("serve-plain",)


def test_reference_plan_train_settings_parse() -> None:
    plan = plan_mod.load(ROOT / "examples" / "kimi-k2.5.toml")
    s = plan.settings.train
    assert s.nproc == 8 and s.ttt_steps == 7 and s.batch_size % s.nproc == 0


def test_the_deep_check_finds_every_bench_stage_that_decodes_offline(tmp_path: Path) -> None:
    """Which bench stages load the target through transformers (``pipeline.eagle3.bench_fit``): the mode in a
    stage's args, in either of argparse's spellings, wins over ``[bench]``'s."""
    from pipeline.eagle3.bench_fit import offline_bench_stages

    text = (ROOT / "pipeline" / "plans" / "demo.toml").read_text()
    for sid, args in (
        ("b-online", '["--mode", "online"]'),
        ("b-eq", '["--mode=online"]'),
        ("b-off", '["--mode=offline"]'),
    ):
        text += f'\n[[stage]]\nid = "{sid}"\nrun = "bench"\nargs = {args}\nafter = ["train"]\n'
    (tmp_path / "p.toml").write_text(text)
    assert offline_bench_stages(plan_mod.load(tmp_path / "p.toml")) == ["bench", "b-off"]
    (tmp_path / "q.toml").write_text(text.replace("[bench]\n", '[bench]\nengine = "sglang"\n', 1))
    assert offline_bench_stages(plan_mod.load(tmp_path / "q.toml")) == ["b-off"]


@pytest.mark.parametrize(
    ("base", "key"),
    [
        (BASE.replace('dir = "run"', 'dir = "run"\ndri = "x"'), "run.dri"),
        (BASE + '[executor]\nkind = "local"\nhots = "gpu1"\n', "executor.hots"),
        (BASE.replace("quota = 50", "quota = 50\nsplitt = 'train'"), "datasets[1].splitt"),
        (BASE.replace("quota = 50", "quota = 50\noptions = { feild = 'msgs' }"), "datasets[1].options.feild"),
        (BASE.replace("quota = 50", "quota = 50\noptions = { hub = 3 }"), "datasets[1].options.hub"),
        (
            BASE.replace("quota = 50", "quota = 50\noptions = { reject_threshold = 2 }"),
            "datasets[1].options.reject_threshold",
        ),
        (BASE.replace('name = "kimi"\n', ""), "datasets[1].name"),
    ],
)
def test_core_tables_refuse_unknown_keys_and_bad_values_naming_file_and_key(
    tmp_path: Path, base: str, key: str
) -> None:
    msg = error(tmp_path, '[[stage]]\nid = "a"\ncommand = "true"\n', base)
    assert msg.startswith(str(tmp_path / "plan.toml")) and f": {key}:" in msg


def test_dataset_options_reach_the_sources_as_the_plan_set_them(tmp_path: Path) -> None:
    base = BASE.replace("quota = 50", "quota = 50\noptions = { field = 'msgs', data_files = ['a.json'] }")
    plan = load(tmp_path, '[[stage]]\nid = "a"\ncommand = "true"\n', base)
    assert plan.dataset("kimi").options == {"field": "msgs", "data_files": ["a.json"]}
    assert plan.dataset("chat").options == {}


def test_a_multiline_stage_command_and_retry_are_typed(tmp_path: Path) -> None:
    plan = load(
        tmp_path, '[[stage]]\nid = "a"\ncommand = """echo 1\necho 2"""\nretry = { max_attempts = 3 }\n'
    )
    assert plan.stage("a").command == "echo 1\necho 2"
    assert plan.stage("a").retry == plan_mod.RetryPolicy(3, 30.0)
    assert "stage[0].retry.backof_s:" in error(
        tmp_path, '[[stage]]\nid = "a"\ncommand = "true"\nretry = { backof_s = 3 }\n'
    )


def test_a_key_of_a_method_the_plan_does_not_train_is_refused_naming_its_method(tmp_path):
    """`dflash_block_size = 8` without `draft = "dflash"`: plan check used to say ok and the run trained EAGLE-3."""
    demo = (ROOT / "pipeline" / "plans" / "demo.toml").read_text()
    assert "\n[train]\n" in demo
    p = tmp_path / "demo.toml"
    p.write_text(demo.replace("\n[train]\n", "\n[train]\ndflash_block_size = 8\n", 1))
    with pytest.raises(plan_mod.PlanError) as exc:
        plan_mod.load(p)
    msg = str(exc.value)
    assert f"{p}: train.dflash_block_size: a key of the dflash draft method" in msg
    assert "train.draft is 'eagle3'" in msg and 'set train.draft = "dflash"' in msg
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "plan", "check", str(p)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and "a key of the dflash draft method" in r.stderr
    p.write_text(demo.replace("\n[train]\n", '\n[train]\ndraft = "dflash"\ndflash_block_size = 8\n', 1))
    assert plan_mod.load(p).settings.train.draft == "dflash"
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "plan", "check", str(p)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "executor,key,words",
    [
        (
            'kind = "local"\noptions = { keepalive_s = 1.0 }',
            "executor.options.keepalive_s",
            "reads no options",
        ),
        (
            'kind = "ssh"\nhost = "h"\nremote_dir = "/r"\noptions = { know_hosts = "/x" }',
            "executor.options.know_hosts",
            "unknown key",
        ),
        (
            'kind = "ssh"\nhost = "h"\nremote_dir = "/r"\noptions = { max_sessions = 0 }',
            "executor.options.max_sessions",
            "must be 1 or more",
        ),
        (
            'kind = "slurm"\noptions = { pipeline = "copy" }',
            "executor.options.pipeline",
            "must be one of auto, upload, installed",
        ),
        (
            'kind = "ssh"\nhost = "h"\nremote_dir = "/r"\noptions = { keepalive_s = "5" }',
            "executor.options.keepalive_s",
            "expected a number",
        ),
    ],
)
def test_executor_options_are_typed_per_kind_by_plan_check(tmp_path, executor, key, words):
    """Each kind's options are checked when the plan loads (aerie plan check), not first when the console
    connects: a misspelt or mistyped one is named with the file and the key."""
    p = write_plan(tmp_path, f"[executor]\n{executor}\n" + BASE + '[[stage]]\nid = "a"\ncommand = "true"\n')
    with pytest.raises(plan_mod.PlanError) as exc:
        plan_mod.load(p)
    msg = str(exc.value)
    assert f"{p}: {key}: " in msg and words in msg, msg
    r = subprocess.run(
        [sys.executable, "-m", "console.cli", "plan", "check", str(p)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 2 and key in r.stderr


def test_valid_ssh_options_load_typed(tmp_path):
    p = write_plan(
        tmp_path,
        '[executor]\nkind = "ssh"\nhost = "h"\nremote_dir = "/r"\n'
        'options = { keepalive_s = 2, max_sessions = 4, pipeline = "upload" }\n'
        + BASE
        + '[[stage]]\nid = "a"\ncommand = "true"\n',
    )
    o = plan_mod.load(p).executor.ssh_options()
    assert (o.keepalive_s, o.max_sessions, o.pipeline, o.connect_timeout_s) == (2.0, 4, "upload", 15.0)
