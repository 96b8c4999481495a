"""Loading a target never waits on a terminal, and Kimi's real tokenizer format loads (issue 25 item 2).

A model folder whose files name code of their own (``auto_map``) makes transformers ask "run custom
code? [y/N]" on stdin when ``trust_remote_code`` is left unset. Aerie passes the plan's
``target.trust_remote_code`` (default false) on every load, so such a target is an error naming that key,
in a stage and in ``aerie plan check --deep`` alike. Each check runs in a child process whose stdin is a
pipe held open: a load that asked would wait there until the timeout, and the test would fail.

Kimi-K2.5's tokenizer is a ``tiktoken.model`` file plus ``tokenizer_config.json``
(:func:`tests.kimi_fixture.write_tiktoken_fixture` writes one with synthetic ranks and Kimi's special
tokens); with ``tiktoken`` installed (the ``pipeline`` extra) Aerie's tokenizer loading and the deep
check's chat-template check work on it, and without it the error names the file and the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.run.plan import dag as plan_mod
from tests.kimi_fixture import (
    KIMI_SPECIAL_IDS,
    TIKTOKEN_DIR,
    build_tiktoken_kimi,
    tiktoken_special_tokens,
    write_tiktoken_fixture,
)

ROOT = Path(__file__).resolve().parent.parent


def custom_code_model(folder: Path, auto_map: bool = True) -> Path:
    """A model folder of a type transformers does not know; with ``auto_map`` its config names a custom
    class whose module, if ever imported, leaves a file behind."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg: dict = {"model_type": "aerie_unknown", "architectures": ["AerieUnknownForCausalLM"]}
    if auto_map:
        cfg["auto_map"] = {
            "AutoConfig": "configuration_unknown.UnknownConfig",
            "AutoModelForCausalLM": "modeling_unknown.UnknownForCausalLM",
        }
        (folder / "configuration_unknown.py").write_text(
            f"open({str(folder / 'CUSTOM_CODE_RAN')!r}, 'w').close()\n"
        )
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def run_open_stdin(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` from the checkout with stdin a pipe held open and never written: a child that asked
    a question there would wait until ``timeout`` (``communicate`` would close stdin, so output goes to
    files and the test only waits for the exit)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env={**env, "HF_HUB_OFFLINE": "1"},
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            text=True,
        )
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        finally:
            assert p.stdin is not None
            p.stdin.close()
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())
    if p.returncode == -9:
        pytest.fail(f"waited {timeout} s (on stdin?):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return result


def run_code(code: str) -> subprocess.CompletedProcess[str]:
    return run_open_stdin(["-c", textwrap.dedent(code)], timeout=120)


def test_the_plan_key_defaults_to_false_and_takes_only_a_bool(tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'[run]\nname = "x"\ndir = "{tmp_path}"\n[target]\nmodel = "m"\n')
    assert plan_mod.load(plan).target.trust_remote_code is False
    plan.write_text(
        f'[run]\nname = "x"\ndir = "{tmp_path}"\n[target]\nmodel = "m"\ntrust_remote_code = "yes"\n'
    )
    with pytest.raises(plan_mod.PlanError, match="target.trust_remote_code"):
        plan_mod.load(plan)


def test_transformers_left_to_itself_would_wait_on_stdin(tmp_path: Path) -> None:
    """What the plan key guards against: ``trust_remote_code`` unset, stdin a terminal-like open pipe."""
    model = custom_code_model(tmp_path / "m")
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from transformers import AutoConfig; AutoConfig.from_pretrained({str(model)!r})",
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:
            if not p.stdout:
                break
            line = p.stdout.readline()  # the question has no newline at its end: read what precedes it
            if "trust_remote_code=True" in line:
                time.sleep(2)
                break
        assert p.poll() is None, "transformers did not ask: the guard below proves nothing"
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("auto_map", [True, False], ids=["custom-code", "unknown-type"])
def test_a_target_needing_code_of_its_own_is_a_clear_error_not_a_question(
    tmp_path: Path, auto_map: bool
) -> None:
    model = custom_code_model(tmp_path / "m", auto_map)
    t0 = time.monotonic()
    p = run_code(
        f"""
        from pipeline.data import model_assets
        try:
            model_assets.model_config({str(model)!r})
        except model_assets.ModelAssetError as exc:
            print("ERROR", exc)
        """
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert time.monotonic() - t0 < 60  # transformers' own question times out after 15 s
    assert "run the custom code" not in p.stdout + p.stderr
    assert p.stdout.startswith("ERROR target.model: "), p.stdout
    assert not (model / "CUSTOM_CODE_RAN").exists()
    if auto_map:
        assert "target.trust_remote_code = true" in p.stdout
        assert "config.json: configuration_unknown.UnknownConfig" in p.stdout
    else:
        assert "model_type 'aerie_unknown'" in p.stdout and "transformers" in p.stdout


def test_trust_remote_code_true_runs_the_folders_code(tmp_path: Path) -> None:
    """The key does what it says: true imports the custom module (which here only leaves a file)."""
    model = custom_code_model(tmp_path / "m")
    run_code(
        f"""
        from pipeline.data import model_assets
        try:
            model_assets.model_config({str(model)!r}, trust_remote_code=True)
        except Exception as exc:  # the module defines no class: only that it ran matters here
            print(type(exc).__name__, exc)
        """
    )
    assert (model / "CUSTOM_CODE_RAN").exists()


def _deep(plan: Path) -> tuple[int, dict, str]:
    p = run_open_stdin(
        ["-m", "pipeline.eagle3.chain_check", str(plan), "--json", "--free-bytes", str(10**13)]
    )
    assert p.stdout.strip(), p.stderr[-3000:]
    return p.returncode, {c["name"]: c for c in json.loads(p.stdout)["checks"]}, p.stderr


def _plan(tmp: Path, model: Path, extra: str = "") -> Path:
    plan = tmp / "plan.toml"
    plan.write_text(
        f'[run]\nname = "x"\ndir = "{tmp / "run"}"\n[target]\nmodel = "{model}"\nmax_length = 256\n{extra}'
        '[vocab]\ndraft_vocab_size = 64\n[[stage]]\nid = "extract"\nrun = "extract"\n'
    )
    return plan


@pytest.mark.slow
def test_deep_check_fails_a_custom_code_target_naming_the_key(tmp_path: Path) -> None:
    model = custom_code_model(tmp_path / "m")
    rc, checks, err = _deep(_plan(tmp_path, model))
    failed = [c for c in checks.values() if not c["ok"]]  # the config check, before anything is built
    assert rc == 1 and failed, checks
    assert any(
        "plan.toml: target.model: " in c["detail"] and "target.trust_remote_code" in c["detail"]
        for c in failed
    ), failed
    assert "Traceback" not in err and not (model / "CUSTOM_CODE_RAN").exists()


# ----------------------------------------------------------------------- Kimi's tokenizer format (tiktoken)
def test_the_committed_fixture_is_what_the_generator_writes(tmp_path: Path) -> None:
    write_tiktoken_fixture(tmp_path)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / f).read_text() == (TIKTOKEN_DIR / f).read_text(), f


def test_kimi_tiktoken_tokenizer_loads_with_kimis_special_ids(tmp_path: Path) -> None:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    from pipeline.data.tokenise import load_chat_tokenizer

    folder = build_tiktoken_kimi(tmp_path / "kimi")
    ranks = load_tiktoken_bpe(str(folder / "tiktoken.model"))
    ct = load_chat_tokenizer(str(folder), 256)
    tok = ct.tokenizer
    # Every named special token where Kimi's own class puts it: its offset after the mergeable ranks.
    for i, name in tiktoken_special_tokens(len(ranks)).items():
        assert tok.convert_tokens_to_ids(name) == i, name
    assert len(KIMI_SPECIAL_IDS) == 23
    # Plain text encodes as tiktoken itself encodes it with these ranks.
    enc = tiktoken.Encoding(name="kimi-fixture", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={})
    text = "What is two plus two? The answer is four."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    ours = tok.encode("question", add_special_tokens=False)
    assert ours == enc.encode("question") and len(ours) < len("question")  # merges applied, not bytes
    # Kimi-K2.5's chat template renders through it, the assistant's answer in the loss mask.
    conv = [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "six"},
    ]
    e = ct.encode([conv])[0]
    assert not isinstance(e, Exception), e
    ids = [int(i) for i in e.input_ids]
    for name in ("<|im_user|>", "<|im_middle|>", "<|im_assistant|>", "<|im_end|>"):
        assert tok.convert_tokens_to_ids(name) in ids, name
    trained = tok.decode([i for i, m in zip(ids, e.loss_mask, strict=True) if m])
    assert "six" in trained and "three" not in trained


def test_without_tiktoken_the_error_names_the_file_and_the_package(tmp_path: Path) -> None:
    folder = build_tiktoken_kimi(tmp_path / "kimi")
    p = run_code(
        f"""
        import sys
        sys.modules["tiktoken"] = None  # as if it were not installed: importing it raises ImportError
        from pipeline.data.model_assets import ModelAssetError
        from pipeline.data.tokenise import load_chat_tokenizer
        try:
            load_chat_tokenizer({str(folder)!r}, 256)
        except ModelAssetError as exc:
            print("ERROR", exc)
        """
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("ERROR target.model: "), p.stdout + p.stderr[-2000:]
    assert "tiktoken.model" in p.stdout and "`tiktoken` package" in p.stdout and "pipeline" in p.stdout


@pytest.mark.slow
def test_deep_check_renders_the_chat_template_through_the_tiktoken_tokenizer(tmp_path: Path) -> None:
    folder = build_tiktoken_kimi(tmp_path / "kimi")
    # aux layers named: the default for a 6-layer model is [1, 2, 2] (a deep-check traceback, not this test's)
    rc, checks, err = _deep(_plan(tmp_path, folder, "[extract]\naux_layers = [1, 2, 4]\n"))
    assert checks["architecture"]["ok"], checks["architecture"]
    tmpl = checks["chat template"]
    assert tmpl["ok"], tmpl
    tok = checks["tokenizer"]  # which tokenizer the run uses and how it cuts text
    assert tok["ok"] and not tok["warning"], tok
    assert (
        "tiktoken.model" in tok["detail"]
        and "tokenization_kimi.py: TikTokenTokenizer.pat_str" in tok["detail"]
    )
    assert "Traceback" not in err and not (folder / "CODE_RAN").exists()
