"""The plan's settings tables, typed: one frozen dataclass per section, each key with its type, default and doc.

Every table of a plan besides ``[run]``, ``[executor]``, ``[[datasets]]`` and ``[[stage]]`` is declared
here, validated once when the plan loads (:func:`PlanSettings.parse`) and read by the stages as
attributes (``plan.settings.train.micro_batch``). A default lives here and nowhere else; a stage that
needs a rule beyond one key (a default that depends on the mode, the stage's GPUs) reads it from a
property or a method of its section. Standard library only: ``aerie plan check --show-defaults`` prints
all of it without importing torch.

A draft method's own ``[train]`` keys are declared in its folder (a :class:`DraftSettings` subclass, found
through :mod:`pipeline.run.plan.draft_names`) and join ``[train]`` when a plan names the method; only the base
class and the joining live here, so ``[train]`` knows no method by name.

Over 450 lines on purpose: it is the reference of every settings key, one declaration per key, grouped by
table; split up, what ``--show-defaults`` prints from one place would be scattered over many.
"""

from __future__ import annotations

import json
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

from pipeline.run.plan import draft_names
from pipeline.run.plan.schema import PlanError, Section, check_text, check_type, key_name, setting

STORAGE_MODES = ("offline", "online")
ENGINES = ("transformers", "sglang")
DTYPES = ("bfloat16", "bf16", "float32", "fp32", "float16", "fp16")
_NAME_BAD = set(" \t'\"`$;&|<>(){}\\*?!#")
_SLURM_TIME_CHARS = set("0123456789-:")


@dataclass(frozen=True)
class TargetSection(Section):
    NAME: ClassVar[str] = "target"
    DEFAULT_ROW_LENGTH: ClassVar[int] = 4096

    model: str | None = setting(None, "the target model: a hub id, a local path or builtin:<name>")
    max_length: int | None = setting(
        None,
        "tokens per training row (unset: rows are cut at 4096; SGLang keeps the model's own context length)",
        lo=16,
        hi=1 << 24,
    )
    hidden_size: int | None = setting(
        None, "the target's hidden size, for disk estimates when its config cannot be read here", lo=1
    )
    trust_remote_code: bool = setting(
        False,
        "run Python code the target's own files ship (their auto_map: a custom config, model or tokenizer "
        "class); read it first. Off: such a target is a plan error, never a question on the terminal",
    )
    engine: str = setting(
        "transformers",
        'what runs the target for the extract stage\'s capture: "transformers" (hooks on the model, any device) '
        'or "sglang" (SGLang\'s model runner in-process, its own tensor parallelism and quantized kernels: INT4 '
        "experts stay packed; offline extraction on GPUs only)",
        choices=ENGINES,
    )
    allow_untested_sglang: bool = setting(
        False,
        "capture through an SGLang release newer than the last one in pipeline/tested_versions.py's table; "
        "off: such a release is refused for capture (Aerie drives its batch API, which changes between releases)",
    )

    @property
    def row_length(self) -> int:
        """Where prep cuts a row, and what the estimates assume a row may hold."""
        return self.max_length or self.DEFAULT_ROW_LENGTH


@dataclass(frozen=True)
class ResourcesSection(Section):
    NAME: ClassVar[str] = "resources"

    cpu_slots: int = setting(4, "CPU slots the supervisor shares among running stages", lo=1, hi=100_000)
    gpus: tuple[int, ...] = setting((), "the GPU ids stages may be given", lo=0, hi=4096)
    disk_reserve_gb: float = setting(
        1.0, "free space kept on the run directory's disk beyond every projection (GB)", lo=0, hi=1e9
    )
    gpu_memory_gb: float | None = setting(
        None, "memory per GPU (GB) for the deep check when no GPU is visible here", positive=True, hi=1e6
    )


@dataclass(frozen=True)
class PrepSection(Section):
    NAME: ClassVar[str] = "prep"

    shard_rows: int = setting(2000, "rows per output shard (the unit of resume)", lo=1)
    batch_rows: int = setting(64, "rows tokenised per batch (a pause waits at most one batch)", lo=1)
    reject_threshold: float = setting(
        0.05,
        "fraction of malformed rows above which the stage fails (a dataset's options may override)",
        lo=0,
        hi=1,
    )
    check_rows: int = setting(64, "rows validated before the full run starts", lo=1)
    reject_messages: int = setting(
        20, "rejects announced as message events per attempt (all go to rejects.jsonl)", lo=0
    )
    tokenizer_threads: int = setting(
        1, "threads the fast tokenizer may use (the stage holds cpu slots for this many)", lo=1, hi=4096
    )
    template_kwargs: dict[str, Any] = setting(
        {}, "extra variables for the chat template (e.g. a thinking switch)"
    )


@dataclass(frozen=True)
class RegenSection(Section):
    NAME: ClassVar[str] = "regen"
    SAMPLING: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")

    concurrency: int = setting(64, "requests in flight per dataset", positive=True)
    temperature: float = setting(0.7, "sampling temperature", lo=0, hi=100)
    top_p: float | None = setting(None, "nucleus sampling (unset: the server's default)", lo=0, hi=1)
    top_k: int | None = setting(None, "top-k sampling (unset: the server's default; -1: off)", lo=-1)
    max_tokens: int = setting(4096, "new tokens per answer at most", positive=True)
    seed: int | None = setting(None, "sampling seed sent with each request")
    stop: tuple[str, ...] = setting((), "stop strings")
    extra: dict[str, Any] = setting({}, "further request-body keys, sent as they are")
    request_timeout_s: float = setting(600.0, "seconds one request may take", positive=True)
    max_attempts: int = setting(5, "tries per request before it counts as failed", positive=True)
    backoff_s: float = setting(1.0, "first wait between tries (doubles each time)", lo=0)
    backoff_max_s: float = setting(30.0, "longest wait between tries", lo=0)
    outage_timeout_s: float = setting(
        900.0, "seconds the server may be unreachable before the stage fails", positive=True
    )
    max_records: int | None = setting(None, "answer at most this many prompts (unset: all)", positive=True)
    max_error_fraction: float = setting(0.05, "failed requests above this share fail the stage", lo=0, hi=1)
    max_skipped_fraction: float = setting(
        0.5, "prompts skipped (too long, truncated) above this share fail the stage", lo=0, hi=1
    )
    drop_truncated: bool = setting(False, "drop answers cut by max_tokens instead of keeping them")
    shard_rows: int = setting(5000, "answers per output shard", positive=True)
    server_url: str | None = setting(None, "the server's base URL (unset: the used serve stage's endpoint)")
    model: str | None = setting(None, "the model name sent with each request (unset: the served model)")
    api_key_env: str | None = setting(None, "environment variable holding the server's API key")

    def sampling_body(self, thinking: bool | None = None) -> dict[str, Any]:
        """The request-body sampling keys that are set, the dataset's thinking switch as the server's
        ``chat_template_kwargs`` (unset: the model's default), then ``extra``."""
        body: dict[str, Any] = {}
        if thinking is not None:
            body["chat_template_kwargs"] = {"thinking": thinking}
        for k in self.SAMPLING:
            v = getattr(self, k)
            if v is not None and v != ():
                body[k] = list(v) if isinstance(v, tuple) else v
        body.update(self.extra)
        return body


@dataclass(frozen=True)
class ServeSection(Section):
    NAME: ClassVar[str] = "serve"

    backend: str = setting(
        "sglang",
        "the inference server: sglang, or local (transformers, CPU/GPU)",
        choices=("sglang", "local"),
    )
    model: str | None = setting(None, "the model it serves (unset: [target] model)")
    host: str = setting("127.0.0.1", "the address it listens on")
    port: int = setting(30000, "its TCP port (0: pick a free one)", lo=0, hi=65535)
    tp: int | None = setting(
        None, "tensor-parallel size (unset: the stage's GPUs, at least 1)", lo=1, hi=4096
    )
    mem_fraction_static: float | None = setting(
        None, "SGLang --mem-fraction-static, between 0 and 1", lo=0, hi=1
    )
    context_length: int | None = setting(
        None, "SGLang --context-length (unset: [target] max_length, if set)", lo=1
    )
    served_model_name: str | None = setting(None, "SGLang --served-model-name")
    dtype: str | None = setting(None, "SGLang --dtype")
    startup_timeout_s: float = setting(1800.0, "seconds the server may take to become ready", positive=True)
    health_interval_s: float = setting(2.0, "seconds between health probes", positive=True)
    health_timeout_s: float = setting(5.0, "seconds one probe may take", positive=True)
    unhealthy_after: int = setting(
        3, "consecutive failed probes after ready that stop the stage", positive=True
    )
    stop_timeout_s: float = setting(
        8.0, "SIGTERM -> wait this long -> SIGKILL for the server child", positive=True
    )
    extra_args: tuple[str, ...] = setting((), "further launch_server arguments, one word each")

    def check(self, file: Path | str, name: str) -> None:
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            self.bad(
                file,
                f"{name}.mem_fraction_static",
                f"must be between 0 and 1, got {self.mem_fraction_static!r}",
            )


@dataclass(frozen=True)
class DeploySection(Section):
    NAME: ClassVar[str] = "deploy"

    draft_model_path: str | None = setting(None, "the draft checkpoint a --mode eagle3 server loads")
    speculative_num_steps: int = setting(3, "SGLang --speculative-num-steps", lo=1)
    speculative_eagle_topk: int = setting(1, "SGLang --speculative-eagle-topk", lo=1)
    speculative_num_draft_tokens: int = setting(4, "SGLang --speculative-num-draft-tokens", lo=1)
    port: int | None = setting(None, "the speculative server's port (unset: [serve] port)", lo=0, hi=65535)


@dataclass(frozen=True)
class ExtractSection(Section):
    NAME: ClassVar[str] = "extract"

    mode: str | None = setting(
        None,
        "offline stores hidden states, online stores nothing (unset: [train] mode, else offline)",
        choices=STORAGE_MODES,
    )
    device: str | None = setting(
        None, 'torch device; "auto" spreads the target over every visible GPU (unset: cuda if any, else cpu)'
    )
    dtype: str | None = setting(
        None, "the target's dtype (unset: bfloat16 on a GPU, float32 on the CPU)", choices=DTYPES
    )
    aux_layers: tuple[int, ...] | None = setting(
        None, "target layers whose outputs feed the draft (unset: EAGLE-3's low/mid/high)", lo=-4096, hi=4096
    )
    max_length: int | None = setting(
        None, "tokens per row read (unset: [target] max_length)", lo=16, hi=1 << 24
    )
    eval_rows: int = setting(64, "held-out rows extracted for the acceptance evaluation", lo=0)
    max_rows: int | None = setting(None, "extract at most this many rows (unset or 0: all)", lo=0)
    max_tokens: int | None = setting(None, "extract at most this many tokens (unset or 0: all)", lo=0)
    shard_tokens: int = setting(262144, "tokens per stored shard (the unit of resume)", lo=1)
    batch_tokens: int = setting(8192, "tokens per target forward", lo=1)
    write_queue: int = setting(2, "batches waiting to be written before the forward waits", lo=0, hi=1024)
    io_threads: int = setting(4, "threads writing shards", lo=1, hi=1024)
    parallel: str | None = setting(
        None, '"tp": run the target tensor-parallel under torchrun', choices=("tp",)
    )
    tp_size: int | None = setting(
        None, "tensor-parallel ranks (unset: the stage's GPUs, else 1)", lo=1, hi=4096
    )

    def check(self, file: Path | str, name: str) -> None:
        if self.aux_layers is not None and not self.aux_layers:
            self.bad(file, f"{name}.aux_layers", "expected a list of layer ids, got an empty list")

    @property
    def aux_layer_count(self) -> int:
        """Target layers fused into the draft's input: EAGLE-3's three unless the plan names them."""
        return len(self.aux_layers) if self.aux_layers else 3


@dataclass(frozen=True)
class VocabSection(Section):
    NAME: ClassVar[str] = "vocab"

    draft_vocab_size: int = setting(
        32000, "tokens in the draft's vocabulary (the most frequent answer tokens)", lo=1
    )


@dataclass(frozen=True)
class TrainSection(Section):
    NAME: ClassVar[str] = "train"
    # The draft method's own keys (a DraftSettings subclass) this class also holds; None: TrainSection itself.
    METHOD_SETTINGS: ClassVar[type[DraftSettings] | None] = None

    mode: str | None = setting(
        None, "the same switch as [extract] mode; the two must agree", choices=STORAGE_MODES
    )
    steps: int = setting(200, "optimiser steps", lo=1)
    batch_size: int = setting(8, "global batch, in sequences (a multiple of nproc)", lo=1)
    micro_batch: int = setting(8, "sequences per rank per forward", lo=1)
    lr: float = setting(1e-4, "peak learning rate", lo=0, hi=10)
    min_lr_ratio: float = setting(0.1, "the cosine decay ends at this share of lr", lo=0, hi=1)
    warmup_steps: int = setting(-1, "linear warm-up steps (-1: 1.5 % of steps, SpecForge's ratio)", lo=-1)
    weight_decay: float = setting(0.0, "AdamW weight decay", lo=0, hi=10)
    max_grad_norm: float = setting(0.5, "gradient clipping norm", lo=0)
    ttt_steps: int = setting(7, "training-time-test depth: draft steps unrolled per row", lo=1, hi=64)
    loss_decay: float = setting(0.8, "weight of step k's loss is loss_decay**k", lo=0, hi=1)
    checkpoint_every: int = setting(100, "steps between checkpoints", lo=1)
    keep_checkpoints: int = setting(2, "checkpoints kept on disk", lo=1)
    log_every: int = setting(1, "steps between metric events", lo=1)
    seed: int = setting(0, "seed of the data order and the draft's initial weights", lo=0)
    nproc: int = setting(1, "data-parallel ranks (torchrun)", lo=1, hi=4096)
    device: str = setting("", "torch device (empty: cuda if any, else cpu)")
    init_lm_head: str = setting(
        "target", "the draft's LM head: rows of the target's (target) or random", choices=("target", "random")
    )
    max_length: int = setting(0, "tokens per row trained on (0: [target] max_length)", lo=0, hi=1 << 24)
    target: str = setting(
        "",
        '"online-tp": every rank holds a tensor-parallel shard of the target and captures',
        choices=("", "online-tp"),
    )
    length_grouping: int = setting(
        16, "sort rows by length within windows of this many batches (0: plain shuffle)", lo=0
    )
    prefetch: int = setting(
        2,
        "GPU, offline data: steps assembled ahead on a feeder thread (0: on the step's thread)",
        lo=0,
        hi=64,
    )
    eval_every: int = setting(
        0, "simulated acceptance on held-out rows every N steps (0: at every checkpoint; -1: never)", lo=-1
    )
    eval_rows: int = setting(64, "held-out rows it reads (the first N of the extraction's eval split)", lo=0)
    stop_when_acceptance_flat: int = setting(
        0, "stop training after N evaluations in a row without a better accept length (0: never)", lo=0
    )
    acceptance_min_delta: float = setting(
        0.0, "an accept length must beat the best by more than this to count as better", lo=0
    )
    eval_spec_steps: int = setting(
        0, "draft steps per verification it simulates (0: min(3, ttt_steps))", lo=0
    )
    loss_chunk_tokens: int = setting(
        4096, "tokens per soft-label loss chunk (0: every step's full logits at once)", lo=0
    )
    loss: str = setting(
        "kl",
        "objective per TTT step: kl (soft-label cross-entropy to the target), lk (-log acceptance), "
        "lk_adaptive (lambda*KL + (1-lambda)*TV); docs/eagle3.md, Methods",
        choices=("kl", "lk", "lk_adaptive"),
    )
    lk_kl_scale: float = setting(
        1.0, "lk_adaptive: lambda = lk_kl_scale * exp(-lk_kl_decay * mean acceptance)", lo=0, hi=1
    )
    lk_kl_decay: float = setting(
        1.0, "lk_adaptive: how fast the KL weight falls as acceptance rises (0: constant)", lo=0, hi=100
    )
    draft_fc_norm: bool = setting(
        False, "EAGLE-3.1: an RMSNorm on each fused target state before fc (config fc_norm)"
    )
    draft_norm_output: bool = setting(
        False, "EAGLE-3.1: feed the next draft step the final-normed hidden (config norm_output)"
    )
    draft: str = setting(
        "eagle3",
        "the draft trained: eagle3 (chain drafter), dflash (block-parallel drafter) or a method registered "
        "through AERIE_DRAFT_METHODS; docs/eagle3.md, Methods",
    )

    @classmethod
    def parse(cls, table: Any, file: Path | str, name: str | None = None) -> TrainSection:
        """``[train]`` with the keys of the method ``draft`` names (:class:`DraftSettings`): those go through
        the same checks, into a ``TrainSection`` that holds them as its own fields (``asdict`` and ``getattr``
        see the flat keys, as a checkpoint and a resume compare them). Another registered method's key (a plan
        switched from it, or one that forgot ``draft``) is refused, naming the method that owns it: ignoring it
        silently trained a method the plan did not ask for."""
        name = name or cls.NAME
        check_type(file, name, table, dict, "a table")
        own = cls._for_table(table, file, name)
        keys = {f.name for f in fields(own)}
        draft = table.get("draft", cls.__dataclass_fields__["draft"].default)
        for k in table:
            owner = None if k in keys else _owner_of(k, draft)
            if owner is not None:
                raise PlanError(
                    file,
                    key_name(name, k),
                    f"a key of the {owner} draft method, but {name}.draft is {draft!r}: it would be ignored "
                    f'(set {name}.draft = "{owner}" to train {owner}, or remove the key)',
                )
        return super(TrainSection, own).parse(table, file, name)

    @classmethod
    def _for_table(cls, table: dict[str, Any], file: Path | str, name: str) -> type[TrainSection]:
        """The section class for this table: ``TrainSection`` plus the keys of the method it names."""
        draft = table.get("draft", cls.__dataclass_fields__["draft"].default)
        if cls.METHOD_SETTINGS is not None or not isinstance(draft, str):
            return cls  # already a method's, or a draft the key's own check refuses
        try:
            methods = draft_names.known()
            if draft not in methods:
                raise PlanError(file, f"{name}.draft", f"must be one of {', '.join(methods)}, got {draft!r}")
            return train_section_for(draft_names.settings_class(draft), file, name, draft)
        except draft_names.DraftNameError as exc:
            raise PlanError(file, f"{name}.draft", str(exc)) from None

    def check(self, file: Path | str, name: str) -> None:
        try:
            methods = draft_names.known()
        except draft_names.DraftNameError as exc:
            self.bad(file, f"{name}.draft", str(exc))
        if self.draft not in methods:
            self.bad(file, f"{name}.draft", f"must be one of {', '.join(methods)}, got {self.draft!r}")
        if self.batch_size % self.nproc:
            self.bad(
                file,
                f"{name}.batch_size",
                f"{self.batch_size} must be a multiple of {name}.nproc ({self.nproc})",
            )
        if self.stop_when_acceptance_flat and self.eval_interval == 0:
            self.bad(
                file,
                f"{name}.stop_when_acceptance_flat",
                f"needs evaluations, but {name}.eval_every is {self.eval_every} and {name}.eval_rows {self.eval_rows}",
            )
        own = self.method_settings()
        own.check(file, name)
        limit, why = own.spec_steps_limit(self, name)
        if self.eval_spec_steps > limit:
            self.bad(file, f"{name}.eval_spec_steps", f"{self.eval_spec_steps} cannot exceed {why}")
        own.check_train(self, file, name)

    def method_settings(self) -> DraftSettings:
        """The draft method's own keys, typed (its :class:`DraftSettings`; the base, with no keys, where the
        method declares none). A ``TrainSection`` built directly rather than parsed gets the method's defaults."""
        cls = type(self).METHOD_SETTINGS
        if cls is None:
            try:
                cls = _checked_settings(draft_names.settings_class(self.draft), "", "train", self.draft)
            except (draft_names.DraftNameError, PlanError):
                cls = None
        return (cls or DraftSettings).of(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled by its method's name and its values: the method's class is made when a plan loads."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return (_restore_train, (self.draft, type(self).METHOD_SETTINGS is not None, values))

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps >= 0 else max(1, round(0.015 * self.steps))

    @property
    def spec_steps(self) -> int:
        """Draft tokens per verification the acceptance evaluation simulates (the method's default unless set)."""
        return self.eval_spec_steps or self.method_settings().default_spec_steps(self)

    @property
    def eval_interval(self) -> int:
        """Steps between acceptance evaluations (0: never)."""
        if self.eval_every < 0 or self.eval_rows == 0:
            return 0
        return self.eval_every or self.checkpoint_every

    @property
    def online_tp(self) -> bool:
        return self.target == "online-tp"


@dataclass(frozen=True)
class DraftSettings(Section):
    """A draft method's own ``[train]`` keys, declared in its folder (a ``settings`` module, standard library
    only, whose ``SETTINGS`` is the subclass; :mod:`pipeline.run.plan.draft_names` says where it is), and the
    rules that tie them to the rest of ``[train]``.

    A subclass declares its keys with :func:`~pipeline.run.plan.schema.setting`, as a section does; their names
    are ``[train]`` keys (``dflash_block_size``), so they may not reuse one of :class:`TrainSection`'s. When a plan
    names the method, ``[train]`` is parsed into a ``TrainSection`` that holds them too; :meth:`of` is the
    method's typed view of it. The hooks below default to a chain drafter trained ``ttt_steps`` deep (EAGLE-3's
    rules); a method overrides what differs.
    """

    NAME: ClassVar[str] = "train"

    @classmethod
    def of(cls, train: TrainSection) -> Self:
        """This method's keys, typed, as ``train`` holds them (its defaults where ``train`` lacks one)."""
        own = {f.name for f in fields(cls) if f.init}
        return cls(**{k: getattr(train, k) for k in own if hasattr(train, k)})

    def check_train(self, train: TrainSection, file: Path | str, name: str) -> None:
        """Rules between this method's keys and the rest of ``[train]`` (a key that means nothing to it)."""

    def spec_steps_limit(self, train: TrainSection, name: str) -> tuple[int, str]:
        """The most draft tokens per verification ``eval_spec_steps`` may simulate, and its reason in words."""
        return train.ttt_steps, f"{name}.ttt_steps ({train.ttt_steps}): the draft is only trained that deep"

    def default_spec_steps(self, train: TrainSection) -> int:
        """Draft tokens per verification the acceptance evaluation simulates when ``eval_spec_steps`` is 0."""
        return min(3, train.ttt_steps)

    def deep_check(self, train: TrainSection, facts: DeepFacts) -> list[DeepLine]:
        """The deep check's lines about this method's draft against the target (``aerie plan check --deep``)."""
        return []


@dataclass(frozen=True)
class DeepFacts:
    """What the deep check (:mod:`pipeline.eagle3.chain_check`) knows of the plan and its target when it asks
    the plan's draft method (:meth:`DraftSettings.deep_check`) for its own lines; plain values, no torch."""

    plan_file: str
    config_file: str  # the target's config.json and the prefix of its text model's keys, to name a field
    text_prefix: str
    num_layers: int
    vocab_size: int
    aux_layers: tuple[int, ...]  # what the extraction captures (plan order sorted, or the default)
    offline_bench_stages: tuple[str, ...]  # bench stages that decode offline with the trained draft
    bench_steps: int  # [bench] steps: draft tokens per verification the offline bench asks for
    sglang_release: str  # the SGLang release the stages are pinned to


@dataclass(frozen=True)
class DeepLine:
    """One line of the deep check: its name, whether it passed, what it found (a FAIL names file and key)."""

    name: str
    ok: bool
    detail: str
    warning: bool = False


_WITH: dict[type[DraftSettings], type[TrainSection]] = {}


def _checked_settings(settings: Any, file: Path | str, name: str, draft: str) -> type[DraftSettings] | None:
    """``SETTINGS`` of the method ``draft``, if it is a :class:`DraftSettings` whose keys are its own."""
    if settings is None:
        return None
    where = draft_names.known()[draft].settings
    if not (isinstance(settings, type) and issubclass(settings, DraftSettings)):
        raise PlanError(file, f"{name}.draft", f"{where}: SETTINGS is not a DraftSettings subclass")
    clash = sorted({f.name for f in fields(settings)} & {f.name for f in fields(TrainSection)})
    if clash:
        raise PlanError(
            file, f"{name}.draft", f"{where}: the {draft} draft redeclares [train] keys {', '.join(clash)}"
        )
    return settings


def train_section_for(settings: Any, file: Path | str, name: str, draft: str) -> type[TrainSection]:
    """``TrainSection`` with the keys of ``settings`` (a method's ``SETTINGS``) as fields of its own, made once."""
    cls = _checked_settings(settings, file, name, draft)
    if cls is None:
        return TrainSection
    if cls not in _WITH:
        hints = typing.get_type_hints(cls)
        own = [(f.name, hints[f.name], _field_copy(f)) for f in fields(cls)]
        made = make_dataclass(f"TrainSection_{draft}", own, bases=(TrainSection,), frozen=True, kw_only=True)
        made.__module__ = __name__
        made.__doc__ = f"[train] with the {draft} draft's own keys ({cls.__module__}.{cls.__qualname__})."
        made.METHOD_SETTINGS = cls  # type: ignore[attr-defined]
        _WITH[cls] = made
    return _WITH[cls]


def _field_copy(f: Field[Any]) -> Any:
    """A method's setting, declared anew for the class that holds it beside ``[train]``'s own."""
    if f.default is not MISSING:
        return field(default=f.default, metadata=f.metadata)
    if f.default_factory is not MISSING:
        return field(default_factory=f.default_factory, metadata=f.metadata)
    return field(metadata=f.metadata)


def _owner_of(key: str, draft: Any) -> str | None:
    """The other registered method that declares ``key``, if one does (a plan for it, switched to ``draft``)."""
    for other in draft_names.known():
        if other == draft:
            continue
        try:
            cls = draft_names.settings_class(other)
        except draft_names.DraftNameError:
            continue
        if isinstance(cls, type) and issubclass(cls, DraftSettings) and key in {f.name for f in fields(cls)}:
            return other
    return None


def _restore_train(draft: str, with_method: bool, values: dict[str, Any]) -> TrainSection:
    """A pickled ``TrainSection`` back, its method's keys' class made again in this process."""
    cls = (
        train_section_for(draft_names.settings_class(draft), "", "train", draft)
        if with_method
        else TrainSection
    )
    return cls(**values)


@dataclass(frozen=True)
class BenchSection(Section):
    NAME: ClassVar[str] = "bench"
    # (offline, online): the offline bench decodes one prompt at a time on the trainer's target, the online
    # one drives a server, so each has its own default size.
    PROMPTS: ClassVar[tuple[int, int]] = (16, 64)
    MAX_NEW_TOKENS: ClassVar[tuple[int, int]] = (64, 256)

    mode: str = setting(
        "offline",
        "offline: speculative decoding on the target here; online: against a server",
        choices=("offline", "online"),
    )
    holdout: float = setting(
        0.05, "share of every dataset's rows held out of training for the benchmarks", lo=0, hi=0.999
    )
    prompts: int | None = setting(None, "held-out prompts benchmarked (unset: 16 offline, 64 online)", lo=1)
    max_new_tokens: int | None = setting(None, "new tokens per prompt (unset: 64 offline, 256 online)", lo=2)
    steps: int = setting(3, "offline: draft tokens per verification", lo=1, hi=64)
    device: str | None = setting(None, "offline: torch device (unset: cuda if any, else cpu)")
    check_lossless: bool = setting(
        False, "offline: also decode without the draft and require the same tokens"
    )
    engine: str | None = setting(
        None,
        'where the draft is measured: "transformers" decodes here (offline), "sglang" drives the SGLang '
        "server the stage uses (online); unset: from mode",
        choices=("transformers", "sglang"),
    )
    concurrency: int = setting(8, "online: requests in flight while warming up", lo=1)
    batches: tuple[int, ...] = setting(
        (1, 8, 32),
        "online: closed-loop request streams, measured in turn (tok/s and accept length at each)",
        lo=1,
        hi=4096,
    )
    requests_per_stream: int = setting(2, "online: greedy requests each stream sends one after another", lo=1)
    timeout_s: float = setting(600.0, "online: seconds one request may take", positive=True)
    parallel: str | None = setting(
        None, 'offline: "tp" runs the target tensor-parallel under torchrun', choices=("tp",)
    )
    tp_size: int | None = setting(
        None, "tensor-parallel ranks (unset: the stage's GPUs, else 1)", lo=1, hi=4096
    )

    def check(self, file: Path | str, name: str) -> None:
        if self.engine == "transformers" and self.mode == "online":  # "sglang" with the default mode is fine
            self.bad(file, f"{name}.engine", f"is {self.engine!r} but {name}.mode is {self.mode!r}; set one")
        if not self.batches:
            self.bad(file, f"{name}.batches", "expected a list of stream counts, got an empty list")

    @property
    def online(self) -> bool:
        """Whether the bench drives a server (``engine = "sglang"`` or ``mode = "online"``)."""
        return self.engine == "sglang" if self.engine is not None else self.mode == "online"

    def prompt_count(self, online: bool) -> int:
        return self.prompts or self.PROMPTS[online]

    def new_tokens(self, online: bool) -> int:
        return self.max_new_tokens or self.MAX_NEW_TOKENS[online]


@dataclass(frozen=True)
class TelemetrySection(Section):
    NAME: ClassVar[str] = "telemetry"

    interval_s: float = setting(2.0, "seconds between GPU/disk samples", positive=True, hi=86400)
    max_mb: float = setting(16.0, "size of the sample log before it rotates (MB)", positive=True)
    projection_every_s: float = setting(30.0, "seconds between disk projections", positive=True, hi=86400)


@dataclass(frozen=True)
class AlertsSection(Section):
    NAME: ClassVar[str] = "alerts"

    command: str | None = setting(
        None, "a shell command run on the executing host for every alert (the team's webhook)"
    )
    bell: bool = setting(True, "ring the terminal bell on an alert")
    notify: bool = setting(True, "show a desktop notification on an alert")
    timeout_s: float = setting(30.0, "seconds each alert command may run", positive=True, hi=86400)
    # Alert rules (pipeline/run/alerts/, run by the supervisor; docs/operating.md, "On day four"). A 0 turns a rule off.
    stall_minutes: float = setting(
        30.0,
        "alert when a running stage reports no progress and no metric for this long (0: off)",
        lo=0,
        hi=1e6,
    )
    diverge_factor: float = setting(
        3.0,
        "alert when the loss is above this many times its minimum over the last diverge_window points "
        "(two points in a row; 0: off)",
        lo=0,
        hi=1e6,
    )
    diverge_window: int = setting(
        50, "logged loss points the divergence rule's minimum spans", lo=2, hi=10**6
    )
    accept_window: int = setting(
        3, "evaluations over which a falling accept length with a falling loss alerts (0: off)", lo=0, hi=1000
    )
    accept_drop: float = setting(
        0.05,
        "the relative fall of the accept length across accept_window evaluations that alerts",
        lo=0,
        hi=1,
    )
    gpu_idle_minutes: float = setting(
        20.0, "alert when a GPU of a running (non-service) stage sits idle this long (0: off)", lo=0, hi=1e6
    )
    gpu_idle_util: float = setting(
        5.0, "utilisation (%) at or below which a GPU counts as idle", lo=0, hi=100
    )
    throughput_fraction: float = setting(
        0.3,
        "alert when the server's gen throughput falls below this fraction of its recent median while "
        "requests run (0: off)",
        lo=0,
        hi=1,
    )
    throughput_window: int = setting(
        30, "gen-throughput samples the server's recent median spans", lo=3, hi=10**5
    )
    accept_gap: float = setting(
        0.15,
        "alert when the bench stage's served accept length is below the train stage's simulated one for the "
        "same draft by more than this fraction (0: off)",
        lo=0,
        hi=1,
    )

    def check(self, file: Path | str, name: str) -> None:
        if 0 < self.diverge_factor <= 1:
            self.bad(
                file, f"{name}.diverge_factor", f"must be 0 (off) or above 1, got {self.diverge_factor!r}"
            )
        if self.accept_window == 1:
            self.bad(file, f"{name}.accept_window", "must be 0 (off) or 2 or more evaluations, got 1")


@dataclass(frozen=True)
class UiSection(Section):
    NAME: ClassVar[str] = "ui"

    theme: str | None = setting(None, "the console theme for this run (the user's config and --theme win)")


@dataclass(frozen=True)
class WandbSection(Section):
    NAME: ClassVar[str] = "wandb"

    project: str | None = setting(None, "required: the W&B project the stages log to")
    entity: str | None = setting(None, "the W&B entity (team)")
    mode: str = setting(
        "offline", "online, or offline (synced later with wandb sync)", choices=("online", "offline")
    )
    group: str | None = setting(None, "the W&B run group (unset: the plan's run name)")

    def check(self, file: Path | str, name: str) -> None:
        if self.project is None:
            self.bad(file, f"{name}.project", "required: the W&B project the stages log to")


@dataclass(frozen=True)
class SlurmSection(Section):
    """``[slurm]``, and a stage's ``slurm = {...}`` overrides: each value becomes one ``sbatch`` argv word."""

    NAME: ClassVar[str] = "slurm"

    partition: str | None = setting(None, "sbatch --partition (unset: the cluster's default)")
    account: str | None = setting(None, "sbatch --account")
    qos: str | None = setting(None, "sbatch --qos")
    time: int | str | None = setting(None, 'sbatch --time: minutes, or "D-HH:MM:SS"', lo=1, hi=10**7)
    extra: tuple[str, ...] = setting((), 'further sbatch long options, e.g. "--constraint=h100"')

    def check(self, file: Path | str, name: str) -> None:
        for k in ("partition", "account", "qos"):
            v = getattr(self, k)
            if v is not None:
                check_text(file, f"{name}.{k}", v, empty=False)
                if v.startswith("-") or any(c.isspace() or c in _NAME_BAD for c in v):
                    self.bad(file, f"{name}.{k}", f"{v!r}: not a valid Slurm {k} name")
        if isinstance(self.time, str):
            check_text(
                file, f"{name}.time", self.time, 'a Slurm time limit (minutes, or "D-HH:MM:SS")', empty=False
            )
            if not set(self.time) <= _SLURM_TIME_CHARS or not self.time[0].isdigit():
                self.bad(
                    file,
                    f"{name}.time",
                    f'{self.time!r}: not a Slurm time limit (e.g. "90", "4:00:00", "1-12:00:00")',
                )
        for i, word in enumerate(self.extra):
            if not word.startswith("--") or len(word) < 3:
                self.bad(
                    file,
                    f"{name}.extra[{i}]",
                    f'{word!r}: each extra item is one sbatch long option, e.g. "--constraint=h100"',
                )

    def given(self) -> dict[str, Any]:
        """The keys the plan set, as ``sbatch`` options take them."""
        return {k: v for k, v in self.to_dict().items() if v is not None and v != []}


SECTIONS: dict[str, type[Section]] = {
    s.NAME: s
    for s in (
        TargetSection,
        ResourcesSection,
        PrepSection,
        RegenSection,
        ServeSection,
        DeploySection,
        ExtractSection,
        VocabSection,
        TrainSection,
        BenchSection,
        TelemetrySection,
        AlertsSection,
        UiSection,
        WandbSection,
        SlurmSection,
    )
}


@dataclass(frozen=True)
class PlanSettings:
    """Every settings table of one plan, typed, with defaults where the plan is silent."""

    target: TargetSection = TargetSection()
    resources: ResourcesSection = ResourcesSection()
    prep: PrepSection = PrepSection()
    regen: RegenSection = RegenSection()
    serve: ServeSection = ServeSection()
    deploy: DeploySection = DeploySection()
    extract: ExtractSection = ExtractSection()
    vocab: VocabSection = VocabSection()
    train: TrainSection = TrainSection()
    bench: BenchSection = BenchSection()
    telemetry: TelemetrySection = TelemetrySection()
    alerts: AlertsSection = AlertsSection()
    ui: UiSection = UiSection()
    wandb: WandbSection | None = None  # W&B logging is on only where the plan has a [wandb] table
    slurm: SlurmSection = SlurmSection()

    @classmethod
    def parse(cls, raw: dict[str, Any], file: Path | str) -> PlanSettings:
        """Each table of ``raw`` that is a settings section, checked; then the rules across sections."""
        values: dict[str, Any] = {
            name: SECTIONS[name].parse(raw[name], file) for name in SECTIONS if name in raw
        }
        settings = cls(**values)
        settings.check(file)
        return settings

    def check(self, file: Path | str) -> None:
        ex, tr = self.extract.mode, self.train.mode
        if ex is not None and tr is not None and ex != tr:
            raise PlanError(file, "extract.mode", f"is {ex!r} but train.mode is {tr!r}; set one")
        if self.train.online_tp and "offline" in (ex, tr):
            raise PlanError(
                file,
                "extract.mode" if ex == "offline" else "train.mode",
                'train.target = "online-tp" captures during training; mode = "offline" would store what it '
                "never reads: drop it",
            )

        if self.target.engine == "sglang":
            self._check_sglang_engine(file)

    def _check_sglang_engine(self, file: Path | str) -> None:
        """What capture through SGLang's model runner cannot do: say which key and what to do instead."""
        dev = self.extract.device
        if dev is not None and (dev == "cpu" or dev.startswith("cpu")):
            raise PlanError(
                file,
                "extract.device",
                'is "cpu" but target.engine = "sglang": SGLang\'s model runner needs a GPU; drop the device or '
                'set target.engine = "transformers"',
            )
        if dev == "auto":
            raise PlanError(
                file,
                "extract.device",
                'is "auto" (layers spread over the GPUs by accelerate) but target.engine = "sglang" shards the '
                'target itself: set extract.parallel = "tp" (with tp_size) instead',
            )
        if self.train.online_tp:
            raise PlanError(
                file,
                "train.target",
                'is "online-tp" but target.engine = "sglang": the draft\'s ranks would have to be SGLang\'s '
                "tensor-parallel ranks too (one process group for both, which SGLang's runner does not share); "
                'use extract.mode = "online" with train.nproc = 1 (SGLang in the train process), mode = "offline" '
                'with extract.parallel = "tp", or target.engine = "transformers"',
            )
        if self.storage_mode == "online" and self.train.device.startswith("cpu"):
            raise PlanError(
                file,
                "train.device",
                'is "cpu" but online training with target.engine = "sglang" runs SGLang\'s model runner in the '
                'train process, which needs a GPU; drop the device or set target.engine = "transformers"',
            )
        if self.storage_mode == "online" and self.train.nproc > 1:
            raise PlanError(
                file,
                "train.nproc",
                f'is {self.train.nproc} but online training with target.engine = "sglang" runs SGLang\'s runner '
                "in the one train process (a one-rank group of its own): set train.nproc = 1, or use "
                'mode = "offline" (the extract stage captures, tensor-parallel if needed)',
            )

    @property
    def storage_mode(self) -> str:
        """``offline`` (hidden states stored) or ``online`` (nothing stored; online-tp training too)."""
        if self.train.online_tp:
            return "online"
        return self.extract.mode or self.train.mode or "offline"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: s.to_dict() for f in fields(self) if (s := getattr(self, f.name)) is not None}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def render_settings(settings: PlanSettings, raw: dict[str, Any]) -> str:
    """Every section's resolved settings, as TOML: the plan's values, then the defaults it left out,
    marked ``(default)``, each with its one-line doc. A key left unset is shown commented out."""
    lines: list[str] = []
    for name in SECTIONS:
        section = getattr(settings, name)
        table = raw.get(name)
        given: dict[str, Any] = table if isinstance(table, dict) else {}
        if lines:
            lines.append("")
        if section is None:
            lines.append(f"# [{name}] is not in the plan: off")
            continue
        lines.append(f"[{name}]")
        for key, _type, _default, doc in type(section).describe():
            value = getattr(section, key)
            where = "" if key in given else " (default)"
            text = f"{key} = {_toml_value(value)}" if value is not None else f"# {key} = (unset)"
            lines.append(f"{text:<44} # {doc}{where}")
    return "\n".join(lines)
