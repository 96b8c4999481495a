"""A tiktoken checkpoint's own split pattern, read from its files, put into the tokenizer transformers built.

Kimi-K2/K2.5 ship their tokenizer as ``tiktoken.model`` (BPE ranks) and ``tokenization_kimi.py`` (the class
``tokenizer_config.json``'s ``auto_map`` names), whose ``pat_str`` is the regular expression that cuts text
into pieces before BPE: Han runs apart from other letters, CamelCase split, contractions kept on the word.
transformers, reading the folder without running that code (``trust_remote_code = false``, Aerie's default),
converts the ranks with its *generic* pattern (cl100k's) instead. Where the two cut a text differently and the
vocabulary has a token across the difference, the ids differ from those of a server running Kimi's own
tokenizer, and the draft would be trained on ids it is never served.

:func:`apply` puts the checkpoint's own pattern into the converted tokenizer's pre-tokenizer, so Aerie cuts
text as the checkpoint's class does. The pattern is **read, never executed**: a ``pat_str`` field of
``tokenizer_config.json`` when there is one, else the ``pat_str`` assignment of the ``auto_map`` class (or
module) in its ``.py`` file, parsed with :mod:`ast` and evaluated only when it is a string literal, a
concatenation of literals, or ``"sep".join([literals])``. A tiktoken checkpoint without a readable pattern
keeps transformers' generic one, with a loud warning (stderr, and :class:`Pattern`'s ``source`` says so for
the deep check).
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIKTOKEN_FILE = "tiktoken.model"
# transformers' TikTokenConverter default (cl100k's), what a converted tiktoken.model splits with otherwise.
GENERIC = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class Pattern:
    """The split pattern a tokenizer uses, and where it came from (for the deep check and provenance)."""

    regex: str
    source: str  # e.g. "tokenization_kimi.py: TikTokenTokenizer.pat_str", or why the generic one is used
    own: bool  # the checkpoint's own pattern (else transformers' generic one)


def literal(node: ast.expr) -> str | None:
    """The string a ``pat_str`` expression builds, when it is built from literals only; else ``None``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = literal(node.left), literal(node.right)
        return a + b if a is not None and b is not None else None
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "join"
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], ast.List | ast.Tuple)
    ):
        sep = literal(node.func.value)
        parts = [literal(e) for e in node.args[0].elts]
        if sep is not None and all(p is not None for p in parts):
            return sep.join(p for p in parts if p is not None)
    return None


def _assigned(body: list[ast.stmt], name: str) -> ast.expr | None:
    for n in body:
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            return n.value
        if (
            isinstance(n, ast.AnnAssign)
            and isinstance(n.target, ast.Name)
            and n.target.id == name
            and n.value
        ):
            return n.value
    return None


def from_source(source: str, cls: str | None, filename: str = "<tokenizer code>") -> str | None:
    """``pat_str`` of class ``cls`` (else of the module) in Python ``source``, parsed, not run."""
    tree = ast.parse(source, filename)
    if cls:
        for n in tree.body:
            if (
                isinstance(n, ast.ClassDef)
                and n.name == cls
                and (v := _assigned(n.body, "pat_str")) is not None
            ):
                return literal(v)
    v = _assigned(tree.body, "pat_str")
    return literal(v) if v is not None else None


def _auto_tokenizer(config: dict[str, Any]) -> str | None:
    auto = config.get("auto_map")
    ref = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if isinstance(ref, list | tuple):
        ref = next((r for r in ref if isinstance(r, str)), None)
    return ref if isinstance(ref, str) else None


def read(folder: str | Path) -> Pattern | None:
    """The split pattern of a local tiktoken checkpoint (``None``: not a tiktoken folder)."""
    folder = Path(folder)
    if not (folder / TIKTOKEN_FILE).is_file() or (folder / "tokenizer.json").is_file():
        return None
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    if isinstance(config.get("pat_str"), str):
        return Pattern(config["pat_str"], "tokenizer_config.json: pat_str", True)
    ref = _auto_tokenizer(config)
    if ref and "." in ref:
        module, _, cls = ref.rpartition(".")
        code = folder / f"{module.rpartition('--')[2].replace('.', '/')}.py"
        try:
            found = from_source(code.read_text(), cls, str(code))
        except (OSError, SyntaxError, ValueError) as exc:
            why = f"{code.name} unreadable ({type(exc).__name__}: {exc})"
        else:
            if found:
                return Pattern(found, f"{code.name}: {cls}.pat_str", True)
            why = f"{code.name} has no pat_str built from string literals"
    else:
        why = "tokenizer_config.json names no tokenizer class (auto_map) nor a pat_str"
    return Pattern(GENERIC, f"transformers' generic pattern: {why}", False)


def apply(tok: Any, folder: str | Path) -> Pattern | None:
    """Give a tokenizer transformers converted from ``tiktoken.model`` the checkpoint's own split pattern.

    Returns the pattern used (``None`` for a folder that is not a tiktoken checkpoint, or a tokenizer that is
    not a converted fast one: the checkpoint's own class, run with ``trust_remote_code``, splits itself)."""
    pat = read(folder)
    backend = getattr(tok, "backend_tokenizer", None)
    if pat is None or backend is None:
        return None
    tok.aerie_split_pattern = pat
    if not pat.own:
        print(
            f"WARNING: {folder}: {TIKTOKEN_FILE} is split with {pat.source}; a server running the checkpoint's "
            "own tokenizer may cut the same text into other ids (docs/eagle3.md, 'The split pattern')",
            file=sys.stderr,
        )
        return pat
    from tokenizers import Regex, pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pat.regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return pat


def describe(tok: Any) -> tuple[str, bool]:
    """What the deep check says about a loaded tokenizer's split, and whether it is a warning."""
    pat: Pattern | None = getattr(tok, "aerie_split_pattern", None)
    name = type(tok).__name__
    if pat is None:
        return f"{name}, as the checkpoint's files define it", False
    if pat.own:
        return f"{name} from {TIKTOKEN_FILE}, split with the checkpoint's own pattern ({pat.source})", False
    return (
        f"{name} from {TIKTOKEN_FILE}, split with {pat.source}: ids may differ from the served tokenizer's",
        True,
    )
