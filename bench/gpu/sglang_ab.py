"""Plain vs EAGLE-3 server variants on the structured 8B target, and a torch-profiler trace of decode rounds (issue 38).

Phase ``ab`` of ``python -m bench.gpu.sglang_serve`` (its servers, settings, throughput and result file come
from the harness and ``sglang_setup``/``sglang_client``). It needs the structured target and its draft from ``--phases plain,data,train`` on the same warm machine.
Each variant of ``--variants`` is ``MODE:BACKEND[:FLAG=VALUE...]``, e.g. ``eagle3:flashinfer`` or
``eagle3:triton:disable-overlap-schedule`` (a flag without ``=`` is passed bare): one server start, then each batch
measured ``--repeats`` times after a warm-up (``throughput``: client tok/s, the counters' accept length and the
server log's own ``gen throughput``), then — with ``--profile-batch`` — SGLang's ``/start_profile`` over a few
decode rounds at that batch, the trace copied to ``$OUT/trace_<variant>.json.gz``. A variant that fails (a
backend that does not start) is recorded with its error and the next one runs. ``bench/gpu/sglang_trace.py`` reads
the traces.
"""

from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from bench.gpu.results import RESULTS, save_results
from bench.gpu.runner import BASE, OUT, log
from bench.gpu.server import Server, http_post
from bench.gpu.sglang_client import chat_prompts, throughput
from bench.gpu.sglang_setup import key, settings, target_name, work_dir

PROFILE_STEPS = 12


def parse_variant(text: str) -> tuple[str, str, str, tuple[str, ...]]:
    """``MODE:BACKEND[:FLAG=VALUE...]`` -> (name, mode, backend, launch flags)."""
    parts = text.split(":")
    if len(parts) < 2 or parts[0] not in ("plain", "eagle3"):
        raise SystemExit(f"--variants: {text!r} is not MODE:BACKEND[:FLAG=VALUE...] (MODE plain or eagle3)")
    flags: list[str] = []
    for f in parts[2:]:
        k, _, v = f.partition("=")
        flags += [f"--{k}", v] if v else [f"--{k}"]
    name = "_".join(p.replace("=", "-") for p in parts)
    return name, parts[0], parts[1], tuple(flags)


def profile_rounds(srv: Any, prompts: list[str], batch: int, name: str) -> dict[str, Any]:
    """``batch`` long greedy requests; once they decode, ``/start_profile`` for ``PROFILE_STEPS`` scheduler steps
    (CPU + GPU activities, no stacks); returns where the trace went and the wall time of the profiled load."""
    d = BASE / "prof" / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    done: list[Any] = []

    def one(k: int) -> None:
        done.append(
            srv.generate(
                {
                    "text": prompts[(k + 3) % len(prompts)],
                    "sampling_params": {"max_new_tokens": 768, "temperature": 0.0, "ignore_eos": True},
                }
            )
        )

    ts = [threading.Thread(target=one, args=(k,)) for k in range(batch)]
    for t in ts:
        t.start()
    time.sleep(1.0)  # past the prefills: the profiled steps are decode rounds
    r: dict[str, Any] = {"batch": batch, "steps": PROFILE_STEPS}
    try:
        http_post(
            f"{srv.s.url}/start_profile",
            {
                "output_dir": str(d),
                "num_steps": PROFILE_STEPS,
                "activities": ["CPU", "GPU"],
                "with_stack": False,
                "record_shapes": False,
            },
            timeout=60,
        )
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the trace
        r["error"] = f"start_profile: {type(e).__name__}: {e}"
    for t in ts:
        t.join()
    deadline = time.monotonic() + 60
    files: list[Path] = []
    while time.monotonic() < deadline:
        files = sorted(p for p in d.rglob("*") if p.is_file() and p.stat().st_size > 0)
        if files and all(_stable(p) for p in files):
            break
        time.sleep(1)
    r["files"] = [str(p.relative_to(d)) for p in files]
    for i, p in enumerate(files):
        dest = OUT / (f"trace_{name}" + (f"_{i}" if i else "") + "".join(p.suffixes))
        shutil.copy2(p, dest)
        r.setdefault("copied", []).append(dest.name)
    log(f"{name}: profile {r.get('files')} {r.get('error', '')}")
    return r


def _stable(p: Path) -> bool:
    a = p.stat().st_size
    time.sleep(0.5)
    return p.stat().st_size == a


def phase_ab(args: argparse.Namespace) -> None:
    name = target_name(args)
    model = BASE / "models" / name
    draft = work_dir(args) / "train" / "draft"
    prompts = chat_prompts(model, json.loads((work_dir(args) / "heldout.json").read_text()))
    out = RESULTS.setdefault(key(args, "ab"), {})
    for text in args.variants.split(","):
        vname, mode, backend, flags = parse_variant(text)
        t0 = time.monotonic()
        res: dict[str, Any] = {"mode": mode, "backend": backend, "flags": list(flags)}
        try:
            srv = Server(
                f"ab_{vname}",
                settings(
                    model,
                    30004,
                    args,
                    draft if mode == "eagle3" else None,
                    args.specs[0],
                    backend=backend,
                    more=flags,
                ),
                args.start_timeout,
                args.dump_after,
            )
        except Exception as e:  # noqa: BLE001 - record, go on with the next variant
            res["error"] = f"{type(e).__name__}: {e}"
            out[vname] = res
            log(f"{vname}: FAILED to start: {e}")
            save_results()
            continue
        try:
            res["start_s"] = round(srv.start_s, 1)
            res["throughput"] = [
                throughput(srv, prompts, b, args.max_new_tokens, args.per_stream, args.warmup)
                for b in args.batches
                for _ in range(args.repeats)
            ]
            if args.profile_batch:
                res["profile"] = profile_rounds(srv, prompts, args.profile_batch, vname)
        except Exception as e:  # noqa: BLE001
            res["error"] = f"{type(e).__name__}: {e}"
            log(f"{vname}: FAILED: {e}")
        finally:
            srv.stop()
            res["held_s"] = round(time.monotonic() - t0, 1)
            out[vname] = res
            save_results()
