"""The deep plan check: what the EAGLE-3 stages will do with this plan's target, before hours are spent.

``python -m pipeline.eagle3.chain_check PLAN [--json]`` (run by ``aerie plan check --deep`` and by
``aerie preflight`` on the host). A plan that runs SGLang also gets the installed SGLang against the
tested-versions table (``sglang``: :mod:`pipeline.tested_versions`). Reads the target's ``config.json`` and tokenizer from a local
folder or the local Hugging Face cache — never a download — builds the model on the meta device
(no memory, no weights) and checks the chain: the architecture is one Aerie can capture, the aux
layers are in range, the draft config it will build, the draft vocabulary fits the target's, what the
plan's draft method checks of its own draft (its :meth:`~pipeline.run.plan.sections.DraftSettings.deep_check`,
looked up by ``[train] draft``: DFlash's target layers and block), the chat template renders a two-turn conversation, the offline hidden states fit the disk, what each GPU
rank holds for capture and training, and whether offline bench stages hold the target (``bench_fit``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.eagle3 import serving_checks
from pipeline.eagle3.chain_memory import DeepTarget, DraftSize, gpu_memory
from pipeline.eagle3.provenance import local_model_dir
from pipeline.run.hosts.checks import CheckReport
from pipeline.run.plan import dag as plan_mod

GiB = 1024**3


@dataclass
class Report(CheckReport):
    """The deep check's report: the checks, and the numbers they were computed from (``--json``)."""

    numbers: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, plan: str) -> Report:
        return cls(title=f"deep check of {plan}:")

    def render(self) -> str:
        tail = "ok: the chain can run" if self.ok else "not ok: fix the FAIL lines above"
        return "\n".join([*self.lines(), tail])


def check(plan: plan_mod.Plan, free_bytes: int | None = None) -> Report:
    """Run every check; ``free_bytes`` overrides the free space measured at the run directory.

    Never raises: whatever a malformed target makes fail is a FAIL line naming the plan and the config file
    (:mod:`pipeline.eagle3.target_config_check` names the field for every malformation it knows)."""
    rep = Report.of(str(plan.path))
    serving_checks.sglang_line(plan, rep)
    serving_checks.draft_line(plan, rep)
    try:
        _check(plan, free_bytes, rep)
    except Exception as exc:  # noqa: BLE001 - the report is the answer, never a traceback
        model = str(plan.target.model or "")
        folder = local_model_dir(model) if model else None
        rep.add(
            "deep check",
            False,
            f"{plan.path}: target.model: {folder / 'config.json' if folder else model}: the check stopped at "
            f"{type(exc).__name__}: {exc} (a malformed target this check does not name field by field yet)",
        )
    return rep


def _check(plan: plan_mod.Plan, free_bytes: int | None, rep: Report) -> None:
    t = _target(plan, rep)
    if t is None:
        return
    aux = _aux_layers(plan, t, rep)
    if aux is None:
        return  # too few layers for any draft: nothing below can be sized
    draft = _draft(plan, t, aux, rep)
    _method(plan, t, aux, rep)
    ct = _chat_template(plan, t, rep)
    max_len = _disk(plan, t, aux, ct, free_bytes, rep)
    gpu_memory(plan, t, aux, draft, max_len, rep, rep.numbers)


def _target(plan: plan_mod.Plan, rep: Report) -> DeepTarget | None:
    """The target's config checked and its model built on the meta device; None (a FAIL line said why)."""
    import torch

    from pipeline.data import model_assets
    from pipeline.eagle3.target_capture import TargetError, tensor_roles, text_backbone
    from pipeline.eagle3.target_config_check import config_problems

    where = str(plan.path)
    model = str(plan.target.model or "")
    folder = local_model_dir(model) if model else None
    if folder is None or not (folder / "config.json").is_file():
        rep.add(
            "target",
            False,
            f"{where}: target.model: {model or '(not set)'}: no config.json in a local folder or "
            "the local Hugging Face cache (download it first: nothing is fetched here)",
        )
        return None
    problems = config_problems(
        folder / "config.json", plan.target.trust_remote_code
    )  # before transformers builds anything from it
    for problem in problems:
        rep.add("config", False, f"{where}: target.model: {problem}")
    if problems:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    trc = plan.target.trust_remote_code
    try:
        cfg = model_assets.model_config(str(folder), trust_remote_code=trc)
        cls = model_assets.model_class(cfg)
        with torch.device("meta"):
            meta = cls.from_config(cfg)
        text_backbone(meta)
        roles = tensor_roles(str(folder), meta, trust_remote_code=trc)
    except (model_assets.ModelAssetError, TargetError, ValueError, OSError) as exc:
        named = str(exc).startswith("target.")  # model_assets names the plan key that decides it
        rep.add("architecture", False, f"{where}: {'' if named else 'target.model: '}{exc}")
        return None
    t = DeepTarget(folder, cfg, cls, meta, getattr(cfg, "text_config", None) or cfg)
    total = sum(p.numel() for p in meta.parameters())
    rep.add(
        "architecture",
        True,
        f"{t.tcfg.model_type} ({type(meta).__name__}): {t.n_layers} layers, hidden {t.hidden}, "
        f"vocab {t.vocab}, {total / 1e9:.1f}B parameters; final norm {roles['norm']}",
    )
    return t


def _aux_layers(plan: plan_mod.Plan, t: DeepTarget, rep: Report) -> list[int] | None:
    """The aux layers the extraction captures, and whether SGLang can feed them (the default where the
    plan's are out of range); None where the target has too few layers for any draft."""
    from pipeline.eagle3.draft_config import (
        DraftModelError,
        default_aux_layers,
        normalise_aux_layers,
        sglang_capture_ids,
    )
    from pipeline.serving.sglang_capture import SGLANG_RELEASE, architecture_of

    where, ext, n_layers = str(plan.path), plan.settings.extract, t.n_layers
    try:
        aux = (
            normalise_aux_layers(list(ext.aux_layers), n_layers, f"{where}: extract.aux_layers")
            if ext.aux_layers is not None
            else default_aux_layers(n_layers)
        )
        note = (
            ""
            if ext.aux_layers is None or list(ext.aux_layers) == aux
            else f" (plan order {list(ext.aux_layers)} sorted)"
        )
        arch = architecture_of(t.cfg) or architecture_of(t.tcfg)
        captured = sglang_capture_ids(aux, arch)  # raises where SGLang cannot be told to feed these layers
        rep.add(
            "aux layers",
            True,
            f"{aux}{note}; SGLang {SGLANG_RELEASE} ({arch or 'its default model class'}) captures the inputs "
            f"of layers {captured}",
        )
        return aux
    except DraftModelError as exc:
        layers = f"{t.cfg_file}: {t.text_prefix}num_hidden_layers"
        rep.add(
            "aux layers",
            False,
            f"{exc} ({layers} is {n_layers})"
            if ext.aux_layers is not None
            else f"{where}: target.model: {layers}: {exc}",
        )
        try:
            return default_aux_layers(n_layers)
        except DraftModelError:
            return None


def _draft(plan: plan_mod.Plan, t: DeepTarget, aux: list[int], rep: Report) -> DraftSize:
    """The draft vocabulary against the target's, and the draft's shape and trainable parameters."""
    from pipeline.eagle3.draft_config import DraftConfig

    dv, vocab = plan.settings.vocab.draft_vocab_size, t.vocab
    if dv > vocab:
        rep.add(
            "draft vocab",
            False,
            f"{plan.path}: vocab.draft_vocab_size: {dv!r} must be between 1 and the target's "
            f"vocabulary ({vocab}: {t.cfg_file}: {t.text_prefix}vocab_size)",
        )
        dv = vocab
    else:
        rep.add("draft vocab", True, f"{dv} of the target's {vocab} tokens")
    dcfg = DraftConfig.from_target(t.tcfg, dv, aux)
    h, nh, hd, inter = dcfg.hidden_size, dcfg.num_attention_heads, dcfg.head_dim, dcfg.intermediate_size
    draft_params = (
        3 * h * h
        + 2 * h * nh * hd * 2
        + 2 * h * dcfg.num_key_value_heads * hd
        + nh * hd * h
        + 3 * h * inter
        + dv * h
    )
    rope = (dcfg.rope_scaling or {}).get("rope_type", (dcfg.rope_scaling or {}).get("type", "default"))
    rep.add(
        "draft",
        True,
        f"hidden {h}, {nh} heads x {hd}, {dcfg.num_key_value_heads} KV heads, MLP {inter}, "
        f"rope {rope} (theta {dcfg.rope_theta:g}), {draft_params / 1e9:.2f}B trainable parameters",
    )
    rep.numbers["draft_params"] = draft_params
    return DraftSize(dcfg, dv, draft_params)


def _method(plan: plan_mod.Plan, t: DeepTarget, aux: list[int], rep: Report) -> None:
    """The plan's draft method's own lines (its settings' ``deep_check``): the check never names a method."""
    from pipeline.eagle3.bench_fit import offline_bench_stages
    from pipeline.run.plan.sections import DeepFacts
    from pipeline.serving.sglang_capture import SGLANG_RELEASE

    train = plan.settings.train
    facts = DeepFacts(
        plan_file=str(plan.path),
        config_file=str(t.cfg_file),
        text_prefix=t.text_prefix,
        num_layers=t.n_layers,
        vocab_size=t.vocab,
        aux_layers=tuple(aux),
        offline_bench_stages=tuple(offline_bench_stages(plan)),
        bench_steps=plan.settings.bench.steps,
        sglang_release=SGLANG_RELEASE,
    )
    for line in train.method_settings().deep_check(train, facts):
        rep.add(line.name, line.ok, line.detail, warning=line.warning)


def _chat_template(plan: plan_mod.Plan, t: DeepTarget, rep: Report) -> Any:
    """The tokenizer and its chat template on a two-turn conversation; the chat tokenizer, or None."""
    from pipeline.data import model_assets
    from pipeline.eagle3.target_config_check import tokenizer_problems

    where, model = str(plan.path), str(plan.target.model or "")
    ct: Any = None
    try:
        from pipeline.data import split_pattern
        from pipeline.data.tokenise import ChatTokenizer, load_hf_tokenizer

        tok = load_hf_tokenizer(str(t.folder), trust_remote_code=plan.target.trust_remote_code)
        problems = tokenizer_problems(t.cfg_file, t.text_prefix, t.vocab, tok)
        for problem in problems:
            rep.add("tokenizer", False, f"{where}: target.model: {problem}")
        if (
            not problems
        ):  # which tokenizer, and how it cuts text (Kimi: its own split pattern, read from its code)
            said, warn = split_pattern.describe(tok)
            rep.add("tokenizer", True, said, warning=warn)
        ct = ChatTokenizer(tok, plan.target.row_length, tokenizer_id=model)
        conv = [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "content": "6."},
        ]
        enc = ct.encode([conv])[0]
        if isinstance(enc, Exception):
            raise ValueError(str(enc))
        rep.add(
            "chat template",
            bool(enc.target_tokens),
            f"a two-turn conversation renders to {enc.num_tokens} tokens, "
            f"{enc.target_tokens} of them trained (assistant)",
        )
    except model_assets.ModelAssetError as exc:  # names its plan key (trust_remote_code, tiktoken)
        rep.add("chat template", False, f"{where}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any template/tokenizer failure is this check's finding
        rep.add(
            "chat template",
            False,
            f"{where}: target.model: the tokenizer or its chat template fails: {type(exc).__name__}: {exc}",
        )
    return ct


def _disk(
    plan: plan_mod.Plan, t: DeepTarget, aux: list[int], ct: Any, free_bytes: int | None, rep: Report
) -> int:
    """Offline hidden states for the planned rows, against free space at the run directory; returns the
    extraction's row length."""
    from pipeline.data import token_estimate
    from pipeline.eagle3 import hidden_store as hs
    from pipeline.run.supervise import budget

    ext = plan.settings.extract
    per_token = hs.bytes_per_token(t.hidden, len(aux))
    max_len = ext.max_length or plan.target.row_length
    rows = sum(int(d.quota or 0) for d in plan.datasets)
    if ct is not None:
        per_ds = token_estimate.estimate(plan, ct.encode, max_len, plan.settings.regen.max_tokens)
    else:  # the tokenizer failed above: every row at max_length
        per_ds = [
            token_estimate.DatasetTokens(d.name, d.quota * max_len, "assumed (no tokenizer)")
            for d in plan.datasets
        ]
    tokens = sum(d.tokens for d in per_ds)
    if ext.max_rows and rows:
        tokens = min(tokens, tokens * ext.max_rows // rows)
    tokens = min(tokens, ext.max_tokens) if ext.max_tokens else tokens
    assumed = [d.name for d in per_ds if d.assumed]
    rep.add(
        "tokens",
        True,
        f"{tokens:,} tokens to extract from {rows:,} rows: "
        + "; ".join(f"{d.name} {d.tokens:,} ({d.how})" for d in per_ds),
        warning=bool(assumed),
    )
    mode = plan.settings.storage_mode
    need = 0 if mode == "online" else tokens * per_token
    rep.numbers.update(bytes_per_token=per_token, tokens=tokens, hidden_state_bytes=need)
    if free_bytes is None:
        p = Path(plan.run_dir)
        while not p.exists() and p != p.parent:
            p = p.parent
        free_bytes = shutil.disk_usage(p).free
    reserve = budget.reserve_bytes(plan)
    if mode == "online":
        rep.add("disk", True, "online training: no hidden states are stored (0 B)")
    else:
        fits = need + reserve <= free_bytes
        rep.add(
            "disk",
            fits,
            f"{plan.path}: offline hidden states {budget.human_bytes(need)} ({per_token / 1000:.1f} KB/token x "
            f"{tokens:,} tokens of {rows:,} rows, see 'tokens') + reserve "
            f"{budget.human_bytes(reserve)} vs {budget.human_bytes(free_bytes)} free at the run "
            "directory" + ("" if fits else "; free space, lower the quotas or go online"),
        )
    return max_len


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.eagle3.chain_check", description=__doc__.splitlines()[0]
    )
    ap.add_argument("plan")
    ap.add_argument("--json", action="store_true", help="one JSON object: checks and numbers")
    ap.add_argument(
        "--free-bytes", type=int, default=None, help="use this free space instead of measuring it"
    )
    args = ap.parse_args(argv)
    try:
        plan = plan_mod.load(args.plan)
    except plan_mod.PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rep = check(plan, args.free_bytes)
    if args.json:
        print(json.dumps({**rep.to_dict(), "numbers": rep.numbers}))
    else:
        print(rep.render())
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
