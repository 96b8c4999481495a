"""The SGLang launch command built from a plan: exact argv, plan errors, and SGLang's own parser."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import PlanError
from pipeline.serving.sglang_args import draft_path, settings_from_plan, sglang_argv
from pipeline.stages.serve import draft_flags
from pipeline.stages.serve.backends import launch

BASE = """
[run]
name = "t"
dir = "run"
[resources]
gpus = [0, 1, 2, 3, 4, 5, 6, 7]
[target]
model = "/models/Kimi-K2.5"
max_length = 8192
"""
STAGES = """
[[stage]]
id = "serve"
run = "serve"
service = true
gpus = "all"
"""


def load(tmp_path: Path, extra: str) -> plan_mod.Plan:
    p = tmp_path / "plan.toml"
    p.write_text(textwrap.dedent(BASE) + textwrap.dedent(extra) + textwrap.dedent(STAGES))
    return plan_mod.load(p)


def test_plain_argv_from_plan(tmp_path):
    plan = load(
        tmp_path,
        """
        [serve]
        mem_fraction_static = 0.85
        port = 30000
        extra_args = ["--enable-metrics"]
    """,
    )
    s = settings_from_plan(plan, gpus=plan.stage("serve").gpus)
    assert sglang_argv(s, python="python3") == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/Kimi-K2.5",
        "--tp-size",
        "8",
        "--host",
        "127.0.0.1",
        "--port",
        "30000",
        "--mem-fraction-static",
        "0.85",
        "--context-length",
        "8192",
        "--enable-metrics",
    ]
    argv, env = launch(s, "python3")
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}


def test_eagle3_argv_from_plan(tmp_path):
    plan = load(
        tmp_path,
        """
        [serve]
        model = "/models/target"
        tp = 4
        context_length = 4096
        mem_fraction_static = 0.7
        [deploy]
        draft_model_path = "/ckpt/epoch_3_step_9000"
        speculative_num_steps = 5
        speculative_eagle_topk = 2
        speculative_num_draft_tokens = 8
        port = 30001
    """,
    )
    s = settings_from_plan(plan, mode="eagle3", gpus=(0, 1, 2, 3))
    assert sglang_argv(s, python="py") == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/target",
        "--tp-size",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        "30001",
        "--mem-fraction-static",
        "0.7",
        "--context-length",
        "4096",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "8",
        "--speculative-draft-model-path",
        "/ckpt/epoch_3_step_9000",
    ]


def test_eagle3_defaults_and_relative_draft_path(tmp_path):
    plan = load(
        tmp_path,
        """
        [deploy]
        draft_model_path = "ckpt/final"
    """,
    )
    s = settings_from_plan(plan, mode="eagle3")
    argv = sglang_argv(s)
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(tmp_path / "ckpt" / "final")
    assert argv[argv.index("--speculative-num-steps") + 1] == "3"
    assert argv[argv.index("--speculative-eagle-topk") + 1] == "1"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "4"
    assert argv[argv.index("--tp-size") + 1] == "1"  # no GPUs given: tp 1


@pytest.mark.parametrize(
    "extra,key,words",
    [
        ('[serve]\nbackend = "vllm"', "serve.backend", "must be one of sglang, local"),
        ('[serve]\nport = "30000"', "serve.port", "expected an integer"),
        ("[serve]\nport = 70000", "serve.port", "must be between 0 and 65535"),
        ("[serve]\nmem_fraction_static = 1.5", "serve.mem_fraction_static", "between 0 and 1"),
        ("[serve]\ntp = 16", "serve.tp", "needs 16 GPUs but the stage has 8"),
        ('[serve]\nextra_args = ["--x", 3]', "serve.extra_args[1]", "expected a string"),
        ("[serve]\nmem_frac = 0.8", "serve.mem_frac", "unknown key"),
        ("[serve]\nstartup_timeout_s = 0", "serve.startup_timeout_s", "must be > 0"),
    ],
)
def test_plan_errors_name_file_and_key(tmp_path, extra, key, words):
    with pytest.raises(
        PlanError
    ) as ei:  # when the plan loads, or (tp vs the stage's GPUs) when it is resolved
        plan = load(tmp_path, extra)
        settings_from_plan(plan, gpus=plan.stage("serve").gpus)
    msg = str(ei.value)
    assert str(tmp_path / "plan.toml") in msg and f": {key}: " in msg and words in msg


def test_eagle3_without_draft_is_an_error(tmp_path):
    plan = load(tmp_path, "")
    with pytest.raises(PlanError, match="deploy.draft_model_path: --mode eagle3 needs the draft checkpoint"):
        settings_from_plan(plan, mode="eagle3")


def _sglang_parser():
    try:
        from sglang.srt.server_args import prepare_server_args
    except ImportError as exc:
        pytest.skip(
            f"sglang is not importable here ({exc}); install it for this test with "
            "`pip install --no-deps -r .ci/sglang-parser-requirements.txt`"
        )
    return prepare_server_args


@pytest.mark.slow
def test_sglang_own_parser_accepts_our_argv(tmp_path):
    """SGLang's real argument parser (pinned like the gpu extra) reads back exactly what we meant."""
    prepare_server_args = _sglang_parser()
    import sglang

    from pipeline.tested_versions import stack_of

    req = (Path(__file__).resolve().parent.parent / ".ci" / "sglang-parser-requirements.txt").read_text()
    assert f"sglang=={sglang.__version__}\n" in req, "the installed sglang is not the parser install's pin"
    assert stack_of(sglang.__version__) is not None, "the parser's sglang is not in the tested-versions table"
    plan = load(
        tmp_path,
        """
        [serve]
        mem_fraction_static = 0.85
        served_model_name = "kimi"
        extra_args = ["--enable-metrics", "--decode-log-interval", "20"]
        [deploy]
        draft_model_path = "/ckpt/final"
        speculative_num_steps = 5
        speculative_eagle_topk = 1
        speculative_num_draft_tokens = 6
    """,
    )
    for mode in ("plain", "eagle3"):
        s = settings_from_plan(plan, mode=mode, gpus=plan.stage("serve").gpus)
        argv = sglang_argv(s)
        assert argv[1:3] == ["-m", "sglang.launch_server"]
        a = prepare_server_args(argv[3:])
        assert (a.model_path, a.tp_size, a.host, a.port) == ("/models/Kimi-K2.5", 8, "127.0.0.1", 30000)
        assert (a.mem_fraction_static, a.context_length, a.served_model_name) == (0.85, 8192, "kimi")
        assert a.enable_metrics is True and a.decode_log_interval == 20
        if mode == "eagle3":
            assert a.speculative_algorithm == "EAGLE3"
            assert a.speculative_draft_model_path == "/ckpt/final"
            assert (a.speculative_num_steps, a.speculative_eagle_topk, a.speculative_num_draft_tokens) == (
                5,
                1,
                6,
            )
        else:
            assert a.speculative_algorithm is None


@pytest.mark.slow
def test_sglang_own_parser_rejects_a_bad_argv():
    prepare_server_args = _sglang_parser()
    with pytest.raises(SystemExit):
        prepare_server_args(["--model-path", "/m", "--tp", "eight"])


def test_local_backend_runs_transformers_serve_with_the_stage_cpu_slots_as_threads(tmp_path, monkeypatch):
    plan = load(
        tmp_path,
        """
        [serve]
        backend = "local"
        port = 8123
        model = "/models/dense"
    """,
    )
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    argv, env = launch(settings_from_plan(plan, cpu=2), "py")
    assert argv == [
        "py",
        "-m",
        "transformers.cli.transformers",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--device",
        "cpu",
        "--log-level",
        "info",
        "/models/dense",
    ]
    assert env["OMP_NUM_THREADS"] == "2" and env["HF_HUB_OFFLINE"] == "1"
    assert env["OMP_WAIT_POLICY"] == "PASSIVE", "its threads sleep between parallel regions, never spin"
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # an operator's own setting wins
    assert "OMP_NUM_THREADS" not in launch(settings_from_plan(plan, cpu=2), "py")[1]


def _draft_with_recipe(folder: Path, recipe: dict | None) -> Path:
    """A draft export as the train stage leaves it: its provenance's recipe names the method it was trained with."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if recipe is not None:
        (folder / "aerie_provenance.json").write_text(json.dumps({"format": 1, "recipe": recipe}))
    return folder


DEPLOY = """
[deploy]
draft_model_path = "draft"
speculative_num_steps = 5
speculative_eagle_topk = 1
speculative_num_draft_tokens = 6
"""


def _deploy_argv(plan: plan_mod.Plan) -> tuple[str, list[str]]:
    method, flags = draft_flags.serve_flags(plan, Path(draft_path(plan)))
    return method, sglang_argv(settings_from_plan(plan, mode="eagle3", flags=flags))


def test_a_dflash_draft_is_served_as_dflash_with_its_block(tmp_path):
    """The plan trains DFlash (blocks of 8): the deploy launches SGLang's DFLASH with 8 draft tokens, not
    EAGLE-3's chain settings of [deploy] (the method's spec is the one source of the flags)."""
    _draft_with_recipe(tmp_path / "draft", None)
    plan = load(tmp_path, '[train]\ndraft = "dflash"\ndflash_block_size = 8\n' + DEPLOY)
    method, argv = _deploy_argv(plan)
    assert method == "dflash"
    tail = argv[argv.index("--speculative-algorithm") :]
    assert tail == [
        "--speculative-algorithm",
        "DFLASH",
        "--speculative-num-draft-tokens",
        "8",
        "--speculative-draft-model-path",
        str(tmp_path / "draft"),
    ]
    assert "--speculative-num-steps" not in argv and "EAGLE3" not in argv


def test_the_drafts_own_provenance_names_its_method(tmp_path):
    """A plan that says nothing of DFlash deploys a DFlash export as DFlash (block 6, from the export's recipe);
    an EAGLE-3 export under a DFlash plan is served as EAGLE-3 with [deploy]'s chain."""
    _draft_with_recipe(tmp_path / "draft", {"draft": "dflash", "train": {"dflash_block_size": 6, "steps": 9}})
    method, argv = _deploy_argv(load(tmp_path, DEPLOY))
    assert method == "dflash" and argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "6"
    other = tmp_path / "other"
    other.mkdir()
    _draft_with_recipe(other / "draft", {"draft": "eagle3", "train": {"ttt_steps": 7}})
    plan = load(other, '[train]\ndraft = "dflash"\ndflash_block_size = 8\n' + DEPLOY)
    method, argv = _deploy_argv(plan)
    assert method == "eagle3"
    assert argv[argv.index("--speculative-algorithm") :][:8] == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "6",
    ]


@pytest.mark.slow
def test_sglang_own_parser_reads_each_methods_deploy(tmp_path):
    """SGLang's parser reads the DFlash deploy as DFLASH with the draft's block as its draft tokens."""
    prepare_server_args = _sglang_parser()
    _draft_with_recipe(tmp_path / "draft", None)
    plan = load(tmp_path, '[train]\ndraft = "dflash"\ndflash_block_size = 8\n' + DEPLOY)
    _, argv = _deploy_argv(plan)
    a = prepare_server_args(argv[3:])
    assert a.speculative_algorithm == "DFLASH" and a.speculative_num_draft_tokens == 8
    assert a.speculative_draft_model_path == str(tmp_path / "draft")
