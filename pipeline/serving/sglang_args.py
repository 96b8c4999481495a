"""The inference server's settings from the plan, and the SGLang launch command built from them.

``[serve]`` configures the server that regeneration uses; ``[deploy]`` adds the EAGLE-3 draft for
the deploy stage (``python -m pipeline.stages.serve --mode eagle3``)::

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
from typing import Any

from pipeline.run.plan import Plan, PlanError

BACKENDS = ("sglang", "local")
MODES = ("plain", "eagle3")
SERVE_KEYS = {
    "backend",
    "model",
    "host",
    "port",
    "tp",
    "mem_fraction_static",
    "context_length",
    "served_model_name",
    "startup_timeout_s",
    "health_interval_s",
    "health_timeout_s",
    "unhealthy_after",
    "stop_timeout_s",
    "extra_args",
    "dtype",
}


@dataclass(frozen=True)
class Speculative:
    draft_model_path: str
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4


@dataclass(frozen=True)
class ServerSettings:
    backend: str
    model: str
    host: str = "127.0.0.1"
    port: int = 30000
    tp: int = 1
    mem_fraction_static: float | None = None
    context_length: int | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    startup_timeout_s: float = 1800.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    unhealthy_after: int = 3  # consecutive failed probes after ready
    stop_timeout_s: float = 8.0  # SIGTERM -> wait -> SIGKILL for the server child
    extra_args: tuple[str, ...] = ()
    speculative: Speculative | None = None
    gpus: tuple[int, ...] = ()
    cpu_threads: int = 1  # the stage's CPU slots: compute threads of a CPU backend

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _get(
    plan: Plan,
    table: str,
    sec: dict[str, Any],
    key: str,
    types: type | tuple[type, ...],
    what: str,
    default: Any,
) -> Any:
    if key not in sec:
        return default
    v = sec[key]
    tt = types if isinstance(types, tuple) else (types,)
    if (isinstance(v, bool) and bool not in tt) or not isinstance(v, tt):
        raise PlanError(plan.path, f"{table}.{key}", f"expected {what}, got {v!r}")
    return v


def _positive(plan: Plan, key: str, v: float | int | None, allow_zero: bool = False) -> None:
    if v is not None and (v < 0 or (v == 0 and not allow_zero)):
        raise PlanError(plan.path, key, f"must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


def settings_from_plan(
    plan: Plan, mode: str = "plain", gpus: tuple[int, ...] = (), draft: str | None = None, cpu: int = 1
) -> ServerSettings:
    """Read ``[serve]`` (and ``[deploy]`` for ``mode="eagle3"``) into :class:`ServerSettings`."""
    if mode not in MODES:
        raise PlanError(plan.path, "serve", f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    sec = plan.section("serve")
    for k in sec:
        if k not in SERVE_KEYS:
            raise PlanError(plan.path, f"serve.{k}", f"unknown key (known: {', '.join(sorted(SERVE_KEYS))})")
    backend = _get(plan, "serve", sec, "backend", str, "a string", "sglang")
    if backend not in BACKENDS:
        raise PlanError(plan.path, "serve.backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    model = _get(plan, "serve", sec, "model", str, "a string (hub id or path)", plan.target.get("model"))
    if not model:
        raise PlanError(plan.path, "serve.model", "no model: set [serve] model or [target] model")
    port = _get(plan, "serve", sec, "port", int, "an integer port (0 = pick a free one)", 30000)
    if not 0 <= port <= 65535:
        raise PlanError(plan.path, "serve.port", f"{port} is not a TCP port")
    tp = _get(plan, "serve", sec, "tp", int, "an integer", max(1, len(gpus)))
    _positive(plan, "serve.tp", tp)
    if gpus and tp > len(gpus):
        raise PlanError(
            plan.path, "serve.tp", f"tp {tp} needs {tp} GPUs but the stage has {len(gpus)}: {list(gpus)}"
        )
    mem = _get(plan, "serve", sec, "mem_fraction_static", (int, float), "a fraction", None)
    if mem is not None and not 0 < mem < 1:
        raise PlanError(plan.path, "serve.mem_fraction_static", f"must be between 0 and 1, got {mem!r}")
    ctx_len = _get(plan, "serve", sec, "context_length", int, "an integer", plan.target.get("max_length"))
    _positive(plan, "serve.context_length", ctx_len)
    extra = _get(plan, "serve", sec, "extra_args", list, "a list of strings", [])
    for i, a in enumerate(extra):
        if not isinstance(a, str):
            raise PlanError(plan.path, f"serve.extra_args[{i}]", f"expected a string, got {a!r}")
    num = (int, float)
    s = ServerSettings(
        backend=backend,
        model=model,
        host=_get(plan, "serve", sec, "host", str, "a string", "127.0.0.1"),
        port=port,
        tp=tp,
        mem_fraction_static=float(mem) if mem is not None else None,
        context_length=ctx_len,
        served_model_name=_get(plan, "serve", sec, "served_model_name", str, "a string", None),
        dtype=_get(plan, "serve", sec, "dtype", str, "a string", None),
        startup_timeout_s=float(_get(plan, "serve", sec, "startup_timeout_s", num, "seconds", 1800.0)),
        health_interval_s=float(_get(plan, "serve", sec, "health_interval_s", num, "seconds", 2.0)),
        health_timeout_s=float(_get(plan, "serve", sec, "health_timeout_s", num, "seconds", 5.0)),
        unhealthy_after=_get(plan, "serve", sec, "unhealthy_after", int, "an integer", 3),
        stop_timeout_s=float(_get(plan, "serve", sec, "stop_timeout_s", num, "seconds", 8.0)),
        extra_args=tuple(extra),
        gpus=tuple(gpus),
        cpu_threads=max(1, cpu),
    )
    for k in (
        "startup_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "unhealthy_after",
        "stop_timeout_s",
    ):
        _positive(plan, f"serve.{k}", getattr(s, k))
    if mode == "eagle3":
        s = _with_speculative(plan, s, draft)
    return s


def _with_speculative(plan: Plan, s: ServerSettings, draft: str | None) -> ServerSettings:
    dep = plan.section("deploy")
    path = draft or _get(plan, "deploy", dep, "draft_model_path", str, "a path", None)
    if not path:
        raise PlanError(plan.path, "deploy.draft_model_path", "--mode eagle3 needs the draft checkpoint path")
    if not Path(path).expanduser().is_absolute():
        path = str(plan.path.parent.absolute() / path)
    vals = {}
    for key, default in (
        ("speculative_num_steps", 3),
        ("speculative_eagle_topk", 1),
        ("speculative_num_draft_tokens", 4),
    ):
        vals[key] = _get(plan, "deploy", dep, key, int, "an integer", default)
        _positive(plan, f"deploy.{key}", vals[key])
    spec = Speculative(
        path,
        vals["speculative_num_steps"],
        vals["speculative_eagle_topk"],
        vals["speculative_num_draft_tokens"],
    )
    port = _get(plan, "deploy", dep, "port", int, "an integer port", s.port)
    return replace(s, speculative=spec, port=port)


def sglang_argv(s: ServerSettings, python: str = "python3") -> list[str]:
    """``python -m sglang.launch_server …`` for these settings (``port`` must be concrete)."""
    argv = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.model,
        "--tp",
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
        sp = s.speculative
        argv += [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            sp.draft_model_path,
            "--speculative-num-steps",
            str(sp.num_steps),
            "--speculative-eagle-topk",
            str(sp.eagle_topk),
            "--speculative-num-draft-tokens",
            str(sp.num_draft_tokens),
        ]
    return argv + list(s.extra_args)
