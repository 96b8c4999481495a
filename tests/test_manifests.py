"""The stages' manifests (pipeline/manifests/): each kind round-trips through its file with the same keys,
a damaged file names the file and the field, a file without a version (written before versions existed)
reads as version 1, a newer version is refused, and keys a class does not name survive a rewrite."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pipeline.manifests import bench, hidden_store, shards, train, vocab
from pipeline.manifests.base import VERSION_KEY, ManifestError

# One document per kind, with the keys its stage writes today (docs/data-formats.md).
DOCS: dict[str, tuple[ModuleType, dict[str, Any]]] = {
    "tokenized": (
        shards,
        {
            "kind": "tokenized",
            "dataset": "toy",
            "source": "local",
            "quota": 3,
            "rows": 3,
            "tokens": 30,
            "rows_read": 4,
            "rejects": 1,
            "duplicates": 0,
            "dropped": 0,
            "tokenizer": "builtin:smollm2-135m-instruct",
            "template_hash": "872be49dbb638044",
            "max_length": 512,
            "shards": [{"file": "data-00000.parquet", "rows": 3, "tokens": 30, "sha256": "ab" * 32}],
            "fingerprint": {"format_version": 1, "dataset": "toy"},
        },
    ),
    "prompts": (
        shards,
        {
            "kind": "prompts",
            "dataset": "chat",
            "rows": 2,
            "shards": [{"file": "data-00000.parquet", "rows": 2, "sha256": "cd" * 32}],
            "fingerprint": {"format_version": 1},
        },
    ),
    "hidden_states": (
        hidden_store,
        {
            "kind": "hidden_states",
            "format": 1,
            "mode": "offline",
            "target": "builtin:tiny",
            "hidden_size": 64,
            "num_layers": 4,
            "aux_layer_ids": [1, 2, 3],
            "sglang_layers_to_capture": [2, 3, 4],
            "target_architecture": "LlamaForCausalLM",
            "dtype": "bfloat16",
            "sources": ["/runs/r/stages/prep.a/out"],
            "holdout": 0.05,
            "max_length": None,
            "rows": 10,
            "tokens": 100,
            "eval_rows": 1,
            "eval_tokens": 9,
            "bytes": 5000,
            "shards": [{"file": "hs-00000.safetensors", "rows": 10, "tokens": 100, "bytes": 4500}],
            "eval_shards": [{"file": "eval-00000.safetensors", "rows": 1, "tokens": 9, "bytes": 500}],
        },
    ),
    "vocab": (
        vocab,
        {
            "kind": "vocab",
            "file": "vocab.safetensors",
            "draft_vocab_size": 32,
            "target_vocab_size": 100,
            "coverage": 0.9,
            "rows": 10,
            "tokens": 100,
            "distinct_tokens": 40,
            "target": "builtin:tiny",
        },
    ),
    "draft": (
        train,
        {
            "kind": "draft",
            "path": "draft",
            "step": 12,
            "last_step": 24,
            "stopped_early": None,
            "chosen_by": "last step",
            "accept_length": None,
            "eval_spec_steps": None,
            "target": "builtin:tiny",
            "aux_layer_ids": [1, 2, 3],
            "steps_log": "steps.jsonl",
            "draft_vocab_size": 32,
            "draft": "dflash",
            "ttt_steps": 3,
            "block_size": 4,  # the method's own keys
            "loss": "dflash",
            "fc_norm": False,
            "norm_output": False,
            "mode": "offline",
            "token_sources": ["/runs/r/stages/prep.a/out"],
            "holdout": 0.05,
            "max_length": 256,
            "world_size": 1,
            "provenance": "draft/provenance.json",
        },
    ),
    "bench": (
        bench,
        {
            "kind": "bench",
            "mode": "offline",
            "accept_len": 2.5,
            "accept_rate": 0.5,
            "max_accept_len": 4,
            "steps": 3,
            "prompts": 2,
            "verify_steps": 8,
            "new_tokens": 20,
            "accepted_histogram": [2, 2, 2, 2],
            "elapsed_s": 1.5,
            "draft": "/runs/r/stages/train/out/draft",
            "draft_kind": "eagle3",
            "lossless_checked": True,
            "lossless_mismatches": 0,
        },
    ),
}


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("kind", sorted(DOCS))
def test_each_kind_round_trips_with_the_same_keys(tmp_path: Path, kind: str) -> None:
    mod, doc = DOCS[kind]
    man = mod.read(write(tmp_path / "in" / "manifest.json", doc))
    out = tmp_path / "out" / "manifest.json"
    mod.write(out, man)
    again = json.loads(out.read_text())
    assert again == {**doc, VERSION_KEY: mod.VERSION}  # the same keys as before, plus the version
    assert mod.read(out) == man


def test_attributes_are_typed_and_the_method_keys_stay_opaque(tmp_path: Path) -> None:
    man = train.read(write(tmp_path / "manifest.json", DOCS["draft"][1]))
    assert man.aux_layer_ids == (1, 2, 3) and man.method_name == "dflash"
    assert man.method == {"block_size": 4, "loss": "dflash"}
    assert man.draft_path(tmp_path) == tmp_path / "draft"
    ext = hidden_store.read(write(tmp_path / "ext" / "manifest.json", DOCS["hidden_states"][1]))
    assert [s.file for s in ext.shards_of("eval")] == ["eval-00000.safetensors"] and ext.holdout == 0.05


@pytest.mark.parametrize(
    ("kind", "damage", "field", "says"),
    [
        ("tokenized", lambda d: d.pop("shards"), "shards", "missing"),
        ("tokenized", lambda d: d.pop("tokens"), "tokens", "missing"),
        ("tokenized", lambda d: d.update(tokens="lots"), "tokens", "expected an integer"),
        ("tokenized", lambda d: d["shards"][0].pop("file"), r"shards\[0\]\.file", "missing"),
        ("prompts", lambda d: d.update(rows=True), "rows", "expected an integer"),
        ("hidden_states", lambda d: d.update(mode="sideways"), "mode", "expected one of offline, online"),
        ("hidden_states", lambda d: d.update(aux_layer_ids=[1, "2"]), r"aux_layer_ids\[1\]", "integer"),
        ("vocab", lambda d: d.pop("draft_vocab_size"), "draft_vocab_size", "missing"),
        ("draft", lambda d: d.pop("aux_layer_ids"), "aux_layer_ids", "missing"),
        ("draft", lambda d: d.update(holdout="half"), "holdout", "expected a number"),
        ("bench", lambda d: d.update(kind="draft"), "kind", "expected 'bench'"),
        ("bench", lambda d: d.pop("kind"), "kind", "missing"),
    ],
)
def test_a_damaged_manifest_names_the_file_and_the_field(
    tmp_path: Path, kind: str, damage: Any, field: str, says: str
) -> None:
    mod, doc = DOCS[kind]
    doc = json.loads(json.dumps(doc))
    damage(doc)
    path = write(tmp_path / "stage" / "out" / "manifest.json", doc)
    with pytest.raises(ManifestError, match=rf"^{path}: {field}: .*{says}") as err:
        mod.read(path)
    assert err.value.file == str(path)


def test_a_file_that_is_not_a_manifest_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "manifest.json"
    bad.write_text("{not json")
    with pytest.raises(ManifestError, match=rf"^{bad}: not valid JSON"):
        vocab.read(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ManifestError, match=rf"^{bad}: expected a JSON object, got list"):
        vocab.read(bad)
    with pytest.raises(ManifestError, match=r"missing \(has the extract stage finished\?\)"):
        hidden_store.read(tmp_path / "none" / "manifest.json")


@pytest.mark.parametrize("kind", sorted(DOCS))
def test_a_manifest_without_a_version_reads_as_version_1(tmp_path: Path, kind: str) -> None:
    mod, doc = DOCS[kind]
    assert VERSION_KEY not in doc  # as every run directory before versions existed holds them
    old = mod.read(write(tmp_path / "manifest.json", doc))
    assert mod.read(write(tmp_path / "v1" / "manifest.json", {**doc, VERSION_KEY: 1})) == old


@pytest.mark.parametrize("kind", sorted(DOCS))
def test_a_manifest_of_a_newer_version_is_refused(tmp_path: Path, kind: str) -> None:
    mod, doc = DOCS[kind]
    path = write(tmp_path / "manifest.json", {**doc, VERSION_KEY: mod.VERSION + 1})
    with pytest.raises(
        ManifestError, match=rf"^{path}: {VERSION_KEY}: version {mod.VERSION + 1} .* newer Aerie"
    ):
        mod.read(path)
    path = write(tmp_path / "manifest.json", {**doc, VERSION_KEY: "1"})
    with pytest.raises(ManifestError, match=rf"^{path}: {VERSION_KEY}: expected a positive integer"):
        mod.read(path)


def test_keys_a_class_does_not_name_survive_a_rewrite(tmp_path: Path) -> None:
    """A newer writer's keys (or a hand-made manifest's) are kept, not dropped, when older code rewrites it."""
    doc = {**DOCS["tokenized"][1], "future_key": {"a": 1}}
    doc["shards"] = [{**doc["shards"][0], "num_tokens": 30, "codec": "zstd"}]
    man = shards.read(write(tmp_path / "in.json", doc))
    assert man.extra == {"future_key": {"a": 1}} and man.shards[0].extra == {
        "num_tokens": 30,
        "codec": "zstd",
    }
    shards.write(tmp_path / "out.json", man)
    assert json.loads((tmp_path / "out.json").read_text()) == {**doc, VERSION_KEY: shards.VERSION}


def test_a_hand_made_tokenized_manifest_meets_the_input_contract(tmp_path: Path) -> None:
    """What bench/gpu and test fixtures write by hand (no fingerprint, no counts) is enough to read."""
    doc = {"kind": "tokenized", "tokens": 7, "shards": [{"file": "rows-00000.parquet", "num_tokens": 7}]}
    man = shards.read(write(tmp_path / "manifest.json", doc))
    assert man.fingerprint is None and man.rows is None and man.shards[0].token_count == 7
    shards.write(tmp_path / "again.json", man)
    assert json.loads((tmp_path / "again.json").read_text()) == {**doc, VERSION_KEY: 1}  # no null keys added
