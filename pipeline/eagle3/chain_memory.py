"""The deep check's GPU memory line (:mod:`.chain_check`): what each rank holds to capture the target and to
train the draft, by the engine the plan captures with, against ``resources.gpu_memory_gb``, and what would
fit instead; then whether the offline bench stages hold the target (:mod:`.bench_fit`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline import tested_versions
from pipeline.eagle3.bench_fit import check_offline_bench
from pipeline.run.hosts.checks import CheckReport
from pipeline.run.plan import dag as plan_mod


@dataclass
class DeepTarget:
    """The target as the deep check sees it: its folder and config, built on the meta device."""

    folder: Path
    cfg: Any
    cls: Any
    meta: Any
    tcfg: Any  # the text model's config (``text_config`` of a multimodal one)

    @property
    def cfg_file(self) -> Path:
        return self.folder / "config.json"

    @property
    def text_prefix(self) -> str:
        return "text_config." if self.tcfg is not self.cfg else ""

    @property
    def n_layers(self) -> int:
        return int(self.tcfg.num_hidden_layers)

    @property
    def hidden(self) -> int:
        return int(self.tcfg.hidden_size)

    @property
    def vocab(self) -> int:
        return int(self.tcfg.vocab_size)


@dataclass(frozen=True)
class DraftSize:
    """The EAGLE-3 draft the plan will train: its config, draft vocabulary and trainable parameters."""

    cfg: Any
    vocab_size: int
    params: int


def _alternatives(sg: Any, act: int, training: int, tp: int, gpu_gb: float | None, tf: Any = None) -> str:
    """What would fit instead: more GPUs for this engine, or SGLang, which keeps packed weights packed."""
    from pipeline.run.supervise import budget

    out = []
    if gpu_gb is None:
        return "set resources.gpu_memory_gb to see what would fit"
    cap = int(float(gpu_gb) * 1e9) - act
    if tf is not None and not tf.problem:
        n = tf.min_ranks(cap)
        out.append(
            f"transformers would need {n} GPUs of {gpu_gb:g} GB"
            if n
            else "no number of such GPUs holds it with transformers"
        )
    s_rank = sg.per_rank(tp) + act
    if tf is None:  # the plan already captures through SGLang: how many GPUs it would take
        n = sg.min_ranks(cap)
        out.append(f"SGLang would need {n} GPUs of {gpu_gb:g} GB" if n else "no number of such GPUs holds it")
    verdict = "fits" if max(s_rank, training) <= gpu_gb * 1e9 else "does not fit" + (" either" if tf else "")
    out.append(
        f"SGLang keeps the INT4 experts packed: {budget.human_bytes(s_rank)} per rank on {tp} GPUs, {verdict}"
        + ("" if tf is None else ' (target.engine = "sglang" captures through it)')
    )
    return "; ".join(out)


@dataclass(frozen=True)
class _Memory:
    """What each GPU rank holds: capturing (the target's shard and activations) and training (the draft, AdamW
    and activations), with the target's layout under the plan's engine and under SGLang."""

    held: Any  # the layout of the engine the plan captures with
    sg: Any  # SGLang's layout
    tf: Any  # transformers' layout (None: its quantizer cannot be built here)
    tp: int
    act: int  # capture activations per rank
    capture: int
    draft_state: int
    train_act: int
    training: int
    micro_batch: int
    seq: int


def gpu_memory(
    plan: plan_mod.Plan,
    t: DeepTarget,
    aux: list[int],
    draft: DraftSize,
    max_len: int,
    rep: CheckReport,
    numbers: dict[str, Any],
) -> None:
    """GPU memory per rank, capture and training, against ``resources.gpu_memory_gb``; then whether the
    offline bench stages hold the target."""
    mem = _memory(plan, t, aux, draft, max_len, rep, numbers)
    if mem is None:
        return
    _versions_line(rep)
    where, gpu_gb = str(plan.path), plan.resources.gpu_memory_gb
    capture, training, online_training = mem.capture, mem.training, 0
    if plan.settings.train.online_tp:
        # Every rank holds its target shard *and* trains its draft replica at the same time.
        capture += training
        numbers["online_tp_bytes_per_rank"] = capture
        online_training, training = training, 0
    detail = _memory_detail(plan, t, mem, capture)
    dequantized = ""
    if mem.held is mem.tf and mem.tf.dequantized:
        dequantized += (
            f"; transformers holds the INT4 routed experts dequantized to bf16 "
            f"({_human_bytes(mem.tf.dequantized)}, 3.56x their packed size)"
        )
    worst = max(capture, training)
    fits = gpu_gb is None or worst <= float(gpu_gb) * 1e9
    engine_problem = mem.held.problem
    if gpu_gb is not None or engine_problem:
        ok = fits and not engine_problem
        alt = _alternatives(
            mem.sg,
            mem.act + online_training,
            training,
            mem.tp,
            gpu_gb,
            mem.held if mem.held is mem.tf else None,
        )
        rep.add(
            "gpu memory",
            ok,
            ("" if ok else f"{where}: ")
            + detail
            + (f" vs {gpu_gb:g} GB per GPU (resources.gpu_memory_gb)" if gpu_gb is not None else "")
            + ("" if fits else f"; {_human_bytes(worst)} does not fit")
            + dequantized
            + (f"; {engine_problem}" if engine_problem else "")
            + ("" if ok else f"; {alt}"),
        )
    else:
        rep.add(
            "gpu memory", True, detail + " (set resources.gpu_memory_gb to have it checked)", warning=True
        )
    check_offline_bench(plan, t.cfg, t.cls, gpu_gb, rep, where)


def _human_bytes(n: float) -> str:
    from pipeline.run.supervise import budget

    return budget.human_bytes(n)


def _memory(
    plan: plan_mod.Plan,
    t: DeepTarget,
    aux: list[int],
    draft: DraftSize,
    max_len: int,
    rep: CheckReport,
    numbers: dict[str, Any],
) -> _Memory | None:
    """The per-rank bytes of capture and training (into ``numbers``); None where the plan's engine cannot
    read the checkpoint's quantization here (a FAIL line says so)."""
    from pipeline.eagle3.target_memory import sglang_layout, transformers_layout

    ext, tr = plan.settings.extract, plan.settings.train
    # Ranks holding a shard of the target: training's under online-tp, else the extraction's.
    tp = tr.nproc if tr.online_tp else (ext.tp_size or len(plan.gpus) or 1) if ext.parallel == "tp" else 1
    engine = plan.target.engine
    try:
        tf = transformers_layout(t.cfg, t.cls, tp)  # what the transformers engine really holds
    except ImportError as exc:
        tf = None  # the quantizer is transformers' business: an SGLang plan reads SGLang's layout below
        if engine != "sglang":
            rep.add(
                "gpu memory",
                False,
                f"{plan.path}: target.model: {t.cfg_file}: quantization_config: the checkpoint's "
                f"quantizer cannot be built here: {exc}",
            )
            return None
    sg = sglang_layout(t.meta, t.cfg)
    held = sg if engine == "sglang" or tf is None else tf  # the layout of the engine the plan captures with
    hidden, vocab, h, dv = t.hidden, t.vocab, draft.cfg.hidden_size, draft.vocab_size
    act = ext.batch_tokens * hidden * 2 * 8  # a few live (tokens x hidden) bf16 buffers per layer step
    act += ext.batch_tokens * len(aux) * hidden * 2
    capture = held.per_rank(tp) + act
    mb, ttt, seq = tr.micro_batch, tr.ttt_steps, tr.max_length or max_len
    draft_state = (
        draft.params * 16 + vocab * h * 2
    )  # fp32 weights + grads + AdamW m, v; bf16 frozen embedding
    train_act = (
        mb * seq * (dv * 4 * 3 + ttt * h * 2 * 12)
    )  # fp32 logits of one TTT step alive + per-step activations
    training = draft_state + train_act + dv * h * 4
    numbers.update(
        capture_bytes_per_rank=capture,
        training_bytes_per_rank=training,
        tp_size=tp,
        engine=engine,
        target_sharded_bytes=held.sharded,
        target_replicated_bytes=held.replicated,
        target_dequantized_bytes=held.dequantized,
        sglang_bytes_per_rank=sg.per_rank(tp) + act,
    )
    return _Memory(held, sg, tf, tp, act, capture, draft_state, train_act, training, mb, seq)


def _versions_line(rep: CheckReport) -> None:
    # The per-rank split is read from the installed transformers' TP plan; a release Aerie was not
    # tested with may shard differently (5.25 moved DeepSeek-V3's routed experts to an EP plan): say so.
    notes = tested_versions.untested()
    rep.add(
        "versions",
        True,
        "; ".join(notes) + "; the per-rank memory below follows this release's TP plan, checked only on the "
        "tested releases (docs/testing.md, Versions)"
        if notes
        else ", ".join(f"{p} {tested_versions.installed(p)}" for p in tested_versions.TESTED) + " (tested)",
        warning=bool(notes),
    )


def _memory_detail(plan: plan_mod.Plan, t: DeepTarget, mem: _Memory, capture: int) -> str:
    """The gpu memory line's account: what a rank holds, part by part."""
    from pipeline.eagle3.target_memory import quantization_of

    hb, tp, held = _human_bytes, mem.tp, mem.held
    if plan.settings.train.online_tp:
        return (
            f"online-tp, per rank: target shard {hb(held.sharded // tp)} + replicated "
            f"{hb(held.replicated)} + capture activations {hb(mem.act)} + draft and "
            f"AdamW {hb(mem.draft_state)} + training activations {hb(mem.train_act)} "
            f"(micro_batch {mem.micro_batch} x {mem.seq} tokens) = {hb(capture)} (TP {tp})"
        )
    return (
        f"capture{' through SGLang' if held is mem.sg else ''} {hb(capture)} per rank "
        f"(TP {tp}: {hb(held.sharded // tp)} sharded + "
        f"{hb(held.replicated)} replicated + activations"
        + ("; quantized experts packed" if held is mem.sg and quantization_of(t.cfg) is not None else "")
        + "); training "
        f"{hb(mem.training)} per rank (draft + AdamW {hb(mem.draft_state)}, activations "
        f"at micro_batch {mem.micro_batch} x {mem.seq} tokens)"
    )
