"""The target run by SGLang's own model runner, in-process (``[target] engine = "sglang"``), for the extract stage
(:func:`load_for_plan`) and for online training on one rank (:func:`load_for_training`, in the train process).

What SpecForge's offline SGLang capture backend does (``specforge/offline_capture/sglang_backend``, read for
SGLang 0.5.14; facts carried over, not its code): build ``ServerArgs`` and a ``ModelConfig``, construct a
``ModelRunner`` for this rank (it loads the weights with SGLang's loaders and kernels: tensor parallel over
``tp_size`` ranks, quantized weights kept as their kernels want them, e.g. Kimi-K2.5's INT4 experts packed),
allocate its KV pool and attention backends, tell the model which layers to capture
(``set_eagle3_layers_to_capture``), replace its logits processor by one that hands back the aux and final
hidden states of *every* token (SGLang's own keeps only each request's last one in an EXTEND pass), and run
each batch as one EXTEND forward with ``CaptureHiddenMode.FULL`` over the rows packed end to end.

The process group exists before the runner is built, as in SpecForge: under ``torchrun`` (``extract.parallel =
"tp"``) the stage has joined it (NCCL, ``env://``); alone, :func:`start_process_group` starts a one-rank group on
a free local port. SGLang's ``init_distributed_environment`` then reuses it and builds its own TP groups.

:class:`SGLangTarget` answers what the extract stage asks of the transformers ``Target`` (``device``,
``capture``, ``argmax``, ``close``), so the stage's batching, staging and store are the same for both engines;
the mapping of SGLang's packed output onto the padded batch is :mod:`pipeline.eagle3.sglang_packing`. The
greedy next token is computed inside the forward, in chunks, through SGLang's own LM-head path (vocabulary
parallel: gathered across ranks), so logits for every token never exist at once.

Releases (``pipeline/tested_versions.py``): the batch construction (``Req``, ``ScheduleBatch.init_new``,
``prepare_for_extend``) is written against 0.5.14, the GPU lock's, which ran it; 0.5.23 changed it (known broken
for capture). ``ModelRunner``'s rank parameters and ``ServerArgs``' type differ too: :func:`runner_kwargs` passes
only what the installed signature names. ``tests/test_sglang_api.py`` checks every name used here in each release.
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeline.eagle3 import sglang_packing
from pipeline.eagle3.target_capture import Capture, TargetError


@dataclass(frozen=True)
class RunnerSpec:
    """One rank's SGLang model runner: what the plan and the stage's GPUs decide."""

    model: str
    dtype: str = "bfloat16"
    tp_size: int = 1
    tp_rank: int = 0
    gpu_id: int = 0
    port: int = 0  # SGLang's NCCL port when it starts the group itself (never here: the group exists first)
    context_length: int = 4096
    batch_tokens: int = 8192
    mem_fraction_static: float = 0.8
    trust_remote_code: bool = False
    attention_backend: str = "triton"  # needs neither FA3 nor FlashInfer (the lent H200's trimmed kernels)


def server_args_kwargs(spec: RunnerSpec) -> dict[str, Any]:
    """``ServerArgs`` for a runner that only captures: no CUDA graphs, no chunked prefill, no radix reuse."""
    return {
        "model_path": spec.model,
        "trust_remote_code": spec.trust_remote_code,
        "dtype": spec.dtype,
        "tp_size": spec.tp_size,
        "pp_size": 1,
        "enable_return_hidden_states": True,
        "disable_cuda_graph": True,
        "chunked_prefill_size": -1,
        "disable_radix_cache": True,
        "attention_backend": spec.attention_backend,
        "sampling_backend": "pytorch",
        "mem_fraction_static": spec.mem_fraction_static,
        "context_length": spec.context_length,
        # every row is one request; a batch of the shortest rows (2 tokens) is the most requests at once
        "max_running_requests": max(1, spec.batch_tokens // 2),
        # the KV pool holds one batch (every forward starts from empty pools), not a server's worth
        "max_total_tokens": 2 * spec.batch_tokens + spec.context_length,
        "skip_tokenizer_init": True,
        "random_seed": 0,
        "nccl_port": spec.port or None,
        "log_level": "warning",
    }


def server_args_fields(cls: Any) -> set[str]:
    """The keys the installed ``ServerArgs`` accepts (a dataclass in 0.5.14, a ``msgspec.Struct`` in 0.5.23)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ()))


# Every ModelRunner keyword Aerie knows how to fill (0.5.14 takes them all; 0.5.23 dropped the rank ones).
RUNNER_PARAMS = ("model_config", "mem_fraction_static", "gpu_id", "tp_rank", "tp_size", "moe_ep_rank",
                 "moe_ep_size", "pp_rank", "pp_size", "nccl_port", "server_args", "is_draft_worker")  # fmt: skip


def runner_kwargs(
    spec: RunnerSpec, server_args: Any, model_config: Any, params: Iterable[str], required: Iterable[str]
) -> dict[str, Any]:
    """``ModelRunner(**kw)`` for this rank: what the installed signature (``params``) names, nothing else."""
    ep = max(1, int(getattr(server_args, "ep_size", 1) or 1))
    every = {
        "model_config": model_config,
        "mem_fraction_static": spec.mem_fraction_static,
        "gpu_id": spec.gpu_id,
        "tp_rank": spec.tp_rank,
        "tp_size": spec.tp_size,
        "moe_ep_rank": spec.tp_rank // max(1, spec.tp_size // ep),
        "moe_ep_size": ep,
        "pp_rank": 0,
        "pp_size": 1,
        "nccl_port": spec.port,
        "server_args": server_args,
        "is_draft_worker": False,
    }
    assert tuple(every) == RUNNER_PARAMS
    names = set(params)
    missing = sorted(set(required) - every.keys())
    if missing:
        raise TargetError(
            f"this SGLang's ModelRunner needs {', '.join(missing)}, which Aerie does not know how to fill "
            "(written for SGLang 0.5.14)"
        )
    return {k: v for k, v in every.items() if k in names}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_process_group(gpu_id: int) -> None:
    """A one-rank NCCL group on a free local port, unless ``torchrun``'s ranks already joined one."""
    import torch.distributed as dist

    if not dist.is_initialized():
        torch.cuda.set_device(gpu_id)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)


def check_hooked(hooked: list[int], aux: list[int], config_ids: list[int]) -> None:
    """SGLang captures the *inputs* of ``hooked``: they must be the outputs of the plan's aux layers."""
    if hooked != [i + 1 for i in aux]:
        raise TargetError(
            f"SGLang hooks the inputs of layers {hooked} for config ids {config_ids}; the plan's aux layers "
            f"{aux} need {[i + 1 for i in aux]} (pipeline.serving.sglang_capture's rule does not match this SGLang)"
        )


@dataclass
class _Captured:
    """What the replaced logits processor returns to the runner (it reads nothing from it)."""

    aux: torch.Tensor  # [T, k*H]
    last: torch.Tensor  # [T, H], after the final norm
    tokens: torch.Tensor  # [T], greedy next token
    logits: None = None


class CaptureHead(nn.Module):
    """Stands in for the model's ``LogitsProcessor``: every token's aux and final states, and greedy tokens."""

    def __init__(self, inner: nn.Module, aux_count: int, vocab_size: int, chunk: int = 1024) -> None:
        super().__init__()
        self.inner = inner
        self.aux_count, self.vocab_size, self.chunk = aux_count, vocab_size, chunk

    def forward(
        self,
        input_ids: Any,
        hidden_states: torch.Tensor,
        lm_head: Any,
        logits_metadata: Any,
        aux_hidden_states: Any = None,
        *_: Any,
        **__: Any,
    ) -> _Captured:
        from sglang.srt.layers.logits_processor import LogitsMetadata
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch

        if aux_hidden_states is None:
            raise TargetError(
                "SGLang ran the model without aux hidden states: set_eagle3_layers_to_capture did not take"
            )
        meta = logits_metadata
        if isinstance(meta, ForwardBatch):
            meta = LogitsMetadata.from_forward_batch(meta)
        if getattr(meta, "next_token_logits_buffer", None) is not None:
            meta.next_token_logits_buffer = None  # a buffer sized for one token per request, not our chunks
        aux = sglang_packing.concat_aux(aux_hidden_states, self.aux_count)
        tokens = torch.empty(hidden_states.shape[0], dtype=torch.int64, device=hidden_states.device)
        for a in range(0, hidden_states.shape[0], self.chunk):
            logits = self.inner._get_logits(hidden_states[a : a + self.chunk], lm_head, meta)
            tokens[a : a + self.chunk] = logits[:, : self.vocab_size].argmax(-1)
        return _Captured(aux, hidden_states, tokens)


def replace_logits_processors(model: nn.Module, aux_count: int, vocab_size: int) -> int:
    """Every ``LogitsProcessor`` of the SGLang model wrapped by :class:`CaptureHead`; how many there were."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    found = [(n, m) for n, m in model.named_modules() if isinstance(m, LogitsProcessor)]
    if not found:
        raise TargetError(f"{type(model).__name__}: no SGLang LogitsProcessor to capture through")
    for name, mod in found:
        parent, _, child = name.rpartition(".")
        setattr(
            model.get_submodule(parent) if parent else model, child, CaptureHead(mod, aux_count, vocab_size)
        )
    return len(found)


class SGLangTarget:
    """The target in SGLang's model runner, answering the extract stage like ``target_capture.Target``."""

    def __init__(self, runner: Any, aux_layer_ids: list[int], config_ids: list[int], vocab_size: int) -> None:
        self.runner = runner
        self.aux_layer_ids = list(aux_layer_ids)
        setter = getattr(runner.model, "set_eagle3_layers_to_capture", None)
        if not callable(setter):
            raise TargetError(
                f"{type(runner.model).__name__}: SGLang cannot capture EAGLE-3 aux states of this model"
            )
        setter(list(config_ids))
        text = getattr(runner.model, "language_model", runner.model)  # Kimi-K2.5: its DeepSeek-V3 inside
        hooked = getattr(getattr(text, "model", None), "layers_to_capture", None)
        if hooked is not None:
            check_hooked(list(hooked), self.aux_layer_ids, list(config_ids))
        replace_logits_processors(runner.model, len(aux_layer_ids), vocab_size)
        self._tokens: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", int(self.runner.gpu_id))

    def close(self) -> None:
        self._tokens = None

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache: Any = None
    ) -> Capture:
        if cache is not None:
            raise TargetError("the SGLang engine captures whole rows; it keeps no cache across calls")
        rows = sglang_packing.row_tokens(input_ids, attention_mask)
        out = self._extend(rows)
        aux, last, tok = sglang_packing.to_padded(
            out.aux, out.last, out.tokens, [len(r) for r in rows], int(input_ids.shape[1])
        )
        self._tokens = tok
        return Capture(aux, last)

    def argmax(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """The greedy tokens of the batch just captured (computed in the forward, by SGLang's LM head)."""
        tok, self._tokens = self._tokens, None
        if tok is None or tuple(tok.shape) != tuple(last_hidden.shape[:-1]):
            raise TargetError("argmax() answers only for the batch capture() just ran")
        return tok

    def _extend(self, rows: list[list[int]]) -> _Captured:
        """One EXTEND forward over ``rows`` packed, as SpecForge's ``_forward_extend`` (SGLang 0.5.14 APIs)."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        r = self.runner
        sampling = SamplingParams(temperature=0, max_new_tokens=1, top_k=1)
        reqs = []
        for i, ids in enumerate(rows):
            req = Req(
                rid=str(i), origin_input_text="", origin_input_ids=array("q", ids), sampling_params=sampling
            )
            req.full_untruncated_fill_ids = array("q", ids)
            req.fill_len = len(ids)
            req.extend_input_len = req.fill_len - len(req.prefix_indices)
            req.logprob_start_len = len(ids) - 1
            reqs.append(req)
        cache = CacheInitParams(
            disable=False,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
            page_size=r.server_args.page_size,
        )
        try:
            batch = ScheduleBatch.init_new(
                reqs=reqs,
                req_to_token_pool=r.req_to_token_pool,
                token_to_kv_pool_allocator=r.token_to_kv_pool_allocator,
                tree_cache=RadixCache(cache),
                model_config=r.model_config,
                enable_overlap=False,
                spec_algorithm=SpeculativeAlgorithm.NONE,
            )
            batch.prepare_for_extend()
            if getattr(batch, "prefill_input_ids_cpu", None) is not None:
                batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
                batch.prefill_input_ids_cpu = None
            batch.capture_hidden_mode = CaptureHiddenMode.FULL
            fb = ForwardBatch.init_new(batch, r)
            fb.capture_hidden_mode = CaptureHiddenMode.FULL
            out = r.forward(fb)
            out = getattr(out, "logits_output", out)
            if not isinstance(out, _Captured):
                raise TargetError(f"SGLang's forward returned {type(out).__name__}, not the captured states")
            return out
        finally:
            r.req_to_token_pool.clear()
            r.token_to_kv_pool_allocator.clear()


def load_sglang_target(
    spec: RunnerSpec, aux_layer_ids: list[int], config_ids: list[int], vocab_size: int
) -> SGLangTarget:
    """Build this rank's SGLang model runner (weights loaded, KV pool and attention backends ready)."""
    try:
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs
    except ImportError as exc:
        raise TargetError(
            f'target.engine = "sglang" but SGLang cannot be imported here ({exc}); install the GPU stack '
            "(pip install -c constraints-gpu.txt '.[pipeline,gpu]') or set target.engine = \"transformers\""
        ) from None
    import inspect

    server_args = ServerArgs(**server_args_kwargs(spec))
    model_config = ModelConfig.from_server_args(server_args)
    sig = inspect.signature(ModelRunner.__init__).parameters
    required = [n for n, p in sig.items() if n != "self" and p.default is inspect.Parameter.empty]
    start_process_group(spec.gpu_id)
    runner = ModelRunner(**runner_kwargs(spec, server_args, model_config, sig, required))
    runner.alloc_memory_pool()
    runner.init_attention_backends()
    runner.init_cuda_graphs()  # with CUDA graphs disabled: only the eager runner every forward goes through
    return SGLangTarget(runner, aux_layer_ids, config_ids, vocab_size)


def load_for_plan(
    plan: Any, aux: list[int], arch: str | None, vocab_size: int, longest: int, dist: Any
) -> SGLangTarget:
    """The extract stage's ``[target] engine = "sglang"``: this rank's runner (tensor-parallel over the torchrun
    ranks with ``extract.parallel = "tp"``, else one GPU), told to capture the outputs of ``aux``."""
    from pipeline.run.stage_side.ranks import tp_device

    sec = plan.settings.extract
    if not torch.cuda.is_available():
        raise ValueError(f'{plan.path}: target.engine = "sglang" needs a GPU and this stage sees none')
    if dist is not None:
        dev = tp_device(dist, sec.device)
        dist.init(dev)  # the group exists before SGLang's runner (SpecForge's order); SGLang reuses it
        tp, rank = dist.world, dist.rank
    else:
        dev, tp, rank = torch.device(sec.device or "cuda"), 1, 0
    dtype = sec.dtype or "bfloat16"
    spec = RunnerSpec(
        model=str(plan.target.model),
        dtype={"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype),
        tp_size=tp,
        tp_rank=rank,
        gpu_id=dev.index or 0,
        context_length=longest + 1,
        batch_tokens=sec.batch_tokens,
        trust_remote_code=plan.target.trust_remote_code,
    )
    return _load_or_explain(str(plan.path), spec, aux, arch, vocab_size)


def _load_or_explain(
    where: str, spec: RunnerSpec, aux: list[int], arch: str | None, vocab_size: int
) -> SGLangTarget:
    from pipeline.serving.sglang_capture import config_layer_ids

    try:
        return load_sglang_target(spec, aux, config_layer_ids(aux, arch), vocab_size)
    except TargetError as exc:
        raise ValueError(f"{where}: target.engine: {exc}") from None


# Online training (``extract.mode = "online"``) runs SGLang's runner and the draft's training in ONE process on
# one GPU. SGLang's ``mem_fraction_static`` is the share of the memory free before its weights load that its
# static part (weights + KV pool) may take; whatever is left is torch's, i.e. the draft's weights, Adam state,
# activations and each batch's captured states. The extract default (0.8) would leave the draft ~20 %. A
# capture needs KV for one batch only (``max_total_tokens`` caps the pool at that, whatever the fraction), so
# the fraction only has to cover the target's weights plus that pool and SGLang's buffers: the weights' share
# of the free memory plus ``ONLINE_HEADROOM`` (on an H200, 14 GB: a Llama-8B-shaped batch of 16k tokens holds
# 2 GB of KV) — an 8B bf16 target takes ~0.21 of an H200, the demo target ~0.10, the rest trains the draft.
ONLINE_HEADROOM = 0.1
ONLINE_MAX_FRACTION = 0.8  # the extract default: a target this big leaves the draft ~20 % either way


def online_mem_fraction(weight_bytes: int, free_bytes: int) -> float:
    """``mem_fraction_static`` for a runner sharing its process with the draft's training (see above)."""
    if free_bytes <= 0:
        return ONLINE_MAX_FRACTION
    return round(min(ONLINE_MAX_FRACTION, weight_bytes / free_bytes + ONLINE_HEADROOM), 3)


def checkpoint_bytes(model: str) -> int:
    """The weights' size on disk (``*.safetensors``, else ``*.bin``); 0 where ``model`` is not a folder."""
    from pathlib import Path

    d = Path(model)
    if not d.is_dir():
        return 0
    files = list(d.glob("*.safetensors")) or list(d.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def load_for_training(
    model: str,
    aux: list[int],
    device: torch.device,
    longest: int,
    micro_batch: int,
    trust_remote_code: bool = False,
    where: str = "plan",
) -> SGLangTarget:
    """The train stage's online target with ``[target] engine = "sglang"``: one GPU, one rank (the plan refuses
    ``online-tp`` and several ranks), a KV pool for one micro-batch and the memory share above."""
    from pipeline.eagle3.target_capture import target_architecture, target_config

    if device.type != "cuda":
        raise ValueError(
            f'{where}: target.engine = "sglang" needs a GPU and the train stage runs on {device}'
        )
    gpu = device.index if device.index is not None else torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(gpu)
    vocab = int(target_config(model, trust_remote_code=trust_remote_code).vocab_size)
    arch = target_architecture(model, trust_remote_code=trust_remote_code)
    spec = RunnerSpec(
        model=model,
        gpu_id=gpu,
        context_length=longest + 1,
        batch_tokens=max(1, micro_batch) * longest,
        mem_fraction_static=online_mem_fraction(checkpoint_bytes(model), int(free)),
        trust_remote_code=trust_remote_code,
    )
    return _load_or_explain(where, spec, aux, arch, vocab)
