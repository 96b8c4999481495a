"""A draft method as one spec, looked up by name: :class:`DraftMethod` (in the spirit of torchtitan's
``ModelSpec`` and vLLM speculators' registry), and the contract between it and the stages that use it.

A method's module defines ``METHOD = DraftMethod(...)`` (a built-in's ``pipeline.drafts.<name>.method``, a
registered folder's ``__init__.py``): how the trainer builds the draft
(:attr:`~DraftMethod.build`), trains it (:attr:`~DraftMethod.loss`: the training objective and the simulated
accept length), saves it for SGLang (:attr:`~DraftMethod.export`), what it writes into the train manifest and
says at start and end, and how the offline bench drafts with it (:attr:`~DraftMethod.drafter`). Names map to
packages in :mod:`pipeline.run.plan.draft_names` (built-in, or registered from any folder through
``AERIE_DRAFT_METHODS``); :func:`draft_method` imports the package and returns its spec. A method's own
``[train]`` keys, their rules and its deep-check lines are not in the spec but in its standard-library
``settings`` module (a :class:`~pipeline.run.plan.sections.DraftSettings`), registered beside it: the plan
and the deep check read them without importing torch or this package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from pipeline.drafts.batch import Batch
from pipeline.eagle3.draft_vocab import VocabMap
from pipeline.eagle3.spec_decode import Drafter
from pipeline.run.plan import draft_names
from pipeline.run.plan.sections import DeploySection, TrainSection


@dataclass(frozen=True)
class BuildInputs:
    """What the trainer knows when it builds the draft: the target, the extraction's aux layers, the draft
    vocabulary and ``[train]``."""

    model_id: str
    aux_layer_ids: list[int]
    vocab: VocabMap
    settings: TrainSection
    trust_remote_code: bool = False


@dataclass
class BuiltDraft:
    """The draft to train (a module with ``trainable_state()``: what checkpoints hold), the rows of the
    target's LM head over the draft vocabulary, its whole LM head (empty where the draft holds the head
    itself), and the columns of the stored aux features the draft reads (``None``: all of them)."""

    draft: torch.nn.Module
    head_d: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    head_full: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    aux_cols: torch.Tensor | None = None


@dataclass
class TrainedDraft:
    """The draft under training, the module the step calls (DDP around it on several ranks), the rows of
    the target's LM head over the draft vocabulary (the soft labels' projection) and the trained params."""

    draft: Any  # the method's draft module
    model: Any
    head_d: torch.Tensor
    params: list[torch.nn.Parameter]
    head_full: torch.Tensor | None = None  # the target's whole lm_head: the LK losses' acceptance needs it


class DraftLoss(Protocol):
    """A method's training objective, in the trainer's per-step bookkeeping (``ttt_steps`` predicted steps
    or slots, each with its count, summed loss and greedy accuracy), and its simulated accept length."""

    @property
    def ttt_steps(self) -> int: ...

    @property
    def decay(self) -> float: ...  # step (slot) j's weight is decay**j: the logged loss weighs them so too

    @property
    def needs_full_head(self) -> bool: ...

    def counts(self, batches: list[Batch], device: torch.device) -> torch.Tensor: ...

    def sums(self, td: TrainedDraft, b: Batch) -> tuple[list[torch.Tensor], torch.Tensor]: ...

    def weighted(self, per_step: list[Any], denom: torch.Tensor) -> Any: ...

    def accept_length(
        self,
        draft: Any,
        data: Any,
        rows: list[int],
        device: torch.device,
        dtype: torch.dtype,
        spec_steps: int,
        micro_batch: int,
    ) -> float: ...


@dataclass(frozen=True)
class DrafterInputs:
    """What the offline bench has when it loads the trained draft: its folder, the target (its LM head), the
    aux layers the target captures, where and in which dtype the draft runs, and the target's embedding."""

    path: Path
    target: Any
    aux_layer_ids: list[int]
    device: torch.device
    dtype: torch.dtype
    embed: (
        torch.Tensor
    )  # the target's input embedding, float (every rank gathers it under tensor parallelism)


def _no_bench_problem(manifest: dict[str, Any], steps: int, tensor_parallel: bool) -> str | None:
    return None


@dataclass(frozen=True)
class DraftMethod:
    """One draft method: everything the train stage, the export and the offline bench need of it."""

    name: str
    build: Callable[[BuildInputs], BuiltDraft]
    loss: Callable[[TrainSection, bool, torch.Tensor | None], DraftLoss]  # settings, autocast, aux columns
    export: Callable[[Any, Path], None]  # the SGLang-loadable folder of a draft
    drafter: Callable[[DrafterInputs], Drafter]  # the offline bench's drafter of a saved draft
    describe: Callable[[TrainSection], str]  # the trainer's start line: the recipe in a few words
    # SGLang's launch flags for the finished draft, all but its path (the one source: the serve stage's
    # --mode eagle3 launches with them, the train stage's last line names them)
    serve_flags: Callable[[TrainSection, DeploySection], tuple[str, ...]]
    manifest: Callable[[TrainSection], dict[str, Any]]  # the train manifest's method keys (block_size, loss)
    shape_keys: tuple[
        str, ...
    ] = ()  # [train] keys that change the draft's modules: a resume refuses a change
    bench_problem: Callable[[dict[str, Any], int, bool], str | None] = _no_bench_problem
    # (the train manifest, [bench] steps, tensor-parallel target) -> why the offline bench cannot run, or None


class DraftMethodError(ValueError):
    """No such draft method, or its package does not define one."""


_loaded: dict[str, DraftMethod] = {}


def draft_method(name: str) -> DraftMethod:
    """The method ``name`` names (``[train] draft``, the train manifest's ``draft``), its package imported once."""
    if name in _loaded:
        return _loaded[name]
    reg = draft_names.known().get(name)
    if reg is None:
        raise DraftMethodError(
            f"no draft method named {name!r} (known: {', '.join(draft_names.known())}; "
            f"register one with {draft_names.ENV}=name=location)"
        )
    where = reg.method
    module = _import(name, where)
    method = getattr(module, "METHOD", None)
    if not isinstance(method, DraftMethod) or method.name != name:
        raise DraftMethodError(f"{where}: defines no METHOD = DraftMethod(name={name!r}, ...)")
    _loaded[name] = method
    return method


def _import(name: str, where: str) -> Any:
    """A module path, or a folder (its ``__init__.py``) or ``.py`` file anywhere on disk."""
    path = Path(where)
    if not (path.suffix == ".py" or path.is_dir() or where.startswith((".", "/", "~"))):
        return importlib.import_module(where)
    path = path.expanduser()
    file = path / "__init__.py" if path.is_dir() else path
    if not file.is_file():
        raise DraftMethodError(f"{draft_names.ENV}: {name}={where}: no such file or package folder")
    mod_name = f"aerie_draft_method_{name}"
    spec = importlib.util.spec_from_file_location(
        mod_name, file, submodule_search_locations=[str(path)] if path.is_dir() else None
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # the package's own relative imports find it
    spec.loader.exec_module(module)
    return module
