"""The methods harness's data, kept compactly: held-out prompts from the repo, target conversations as token ids.

Two things live here, both without torch so the tests stay fast:

- :func:`load_prompts` reads ``bench/gpu/methods_prompts.jsonl``: one held-out prompt a line, UltraChat-style
  (``{"prompt_id", "kind", "messages": [{"role": "user", "content": ...}]}``), written by hand and *not* from
  the training distribution. A malformed line fails with the file, the line and the field.
- :func:`pack` / :func:`unpack` keep the target's conversations as token ids in one compressed ``.npz``:
  ``tokens`` (uint16, every conversation's user ids then its answer ids, concatenated), ``offsets`` (int64,
  n + 1: where each conversation starts), ``prompt_len`` (int32: how many of its ids are the user turn — the
  role/answer split prep needs), the same three for the held-out prompts (``held_*``, answered by the target
  too so prep sees a whole turn), and ``meta`` (JSON: model, sizes, seed). 30K conversations of ≤ 256 answer
  tokens are ~7M ids: ~14 MB raw, less compressed — one device call carries it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS_FILE = Path(__file__).resolve().parent / "methods_prompts.jsonl"
KINDS = ("chat", "maths", "code", "summarise")


class PromptFileError(ValueError):
    """A held-out prompt file that cannot be used, naming the file, the line and the field."""


@dataclass(frozen=True)
class HeldPrompt:
    prompt_id: str
    kind: str
    text: str


def load_prompts(path: Path = PROMPTS_FILE) -> list[HeldPrompt]:
    """Every prompt of ``path``; a bad line raises :class:`PromptFileError` naming ``path:line`` and the field."""
    out: list[HeldPrompt] = []
    seen: set[str] = set()
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise PromptFileError(f"{path}: cannot read the held-out prompts ({exc.strerror})") from exc
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{no}"
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise PromptFileError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(rec, dict):
            raise PromptFileError(f"{where}: expected an object, got {type(rec).__name__}")
        pid, kind, msgs = rec.get("prompt_id"), rec.get("kind"), rec.get("messages")
        if not isinstance(pid, str) or not pid:
            raise PromptFileError(f"{where}: field 'prompt_id' must be a non-empty string")
        if pid in seen:
            raise PromptFileError(f"{where}: field 'prompt_id' {pid!r} repeats an earlier line")
        if kind not in KINDS:
            raise PromptFileError(f"{where}: field 'kind' is {kind!r}, expected one of {', '.join(KINDS)}")
        if not isinstance(msgs, list) or len(msgs) != 1 or not isinstance(msgs[0], dict):
            raise PromptFileError(f"{where}: field 'messages' must hold exactly one user turn")
        if msgs[0].get("role") != "user":
            raise PromptFileError(
                f"{where}: field 'messages[0].role' is {msgs[0].get('role')!r}, expected 'user'"
            )
        text = msgs[0].get("content")
        if not isinstance(text, str) or not text.strip():
            raise PromptFileError(f"{where}: field 'messages[0].content' must be non-empty text")
        seen.add(pid)
        out.append(HeldPrompt(pid, kind, text))
    if not out:
        raise PromptFileError(f"{path}: no prompts")
    return out


@dataclass
class Conversations:
    """Token-id conversations: ``prompts[i]`` (the user turn's ids) and ``answers[i]`` (the target's)."""

    prompts: list[list[int]]
    answers: list[list[int]]

    def __len__(self) -> int:
        return len(self.prompts)

    def arrays(self, prefix: str = "") -> dict[str, Any]:  # Any: numpy's stubs mistype savez(**arrays)
        lens = [len(p) + len(a) for p, a in zip(self.prompts, self.answers, strict=True)]
        flat = [t for p, a in zip(self.prompts, self.answers, strict=True) for t in (*p, *a)]
        top = max(flat, default=0)
        if top >= 1 << 16 or min(flat, default=0) < 0:
            raise ValueError(
                f"token id {top} does not fit uint16: this target's vocabulary is too large to pack"
            )
        return {
            f"{prefix}tokens": np.asarray(flat, dtype=np.uint16),
            f"{prefix}offsets": np.concatenate([[0], np.cumsum(lens, dtype=np.int64)]).astype(np.int64),
            f"{prefix}prompt_len": np.asarray([len(p) for p in self.prompts], dtype=np.int32),
        }

    @classmethod
    def from_arrays(cls, z: Any, prefix: str = "") -> Conversations:
        toks, offs, plen = z[f"{prefix}tokens"], z[f"{prefix}offsets"], z[f"{prefix}prompt_len"]
        if offs.shape[0] != plen.shape[0] + 1 or int(offs[-1]) != toks.shape[0]:
            raise ValueError(f"{prefix}offsets do not match {prefix}tokens / {prefix}prompt_len")
        prompts, answers = [], []
        for i in range(plen.shape[0]):
            row = toks[int(offs[i]) : int(offs[i + 1])].astype(np.int64).tolist()
            prompts.append(row[: int(plen[i])])
            answers.append(row[int(plen[i]) :])
        return cls(prompts, answers)


def pack(path: Path, train: Conversations, held: Conversations, meta: dict[str, Any]) -> str:
    """Write the compressed ``.npz`` (atomically) and return its sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**meta, "conversations": len(train), "held_prompts": len(held)}
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(
        tmp, **train.arrays(), **held.arrays("held_"), meta=np.frombuffer(json.dumps(doc).encode(), np.uint8)
    )
    tmp.replace(path)
    return sha256(path)


def unpack(path: Path) -> tuple[Conversations, Conversations, dict[str, Any]]:
    """(training conversations, held-out prompts answered, meta) of a packed file."""
    try:
        with np.load(Path(path)) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            return Conversations.from_arrays(z), Conversations.from_arrays(z, "held_"), meta
    except (OSError, KeyError, ValueError) as exc:
        raise ValueError(f"{path}: not a methods data file ({exc})") from exc


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def round_trip_share(ids: Sequence[Sequence[int]], back: Sequence[Sequence[int]]) -> float:
    """Share of id lists that came back identical (generated ids → text → prep's tokenizer → ids)."""
    if len(ids) != len(back):
        raise ValueError(f"{len(ids)} id lists but {len(back)} came back")
    return sum(list(a) == list(b) for a, b in zip(ids, back, strict=True)) / max(1, len(ids))


def interleave(kinds: Sequence[str]) -> list[int]:
    """Indices taking one prompt of each kind in turn (file order within a kind), so any first N cover every kind."""
    queues: dict[str, list[int]] = {}
    for i, k in enumerate(kinds):
        queues.setdefault(k, []).append(i)
    out: list[int] = []
    while any(queues.values()):
        for q in queues.values():
            if q:
                out.append(q.pop(0))
    return out
