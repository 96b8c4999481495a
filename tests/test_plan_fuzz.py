"""Plan fuzzing (issue 18, item 7): malformed plans never raise a traceback, only a PlanError naming file and key.

Property-based with ``hypothesis``: start from a valid plan and damage it — values replaced by values of
the wrong type (huge and negative numbers, NaN, unicode with control characters, nested tables),
keys deleted, unknown keys added, dependencies rewired into cycles — and also feed the loader raw text
and raw bytes. Whatever comes in, :func:`pipeline.run.plan.dag.load` / ``from_dict`` either returns a plan
whose DAG can be ordered and rendered, or raises :class:`~pipeline.run.plan.dag.PlanError` whose ``file`` is
the plan and whose ``key`` names where the problem is.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.sections import SECTIONS, render_settings

PLAN_PATH = Path("/nonexistent/fuzz/plan.toml")  # from_dict never reads it; errors must still name it

VALID: dict[str, Any] = {
    "run": {"name": "fuzz", "dir": "run"},
    "executor": {"kind": "local"},
    "resources": {"cpu_slots": 4, "gpus": [0, 1]},
    "target": {"model": "builtin:smollm2-135m-instruct", "max_length": 512},
    "datasets": [
        {
            "name": "chat",
            "source": "ultrachat",
            "kind": "prompt-only",
            "quota": 10,
            "path": "data/chat.jsonl",
        },
        {"name": "kimi", "source": "kimi", "kind": "target-native", "quota": 5},
    ],
    # Every settings section, each with a key or two, so the damage reaches them all.
    "prep": {"shard_rows": 8, "reject_threshold": 0.1, "template_kwargs": {"thinking": True}},
    "regen": {"concurrency": 4, "stop": ["</s>"], "top_p": 0.9},
    "serve": {"backend": "local", "port": 0, "extra_args": ["--x"]},
    "deploy": {"draft_model_path": "ckpt", "speculative_num_steps": 3},
    "extract": {"mode": "offline", "aux_layers": [1, 2, 3], "batch_tokens": 512},
    "vocab": {"draft_vocab_size": 100},
    "train": {"steps": 4, "lr": 1e-3, "nproc": 2, "batch_size": 4},
    "bench": {"holdout": 0.2, "prompts": 2},
    "telemetry": {"interval_s": 2},
    "alerts": {"command": "true", "bell": False},
    "ui": {"theme": "aerie-dark"},
    "wandb": {"project": "p", "mode": "offline"},
    "stage": [
        {"id": "prep", "run": "prep", "for_each": "dataset"},
        {
            "id": "regen",
            "command": "echo {dataset}",
            "for_each": "dataset",
            "when": {"kind": "prompt-only"},
            "after": ["prep.{dataset}"],
            "env": {"A_B": "1"},
            "retry": {"max_attempts": 3, "backoff_s": 1.5},
        },
        {"id": "serve", "run": "serve", "service": True, "gpus": [0]},
        {
            "id": "train",
            "run": "train",
            "after": ["prep.*", "regen.*"],
            "uses": ["serve"],
            "gpus": "all",
            "cpu": 2,
            "output_bytes": 1000,
            "pause_grace_s": 5,
            "kill_grace_s": 2.5,
            "description": "d",
        },
    ],
}

_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    [
        "",
        "../../etc/passwd",
        "a b",
        "x;rm -rf /",
        "$(touch pwned)",
        "`id`",
        "'\"",
        "é✓",
        "-oProxyCommand=sh",
        "a\x00b",
        "a\nb",
        "prep.*",
        "prep",
        "serve",
        "train",
        "all",
        "dataset",
        "ssh",
        "local",
    ]
)
_scalar = (
    st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _text
)
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=8,
)
_extra_keys = (
    st.sampled_from(
        [
            "id",
            "run",
            "command",
            "after",
            "uses",
            "name",
            "path",
            "kind",
            "quota",
            "gpus",
            "cpu",
            "retry",
            "env",
            "when",
            "for_each",
            "service",
            "bogus",
            "dir",
            "host",
            "port",
            "options",
            "max_attempts",
            "backoff_s",
            "steps",
            "mode",
            "aux_layers",
            "holdout",
            "project",
            "interval_s",
        ]
    )
    | _text
)


def _containers(obj: Any, here: tuple = ()) -> list[tuple]:
    """Paths (tuples of keys/indices) to every dict and list inside ``obj``, the root included."""
    out = [here]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        if isinstance(v, dict | list):
            out += _containers(v, (*here, k))
    return out


def _get(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


@st.composite
def damaged_plans(draw: st.DrawFn) -> dict[str, Any]:
    raw = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 4))):
        target = _get(raw, draw(st.sampled_from(_containers(raw))))
        op = draw(st.sampled_from(["replace", "delete", "add", "cycle"]))
        if op == "cycle":
            stages = raw.get("stage")
            if isinstance(stages, list) and stages and all(isinstance(s, dict) for s in stages):
                ids = [s.get("id") for s in stages if isinstance(s.get("id"), str)] or ["x"]
                s = draw(st.sampled_from(stages))
                s["after"] = draw(
                    st.lists(st.sampled_from([*ids, *(i + ".*" for i in ids), "prep.chat"]), max_size=3)
                )
            continue
        if isinstance(target, dict):
            if op == "add" or not target:
                target[draw(_extra_keys)] = draw(_value)
            else:
                key = draw(st.sampled_from(sorted(target, key=str)))
                if op == "delete":
                    del target[key]
                else:
                    target[key] = draw(_value)
        elif isinstance(target, list):
            if op == "add" or not target:
                target.append(draw(_value))
            else:
                i = draw(st.integers(0, len(target) - 1))
                if op == "delete":
                    del target[i]
                else:
                    target[i] = draw(_value)
    return raw


def _check(raw: Any) -> None:
    try:
        plan = plan_mod.from_dict(raw, PLAN_PATH)
    except plan_mod.PlanError as exc:
        assert exc.file == str(PLAN_PATH)
        assert str(exc).startswith(f"{PLAN_PATH}: ")
        assert exc.key or not isinstance(raw, dict), f"no key named in {exc}"
        return
    # Accepted: then it is a usable plan, and every setting has its declared type.
    plan.order()
    plan_mod.render_dag(plan)
    render_settings(plan.settings, plan.raw)
    for name, cls in SECTIONS.items():
        section = getattr(plan.settings, name)
        for f in dataclasses.fields(section) if section is not None else ():
            v = getattr(section, f.name)
            assert v is None or _has_type(v, typing.get_type_hints(cls)[f.name]), (name, f.name, v)
            assert not isinstance(v, float) or math.isfinite(v), (name, f.name, v)
    for s in plan.stages:
        assert plan_mod.StageSpec.from_dict(s.to_dict()) == s
        assert all(math.isfinite(x) for x in (s.retry.backoff_s, s.pause_grace_s, s.kill_grace_s))


def _has_type(v: Any, tp: Any) -> bool:
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(tp) if a is not type(None)] if union else [tp]
    for a in args:
        origin = typing.get_origin(a) or a
        if origin is float and isinstance(v, float):
            return True
        if origin is int and isinstance(v, int) and not isinstance(v, bool):
            return True
        if origin in (str, bool, dict, tuple, list) and isinstance(v, origin):
            return True
    return False


def test_the_valid_plan_is_valid() -> None:
    plan = plan_mod.from_dict(copy.deepcopy(VALID), PLAN_PATH)
    assert "train" in plan.order()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_plans())
def test_damaged_plans_fail_only_with_a_plan_error_naming_file_and_key(raw: dict[str, Any]) -> None:
    _check(raw)


@settings(max_examples=100, deadline=None)
@given(_value)
def test_any_value_at_the_top_is_a_plan_error_or_a_plan(raw: Any) -> None:
    _check(raw)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.binary(max_size=200)
    | st.text(max_size=200).map(str.encode)
    | st.sampled_from(
        [
            b"[run]\ndir = 'r'\n" + b"[" * 5000,
            b"a = " + b"[" * 5000 + b"]" * 5000,
            b"\xff\xfe[run]",
            b"[run]\nname = 1\n",
            b'[[stage]]\nid = "x"\nrun = "prep"\n',
        ]
    )
)
def test_any_file_content_is_a_plan_error_or_a_plan(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "plan.toml"
    path.write_bytes(content)
    try:
        plan_mod.load(path)
    except plan_mod.PlanError as exc:
        assert exc.file == str(path)
        assert str(exc).startswith(f"{path}: ")


def test_a_long_dependency_chain_is_ordered_without_recursion() -> None:
    raw = {
        "run": {"dir": "r"},
        "stage": [
            {"id": f"s{i}", "command": "true", "after": [f"s{i - 1}"] if i else []} for i in range(3000)
        ],
    }
    plan = plan_mod.from_dict(raw, PLAN_PATH)
    assert plan.order()[-1] == "s2999"
    raw["stage"][0]["after"] = ["s2999"]
    with pytest.raises(plan_mod.PlanError, match="dependency cycle: s0 -> s2999"):
        plan_mod.from_dict(raw, PLAN_PATH)
