"""What the regeneration stage reads: its ``[regen]`` settings, the upstream prompts, and the servers to ask."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from pipeline import tested_versions
from pipeline.manifests import shards as shards_manifest
from pipeline.manifests.base import MANIFEST_FILE, ManifestError, kind_of
from pipeline.run.plan.dag import Plan
from pipeline.run.plan.sections import RegenSection
from pipeline.run.rundir.layout import RunDir, read_json
from pipeline.run.stage_side.runtime import StageContext


class InputError(ValueError):
    """Bad upstream data; names the file, row and field."""


def regen_settings(plan: Plan) -> RegenSection:
    """``[regen]``, typed and checked when the plan loaded."""
    return plan.settings.regen


# ------------------------------------------------------------------------------------ inputs
def find_prompt_dir(inputs: dict[str, Path]) -> Path:
    """The one input whose ``manifest.json`` is of kind ``prompts``."""
    found = []
    for _dep, d in inputs.items():
        mpath = Path(d) / MANIFEST_FILE
        try:
            if mpath.is_file() and kind_of(mpath) == shards_manifest.PROMPTS:
                found.append(Path(d))
        except ManifestError as exc:
            raise InputError(str(exc)) from None
    if not found:
        deps = ", ".join(f"{k} ({v})" for k, v in inputs.items()) or "none"
        raise InputError(
            f"no upstream output with a manifest.json of kind 'prompts' (inputs: {deps}); "
            "regen runs after the prep stage of a prompt-only dataset"
        )
    if len(found) > 1:
        raise InputError(f"several prompt inputs: {', '.join(map(str, found))}; give one with --input")
    return found[0]


def read_prompts(d: Path, limit: int | None = None) -> list[tuple[str, list[dict[str, Any]]]]:
    """``(id, messages)`` from a ``prompts`` output, in shard order; errors name file, row and field."""
    import pyarrow.parquet as pq

    try:
        man = shards_manifest.read(d / MANIFEST_FILE)
    except ManifestError as exc:
        raise InputError(str(exc)) from None
    if man.kind != shards_manifest.PROMPTS:
        raise InputError(f"{d / MANIFEST_FILE}: kind: is {man.kind!r}, not a prompts manifest")
    out: list[tuple[str, list[dict[str, Any]]]] = []
    seen: set[str] = set()
    for s in man.shards:
        path = d / s.file
        try:
            table = pq.read_table(path, columns=["id", "messages"])
        except (OSError, KeyError) as exc:
            raise InputError(f"{path}: cannot read prompt shard: {exc}") from None
        for row, (rid, msgs) in enumerate(
            zip(table.column("id").to_pylist(), table.column("messages").to_pylist(), strict=True)
        ):
            where = f"{path.name}: row {row}"
            if not isinstance(rid, str) or not rid:
                raise InputError(f"{where}: id: expected a non-empty string, got {rid!r}")
            if rid in seen:
                raise InputError(f"{where}: id: duplicate id {rid!r}")
            if not isinstance(msgs, list) or not msgs or msgs[-1].get("role") != "user":
                raise InputError(f"{where} (id {rid}): messages: expected turns ending with a user turn")
            seen.add(rid)
            out.append((rid, [{"role": m["role"], "content": m["content"]} for m in msgs]))
            if limit is not None and len(out) >= limit:
                return out
    return out


def server_urls(ctx: StageContext, plan: Plan, s: RegenSection, override: str | None) -> list[str]:
    """Every server to send requests to: the override, ``[regen] server_url``, else the ``endpoint.json``
    of each service this stage uses (several with ``replicas = N`` under Slurm), else ``[serve]``'s. The plan's
    own SGLang server is checked against the tested-versions table first (refused: :class:`InputError`)."""
    if override:
        return [override]
    if s.server_url:
        return [s.server_url]
    if plan.settings.serve.backend == "sglang":  # the plan's own SGLang server, on this host: the table first
        refusal = tested_versions.stage_refusal(plan, "serve")
        if refusal:
            raise InputError(f'{plan.path}: serve.backend = "sglang": {refusal}')
    uses: tuple[str, ...] = ()
    with contextlib.suppress(KeyError):
        uses = plan.stage(ctx.stage_id).uses
    urls: list[str] = []
    if ctx.run_dir is not None:
        for u in uses:
            ep = read_json(RunDir(ctx.run_dir).stage(u).out / "endpoint.json")
            if ep and ep.get("url") and str(ep["url"]) not in urls:
                urls.append(str(ep["url"]))
    if urls:
        return urls
    serve = plan.settings.serve
    if serve.port:
        return [f"http://{serve.host}:{serve.port}"]
    raise InputError(
        "no server address: the service's endpoint.json is missing and [serve] port is 0; "
        "pass --server-url or set [regen] server_url"
    )
