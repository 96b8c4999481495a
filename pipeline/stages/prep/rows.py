"""From raw source rows to per-row outcomes: validate, normalise, de-duplicate, tokenise.

Every row read ends as exactly one :class:`Outcome`: ``accept`` (goes into a shard), ``reject``
(malformed: quarantined to rejects.jsonl and counted against the plan's threshold), ``duplicate``
(an exact copy of an earlier row) or ``dropped`` (well-formed, but nothing to learn from within the
plan's max length). Outcomes depend only on the rows before them, so a resumed run reproduces them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.data import sources
from pipeline.data.conversation import ConversationError, conversation_hash, prompt_of, trim_to_last_assistant
from pipeline.data.tokenise import ChatTokenizer, Encoded

TARGET_NATIVE = "target-native"


@dataclass
class Outcome:
    row: int
    kind: str  # accept | reject | duplicate | dropped
    line: int | None = None
    field: str | None = None
    reason: str | None = None
    seen: str | None = None  # the content hash this row added to the seen set
    item: Any = None  # prompt messages (prompt-only) / conversation (target-native)
    encoded: Encoded | None = None

    def reject_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"row": self.row, "field": self.field, "reason": self.reason}
        if self.line is not None:
            rec["line"] = self.line
        return rec


class RowProcessor:
    """Turns batches of :class:`~pipeline.data.sources.RawRow` into outcomes, remembering what it has seen."""

    def __init__(
        self,
        src: sources.Source,
        kind: str,
        options: dict[str, Any],
        tokenizer: ChatTokenizer | None,
        seen: set[str] | None = None,
    ) -> None:
        if kind == TARGET_NATIVE and tokenizer is None:
            raise ValueError("a target-native dataset needs the target tokenizer")
        self.src, self.kind, self.options, self.tokenizer = src, kind, options, tokenizer
        self.seen: set[str] = seen if seen is not None else set()

    def process(self, batch: Sequence[sources.RawRow]) -> list[Outcome]:
        out: list[Outcome] = []
        pending: list[Outcome] = []
        field = self.src.conv_field
        for raw in batch:
            o = Outcome(raw.index, "accept", raw.line)
            try:
                if isinstance(raw.row, ConversationError):
                    raise raw.row
                conv = sources.normalise(self.src, raw.row, self.options)
                o.item = (
                    trim_to_last_assistant(conv, field)
                    if self.kind == TARGET_NATIVE
                    else prompt_of(conv, field)
                )
            except ConversationError as exc:
                o.kind, o.field, o.reason = "reject", exc.field, exc.reason
                out.append(o)
                continue
            h = conversation_hash(o.item)
            if h in self.seen:
                o.kind, o.item = "duplicate", None
            else:
                self.seen.add(h)
                o.seen = h
                if self.kind == TARGET_NATIVE:
                    pending.append(o)
            out.append(o)
        if pending:
            assert self.tokenizer is not None
            for o, enc in zip(pending, self.tokenizer.encode([o.item for o in pending], field), strict=True):
                if isinstance(enc, ConversationError):
                    o.kind, o.field, o.reason, o.item = "reject", enc.field, enc.reason, None
                elif enc.target_tokens == 0:
                    o.kind, o.reason, o.item = (
                        "dropped",
                        (f"no assistant tokens within max_length {self.tokenizer.max_length}"),
                        None,
                    )
                else:
                    o.encoded, o.item = enc, None  # the conversation is not needed once tokenised
        return out
