"""SGLang on the lent H200 (issue 26): start it with the serve stage's own argv, measure plain vs EAGLE-3 decoding.

``python bench/gpu_sglang.py --stage-from .gpu-stage/c1 --stage-from .gpu-stage/c2 [--phases smollm2,plain,data,train,eagle3]
[--batches 1,8,32] [--specs 3/1/4,...]`` — on the device, one ``run`` call carrying ``.gpu-stage/c1`` and
``.gpu-stage/c2`` (~57 MB together with the repo), made by ``bash bench/gpu_sglang_stage.sh`` here; all phases take
~10 minutes, so split them over back-to-back calls (``--phases smollm2,plain,data`` then ``--phases train,eagle3``,
issued within the 30 s the machine stays warm; later calls need no ``--stage-from``).

SGLang itself is assembled here by ``bench/gpu_sglang_stage.sh`` (wheels → one trimmed site folder → xz → chunk
folders ``.gpu-stage/cN`` of ≤ 56 MiB, each carried by one ``run`` call; the machine keeps /tmp while warm). The
server runs under the image's python3 (torch 2.11+cu130) with that site folder first on ``PYTHONPATH``;
everything else (model building, Aerie's stages, this client) runs on the image's own packages.

Phases (each resumable on a warm machine: what it made stays under ``--work``):

- ``smollm2``: the demo model's shape, tokenizer and chat template (SmolLM2-135M-Instruct's real files; random
  weights, its 270 MB of weights do not travel), served; one chat completion and plain tokens/s at batch 1.
- ``plain``: a random-weight Llama-3.1-8B-shaped target (32 layers, hidden 4096, GQA 32/8, the SmolLM2 tokenizer
  so vocabulary 49,152), served plainly; client tokens/s at each batch.
- ``data``: the same server writes the draft's training data: it samples user prompts from its own chat template
  and answers them greedily (the regen stage's job), as an UltraChat-schema JSONL.
- ``train``: Aerie's real stages by their command lines: prep → extract → vocab → train (→ offline bench with
  ``--offline-bench``); the train stage writes ``train/draft``.
- ``eagle3``: the target served with ``--speculative-algorithm EAGLE3 --speculative-draft-model-path
  <train/draft>`` as written (3/1/4 by default), tokens/s at each batch, and the accept length from SGLang's own
  counters: Δ``sglang:generation_tokens_total`` / Δ``sglang:spec_verify_calls_total`` over the measurement
  (``--enable-metrics``), and the same ratio from the responses' ``completion_tokens``/``spec_verify_ct``.

``--target structured`` runs plain/data/train/eagle3 on ``llama8b_structured`` instead: the same 8B shape,
restructured by ``bench/structured_target.py`` so its greedy text is mostly a fixed map of the current token
(``--follow``: the share calibrated on the device), prompted with random word strings, under ``work_structured``
and ``structured_*`` result keys (``docs/performance.md`` has its table). ``--no-prefill-graph`` skips the
piecewise prefill CUDA graphs (~35 s a server start).

The launch argv is ``pipeline.serving.sglang_args.sglang_argv`` (the serve and deploy stages' builder) with the
bench's backend choices as ``extra_args``. While a server starts, its pid is watched with ``/health``: a dead server
fails at once with its log tail; one still silent after ``--dump-after`` s gets a py-spy stack dump of every
process. Results go to ``$OUT/gpu_sglang.json``, server logs to ``$OUT/server_<name>.log``.

Over 450 lines: it is one device command, carried whole to a machine that keeps nothing between sessions; its
phases share the server wrapper, the staging and the result file, and the target builder and the real-stage
phases already live apart (``structured_target.py``, ``gpu_sglang_stages.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.serving.sglang_args import ServerSettings, Speculative, sglang_argv  # noqa: E402

BASE = Path("/tmp/sgl")
SITE = BASE / "site"
OUT = Path(os.environ.get("OUT") or "/tmp/sgl/out")
T0 = time.monotonic()
RESULTS: dict[str, Any] = {"bench": "gpu_sglang"}
_SERVERS: list[subprocess.Popen] = []


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def save_results() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    old = BASE / "results.json"
    doc = json.loads(old.read_text()) if old.exists() else {}
    doc.update(RESULTS)
    old.write_text(json.dumps(doc, indent=1))
    (OUT / "gpu_sglang.json").write_text(json.dumps(doc, indent=1))


# ---- staging ----------------------------------------------------------------------------------------------


def stage(sources: list[Path]) -> None:
    """Copy carried chunk parts to /tmp/sgl/parts; once all are there, join, check and unpack the site folder."""
    parts = BASE / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    for src in sources:
        for f in src.iterdir():
            if f.is_dir():
                shutil.copytree(f, BASE / f.name, dirs_exist_ok=True)
            else:
                shutil.copy2(f, parts / f.name)
    if (SITE / ".complete").exists():
        return
    if not (parts / "PARTS").exists():
        log("stage: chunk c1 (PARTS, SHA256) not carried yet")
        return
    want = int((parts / "PARTS").read_text())
    have = sorted(parts.glob("part.*"))
    if len(have) < want:
        log(f"stage: {len(have)}/{want} parts here; carry the rest")
        return
    h = hashlib.sha256()
    t = time.monotonic()
    joined = BASE / "site.tar.xz"
    with joined.open("wb") as out:
        for f in have:
            data = f.read_bytes()
            h.update(data)
            out.write(data)
    if h.hexdigest() != (parts / "SHA256").read_text().strip():
        raise SystemExit("stage: joined archive's sha256 differs from c1/SHA256")
    with tarfile.open(joined) as tf:
        tf.extractall(BASE, filter="fully_trusted")
    (SITE / ".complete").write_text("ok")
    for f in (SITE / "bin").glob("*"):
        f.chmod(0o755)
    log(f"stage: site unpacked in {time.monotonic() - t:.0f} s ({len(have)} parts)")


# ---- models -----------------------------------------------------------------------------------------------


def build_models(which: list[str], args: argparse.Namespace | None = None) -> dict[str, Path]:
    """Random-weight checkpoints (image's transformers) with the SmolLM2 tokenizer and chat template;
    ``llama8b_structured`` is the 8B shape restructured by ``bench/structured_target.py`` (``--follow``)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu_common import SHAPES

    tok_dir = BASE / "smollm2"
    tok_files = ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    smol_cfg = json.loads((tok_dir / "config.json").read_text())
    paths = {}
    for name in which:
        dest = BASE / "models" / name
        paths[name] = dest
        if (dest / ".complete").exists():
            continue
        t = time.monotonic()
        if name == "smollm2":
            raw = {
                k: v for k, v in smol_cfg.items() if k not in ("quantization_config", "_model_name_or_path")
            }
            cfg = LlamaConfig(**raw)
        else:  # llama8b: Llama-3.1-8B's decoder, the SmolLM2 vocabulary (its tokenizer and chat template)
            shape = dict(SHAPES["llama8b"], vocab_size=smol_cfg["vocab_size"])
            cfg = LlamaConfig(
                num_hidden_layers=32,
                tie_word_embeddings=False,
                bos_token_id=smol_cfg["bos_token_id"],
                eos_token_id=smol_cfg["eos_token_id"],
                pad_token_id=smol_cfg["pad_token_id"],
                **shape,
            )
        cfg.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        structure = None
        if name == "llama8b_structured":
            from transformers import AutoTokenizer

            from bench import structured_target

            assert args is not None
            model.eval()
            structure = structured_target.build(
                model, AutoTokenizer.from_pretrained(str(tok_dir)), args.follow, args.cycle_words
            )
            RESULTS["structure"] = {k: v for k, v in structure.items() if k != "succ"}
            log(f"structured: {RESULTS['structure']}")
        model.config.dtype = torch.bfloat16
        tmp = dest.with_name(name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(str(tmp))
        for f in tok_files:
            shutil.copy2(tok_dir / f, tmp / f)
        if structure is not None:
            (tmp / "structure.json").write_text(json.dumps(structure))
        n = sum(p.numel() for p in model.parameters())
        del model
        torch.cuda.empty_cache()
        (tmp / ".complete").write_text(str(n))
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        log(f"model {name}: {n / 1e9:.2f} B params, random bf16, saved in {time.monotonic() - t:.0f} s")
    return paths


# ---- the server -------------------------------------------------------------------------------------------


def _get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except Exception:
        return 0, b""


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _tree(pid: int) -> list[int]:
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out += _tree(int(k))
    return out


def _pyspy(pid: int, name: str, tag: str) -> None:
    spy = SITE / "bin" / "py-spy"
    with (OUT / f"pyspy_{name}.txt").open("a") as f:
        f.write(f"==== {tag}\n")
        for p in _tree(pid):
            f.flush()
            subprocess.run(
                [str(spy), "dump", "--pid", str(p)], stdout=f, stderr=subprocess.STDOUT, timeout=30
            )


class Server:
    def __init__(self, name: str, settings: ServerSettings, start_timeout: float, dump_after: float) -> None:
        self.name, self.s = name, settings
        argv = sglang_argv(settings, python=sys.executable)
        RESULTS.setdefault("argv", {})[name] = argv
        env = dict(os.environ)
        env.update(
            PYTHONPATH=str(SITE),
            PYTHONUNBUFFERED="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            SGLANG_DISABLE_REQUEST_LOGGING="1",
            SGLANG_TORCH_PROFILER_DIR=str(BASE / "prof"),
        )
        self.log_path = OUT / f"server_{name}.log"
        self.logf = self.log_path.open("w")
        log(f"{name}: {' '.join(argv)}")
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(
            argv, env=env, stdout=self.logf, stderr=subprocess.STDOUT, start_new_session=True, cwd="/tmp"
        )
        _SERVERS.append(self.p)
        (BASE / "server.pids").write_text(str(self.p.pid))
        dumped = False
        while True:
            if self.p.poll() is not None:
                self.logf.flush()
                tail = (OUT / f"server_{name}.log").read_text()[-4000:]
                print(tail)
                raise RuntimeError(f"{name}: server exited with {self.p.returncode} before /health answered")
            st, _ = _get(f"{settings.url}/health", timeout=2)
            if st == 200:
                break
            el = time.monotonic() - self.t0
            if el > dump_after and not dumped:
                dumped = True
                log(f"{name}: no /health after {el:.0f} s: py-spy dump to pyspy_{name}.txt")
                _pyspy(self.p.pid, name, f"{el:.0f} s")
            if el > start_timeout:
                _pyspy(self.p.pid, name, f"timeout {el:.0f} s")
                self.stop()
                raise RuntimeError(f"{name}: no /health after {start_timeout:.0f} s")
            time.sleep(1)
        self.start_s = time.monotonic() - self.t0
        log(f"{name}: healthy after {self.start_s:.0f} s")

    def generate(self, body: dict) -> Any:
        return _post(f"{self.s.url}/generate", body)

    def metrics(self) -> dict[str, float]:
        st, raw = _get(f"{self.s.url}/metrics", timeout=10)
        out: dict[str, float] = {}
        for line in raw.decode(errors="replace").splitlines():
            if line.startswith("sglang:") and " " in line:
                key, val = line.rsplit(" ", 1)
                base = key.split("{", 1)[0]
                with contextlib.suppress(ValueError):
                    out[base] = out.get(base, 0.0) + float(val)
        return out

    def stop(self) -> None:
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, signal.SIGTERM)
                self.p.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=30)
        self.logf.close()
        (BASE / "server.pids").unlink(missing_ok=True)


def _kill_leftover() -> None:
    f = BASE / "server.pids"
    if f.exists():
        pid = int(f.read_text())
        try:
            os.killpg(pid, signal.SIGKILL)
            log(f"killed a server left by an earlier call (pgid {pid})")
            time.sleep(3)
        except ProcessLookupError:
            pass
        f.unlink()


def _cleanup(*_: Any) -> None:
    for p in _SERVERS:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    if _:
        raise SystemExit(1)


def settings(
    model: Path,
    port: int,
    args: argparse.Namespace,
    draft: Path | None = None,
    spec: tuple[int, int, int] = (3, 1, 4),
    backend: str | None = None,
    more: tuple[str, ...] = (),
) -> ServerSettings:
    extra = [
        "--attention-backend",
        backend or args.attention_backend,
        "--sampling-backend",
        "pytorch",
        "--grammar-backend",
        "none",
        "--enable-metrics",
        "--cuda-graph-max-bs",
        str(max(args.batches)),
        "--log-level",
        "info",
    ]
    if args.no_cuda_graph:
        extra.append("--disable-cuda-graph")
    if args.no_prefill_graph:  # the piecewise prefill graphs cost 34-84 s a start; decode graphs stay
        extra += ["--cuda-graph-backend-prefill", "disabled"]
    extra += list(more)
    return ServerSettings(
        backend="sglang",
        model=str(model),
        host="127.0.0.1",
        port=port,
        tp=1,
        mem_fraction_static=args.mem_fraction,
        context_length=args.context_length,
        extra_args=tuple(extra),
        speculative=Speculative(str(draft), *spec) if draft else None,
    )


# ---- measurement ------------------------------------------------------------------------------------------


def chat_prompts(model_dir: Path, questions: list[str]) -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


def log_window(srv: Server, start: int) -> dict[str, Any]:
    """The server's own decode lines written since byte ``start`` of its log: SGLang's ``gen throughput``
    (a steady-state rate over its last log interval, no client or prefill time in it) and the running batch."""
    from pipeline.serving.sglang_log import parse_line

    srv.logf.flush()
    with srv.log_path.open("rb") as f:
        f.seek(start)
        text = f.read()
    gen: list[float] = []
    running: list[float] = []
    acc: list[float] = []
    graph = {"True": 0, "False": 0}
    for raw in text.splitlines():
        rec = parse_line(raw)
        if rec is None or rec.kind != "decode":
            continue
        if isinstance(rec.fields.get("cuda_graph"), bool):
            graph[str(rec.fields["cuda_graph"])] += 1
        m = rec.metrics()
        if "gen_throughput" in m:
            gen.append(m["gen_throughput"])
            running.append(m.get("running_req", 0.0))
            if "accept_len" in m:
                acc.append(m["accept_len"])
    out: dict[str, Any] = {"log_decode_lines": len(gen), "log_cuda_graph_lines": graph}
    if gen:
        top = max(running)
        full = sorted(g for g, r in zip(gen, running, strict=True) if r == top)
        out["log_gen_throughput_median"] = round(full[len(full) // 2], 1)  # lines with the full batch running
        out["log_running_req_max"] = top
        out["log_gen_throughput_all"] = gen
    if acc:
        out["log_accept_len_median"] = sorted(acc)[len(acc) // 2]
    return out


def throughput(
    srv: Server, prompts: list[str], batch: int, max_new: int, per_stream: int, warmup: int = 0
) -> dict[str, Any]:
    """``batch`` closed-loop streams, each sending ``per_stream`` greedy requests one after another; first, with
    ``warmup`` > 0, one unmeasured request a stream of ``warmup`` new tokens, so the first use of this batch size
    (kernels compiled on first call, allocator growth) stays out of the measured window."""
    if warmup:
        with ThreadPoolExecutor(batch) as ex:
            list(
                ex.map(
                    lambda k: srv.generate(
                        {
                            "text": prompts[(k + 7) % len(prompts)],
                            "sampling_params": {
                                "max_new_tokens": warmup,
                                "temperature": 0.0,
                                "ignore_eos": True,
                            },
                        }
                    ),
                    range(batch),
                )
            )
    srv.logf.flush()
    log_start = srv.log_path.stat().st_size
    n = batch * per_stream
    work = [prompts[i % len(prompts)] for i in range(n)]
    m0 = srv.metrics()
    lock = threading.Lock()
    agg: dict[str, Any] = {"tokens": 0, "verify": 0, "lat": []}

    def stream(k: int) -> None:
        for j in range(per_stream):
            t = time.monotonic()
            r = srv.generate(
                {
                    "text": work[k * per_stream + j],
                    "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
                }
            )
            mi = r["meta_info"]
            with lock:
                agg["tokens"] += mi["completion_tokens"]
                agg["verify"] += mi.get("spec_verify_ct", 0) or 0
                agg["lat"].append(time.monotonic() - t)

    t0 = time.monotonic()
    with ThreadPoolExecutor(batch) as ex:
        list(ex.map(stream, range(batch)))
    wall = time.monotonic() - t0
    m1 = srv.metrics()
    d_gen = m1.get("sglang:generation_tokens_total", 0) - m0.get("sglang:generation_tokens_total", 0)
    d_ver = m1.get("sglang:spec_verify_calls_total", 0) - m0.get("sglang:spec_verify_calls_total", 0)
    lat = sorted(agg["lat"])
    res = {
        "batch": batch,
        "requests": n,
        "max_new_tokens": max_new,
        "completion_tokens": agg["tokens"],
        "wall_s": round(wall, 3),
        "tokens_per_s": round(agg["tokens"] / wall, 1),
        "per_stream_tokens_per_s": round(agg["tokens"] / wall / batch, 1),
        "median_request_s": round(lat[len(lat) // 2], 3),
        "metrics_generation_tokens": d_gen,
        "metrics_spec_verify_calls": d_ver,
    }
    res["warmup_new_tokens"] = warmup
    res.update(log_window(srv, log_start))
    if d_ver:
        res["accept_length_metrics"] = round(d_gen / d_ver, 3)
    if agg["verify"]:
        res["accept_length_responses"] = round(agg["tokens"] / agg["verify"], 3)
    log(
        f"{srv.name} batch {batch}: {res['tokens_per_s']:,.0f} tok/s ({res['per_stream_tokens_per_s']:,.0f} per stream"
        f"; server log {res.get('log_gen_throughput_median')})"
        + (
            f", accept length {res.get('accept_length_metrics')} (metrics) / {res.get('accept_length_responses')}"
            if d_ver
            else ""
        )
    )
    return res


def sample_questions(srv: Server, model_dir: Path, n: int, seed: int) -> list[str]:
    """User turns the target writes itself from its chat template's user header (sampled, T=1, top-p 0.95)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    mark = "AERIE-PROMPT-MARK"
    head = tok.apply_chat_template([{"role": "user", "content": mark}], tokenize=False)
    head = head[: head.index(mark)]
    out: list[str] = []
    seen: set[str] = set()
    k = 0
    while len(out) < n and k < 5:
        r = srv.generate(
            {
                "text": [head] * (n - len(out) + 16),
                "sampling_params": {
                    "max_new_tokens": 48,
                    "temperature": 1.0,
                    "top_p": 0.95,
                    "stop": ["<|im_end|>"],
                },
            }
        )
        for item in r:
            t = item["text"].strip()
            if len(t) >= 12 and t not in seen:
                seen.add(t)
                out.append(t)
        k += 1
    return out[:n]


# ---- phases -----------------------------------------------------------------------------------------------


def target_name(args: argparse.Namespace) -> str:
    return "llama8b_structured" if args.target == "structured" else "llama8b"


def work_dir(args: argparse.Namespace) -> Path:
    return BASE / ("work_structured" if args.target == "structured" else "work")


def questions(srv: Server, model: Path, n: int, seed: int, args: argparse.Namespace) -> list[str]:
    """The random target writes its own user turns; the structured one gets random word strings (it has no
    chat-like text of its own to sample: its sampled turns would be walks of its word cycle)."""
    if args.target != "structured":
        return sample_questions(srv, model, n, seed)
    from transformers import AutoTokenizer

    from bench.structured_target import word_prompts

    return word_prompts(AutoTokenizer.from_pretrained(str(model)), n, seed)


def phase_smollm2(args: argparse.Namespace) -> None:
    model = build_models(["smollm2"])["smollm2"]
    srv = Server("smollm2", settings(model, 30001, args), args.start_timeout, args.dump_after)
    try:
        r: dict[str, Any] = {"start_s": round(srv.start_s, 1)}
        chat = _post(
            f"{srv.s.url}/v1/chat/completions",
            {"model": str(model), "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16},
        )
        r["chat_completion_tokens"] = chat["usage"]["completion_tokens"]
        prompts = chat_prompts(model, ["Tell me about the sea.", "Write a poem about rain."])
        r["throughput"] = [throughput(srv, prompts, 1, args.max_new_tokens, 3)]
        RESULTS["smollm2"] = r
    finally:
        srv.stop()
    save_results()


def phase_plain_and_data(args: argparse.Namespace, phases: list[str]) -> None:
    name = target_name(args)
    model = build_models([name], args)[name]
    srv = Server(f"{name}_plain", settings(model, 30002, args), args.start_timeout, args.dump_after)
    try:
        work = work_dir(args)
        work.mkdir(parents=True, exist_ok=True)
        held = work / "heldout.json"
        if not held.exists():
            qs = questions(srv, model, args.bench_prompts, 12345, args)
            held.write_text(json.dumps(qs))
        prompts = chat_prompts(model, json.loads(held.read_text()))
        if "plain" in phases:
            RESULTS[plain_key(args)] = {
                "start_s": round(srv.start_s, 1),
                "throughput": [
                    throughput(srv, prompts, b, args.max_new_tokens, args.per_stream, args.warmup)
                    for b in args.batches
                    for _ in range(args.repeats)
                ],
            }
            if args.profile_batch:
                from bench import gpu_sglang_ab

                gpu_sglang_ab.g = sys.modules[__name__]
                RESULTS[plain_key(args)]["profile"] = gpu_sglang_ab.profile_rounds(
                    srv, prompts, args.profile_batch, f"{name}_plain"
                )
            save_results()
        if "data" in phases and not (work / "self.jsonl").exists():
            t = time.monotonic()
            qs = questions(srv, model, args.prompts, args.seed, args)
            texts = chat_prompts(model, qs)
            r = srv.generate(
                {
                    "text": texts,
                    "sampling_params": {"max_new_tokens": args.answer_tokens, "temperature": 0.0},
                }
            )
            rows = []
            for i, (q, item) in enumerate(zip(qs, r, strict=True)):
                a = item["text"].strip()
                if a:
                    rows.append(
                        {
                            "prompt": q,
                            "prompt_id": f"q{i:06d}",
                            "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                        }
                    )
            (work / "self.jsonl").write_text("".join(json.dumps(c) + "\n" for c in rows))
            toks = sum(item["meta_info"]["completion_tokens"] for item in r)
            RESULTS[key(args, "data")] = {
                "conversations": len(rows),
                "answer_tokens": toks,
                "seconds": round(time.monotonic() - t, 1),
            }
            if (model / "structure.json").exists():
                RESULTS[key(args, "data")]["stats"] = answer_stats(model, r)
                log(f"data: {RESULTS[key(args, 'data')]['stats']}")
            log(f"data: {len(rows)} conversations, {toks:,} answer tokens in {time.monotonic() - t:.0f} s")
            save_results()
    finally:
        srv.stop()


def plain_key(args: argparse.Namespace) -> str:
    return key(args, "plain")


def key(args: argparse.Namespace, what: str) -> str:
    """Result keys: the random target's as before, the structured one's prefixed."""
    return f"structured_{what}" if args.target == "structured" else what


def answer_stats(model: Path, items: list[dict]) -> dict[str, Any]:
    """``text_stats`` of the greedy answers (their token ids), against the target's own successor map."""
    from transformers import AutoTokenizer

    from bench.structured_target import text_stats

    succ = json.loads((model / "structure.json").read_text())["succ"]
    tok = AutoTokenizer.from_pretrained(str(model))
    seqs = [
        list(it["output_ids"])
        if it.get("output_ids")
        else tok(it["text"], add_special_tokens=False).input_ids
        for it in items
    ]
    return text_stats(seqs, succ)


def _stage_cli(module: str, plan: Path, out: Path, inputs: list[Path], *extra: str) -> float:
    argv = [sys.executable, "-m", module, "--plan", str(plan), "--out", str(out), *extra]
    for i in inputs:
        argv += ["--input", str(i)]
    t = time.monotonic()
    env = dict(os.environ)
    # datasets (+ dill, multiprocess): prep reads JSONL through it, and the image lacks it.
    if (BASE / "extra").is_dir():
        env["PYTHONPATH"] = str(BASE / "extra")
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-4000:])
        raise RuntimeError(f"{module} failed ({p.returncode})")
    dt = time.monotonic() - t
    log(f"{module} {dt:.0f} s")
    return dt


def training_sections(args: argparse.Namespace) -> str:
    """The plan's [prep] … [train] tables the bench's training runs share (this phase and ``gpu_sglang_stages``)."""
    return f"""[prep]
reject_threshold = 0.5
[extract]
batch_tokens = 32768
shard_tokens = 1048576
eval_rows = 32
[vocab]
draft_vocab_size = 8192
[train]
steps = {args.steps}
batch_size = {args.batch}
micro_batch = {args.batch}
ttt_steps = {args.ttt}
lr = {args.lr}
checkpoint_every = {args.steps // 2}
keep_checkpoints = 1
log_every = 50
eval_spec_steps = 3
"""


def phase_train(args: argparse.Namespace) -> None:
    work = work_dir(args)
    if (work / "train" / "draft" / "config.json").exists():
        return
    model = BASE / "models" / target_name(args)
    data = work / "self.jsonl"
    n = sum(1 for _ in data.open())
    plan = work / "plan.toml"
    plan.write_text(f"""[run]
name = "sglang-bench"
dir = "{work / "run"}"
[target]
model = "{model}"
max_length = 1024
{training_sections(args)}[bench]
holdout = 0.05
prompts = 8
max_new_tokens = 128
steps = 3
[[datasets]]
name = "self"
source = "ultrachat"
kind = "target-native"
path = "{data}"
quota = {n}
""")
    t: dict[str, Any] = {}
    t["prep_s"] = _stage_cli("pipeline.stages.prep", plan, work / "tok", [], "--dataset", "self")
    t["extract_s"] = _stage_cli("pipeline.stages.extract", plan, work / "ext", [work / "tok"])
    t["vocab_s"] = _stage_cli("pipeline.stages.vocab", plan, work / "voc", [work / "tok"])
    t["train_s"] = _stage_cli("pipeline.stages.train", plan, work / "train", [work / "ext", work / "voc"])
    man = json.loads((work / "train" / "manifest.json").read_text())
    ev = [json.loads(x) for x in (work / "train" / "events.jsonl").read_text().splitlines() if x.strip()]
    curve = {
        e["step"]: e["value"] for e in ev if e.get("type") == "metric" and e.get("name") == "accept_length"
    }
    t.update(
        kept_step=man["step"],
        sim_accept_by_step=curve,
        extract_tokens=json.loads((work / "ext" / "manifest.json").read_text())["tokens"],
        draft_config=json.loads((work / "train" / "draft" / "config.json").read_text()),
    )
    if args.offline_bench:
        t["bench_s"] = _stage_cli("pipeline.stages.bench", plan, work / "bench", [work / "train"])
        b = json.loads((work / "bench" / "results.json").read_text())
        t["offline_accept_len"] = b["accept_len"]
    RESULTS[key(args, "train")] = t
    save_results()


def phase_eagle3(args: argparse.Namespace) -> None:
    name = target_name(args)
    model = BASE / "models" / name
    draft = work_dir(args) / "train" / "draft"
    prompts = chat_prompts(model, json.loads((work_dir(args) / "heldout.json").read_text()))
    out = RESULTS.setdefault(key(args, "eagle3"), {})
    for spec in args.specs:
        k = "/".join(map(str, spec))
        srv = Server(
            f"{name}_eagle3_{k.replace('/', '-')}",
            settings(model, 30003, args, draft, spec),
            args.start_timeout,
            args.dump_after,
        )
        try:
            out[k] = {
                "start_s": round(srv.start_s, 1),
                "throughput": [
                    throughput(srv, prompts, b, args.max_new_tokens, args.per_stream, args.warmup)
                    for b in args.batches
                ],
            }
        finally:
            srv.stop()
        save_results()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage-from", action="append", default=[], type=Path, help="a carried chunk folder")
    ap.add_argument("--phases", default="smollm2,plain,data,train,eagle3")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--specs", default="3/1/4", help="steps/topk/draft-tokens, comma-separated")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--per-stream", type=int, default=2)
    ap.add_argument("--bench-prompts", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=1024, help="training conversations the target writes")
    ap.add_argument("--answer-tokens", type=int, default=192)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ttt", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline-bench", action="store_true")
    ap.add_argument("--regen-prompts", type=int, default=2000, help="stages: prompts the regen stage answers")
    ap.add_argument(
        "--hf-prompts", type=int, default=256, help="stages: of those, through transformers generate"
    )
    ap.add_argument("--hf-batch", type=int, default=128)
    ap.add_argument("--target", choices=["random", "structured"], default="random")
    ap.add_argument(
        "--follow", type=float, default=0.85, help="structured: share of tokens that follow the map"
    )
    ap.add_argument("--cycle-words", type=int, default=4096, help="structured: tokens on the word cycle")
    ap.add_argument("--no-prefill-graph", action="store_true", help="skip the piecewise prefill CUDA graphs")
    ap.add_argument("--attention-backend", default="triton")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument(
        "--warmup",
        type=int,
        default=64,
        help="new tokens of one unmeasured request a stream before each batch (0: none)",
    )
    ap.add_argument(
        "--variants",
        default="plain:triton,eagle3:triton",
        help="ab: MODE:BACKEND[:FLAG=VALUE...], comma-separated (bench/gpu_sglang_ab.py)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="ab: measurements of each batch")
    ap.add_argument(
        "--profile-batch", type=int, default=8, help="ab: torch-profile decode rounds at this batch (0: off)"
    )
    ap.add_argument("--mem-fraction", type=float, default=0.8)
    ap.add_argument("--context-length", type=int, default=2048)
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--dump-after", type=float, default=120)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.specs = [tuple(int(x) for x in s.split("/")) for s in args.specs.split(",")]
    phases = [p for p in args.phases.split(",") if p]
    OUT.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _cleanup)
    _kill_leftover()
    stage(args.stage_from)
    if not (SITE / ".complete").exists():
        return 0
    import torch

    RESULTS["device"] = torch.cuda.get_device_name(0)
    RESULTS["torch"] = torch.__version__
    try:
        if "smollm2" in phases:
            phase_smollm2(args)
        if "plain" in phases or "data" in phases:
            phase_plain_and_data(args, phases)
        if "train" in phases:
            phase_train(args)
        if "eagle3" in phases:
            phase_eagle3(args)
        if "ab" in phases:
            from bench import gpu_sglang_ab

            gpu_sglang_ab.g = sys.modules[__name__]
            gpu_sglang_ab.phase_ab(args)
        if "stages" in phases or "stages2" in phases:
            from bench import gpu_sglang_stages

            gpu_sglang_stages.g = sys.modules[__name__]  # this run's RESULTS, servers and log clock
            if "stages" in phases:
                gpu_sglang_stages.phase_stages(args)
            if "stages2" in phases:
                gpu_sglang_stages.phase_stages2(args)
    except Exception as e:  # noqa: BLE001 - report, keep what was measured
        RESULTS.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        log(f"FAILED: {type(e).__name__}: {e}")
        save_results()
        _cleanup()
        return 1
    finally:
        _cleanup()
    save_results()
    summary(json.loads((BASE / "results.json").read_text()), args)
    return 0


def summary(doc: dict, args: argparse.Namespace) -> None:
    print("\nbatch | plain tok/s | eagle3 tok/s (spec) | speedup | accept length (metrics / responses)")
    plain = {r["batch"]: r for r in doc.get(key(args, "plain"), {}).get("throughput", [])}
    for spec, e in doc.get(key(args, "eagle3"), {}).items():
        for r in e["throughput"]:
            p = plain.get(r["batch"])
            sp = f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}x" if p else "-"
            print(
                f"{r['batch']:5} | {p['tokens_per_s'] if p else '-':>11} | {r['tokens_per_s']:>9} ({spec}) | {sp} | "
                f"{r.get('accept_length_metrics')} / {r.get('accept_length_responses')}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
