"""The inference server's settings from the plan, and the SGLang launch command built from them.

``[serve]`` configures the server that regeneration uses; ``[deploy]`` adds the trained draft for
the deploy stage (``python -m pipeline.stages.serve --mode eagle3``), launched with its own method's flags
(:attr:`pipeline.drafts.registry.DraftMethod.serve_flags`, which the stage passes in: EAGLE-3's use
``[deploy]``'s steps, top-k and draft tokens; DFlash's its block size)::

    [serve]
    backend = "sglang"              # or "local": transformers serve on the CPU (demo, CI)
    model = "/models/Kimi-K2.5"     # default: [target] model
    host = "127.0.0.1"
    port = 30000                    # 0 = pick a free port at launch
    tp = 8                          # default: the stage's GPU count (1 without GPUs)
    mem_fraction_static = 0.85
    context_length = 8192           # default: [target] max_length
    startup_timeout_s = 1800        # no /health answer by then: unhealthy, stopped
    extra_args = ["--enable-metrics"]

    [deploy]
    draft_model_path = "/ckpt/epoch_3_step_9000"
    speculative_num_steps = 3
    speculative_eagle_topk = 1
    speculative_num_draft_tokens = 4

Every error names the plan file and the key. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.run.plan.dag import Plan, PlanError
from pipeline.run.plan.sections import ServeSection

MODES = ("plain", "eagle3")


@dataclass(frozen=True)
class Speculative:
    """The draft a speculative server loads, and its method's launch flags (all but the path)."""

    draft_model_path: str
    flags: tuple[str, ...]


def eagle3_flags(num_steps: int, eagle_topk: int, num_draft_tokens: int) -> tuple[str, ...]:
    """EAGLE-3's launch flags for a chain of ``num_steps`` (the bench scripts' spec sweep; the stages take a
    draft's flags from its method's spec)."""
    return (
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        str(num_steps),
        "--speculative-eagle-topk",
        str(eagle_topk),
        "--speculative-num-draft-tokens",
        str(num_draft_tokens),
    )


@dataclass(frozen=True)
class ServerSettings:
    """A server as one stage launches it: ``[serve]`` resolved for the stage's GPUs (defaults: ServeSection)."""

    backend: str
    model: str
    host: str = ServeSection.host
    port: int = ServeSection.port
    tp: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    startup_timeout_s: float = ServeSection.startup_timeout_s
    health_interval_s: float = ServeSection.health_interval_s
    health_timeout_s: float = ServeSection.health_timeout_s
    unhealthy_after: int = ServeSection.unhealthy_after  # consecutive failed probes after ready
    stop_timeout_s: float = ServeSection.stop_timeout_s  # SIGTERM -> wait -> SIGKILL for the server child
    extra_args: tuple[str, ...] = ()
    speculative: Speculative | None = None
    gpus: tuple[int, ...] = ()
    cpu_threads: int = 1  # the stage's CPU slots: compute threads of a CPU backend

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def settings_from_plan(
    plan: Plan,
    mode: str = "plain",
    gpus: tuple[int, ...] = (),
    draft: str | None = None,
    cpu: int = 1,
    flags: tuple[str, ...] | None = None,
) -> ServerSettings:
    """``[serve]`` (and ``[deploy]`` for ``mode="eagle3"``), checked when the plan loaded, resolved for a
    stage with these GPUs into :class:`ServerSettings`. ``flags``: the draft method's launch flags
    (:func:`draft_path` says which draft; its method's ``serve_flags`` says them); unset, EAGLE-3's from
    ``[deploy]``."""
    if mode not in MODES:
        raise PlanError(plan.path, "serve", f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    sec = plan.settings.serve
    model = sec.model or plan.target.model
    if not model:
        raise PlanError(plan.path, "serve.model", "no model: set [serve] model or [target] model")
    tp = sec.tp if sec.tp is not None else max(1, len(gpus))
    if gpus and tp > len(gpus):
        raise PlanError(
            plan.path, "serve.tp", f"tp {tp} needs {tp} GPUs but the stage has {len(gpus)}: {list(gpus)}"
        )
    s = ServerSettings(
        backend=sec.backend,
        model=model,
        host=sec.host,
        port=sec.port,
        tp=tp,
        mem_fraction_static=sec.mem_fraction_static,
        context_length=sec.context_length if sec.context_length is not None else plan.target.max_length,
        served_model_name=sec.served_model_name,
        dtype=sec.dtype,
        startup_timeout_s=sec.startup_timeout_s,
        health_interval_s=sec.health_interval_s,
        health_timeout_s=sec.health_timeout_s,
        unhealthy_after=sec.unhealthy_after,
        stop_timeout_s=sec.stop_timeout_s,
        extra_args=sec.extra_args,
        gpus=tuple(gpus),
        cpu_threads=max(1, cpu),
    )
    if mode == "eagle3":
        dep = plan.settings.deploy
        if flags is None:
            flags = eagle3_flags(
                dep.speculative_num_steps, dep.speculative_eagle_topk, dep.speculative_num_draft_tokens
            )
        spec = Speculative(draft_path(plan, draft), tuple(flags))
        s = replace(s, speculative=spec, port=dep.port if dep.port is not None else s.port)
    return s


def draft_path(plan: Plan, draft: str | None = None) -> str:
    """The draft the deploy serves: ``draft`` (the stage's ``--draft``) or ``[deploy] draft_model_path``,
    relative to the plan's folder."""
    path = draft or plan.settings.deploy.draft_model_path
    if not path:
        raise PlanError(plan.path, "deploy.draft_model_path", "--mode eagle3 needs the draft checkpoint path")
    if not Path(path).expanduser().is_absolute():
        path = str(plan.path.parent.absolute() / path)
    return path


def sglang_argv(s: ServerSettings, python: str = "python3") -> list[str]:
    """``python -m sglang.launch_server …`` for these settings (``port`` must be concrete)."""
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.model,
        "--tp-size",  # its declared name: "--tp" parses only as an argparse abbreviation
        str(s.tp),
        "--host",
        s.host,
        "--port",
        str(s.port),
    ]
    if s.mem_fraction_static is not None:
        argv += ["--mem-fraction-static", f"{s.mem_fraction_static:g}"]
    if s.context_length is not None:
        argv += ["--context-length", str(s.context_length)]
    if s.served_model_name:
        argv += ["--served-model-name", s.served_model_name]
    if s.dtype:
        argv += ["--dtype", s.dtype]
    if s.speculative is not None:
        argv += [*s.speculative.flags, "--speculative-draft-model-path", s.speculative.draft_model_path]
    return argv + list(s.extra_args)
