"""The draft export's provenance and the deploy-time guard (pipeline/eagle3/provenance.py): a real training
run on the tiny random-weight Llama writes it; the serve stage and the deep check refuse the draft against a
target or tokenizer it was not trained for, naming both fingerprints and files; an export from before
provenance is served with a warning."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.eagle3 import chain_check, draft_vocab, provenance
from pipeline.run.plan import dag as plan_mod
from pipeline.run.rundir.events import read_all
from tests.eagle3_fixtures import ROOT, TEST_SECTIONS, shared
from tests.tiny_llama import tiny_llama


def other_target(tmp: Path, edit: str) -> Path:
    """A copy of the tiny Llama (weights linked) with its config or its tokenizer changed."""
    src = Path(tiny_llama())
    dst = tmp / f"other-{edit}"
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "model.safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    if edit == "config":  # another target of the same family: one layer more
        cfg = json.loads((dst / "config.json").read_text())
        cfg["num_hidden_layers"] += 1
        (dst / "config.json").write_text(json.dumps(cfg))
    else:  # the same weights served with another tokenizer: one token added
        tok = json.loads((dst / "tokenizer.json").read_text())
        tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 99999, "content": "<|extra|>"})
        (dst / "tokenizer.json").write_text(json.dumps(tok))
    return dst


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared(tmp_path_factory, "train") / "draft"


def test_the_export_says_what_it_was_trained_for(
    draft: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    doc = json.loads((draft / provenance.PROVENANCE_FILE).read_text())
    target = Path(tiny_llama())
    man = json.loads((draft.parent / "manifest.json").read_text())
    assert man["provenance"] == f"draft/{provenance.PROVENANCE_FILE}"
    assert doc["target"]["config_sha256"] == provenance.target_fingerprint(target)["config_sha256"]
    assert doc["target"]["model"] == str(target) and doc["target"]["num_hidden_layers"] > 0
    tok = provenance.tokenizer_fingerprint(target)
    assert doc["tokenizer"]["sha256"] == tok["sha256"] and "tokenizer.json" in doc["tokenizer"]["files"]
    assert doc["aux_layer_ids"] == man["aux_layer_ids"]
    voc = shared(tmp_path_factory, "voc")
    assert doc["draft_vocab"]["mapping_sha256"] == provenance.sha256_file(voc / draft_vocab.VOCAB_FILE)
    ext = shared(tmp_path_factory, "ext")
    assert doc["data"]["manifests"]["extract"]["sha256"] == provenance.sha256_file(ext / "manifest.json")
    assert doc["data"]["manifests"]["vocab"]["sha256"] == provenance.sha256_file(voc / "manifest.json")
    assert (
        doc["recipe"]["train"]["steps"] == TEST_SECTIONS["train"]["steps"]
        and doc["recipe"]["draft"] == "eagle3"
    )
    assert doc["accept_length"]["held_out"] == man["accept_length"]


def test_the_guard_passes_the_target_it_was_trained_for(draft: Path) -> None:
    v = provenance.check(draft, tiny_llama())
    assert v.level == "ok" and "trained for this target" in v.detail


@pytest.mark.parametrize("edit", ["config", "tokenizer"])
def test_the_guard_refuses_another_target_or_tokenizer_naming_both(
    draft: Path, tmp_path: Path, edit: str
) -> None:
    other = other_target(tmp_path, edit)
    v = provenance.check(draft, str(other))
    assert v.level == "refuse" and not v.ok
    doc = provenance.read(draft)
    assert doc is not None
    served_cfg = provenance.target_fingerprint(other)
    served_tok = provenance.tokenizer_fingerprint(other)
    assert str(draft / provenance.PROVENANCE_FILE) in v.detail and f"not trained for {other}" in v.detail
    if edit == "config":
        assert (
            doc["target"]["config_sha256"][:12] in v.detail and served_cfg["config_sha256"][:12] in v.detail
        )
        assert doc["target"]["config_file"] in v.detail and str(other / "config.json") in v.detail
        assert "tokenizer differs" not in v.detail and "num_hidden_layers: " in v.detail
    else:
        assert doc["tokenizer"]["sha256"][:12] in v.detail and served_tok["sha256"][:12] in v.detail
        assert (
            doc["tokenizer"]["dir"] in v.detail and str(other) in v.detail and "target config" not in v.detail
        )


def test_the_same_network_in_another_precision_or_quantization_passes(draft: Path, tmp_path: Path) -> None:
    """A bf16-trained draft serves the FP8/INT4 checkpoint of its target: dtype, quantization and bookkeeping
    keys are not part of the fingerprint (a fine-tune of the same architecture is not told apart either)."""
    same = other_target(tmp_path, "tokenizer")
    shutil.copy(
        Path(tiny_llama()) / "tokenizer.json", same / "tokenizer.json"
    )  # back to the trained tokenizer
    cfg = json.loads((same / "config.json").read_text())
    cfg.update(
        transformers_version="9.9.9",
        torch_dtype="float8_e4m3fn",
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    )
    (same / "config.json").write_text(json.dumps(cfg, indent=4))
    assert provenance.check(draft, str(same)).level == "ok"


def test_an_export_without_provenance_is_served_with_a_warning(draft: Path, tmp_path: Path) -> None:
    old = tmp_path / "old-draft"
    shutil.copytree(draft, old)
    (old / provenance.PROVENANCE_FILE).unlink()
    v = provenance.check(old, str(other_target(tmp_path, "config")))
    assert v.level == "warn" and v.ok and "missing" in v.detail and "unchecked" in v.detail


def _plan(tmp: Path, served: Path, draft: Path) -> Path:
    p = tmp / "plan.toml"
    p.write_text(
        f'[run]\nname = "g"\ndir = "{tmp / "run"}"\n[target]\nmodel = "{tiny_llama()}"\nmax_length = 256\n'
        f'[serve]\nmodel = "{served}"\n[deploy]\ndraft_model_path = "{draft}"\n'
        '[[stage]]\nid = "serve"\nrun = "serve"\nservice = true\n'
    )
    return p


def test_the_serve_stage_refuses_before_starting_a_server(draft: Path, tmp_path: Path) -> None:
    other = other_target(tmp_path, "config")
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.stages.serve", "--plan", str(_plan(tmp_path, other, draft))]
        + ["--out", str(out), "--stage", "serve", "--mode", "eagle3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    evs = read_all(out / "events.jsonl")
    errors = [e.get("text") for e in evs if e.type == "message" and e.get("level") == "error"]
    assert len(errors) == 1 and f"not trained for {other}" in errors[0] and "target config" in errors[0]
    assert [e.get("state") for e in evs if e.type == "health"] == ["unhealthy"]
    assert "sglang.launch_server" not in p.stderr  # nothing was launched


def test_the_deep_check_refuses_a_deploy_draft_for_another_target(draft: Path, tmp_path: Path) -> None:
    other = other_target(tmp_path, "tokenizer")
    plan = plan_mod.load(_plan(tmp_path, other, draft))
    line = next(c for c in chain_check.check(plan, free_bytes=10**12).checks if c.name == "draft provenance")
    assert not line.ok and line.detail.startswith(f"{plan.path}: deploy.draft_model_path: ")
    assert "tokenizer differs" in line.detail
    plan = plan_mod.load(_plan(tmp_path, Path(tiny_llama()), draft))
    line = next(c for c in chain_check.check(plan, free_bytes=10**12).checks if c.name == "draft provenance")
    assert line.ok and not line.warning


def _served_copy(tmp: Path, name: str) -> Path:
    dst = tmp / name
    shutil.copytree(Path(tiny_llama()), dst, symlinks=True)
    return dst


def test_a_refusal_names_the_config_field_that_differs_with_both_fingerprints(
    draft: Path, tmp_path: Path
) -> None:
    other = other_target(tmp_path, "config")
    v = provenance.check(draft, str(other))
    layers = provenance.target_fingerprint(other)["num_hidden_layers"]
    assert f"target config differs (num_hidden_layers: {layers - 1} -> {layers})" in v.detail
    assert "tokenizer differs" not in v.detail and "chat template" not in v.detail


def test_the_chat_template_is_compared_wherever_it_lives_under_one_name(draft: Path, tmp_path: Path) -> None:
    """Edited in chat_template.jinja or in tokenizer_config.json: the same refusal, "chat template differs"; the
    same template moved from one to the other passes."""
    trained = (Path(tiny_llama()) / provenance.CHAT_TEMPLATE_FILE).read_text()
    moved = _served_copy(tmp_path, "moved")
    (moved / provenance.CHAT_TEMPLATE_FILE).unlink()
    tc = json.loads((moved / "tokenizer_config.json").read_text())
    (moved / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": trained}))
    assert provenance.check(draft, str(moved)).level == "ok"
    in_config = _served_copy(tmp_path, "in-config")
    (in_config / provenance.CHAT_TEMPLATE_FILE).unlink()
    edited = trained.replace("<|im_start|>", "<|im_start|> ", 1)
    assert edited != trained
    (in_config / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": edited}))
    in_jinja = _served_copy(tmp_path, "in-jinja")
    (in_jinja / provenance.CHAT_TEMPLATE_FILE).write_text(edited)
    for served, where in (
        (in_config, "tokenizer_config.json: chat_template"),
        (in_jinja, "chat_template.jinja"),
    ):
        v = provenance.check(draft, str(served))
        assert v.level == "refuse", v.detail
        assert "chat template differs" in v.detail and f"({where} in {served})" in v.detail
        assert "tokenizer differs" not in v.detail and "target config" not in v.detail


@pytest.mark.parametrize("text", ["[]", "{not json", '"a string"'])
def test_a_malformed_provenance_file_is_malformed_not_missing(draft: Path, tmp_path: Path, text: str) -> None:
    bad = tmp_path / "bad-draft"
    shutil.copytree(draft, bad)
    (bad / provenance.PROVENANCE_FILE).write_text(text)
    v = provenance.check(bad, tiny_llama())
    assert v.level == "refuse" and "malformed" in v.detail and "missing" not in v.detail
    assert str(bad / provenance.PROVENANCE_FILE) in v.detail


def test_aerie_status_shows_the_whole_refusal(draft: Path, tmp_path: Path) -> None:
    """The line status shows for a failed stage is the whole refusal: both fingerprints and the served model's
    details, not cut before them."""
    from pipeline.run.rundir.logscan import last_error_line

    other = other_target(tmp_path, "config")
    v = provenance.check(draft, str(other))
    line = last_error_line(f"===== aerie: attempt 1\nerror: {v.detail}\n")
    assert line == f"error: {v.detail}"
    served = provenance.target_fingerprint(other)
    assert served["config_sha256"][:12] in line and f"{served['config_file']}: " in line
    assert f"{served['num_hidden_layers']} layers, hidden {served['hidden_size']}" in line
