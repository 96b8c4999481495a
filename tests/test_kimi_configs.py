"""Malformed target configs are plan errors (issue 25, item 5): ``aerie plan check --deep`` never shows a
traceback and never passes a broken config; each problem is a FAIL line naming the config file and the field.

Every example starts from Kimi-K2.5's real ``config.json`` (``tests/kimi_fixture.py``: real sizes, nothing
loaded, the model built on the meta device) beside the tiny tokenizer with Kimi's special tokens and chat
template (512 ids). The eight configs the issue found crashing or passing are checked by name; a
property-based test then damages any field — dropped, of the wrong type, out of range, or inconsistent with
the tokenizer — and asserts that the check either passes or names the file and that field.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.eagle3 import chain_check
from pipeline.run.plan import dag as plan_mod
from tests.kimi_fixture import build_tiny_tokenizer, kimi_config

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_IDS = 512  # the tiny Kimi tokenizer's vocabulary (tests/kimi_fixture.py)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("kimi-tok"), TOKENIZER_IDS)


def model_folder(root: Path, tokenizer_dir: Path, cfg: dict[str, Any]) -> Path:
    """A target folder: this config.json (no weights) and the tiny Kimi tokenizer."""
    root.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        (root / f.name).write_bytes(f.read_bytes())
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    return root


def write_plan(folder: Path, extract: str = "") -> Path:
    """Online training (no disk verdict), no datasets, no GPU size: only the target can fail the check."""
    p = folder / "plan.toml"
    p.write_text(
        f'[run]\nname = "cfg"\ndir = "{folder / "run"}"\n[target]\nmodel = "{folder}"\nmax_length = 256\n'
        f'[extract]\nmode = "online"\n{extract}\n[vocab]\ndraft_vocab_size = 128\n'
        '[[stage]]\nid = "extract"\nrun = "extract"\n'
    )
    return p


def deep_check(folder: Path, extract: str = "") -> chain_check.Report:
    plan = plan_mod.load(write_plan(folder, extract))
    return chain_check.check(plan, free_bytes=10**15)  # raising here is the traceback the operator would see


def failures(rep: chain_check.Report) -> list[str]:
    return [c.detail for c in rep.checks if not c.ok]


def names_field(line: str, cfg_file: Path, field: str) -> bool:
    """``line`` names the config file and ``field`` (dotted, not the tail of a longer dotted name)."""
    _, sep, rest = line.partition(f"{cfg_file}: ")
    return bool(sep) and re.search(rf"(?<![\w.]){re.escape(field)}(?![\w])", rest) is not None


# ------------------------------------------------------------------------------ the issue's eight configs
def _drop(path: str) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            cfg = cfg[p]
        del cfg[last]

    return edit


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def edit(cfg: dict) -> None:
        *parents, last = path.split(".")
        for p in parents:
            cfg = cfg[p]
        cfg[last] = value

    return edit


def _small_vocab(cfg: dict) -> None:
    """A vocabulary of 300 with token ids inside it, but the tokenizer has 512 ids."""
    for table in (cfg, cfg["text_config"]):
        table.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg["text_config"]["vocab_size"] = 300


EIGHT = {
    # crashed with a traceback
    "yarn without factor": (_drop("text_config.rope_scaling.factor"), "", "text_config.rope_scaling.factor"),
    "unsupported rope type": (
        _set("text_config.rope_scaling.type", "ntk"),
        "",
        "text_config.rope_scaling.type",
    ),
    "fewer layers than the default aux list": (
        _set("text_config.num_hidden_layers", 4),
        "",
        "text_config.num_hidden_layers",
    ),
    "vocab smaller than the pad id": (
        _set("text_config.vocab_size", 163839),  # ids 0..163838: pad 163839 is outside, bos/eos inside
        "",
        "text_config.pad_token_id",
    ),
    # passed silently
    "no text_config in the kimi_k25 wrapper": (_drop("text_config"), "", "text_config"),
    "vocab smaller than the tokenizer's ids": (_small_vocab, "", "text_config.vocab_size"),
    "wrong architectures": (_set("architectures", ["DeepseekV3ForCausalLM"]), "", "architectures"),
    # SGLang picks the capture rule by architectures[0]: a Llama class would be fed other layers than these
    "wrong capture ids": (
        _set("architectures", ["LlamaForCausalLM"]),
        "aux_layers = [2, 30, 58]",
        "architectures",
    ),
}


@pytest.mark.parametrize("case", list(EIGHT))
def test_each_malformed_config_the_issue_found_is_a_fail_line_naming_file_and_field(
    case: str, tmp_path: Path, tokenizer_dir: Path
) -> None:
    edit, extract, field = EIGHT[case]
    cfg = kimi_config()
    edit(cfg)
    folder = model_folder(tmp_path / "m", tokenizer_dir, cfg)
    rep = deep_check(folder, extract)
    bad = failures(rep)
    assert not rep.ok and bad, rep.render()
    assert any(names_field(line, folder / "config.json", field) for line in bad), rep.render()
    assert "deep check" not in rep.failed, rep.render()  # named by its field, not caught as a crash


def test_a_custom_aux_list_beyond_the_layers_names_the_plan_key_and_the_config_field(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    folder = model_folder(tmp_path / "m", tokenizer_dir, kimi_config(num_hidden_layers=20))
    rep = deep_check(folder, "aux_layers = [1, 29, 57]")
    (line,) = failures(rep)
    assert "extract.aux_layers: layer 29 out of range" in line
    assert names_field(line, folder / "config.json", "text_config.num_hidden_layers") and "is 20" in line


def test_the_real_config_passes(tmp_path: Path, tokenizer_dir: Path) -> None:
    rep = deep_check(model_folder(tmp_path / "m", tokenizer_dir, kimi_config()))
    assert rep.ok, rep.render()


def test_the_cli_prints_the_fail_line_and_no_traceback(tmp_path: Path, tokenizer_dir: Path) -> None:
    """What the operator sees from ``aerie plan check --deep`` (which runs this module)."""
    cfg = kimi_config()
    del cfg["text_config"]["rope_scaling"]["factor"]
    folder = model_folder(tmp_path / "m", tokenizer_dir, cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.eagle3.chain_check", str(write_plan(folder))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1 and "Traceback" not in p.stdout + p.stderr, p.stderr[-3000:]
    assert (
        "FAIL config" in p.stdout
        and f"{folder / 'config.json'}: text_config.rope_scaling.factor: missing (yarn scaling needs it)"
        in p.stdout
    ), p.stdout


# ------------------------------------------------------------------------------ property: damage any field
def _leaves(d: dict, pre: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for k, v in d.items():
        if k in ("vision_config", "quantization_config"):
            continue  # the vision tower and the quantizer are not the text model's fields
        out.append((*pre, k))
        if isinstance(v, dict):
            out += _leaves(v, (*pre, k))
    return out


FIELDS = _leaves(kimi_config())
TOKEN_IDS = [f for f in FIELDS if f[-1] in ("bos_token_id", "eos_token_id", "pad_token_id")]
WRONG_TYPES = ["x", [1], {"a": 1}, True, None, 1.5, 7]


@st.composite
def damaged(draw: st.DrawFn) -> tuple[dict, tuple[str, ...], str]:
    """(config, the field damaged, how)."""
    cfg = copy.deepcopy(kimi_config())
    kind = draw(st.sampled_from(["drop", "wrong type", "out of range", "tokenizer"]))
    if kind == "tokenizer":  # a vocabulary the tokenizer's ids overflow, or an id beyond the vocabulary
        path = draw(st.sampled_from([("text_config", "vocab_size"), *TOKEN_IDS]))
        value: Any = (
            draw(st.integers(1, TOKENIZER_IDS - 1))
            if path[-1] == "vocab_size"
            else draw(st.one_of(st.integers(163840, 2**40), st.integers(-(2**31), -1)))
        )
    else:
        path = draw(st.sampled_from(FIELDS))
    table = cfg
    for p in path[:-1]:
        table = table[p]
    old = table[path[-1]]
    if kind == "drop":
        del table[path[-1]]
        return cfg, path, kind
    if kind == "wrong type":
        value = draw(st.sampled_from([v for v in WRONG_TYPES if type(v) is not type(old)]))
    elif kind == "out of range":
        if isinstance(old, bool) or not isinstance(old, int | float | str | list):
            value = draw(st.sampled_from(["no-such-value", -1]))
        elif isinstance(old, int | float):
            value = draw(st.sampled_from([0, -1, -0.5, -(2**31)]))
        elif isinstance(old, str):
            value = draw(st.sampled_from(["no-such-value", ""]))
        else:
            value = draw(st.sampled_from([[], ["NoSuchClass"]]))
    table[path[-1]] = value
    return cfg, path, f"{kind}: {value!r}"


@settings(
    max_examples=45,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(damaged())
def test_a_damaged_kimi_config_passes_or_fails_naming_the_file_and_the_field(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, case: tuple[dict, tuple[str, ...], str]
) -> None:
    cfg, path, how = case
    folder = model_folder(tmp_path_factory.mktemp("damaged"), tokenizer_dir, cfg)
    rep = deep_check(folder)  # never raises
    if rep.ok:
        return
    cfg_file = folder / "config.json"
    field = ".".join(path)
    bad = failures(rep)
    assert all(str(cfg_file) in line for line in bad), (how, rep.render())
    assert any(names_field(line, cfg_file, field) for line in bad), (field, how, rep.render())
