"""How many tokens each dataset will bring to extraction: counted where prep already ran, sampled from the
dataset's own rows where they are on disk, and only assumed (every row ``max_length`` tokens) where neither is
possible. The deep check's disk projection is built on it (a flat ``max_length`` per row overstates a 1,500-token
mean at 2,048 by 36 %). Nothing is downloaded: a dataset that lives only on the hub is assumed, and says so.
"""

from __future__ import annotations

import itertools
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.data import sources
from pipeline.data.conversation import ConversationError, prompt_of
from pipeline.run.plan.dag import Dataset, Plan
from pipeline.run.rundir.layout import RunDir
from pipeline.run.supervise.budget import BudgetError, manifest_tokens

PROMPT_ONLY = "prompt-only"


@dataclass(frozen=True)
class DatasetTokens:
    name: str
    tokens: int
    how: str  # counted | sampled | assumed, with the figures behind it

    @property
    def assumed(self) -> bool:
        return self.how.startswith("assumed")


def sample_mean(ds: Dataset, encode: Any, n: int, cache_dir: Path) -> tuple[float, int] | str:
    """Mean tokens of the first ``n`` usable rows of a local dataset and how many were used: the whole
    conversation for a target-native dataset, the prompt for a prompt-only one (its answer is regenerated).
    Where no row can be used: why (the first row's problem)."""
    src = sources.get(ds.source)
    convs: list[list[dict[str, Any]]] = []
    for raw in itertools.islice(
        sources.open_rows(src, ds.path, ds.split, ds.config, ds.options, cache_dir), 4 * n
    ):
        if isinstance(raw.row, ConversationError):
            continue
        try:
            conv = sources.normalise(src, raw.row, ds.options)
            if ds.kind == PROMPT_ONLY:
                # The prompt, closed by an empty answer, renders as the prompt plus the assistant header.
                conv = [*prompt_of(conv), {"role": "assistant", "content": ""}]
        except ConversationError:
            continue
        convs.append(conv)
        if len(convs) >= n:
            break
    encoded = encode(convs) if convs else []
    lengths = [e.num_tokens for e in encoded if not isinstance(e, Exception)]
    if not lengths:
        return f"no usable row among the first {4 * n}" + (f" ({encoded[0]})" if encoded else "")
    return sum(lengths) / len(lengths), len(lengths)


def estimate(
    plan: Plan, encode: Any, max_len: int, answer_tokens: int, sample: int = 32
) -> list[DatasetTokens]:
    """Each dataset's tokens, by the best evidence there is (see the module docstring). ``encode`` is the
    target's chat tokenizer's ``encode``; ``answer_tokens`` what regeneration may add to a prompt."""
    run = RunDir(plan.run_dir)
    out: list[DatasetTokens] = []
    with tempfile.TemporaryDirectory(prefix="aerie-tokens-") as tmp:
        for ds in plan.datasets:
            counted = _counted(plan, run, ds)
            if counted is not None:
                out.append(DatasetTokens(ds.name, counted, f"counted by prep: {counted:,} tokens"))
                continue
            got: tuple[float, int] | str = "no local rows to sample"
            if ds.path and Path(ds.path).exists():
                try:
                    got = sample_mean(ds, encode, sample, Path(tmp))
                except (OSError, ValueError, KeyError) as exc:  # prep reports data problems row by row
                    got = f"its rows cannot be read here: {exc}"
            if isinstance(got, str):
                out.append(
                    DatasetTokens(ds.name, ds.quota * max_len, f"assumed {max_len:,} tokens per row ({got})")
                )
                continue
            mean, n = got
            per_row = min(max_len, mean + (answer_tokens if ds.kind == PROMPT_ONLY else 0))
            what = (
                f"prompts {mean:,.0f} + at most {answer_tokens:,} answer tokens"
                if ds.kind == PROMPT_ONLY
                else f"{mean:,.0f}"
            )
            out.append(
                DatasetTokens(
                    ds.name,
                    math.ceil(per_row * ds.quota),
                    f"sampled {n} rows: {what} per row, at most {max_len:,}",
                )
            )
    return out


def _counted(plan: Plan, run: RunDir, ds: Dataset) -> int | None:
    """Tokens the dataset's prep (or regeneration) wrote, where its output is already in the run directory."""
    if not run.root.is_dir():
        return None
    total = None
    for spec in plan.stages:
        if spec.dataset == ds.name and spec.run in ("prep", "regen"):
            try:
                got = manifest_tokens(run.stage(spec.id).out)
            except BudgetError:
                got = None
            if got is not None:
                total = max(total or 0, got[0])  # regen's tokens replace prep's prompts
    return total
