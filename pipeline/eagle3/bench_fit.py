"""Whether the plan's offline bench stages can hold the target: part of the deep check (``chain_check``).

The offline bench decodes with the target loaded through transformers (tensor-parallel under ``[bench] parallel
= "tp"``), whatever ``target.engine`` the extraction uses. For Kimi-K2.5 that is the dequantized ≈2 TB, so a plan
that captures through SGLang would pass the capture check and fail at its last stage, days in; this check says so
at plan time and names the way out, the online bench through SGLang.
"""

from __future__ import annotations

from typing import Any

from pipeline.run.hosts.checks import CheckReport
from pipeline.run.plan import dag as plan_mod
from pipeline.run.supervise import budget


def offline_bench_stages(plan: plan_mod.Plan) -> list[str]:
    """The plan's bench stages that decode offline (``--mode`` in their args, else ``[bench]``'s mode): they load
    the target through transformers, whatever ``target.engine`` the extraction uses."""
    default = "online" if plan.settings.bench.online else "offline"
    ids = []
    for st in plan.stages:
        if st.run != "bench":
            continue
        mode = default
        for i, a in enumerate(st.args):  # argparse's two spellings: --mode online, --mode=online
            if a == "--mode" and i + 1 < len(st.args):
                mode = st.args[i + 1]
            elif a.startswith("--mode="):
                mode = a.split("=", 1)[1]
        if mode == "offline":
            ids.append(st.id)
    return ids


def check_offline_bench(
    plan: plan_mod.Plan, cfg: Any, cls: Any, gpu_gb: float | None, rep: CheckReport, where: str
) -> None:
    """The offline bench holds the whole target through transformers (tensor-parallel with ``[bench] parallel``):
    a plan whose extraction fits only under SGLang would otherwise pass here and fail at its last stage, days in."""
    from pipeline.eagle3.target_memory import transformers_layout

    stages = offline_bench_stages(plan)
    if not stages:
        return
    b = plan.settings.bench
    tp = (b.tp_size or len(plan.gpus) or 1) if b.parallel == "tp" else 1
    try:
        layout = transformers_layout(cfg, cls, tp)
    except ImportError as exc:
        problem: str | None = f"the checkpoint's quantizer cannot be built here: {exc}"
        need = None
    else:
        problem, need = layout.problem, layout.per_rank(tp)
    if gpu_gb is None and problem is None:
        return
    fits = problem is None and (gpu_gb is None or (need is not None and need <= float(gpu_gb) * 1e9))
    what = (
        f"stage {', '.join(stages)}: the offline bench loads the target through transformers (TP {tp})"
        + (f": {budget.human_bytes(need)} per rank" if need is not None else "")
        + (f" vs {gpu_gb:g} GB per GPU" if gpu_gb is not None else "")
        + (f"; {problem}" if problem else "")
    )
    rep.add(
        "bench",
        fits,
        what
        if fits
        else f'{where}: {what}; measure the draft through SGLang instead: [bench] engine = "sglang" with a plain '
        'and an eagle3 serve stage (docs/eagle3.md, "Online deploy benchmark")',
    )
