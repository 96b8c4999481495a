"""The full prep run of one dataset: validate first, then outcomes -> shards, resumably, with events.

Shard *k* holds accepted rows ``k*shard_rows .. (k+1)*shard_rows-1`` in source order, so the shards are a
pure function of the source, the settings and the tokenizer: a killed run resumes after its last finished
shard (restoring the seen-hashes, rejects and counters from the shard records) and produces byte-identical
shards. A finished dataset (manifest present with the same fingerprint) is a no-op.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pipeline.data import sources
from pipeline.data.shard_writer import (
    ShardStore,
    StaleOutputError,
    prompt_table,
    tokenized_table,
    write_rejects,
)
from pipeline.data.tokenise import ChatTokenizer
from pipeline.run.plan.dag import Dataset
from pipeline.run.stage_side.runtime import StageContext, fail
from pipeline.stages.prep.check import check_dataset
from pipeline.stages.prep.rows import TARGET_NATIVE, Outcome, RowProcessor
from pipeline.stages.prep.settings import PrepSettings

PREP_VERSION = 1
CACHE_DIR = ".hf-cache"  # datasets' lock/cache files, inside the stage's own out dir


@dataclass
class Tally:
    """Counters over every row consumed so far (restored from shard records on resume)."""

    read: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejects: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)

    def add(self, outs: list[Outcome]) -> None:
        for o in outs:
            self.read += 1
            if o.kind == "accept":
                self.accepted += 1
            elif o.kind == "duplicate":
                self.duplicates += 1
            elif o.kind == "reject":
                self.rejects.append(o.reject_record())
            elif o.kind == "dropped":
                self.dropped.append({"row": o.row, "reason": o.reason})

    @property
    def reject_rate(self) -> float:
        return len(self.rejects) / self.read if self.read else 0.0


def fingerprint(ds: Dataset, settings: PrepSettings, tokenizer: ChatTokenizer | None) -> dict[str, Any]:
    """Everything the shards depend on; outputs made under another fingerprint are never reused."""
    src = sources.get(ds.source)
    fp: dict[str, Any] = {
        "prep_version": PREP_VERSION,
        "dataset": ds.name,
        "source": ds.source,
        "kind": ds.kind,
        "quota": ds.quota,
        "input": sources.describe(src, ds.path, ds.split, ds.config, ds.options),
        "options": {k: v for k, v in sorted(ds.options.items()) if k != "reject_threshold"},
        "shard_rows": settings.shard_rows,
    }
    if tokenizer is not None:
        fp.update(
            tokenizer=tokenizer.tokenizer_id,
            template_hash=tokenizer.template_hash,
            max_length=tokenizer.max_length,
            template_kwargs=tokenizer.template_kwargs,
        )
    return fp


def _row_id(ds: Dataset, row: int) -> str:
    return f"{ds.name}-{row}"


class PrepRun:
    def __init__(
        self, ctx: StageContext, ds: Dataset, settings: PrepSettings, tokenizer: ChatTokenizer | None
    ) -> None:
        self.ctx, self.ds, self.settings, self.tokenizer = ctx, ds, settings, tokenizer
        self.src = sources.get(ds.source)
        self.out_kind = "tokenized" if ds.kind == TARGET_NATIVE else "prompts"
        self.store = ShardStore(ctx.out, fingerprint(ds, settings, tokenizer))
        self.cache_dir = ctx.out / CACHE_DIR
        self.announced = 0
        self.t0 = time.monotonic()
        self.accepted_at_start = 0

    # -- events -----------------------------------------------------------------------------
    def _progress(self, tally: Tally, force: bool = False) -> None:
        dt = max(time.monotonic() - self.t0, 1e-6)
        self.ctx.progress(
            tally.accepted,
            self.ds.quota,
            unit="rows",
            key=self.ds.name,
            force=force,
            rate=round((tally.accepted - self.accepted_at_start) / dt, 2),
            read=tally.read,
            rejects=len(tally.rejects),
            duplicates=tally.duplicates,
        )

    def _announce(self, outs: list[Outcome]) -> None:
        for o in outs:
            if o.kind == "reject" and self.announced < self.settings.reject_messages:
                self.announced += 1
                where = f"row {o.row}" + (f" (line {o.line})" if o.line else "")
                self.ctx.message(
                    f"{self.ds.name}: {where}: {o.field}: {o.reason} (quarantined to rejects.jsonl)",
                    level="warning",
                    code="reject",
                    dataset=self.ds.name,
                    row=o.row,
                    field=o.field,
                )

    def _add(self, tally: Tally, outs: list[Outcome]) -> None:
        tally.add(outs)
        self._announce(outs)

    def _metrics(self, tally: Tally) -> None:
        for name, value in (
            ("rejects", len(tally.rejects)),
            ("reject_rate", tally.reject_rate),
            ("duplicates", tally.duplicates),
            ("dropped", len(tally.dropped)),
        ):
            self.ctx.metric(name, value, step=tally.read, key=self.ds.name)

    # -- the run ----------------------------------------------------------------------------
    def validate_first(self) -> None:
        n = self.settings.check_rows
        rep = check_dataset(self.ds, self.tokenizer, n, self.cache_dir, self.settings.batch_rows)
        self.ctx.message(rep.summary(), code="check")
        if rep.problems and rep.reject_rate > self.settings.reject_threshold:
            fail(
                self.ctx,
                f"{self.ds.name}: validation of the first {rep.rows} rows failed: {len(rep.problems)} "
                f"malformed ({rep.reject_rate:.0%} > threshold {self.settings.reject_threshold:.0%}); nothing was "
                "written.\n" + "\n".join(rep.lines()),
            )

    def restore(self) -> tuple[list[dict[str, Any]], Tally, set[str], int]:
        records = self.store.finished()
        tally, seen = Tally(), set()
        for r in records:
            tally.read += r["source_end"] + 1 - r["source_start"]
            tally.accepted += r["rows"]
            tally.duplicates += r["duplicates"]
            tally.rejects.extend(r["rejects"])
            tally.dropped.extend(r["dropped"])
            seen.update(r["seen"])
        start = records[-1]["source_end"] + 1 if records else 0
        return records, tally, seen, start

    def commit(self, index: int, outs: list[Outcome]) -> dict[str, Any]:
        acc = [o for o in outs if o.kind == "accept"]
        ids = [_row_id(self.ds, o.row) for o in acc]
        if self.out_kind == "tokenized":
            encoded = [o.encoded for o in acc if o.encoded is not None]
            assert len(encoded) == len(acc), "an accepted row of a target-native dataset is always tokenized"
            table = tokenized_table(ids, encoded)
        else:
            table = prompt_table(ids, [o.item for o in acc])
        state = {
            "source_start": outs[0].row,
            "source_end": outs[-1].row,
            "duplicates": sum(o.kind == "duplicate" for o in outs),
            "rejects": [o.reject_record() for o in outs if o.kind == "reject"],
            "dropped": [{"row": o.row, "reason": o.reason} for o in outs if o.kind == "dropped"],
            "seen": [o.seen for o in outs if o.seen],
        }
        return self.store.commit(index, table, state)

    def run(self) -> int:
        ds, ctx = self.ds, self.ctx
        if self._already_prepared():
            return 0
        self.store.clean_partials()
        if ds.kind != self.src.kind:
            usual = (
                "already holds the target's replies"
                if self.src.kind == TARGET_NATIVE
                else "holds another model's replies"
            )
            ctx.message(
                f"{ds.name}: source {self.src.key} usually {usual}; the plan makes it {ds.kind}",
                level="warning",
                code="kind",
            )
        self.validate_first()
        try:
            records, tally, seen, start = self.restore()
        except StaleOutputError as exc:
            fail(ctx, f"{ds.name}: {exc}")
        if records:
            ctx.message(
                f"{ds.name}: resuming after {len(records)} finished shards ({tally.accepted} rows, "
                f"source row {start})",
                code="resume",
            )
        self.accepted_at_start = tally.accepted
        self.t0 = time.monotonic()
        self._progress(tally, force=True)
        self._fill(records, tally, seen, start)
        self._finish(records, tally)
        return 0

    def _already_prepared(self) -> bool:
        """Whether a complete output for these settings is there (then nothing is done but say so)."""
        ds, ctx = self.ds, self.ctx
        try:
            man = self.store.complete()
        except StaleOutputError as exc:
            fail(ctx, f"{ds.name}: {exc}")
        if man is None:
            return False
        ctx.message(
            f"{ds.name}: already prepared ({man.rows} rows in {len(man.shards)} shards); nothing to do",
            code="up-to-date",
        )
        ctx.progress(man.rows or 0, ds.quota, unit="rows", key=ds.name, force=True, rate=0.0)
        return True

    def _fill(self, records: list[dict[str, Any]], tally: Tally, seen: set[str], start: int) -> None:
        """Read the source from row ``start`` and commit shards (appended to ``records``) up to the quota."""
        ds, ctx = self.ds, self.ctx
        proc = RowProcessor(self.src, ds.kind, ds.options, self.tokenizer, seen)
        rows = sources.open_rows(
            self.src, ds.path, ds.split, ds.config, ds.options, self.cache_dir, start=start
        )
        pending: list[Outcome] = []
        pending_acc = 0
        S = self.settings.shard_rows
        exhausted = False
        while tally.accepted + pending_acc < ds.quota and not exhausted:
            ctx.safe_point()
            batch = list(itertools.islice(rows, self.settings.batch_rows))
            exhausted = not batch
            outs = proc.process(batch)
            pending.extend(outs)
            pending_acc += sum(o.kind == "accept" for o in outs)
            # cut full shards (and the last one, at the quota) in source order
            while tally.accepted < ds.quota and (
                pending_acc >= S or tally.accepted + pending_acc >= ds.quota
            ):
                take = min(S, ds.quota - tally.accepted)
                k = _index_of_nth_accept(pending, take)
                shard, pending = pending[: k + 1], pending[k + 1 :]
                pending_acc -= take
                records.append(self.commit(len(records), shard))
                self._add(tally, shard)
                write_rejects(ctx.out / "rejects.jsonl", tally.rejects)
                self._metrics(tally)
                ctx.safe_point()
            self._progress(tally)
        if tally.accepted >= ds.quota:
            pending = []  # rows read past the quota are not part of this dataset
        elif pending and pending_acc:
            records.append(self.commit(len(records), pending))
            self._add(tally, pending)
            pending = []
        self._add(tally, pending)  # trailing rows without an accepted one (source exhausted)

    def _finish(self, records: list[dict[str, Any]], tally: Tally) -> None:
        """Write the rejects and the manifest, or fail the stage above the reject threshold."""
        ds, ctx = self.ds, self.ctx
        write_rejects(ctx.out / "rejects.jsonl", tally.rejects)
        self._metrics(tally)
        self._progress(tally, force=True)
        if tally.reject_rate > self.settings.reject_threshold:
            fail(
                ctx,
                f"{ds.name}: {len(tally.rejects)} of {tally.read} rows malformed ({tally.reject_rate:.1%}), "
                f"above the threshold {self.settings.reject_threshold:.1%}; see {ctx.out / 'rejects.jsonl'}",
            )
        if tally.accepted < ds.quota:
            ctx.message(
                f"{ds.name}: the source ran out after {tally.read} rows: {tally.accepted} of quota {ds.quota}",
                level="warning",
                code="short",
            )
        fields: dict[str, Any] = {
            "dataset": ds.name,
            "source": ds.source,
            "quota": ds.quota,
            "rows_read": tally.read,
            "rejects": len(tally.rejects),
            "duplicates": tally.duplicates,
            "dropped": len(tally.dropped),
        }
        if self.tokenizer is not None:
            fields.update(
                tokenizer=self.tokenizer.tokenizer_id,
                template_hash=self.tokenizer.template_hash,
                max_length=self.tokenizer.max_length,
            )
        man = self.store.write_manifest(self.out_kind, records, **fields)
        tokens = f", {man.tokens} tokens" if man.tokens is not None else ""
        ctx.message(
            f"{ds.name}: {man.rows} rows{tokens} in {len(records)} shards; {len(tally.rejects)} rejects, "
            f"{tally.duplicates} duplicates, {len(tally.dropped)} dropped",
            code="done",
        )


def _index_of_nth_accept(outs: list[Outcome], n: int) -> int:
    seen = 0
    for i, o in enumerate(outs):
        if o.kind == "accept":
            seen += 1
            if seen == n:
                return i
    raise AssertionError("fewer accepted rows than expected")
