"""The regeneration stage: prompts from prep -> the target's own answers -> tokenized shards.

1. Read the ``prompts`` shards of the upstream prep stage (``ctx.inputs``; ``--input`` by hand).
2. Ask the inference server (the service this stage ``uses``: its ``out/endpoint.json``; or
   ``[regen] server_url`` / ``--server-url``) for each prompt not yet in ``out/responses.jsonl``; a
   service with ``replicas = N`` (Slurm) has N endpoints, and requests go to each in turn.
3. Tokenise prompt + answer with the target's chat template and write loss-masked shards
   (:mod:`pipeline.data.tokenise`), ``manifest.json`` of kind ``tokenized`` last.

``[regen]``'s keys, defaults and docs: :class:`pipeline.run.plan.sections.RegenSection` (``aerie plan check
--show-defaults`` prints them). What the stage reads and where it sends requests: :mod:`.inputs`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from pipeline.manifests.shards import ShardsManifest
from pipeline.run.plan.dag import Plan, PlanError
from pipeline.run.plan.sections import RegenSection
from pipeline.run.rundir.files import sha256_file
from pipeline.run.rundir.layout import write_atomic
from pipeline.run.stage_side.runtime import StageContext, add_common_args, fail
from pipeline.stages.regen.client import ClientConfig, ClientStats, OutageError, Regenerator
from pipeline.stages.regen.inputs import (
    InputError,
    find_prompt_dir,
    read_prompts,
    regen_settings,
    server_urls,
)
from pipeline.stages.regen.store import ResponseLog


# ------------------------------------------------------------------------------ generation
class Reporter:
    """Events of the request phase: progress, throughput, outages, failures, pause."""

    def __init__(self, ctx: StageContext, total: int, already: int) -> None:
        self.ctx, self.total, self.already = ctx, total, already
        self.failures: list[dict[str, Any]] = []
        self._last = (time.monotonic(), 0, 0)

    def on_failure(self, rid: str, why: str) -> None:
        self.failures.append({"id": rid, "reason": why})
        if len(self.failures) <= 5:
            self.ctx.message(f"record {rid}: {why}", level="warning", code="request-failed")
        elif len(self.failures) == 6:
            self.ctx.message("more failed records: see errors.jsonl when the stage ends", level="warning")

    def on_outage(self, start: bool, detail: str, dur: float) -> None:
        if start:
            self.ctx.message(
                f"server unreachable ({detail}): waiting and retrying; no record is lost",
                level="warning",
                code="server-outage",
            )
            self.ctx.metric("server_outage", 1)
        else:
            self.ctx.message(
                f"server reachable again after {dur:.1f}s outage", code="server-recovered", outage_s=dur
            )
            self.ctx.metric("server_outage", 0, outage_s=dur)

    def on_pause(self, paused: bool) -> None:
        if paused:
            self.ctx.message("paused at a safe point (no request in flight)", code="paused")
        else:
            self.ctx.message("resumed", code="resumed")

    def tick(self, st: ClientStats) -> None:
        now = time.monotonic()
        t0, a0, c0 = self._last
        dt = max(now - t0, 1e-6)
        self._last = (now, st.answered, st.completion_tokens)
        done = self.already + st.answered + st.failed
        self.ctx.progress(
            done,
            self.total,
            unit="records",
            force=True,
            answered=self.already + st.answered,
            failed=st.failed,
        )
        self.ctx.metric("requests_per_s", round((st.answered - a0) / dt, 3))
        self.ctx.metric("gen_tokens_per_s", round((st.completion_tokens - c0) / dt, 3))
        self.ctx.metric("in_flight", st.in_flight, retries=st.retries)


def generate(
    ctx: StageContext,
    cfg: ClientConfig,
    prompts: list[tuple[str, list[dict[str, Any]]]],
    log: ResponseLog,
    tick_s: float = 2.0,
) -> tuple[ClientStats, Reporter, bool]:
    todo = [p for p in prompts if p[0] not in log]
    rep = Reporter(ctx, len(prompts), len(prompts) - len(todo))
    ctx.message(
        f"{len(prompts)} prompts, {rep.already} already answered, {len(todo)} to ask {cfg.url} "
        f"(concurrency {cfg.concurrency}, max_tokens {cfg.sampling.get('max_tokens')})",
        code="regen-start",
    )
    regen = Regenerator(
        cfg,
        log.append,
        on_failure=rep.on_failure,
        on_outage=rep.on_outage,
        paused=ctx.pause_requested,
        on_pause=rep.on_pause,
    )

    async def go() -> ClientStats:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, regen.stop)
        try:
            return await regen.run(todo, tick=rep.tick, tick_s=tick_s)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    try:
        stats = asyncio.run(go()) if todo else regen.stats
    finally:
        log.sync()
    if regen.abandoned:
        ctx.message(
            f"{regen.abandoned} request(s) still in flight after the {cfg.drain_timeout_s:g}s drain time "
            "were cancelled: a retry asks for them again (raise the stage's kill_grace_s to drain longer)",
            level="warning",
            code="abandoned",
        )
    if regen.model:
        ctx.message(
            f"model {regen.model}: {stats.answered} answered, {stats.failed} failed, {stats.retries} retries, "
            f"{stats.sent} requests sent",
            code="regen-summary",
            sent=stats.sent,
            retries=stats.retries,
        )
    return stats, rep, regen.stopping


# ------------------------------------------------------------------------------- tokenising
def split_by_length(
    ct: Any, prompts: list[tuple[str, list[dict[str, Any]]]]
) -> tuple[list, list[tuple[str, int]]]:
    """``(prompts that leave room for an answer, [(id, prompt tokens)] of those that fill max_length)``."""
    texts = [ct.render(ct.template_messages(m), add_generation_prompt=True) for _, m in prompts]
    lengths = (
        [len(ids) for ids in ct.tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []
    )
    fit, too_long = [], []
    for p, n in zip(prompts, lengths, strict=True):
        if n < ct.max_length:
            fit.append(p)
        else:
            too_long.append((p[0], n))
    return fit, too_long


def tokenise_answers(
    ctx: StageContext,
    ct: Any,
    dataset: str,
    order: list[str],
    log: ResponseLog,
    s: RegenSection,
    skipped: list[dict[str, Any]] | None = None,
    info: dict[str, Any] | None = None,
) -> ShardsManifest:
    """Prompt + answer -> tokenized shards (docs/data-formats.md, "Regeneration outputs")."""
    from pipeline.data import shard_writer as sw

    fingerprint = {
        "stage": "regen",
        "dataset": dataset,
        "tokenizer": ct.tokenizer_id,
        "template_hash": ct.template_hash,
        "max_length": ct.max_length,
        "drop_truncated": bool(s.drop_truncated),
        "responses_sha256": sha256_file(log.path),
        "shard_rows": int(s.shard_rows),
    }
    store = sw.ShardStore(ctx.out, fingerprint)
    done, finished = _resume(ctx, store)
    if done is not None:
        return done
    recs = log.records()
    rows = [rid for rid in order if rid in recs]
    truncated = sum(1 for rid in rows if recs[rid].get("finish_reason") == "length")
    per = int(s.shard_rows)
    shards = list(finished)
    pos = sum(int(r.get("rows_in", 0)) for r in finished)
    while pos < len(rows):
        ctx.safe_point()
        chunk = rows[pos : pos + per]
        table, meta = _tokenise_chunk(ct, chunk, recs, s)
        shards.append(store.commit(len(shards), table, {"rows_in": len(chunk), **meta}))
        pos += len(chunk)
        ctx.progress(pos, len(rows), unit="rows", key="tokenise", force=True)
    all_rejects = list(skipped or []) + [r for sh in shards for r in sh.get("rejects", [])]
    sw.write_rejects(ctx.out / "rejects.jsonl", all_rejects)
    man = store.write_manifest(
        "tokenized",
        shards,
        dataset=dataset,
        tokenizer=ct.tokenizer_id,
        template_hash=ct.template_hash,
        max_length=ct.max_length,
        answers=len(rows),
        rejects=len(all_rejects) - len(skipped or []),
        skipped=len(skipped or []),
        dropped=sum(int(sh.get("dropped", 0)) for sh in shards),
        truncated_answers=truncated,
        **(info or {}),
    )
    ctx.message(
        f"tokenized {man.rows} rows ({man.tokens or 0:,} tokens) into {len(shards)} shard(s); {man.rejects} rejected, "
        f"{man.skipped} prompts not sent, {man.dropped} dropped, {truncated} answers cut at max_tokens",
        code="tokenized",
    )
    return man


def _resume(ctx: StageContext, store: Any) -> tuple[ShardsManifest | None, list[dict[str, Any]]]:
    """``(the manifest, [])`` when the output is complete for these answers and settings; else ``(None,
    the shards already committed)``, every shard of other answers or settings removed first."""
    from pipeline.data import shard_writer as sw

    store.clean_partials()
    try:
        done = store.complete()
    except sw.StaleOutputError:
        done = None
    if done is not None:
        ctx.message(f"tokenized output already complete ({done.rows} rows)", code="up-to-date")
        return done, []
    try:
        return None, store.finished()
    except sw.StaleOutputError:  # shards made from other answers or settings: start the shards over
        for p in [
            *ctx.out.glob(f"{sw.SHARD_PREFIX}*.parquet"),
            *store.progress_dir.glob("*.json"),
            store.manifest_path,
        ]:
            p.unlink(missing_ok=True)
        return None, []


def _tokenise_chunk(
    ct: Any, chunk: list[str], recs: dict[str, dict[str, Any]], s: RegenSection
) -> tuple[Any, dict[str, Any]]:
    """One shard's table from answers ``chunk``, and its progress record (``rejects``, ``dropped``)."""
    from pipeline.data import conversation as conv
    from pipeline.data import shard_writer as sw

    ids, convs, rejects, dropped = [], [], [], 0
    for rid in chunk:
        rec = recs[rid]
        if s.drop_truncated and rec.get("finish_reason") == "length":
            dropped += 1
            continue
        try:
            convs.append(conv.check_conversation(rec["messages"]))
            ids.append(rid)
        except conv.ConversationError as exc:
            rejects.append({"id": rid, "field": exc.field, "reason": exc.reason})
    enc = ct.encode(convs) if convs else []
    ok_ids, ok_enc = [], []
    for rid, e in zip(ids, enc, strict=True):
        if isinstance(e, conv.ConversationError):
            rejects.append({"id": rid, "field": e.field, "reason": e.reason})
        elif e.target_tokens == 0:
            dropped += 1  # well-formed, but no answer token within max_length
        else:
            ok_ids.append(rid)
            ok_enc.append(e)
    return sw.tokenized_table(ok_ids, ok_enc), {"rejects": rejects, "dropped": dropped}


# ------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.stages.regen", description=__doc__.split("\n")[0])
    add_common_args(ap)
    ap.add_argument("--dataset", required=True, help="dataset name (the plan's [[datasets]] entry)")
    ap.add_argument("--input", type=Path, default=None, help="prompts output dir (default: the prep input)")
    ap.add_argument(
        "--server-url", default=None, help="http://host:port of the server (default: the service's)"
    )
    args = ap.parse_args(argv)
    ctx = StageContext.from_cli(args)
    try:
        plan = ctx.plan
        plan.dataset(args.dataset)
        s = regen_settings(plan)
        src = args.input or find_prompt_dir(ctx.inputs)
        prompts = read_prompts(src, s.max_records)
        if not prompts:
            fail(ctx, f"{src}: no prompts to regenerate", 2)
        urls = server_urls(ctx, plan, s, args.server_url)
    except (PlanError, InputError, ValueError) as exc:
        fail(ctx, str(exc), 2)
    from pipeline.data.tokenise import load_chat_tokenizer

    template_kwargs = plan.template_kwargs(args.dataset)
    ct = load_chat_tokenizer(
        str(plan.target.model),
        plan.target.row_length,
        template_kwargs,
        trust_remote_code=plan.target.trust_remote_code,
    )
    read = len(prompts)
    prompts, skipped = _send_only_what_fits(ctx, ct, prompts, s)
    if len(urls) > 1:
        ctx.message(f"spreading requests over {len(urls)} servers: {', '.join(urls)}")
    cfg = _client_config(ctx, plan, s, urls, template_kwargs.get("thinking"))
    try:
        log = ResponseLog(ctx.out / "responses.jsonl")
    except ValueError as exc:
        fail(ctx, str(exc), 2)
    if log.repaired_bytes:
        ctx.message(
            f"responses.jsonl: cut a torn last line ({log.repaired_bytes} bytes) left by a kill",
            level="warning",
        )
    try:
        _stats, rep, stopped = generate(ctx, cfg, prompts, log)
    except OutageError as exc:
        log.close()
        fail(ctx, str(exc), 1)
    log.close()
    write_atomic(
        ctx.out / "errors.jsonl", "".join(json.dumps(f, ensure_ascii=False) + "\n" for f in rep.failures)
    )
    if stopped:
        ctx.message(
            f"stopped by a signal with {len(log)} of {len(prompts)} answered; a retry asks only for the rest",
            level="warning",
            code="stopped",
        )
        ctx.close()
        return 128 + signal.SIGTERM
    failed = _check_answers(ctx, s, prompts, log, len(rep.failures))
    try:
        ds = plan.dataset(args.dataset)
        info = {
            "source": ds.source,
            "prompts": read,
            "failed": failed,
            "regenerated_by": {"model": model_id(log), "url": urls[0], "sampling": cfg.sampling},
        }
        tokenise_answers(ctx, ct, args.dataset, [rid for rid, _ in prompts], log, s, skipped, info)
    except (ValueError, OSError) as exc:
        fail(ctx, f"tokenising the answers failed: {exc}", 1)
    ctx.progress(len(prompts), len(prompts), unit="records", force=True)
    ctx.close()
    return 0


def _send_only_what_fits(
    ctx: StageContext, ct: Any, prompts: list[tuple[str, list[dict[str, Any]]]], s: RegenSection
) -> tuple[list[tuple[str, list[dict[str, Any]]]], list[dict[str, Any]]]:
    """``(the prompts that leave room for an answer, the rejects of those that do not)``; the stage fails
    when more than ``max_skipped_fraction`` of them do not."""
    read, max_length = len(prompts), ct.max_length
    prompts, too_long = split_by_length(ct, prompts)
    skipped = [
        {
            "id": rid,
            "field": "messages",
            "reason": f"the prompt alone is {n} tokens, >= target.max_length "
            f"{max_length}: no room for an answer (not sent)",
        }
        for rid, n in too_long
    ]
    if too_long:
        lens = sorted(n for _, n in too_long)
        text = (
            f"{len(too_long)} of {read} prompts are {lens[0]}-{lens[-1]} tokens, not shorter than target.max_length "
            f"{max_length}: not sent (they would train on no answer token)"
        )
        if len(too_long) > s.max_skipped_fraction * read:
            fail(
                ctx,
                text + f"; that is more than regen.max_skipped_fraction {s.max_skipped_fraction:g}: "
                "raise [target] max_length, or drop this dataset",
                2,
            )
        ctx.message(text, level="warning", code="prompts-too-long", skipped=len(too_long))
    return prompts, skipped


def _client_config(
    ctx: StageContext, plan: Plan, s: RegenSection, urls: list[str], thinking: bool | None
) -> ClientConfig:
    """How the client talks to the servers: ``[regen]``'s settings, the key from its environment variable."""
    return ClientConfig(
        url=urls[0],
        more_urls=tuple(urls[1:]),
        model=s.model,
        concurrency=int(s.concurrency),
        request_timeout_s=float(s.request_timeout_s),
        max_attempts=int(s.max_attempts),
        backoff_s=float(s.backoff_s),
        backoff_max_s=float(s.backoff_max_s),
        outage_timeout_s=float(s.outage_timeout_s),
        sampling=s.sampling_body(thinking=thinking),
        api_key=os.environ.get(s.api_key_env) if s.api_key_env else None,
        drain_timeout_s=max(1.0, _kill_grace(plan, ctx.stage_id) - 2.0),
    )


def _check_answers(
    ctx: StageContext, s: RegenSection, prompts: list[tuple[str, Any]], log: ResponseLog, failed: int
) -> int:
    """The failed count, once every prompt is answered or failed; the stage fails above max_error_fraction."""
    answered = sum(1 for rid, _ in prompts if rid in log)
    if answered + failed != len(prompts):
        fail(ctx, f"bookkeeping: {answered} answered + {failed} failed != {len(prompts)} prompts", 1)
    if failed and failed > s.max_error_fraction * len(prompts):
        fail(
            ctx,
            f"{failed} of {len(prompts)} records failed (> max_error_fraction {s.max_error_fraction:g}); "
            "see errors.jsonl; a retry asks only for the unanswered ones",
            1,
        )
    return failed


def model_id(log: ResponseLog) -> str | None:
    """The model that answered (as the server named it), from the first answer."""
    with open(log.path, "rb") as fh:
        first = fh.readline()
    return json.loads(first).get("model") if first.strip() else None


def _kill_grace(plan: Plan, stage_id: str) -> float:
    try:
        return plan.stage(stage_id).kill_grace_s
    except KeyError:
        return 10.0
