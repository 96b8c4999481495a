"""A draft export's provenance, and the deploy-time guard that reads it.

A draft is trained on one target's hidden states at its aux layers, with one tokenizer's ids: served against
another target (or the same target with another tokenizer) it loads without an error and accepts almost
nothing — a known failure in the field (a draft with default aux layers served against another target:
acceptance near 1 %). So the train stage writes ``aerie_provenance.json`` into the export (``draft/``, beside
SGLang's ``config.json`` and weights; SGLang ignores it), and the serve stage (``--mode eagle3``) and
``aerie plan check --deep`` compare it with the target about to be served:

* **target fingerprint**: sha256 of the target's ``config.json`` as JSON (key order and whitespace do not
  count, nor bookkeeping, dtype and quantization: the same network served in FP8 or INT4 passes), and its
  architecture, layer count, hidden size, vocabulary, for the message. It is the config's, not the weights':
  a fine-tune of the same architecture is not told apart (hashing ~600 GB of weights at every deploy is not
  done);
* **tokenizer fingerprint**: sha256 over the tokenizer files present (``tokenizer.json``,
  ``tokenizer_config.json``, ``tiktoken.model``, …) and, for a tiktoken checkpoint, the split pattern Aerie
  uses (:mod:`pipeline.data.split_pattern`);
* the aux layer ids, the draft vocabulary mapping's sha256, the hashes of the extraction's and the vocabulary's
  manifests and the data sources, the recipe (the ``[train]`` settings), and the accept length measured on
  held-out rows when training measured one.

A mismatch of either fingerprint refuses, naming both fingerprints and both files. An export without
provenance (written before this) is a warning, not a refusal; so is a target whose files are not on this
machine (nothing to compare with).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "aerie_provenance.json"
# 2: the chat template is its own fingerprint (wherever it lives), out of the tokenizer's; the target's canonical
# config is kept, so a refusal names the fields that differ. A format-1 export is compared the way it was written.
FORMAT = 2
CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)


def local_model_dir(model: str) -> Path | None:
    """The folder holding the target's files: a local path, a built-in model, or the local HF cache."""
    from pipeline.data import model_assets

    if model.startswith(model_assets.BUILTIN_PREFIX):
        return Path(model_assets.resolve(model))
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001 - an odd cache means "not found", reported by the caller
        hit = None
    return Path(hit).parent if isinstance(hit, str) else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# Config keys that do not change what a draft learnt from the target: bookkeeping, and the precision or
# quantization the same network is stored or served in (a bf16-trained draft serves an FP8/INT4 target).
IGNORED_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "torch_dtype",
        "dtype",
        "quantization_config",
        "use_cache",
    }
)


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items() if k not in IGNORED_CONFIG_KEYS}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


SHAPE_FIELDS = ("architecture", "num_hidden_layers", "hidden_size", "vocab_size")


def target_fingerprint(folder: Path) -> dict[str, Any]:
    """The target's config as a fingerprint: sha256 of its ``config.json`` as canonical JSON (sorted keys, without
    :data:`IGNORED_CONFIG_KEYS`, nested configs too), its shape for the messages, and the canonical config itself
    (so a refusal can name the fields that differ)."""
    cfile = folder / "config.json"
    cfg = json.loads(cfile.read_text())
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    canonical = _canonical(cfg)
    canon = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return {
        "config_file": str(cfile),
        "config_sha256": hashlib.sha256(canon.encode()).hexdigest(),
        "architecture": (cfg.get("architectures") or [cfg.get("model_type")])[0],
        "num_hidden_layers": text.get("num_hidden_layers"),
        "hidden_size": text.get("hidden_size"),
        "vocab_size": text.get("vocab_size"),
        "config": canonical,
    }


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def differing_fields(trained: dict[str, Any], served: dict[str, Any], most: int = 6) -> list[str]:
    """``"num_hidden_layers: 4 -> 5"`` for each config field that differs (the recorded canonical configs; for an
    export that kept only the shape, its shape fields)."""
    if isinstance(trained.get("config"), dict) and isinstance(served.get("config"), dict):
        a, b = _flat(trained["config"]), _flat(served["config"])
    else:
        a = {k: trained.get(k) for k in SHAPE_FIELDS}
        b = {k: served.get(k) for k in SHAPE_FIELDS}
    keys = sorted(k for k in set(a) | set(b) if a.get(k, "(absent)") != b.get(k, "(absent)"))
    out = [f"{k}: {a.get(k, '(absent)')} -> {b.get(k, '(absent)')}" for k in keys[:most]]
    return out + ([f"{len(keys) - most} more"] if len(keys) > most else [])


def chat_template_fingerprint(folder: Path) -> dict[str, Any]:
    """The chat template wherever the checkpoint keeps it (``chat_template.jinja``, else ``tokenizer_config.json``'s
    ``chat_template``), under one name: moving it between the two does not change it, editing it in either does."""
    text: str | None = None
    source = None
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        text, source = jinja.read_text(), CHAT_TEMPLATE_FILE
    else:
        tc = _tokenizer_config(folder)
        if tc.get("chat_template") is not None:
            t = tc["chat_template"]
            text = t if isinstance(t, str) else json.dumps(t, sort_keys=True)
            source = "tokenizer_config.json: chat_template"
    return {
        "sha256": hashlib.sha256(text.encode()).hexdigest() if text is not None else None,
        "source": source,
    }


def _tokenizer_config(folder: Path) -> dict[str, Any]:
    try:
        doc = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def tokenizer_fingerprint(folder: Path, fmt: int = FORMAT) -> dict[str, Any]:
    """sha256 over the tokenizer files present (name and content) and a tiktoken checkpoint's split pattern.
    From format 2 ``tokenizer_config.json`` counts without its ``chat_template`` (the template is compared on its
    own, :func:`chat_template_fingerprint`); ``fmt=1`` hashes it whole, as a format-1 export recorded it."""
    from pipeline.data import split_pattern

    h = hashlib.sha256()
    files = []
    for name in TOKENIZER_FILES:
        f = folder / name
        if f.is_file():
            files.append(name)
            if name == "tokenizer_config.json" and fmt >= 2:
                rest = {k: v for k, v in _tokenizer_config(folder).items() if k != "chat_template"}
                digest = hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()
            else:
                digest = sha256_file(f)
            h.update(f"{name}\0{digest}\n".encode())
    pat = split_pattern.read(folder)
    if pat is not None:
        h.update(f"split_pattern\0{pat.regex}\n".encode())
    return {
        "dir": str(folder),
        "sha256": h.hexdigest() if files else None,
        "files": files,
        "split_pattern": pat.source if pat else None,
    }


def write(
    draft_dir: Path,
    *,
    model: str,
    aux_layer_ids: list[int],
    vocab_dir: Path | None,
    manifests: dict[str, Path],
    sources: list[Any],
    recipe: dict[str, Any],
    accept_length: dict[str, Any],
) -> dict[str, Any]:
    """``draft_dir/aerie_provenance.json`` for a draft trained on ``model`` (the train stage's export)."""
    from pipeline.eagle3 import draft_vocab

    folder = local_model_dir(model)
    vocab_file = vocab_dir / draft_vocab.VOCAB_FILE if vocab_dir is not None else None
    doc = {
        "format": FORMAT,
        "target": {"model": model, **(target_fingerprint(folder) if folder else {})},
        "tokenizer": tokenizer_fingerprint(folder) if folder else None,
        "chat_template": chat_template_fingerprint(folder) if folder else None,
        "aux_layer_ids": list(aux_layer_ids),
        "draft_vocab": {
            "file": str(vocab_file) if vocab_file else None,
            "mapping_sha256": sha256_file(vocab_file) if vocab_file and vocab_file.is_file() else None,
        },
        "data": {
            "manifests": {
                k: {"file": str(p), "sha256": sha256_file(p)} for k, p in manifests.items() if p.is_file()
            },
            "sources": sources,
        },
        "recipe": recipe,
        "accept_length": accept_length,
    }
    (draft_dir / PROVENANCE_FILE).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def read(draft_dir: Path) -> dict[str, Any] | None:
    """What the export says of itself, or ``None`` for an export without provenance (older Aerie, or not ours)."""
    path = draft_dir / PROVENANCE_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(f"{path}: malformed: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: malformed: a JSON {type(doc).__name__}, not the provenance object")
    return doc


@dataclass(frozen=True)
class Verdict:
    """The guard's answer: ``level`` ok, warn or refuse, and what to tell the operator."""

    level: str
    detail: str

    @property
    def ok(self) -> bool:
        return self.level != "refuse"


def _short(h: str | None) -> str:
    return (h or "unknown")[:12]


def format_of(doc: dict[str, Any]) -> int:
    """The provenance format an export was written in (1 where it does not say)."""
    fmt = doc.get("format")
    return fmt if isinstance(fmt, int) else 1


def _config_problem(trained: dict[str, Any], served: dict[str, Any]) -> str | None:
    if not trained.get("config_sha256") or trained["config_sha256"] == served["config_sha256"]:
        return None
    return (
        f"target config differs ({'; '.join(differing_fields(trained, served))}): trained against sha256 "
        f"{_short(trained['config_sha256'])} ({trained.get('config_file')}: {trained.get('architecture')}, "
        f"{trained.get('num_hidden_layers')} layers, hidden {trained.get('hidden_size')}), served "
        f"{_short(served['config_sha256'])} ({served['config_file']}: {served['architecture']}, "
        f"{served['num_hidden_layers']} layers, hidden {served['hidden_size']})"
    )


def _tokenizer_problems(doc: dict[str, Any], folder: Path) -> list[str]:
    """The tokenizer and (from format 2) the chat template, each against what the export recorded."""
    fmt = format_of(doc)
    out = []
    tok_trained = doc.get("tokenizer") or {}
    tok_served = tokenizer_fingerprint(folder, fmt)
    if tok_trained.get("sha256") and tok_trained["sha256"] != tok_served["sha256"]:
        out.append(
            f"tokenizer differs: trained with sha256 {_short(tok_trained['sha256'])} ({tok_trained.get('dir')}: "
            f"{', '.join(tok_trained.get('files') or [])}), served {_short(tok_served['sha256'])} "
            f"({tok_served['dir']}: {', '.join(tok_served['files'])})"
        )
    ct_trained = doc.get("chat_template") or {}
    if fmt >= 2 and isinstance(ct_trained, dict):
        ct_served = chat_template_fingerprint(folder)
        if ct_trained.get("sha256") != ct_served["sha256"]:
            out.append(
                f"chat template differs: trained with sha256 {_short(ct_trained.get('sha256'))} "
                f"({ct_trained.get('source') or 'none'}), served {_short(ct_served['sha256'])} "
                f"({ct_served['source'] or 'none'} in {folder})"
            )
    return out


def check(draft_dir: str | Path, served_model: str) -> Verdict:
    """Whether the draft at ``draft_dir`` was trained for ``served_model`` (the target about to be served).
    A refusal names both fingerprints and what differs (config fields, tokenizer, chat template), each in full."""
    draft_dir = Path(draft_dir)
    pfile = draft_dir / PROVENANCE_FILE
    if not draft_dir.is_dir():
        return Verdict("warn", f"{draft_dir}: no draft folder here to check (SGLang will look for it)")
    try:
        doc = read(draft_dir)
    except ValueError as exc:
        return Verdict(
            "refuse", f"{exc}: rewrite it by re-exporting the draft, or remove it to serve unchecked"
        )
    if doc is None:
        return Verdict(
            "warn",
            f"{pfile}: missing (an export written before Aerie recorded provenance): nothing says which target "
            f"and tokenizer it was trained for; serving it against {served_model} unchecked",
        )
    folder = local_model_dir(served_model)
    if folder is None or not (folder / "config.json").is_file():
        return Verdict(
            "warn",
            f"{served_model}: not on this machine (no config.json in a folder or the HF cache): the draft's "
            f"provenance ({pfile}) cannot be compared with it",
        )
    trained = doc.get("target") or {}
    served = target_fingerprint(folder)
    problems = [x for x in [_config_problem(trained, served), *_tokenizer_problems(doc, folder)] if x]
    if problems:
        return Verdict(
            "refuse",
            f"{pfile}: this draft was not trained for {served_model}: "
            + "; ".join(problems)
            + ". A draft served against another target or tokenizer loads and accepts almost nothing: serve the "
            "target it was trained for, or train a draft for this one",
        )
    if not trained.get("config_sha256"):
        return Verdict(
            "warn", f"{pfile}: records no target fingerprint (its target was not on disk when trained)"
        )
    acc = (doc.get("accept_length") or {}).get("held_out")
    tok = tokenizer_fingerprint(folder, format_of(doc))
    return Verdict(
        "ok",
        f"{pfile}: trained for this target (config {_short(served['config_sha256'])}, tokenizer "
        f"{_short(tok['sha256'])}), aux layers {doc.get('aux_layer_ids')}"
        + (f", accept length {acc:.2f} on held-out rows" if isinstance(acc, int | float) else ""),
    )
