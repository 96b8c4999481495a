"""The command and environment that start each server backend.

``sglang``: ``python -m sglang.launch_server …`` from :func:`pipeline.serving.sglang_args.sglang_argv`, on
the stage's GPUs (``CUDA_VISIBLE_DEVICES`` in NVML order). ``local``: ``transformers serve`` on
the CPU with the model preloaded, an OpenAI-compatible server on the same ``/health`` and
``/v1/chat/completions`` paths; a ``builtin:`` model resolves to the cached dense folder
(:mod:`pipeline.data.model_assets`), since transformers cannot serve the GGUF directly. Its compute
threads are the stage's CPU slots (``OMP_NUM_THREADS``, unless already set): with torch's default of
one thread per core, two requests generating at once on a busy shared 2-core machine were measured
~400x slower than with one thread each (docs/performance.md; on an idle machine 1.5x faster). Its threads
sleep between parallel regions (``OMP_WAIT_POLICY=PASSIVE``, unless already set): spinning ones beside another
busy process took 4-5x the CPU for the same decoding (docs/performance.md, "OpenMP threads that wait").
"""

from __future__ import annotations

import os

from pipeline.serving.sglang_args import ServerSettings, sglang_argv


def local_argv(s: ServerSettings, python: str) -> list[str]:
    from pipeline.data.model_assets import resolve

    argv = [
        python,
        "-m",
        "transformers.cli.transformers",
        "serve",
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--device",
        "cuda" if s.gpus else "cpu",
        "--log-level",
        "info",
    ]
    if s.dtype:
        argv += ["--dtype", s.dtype]
    return [*argv, *s.extra_args, resolve(s.model)]


def launch(s: ServerSettings, python: str) -> tuple[list[str], dict[str, str]]:
    """``(argv, env additions)`` for the server child."""
    env: dict[str, str] = {}
    if s.gpus:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbering = NVML numbering = the plan's GPU ids
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, s.gpus))
    if s.backend == "local":
        env.update({"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"})
        if not s.gpus and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(s.cpu_threads)
            if "OMP_WAIT_POLICY" not in os.environ:  # sleeping, not spinning, between parallel regions
                env["OMP_WAIT_POLICY"] = "PASSIVE"
        return local_argv(s, python), env
    return sglang_argv(s, python), env
