"""The methods harness's recipes and its one table (no torch: the tests import it directly).

A recipe is one line: a dict of ``[train]`` plan overrides trained by the real train stage, or
``{"command": ...}`` for an external trainer (SpecForge's wrapper) whose ``{placeholders}`` are filled from
:data:`COMMAND_FIELDS`; it must write an SGLang-format draft folder to ``{out}``, which is then benched the
same way. ``--recipe NAME=JSON`` adds one without editing this file.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

RECIPES: dict[str, dict[str, Any]] = {
    "eagle3": {},  # plain EAGLE-3: soft-label KL per TTT step
    "lk": {"loss": "lk"},  # -log acceptance (arXiv 2602.23881)
    "lk_adaptive": {"loss": "lk_adaptive"},  # lambda*KL + (1-lambda)*TV, lambda falling as acceptance rises
    "eagle31": {"draft_fc_norm": True, "draft_norm_output": True},  # EAGLE-3.1's two norms
    # DFlash (a parallel drafter): a block of B slots drafted in one pass, so it is benched only at the spec whose
    # draft tokens equal B ([bench] steps = B - 1, what SGLang serves by default); same size as EAGLE-3's draft
    "dflash4": {"draft": "dflash", "dflash_block_size": 4, "specs": ["3/1/4"]},
    "dflash8": {"draft": "dflash", "dflash_block_size": 8, "specs": ["7/1/8"]},
}
DEFAULT_RECIPES = ("eagle3", "lk", "lk_adaptive", "eagle31")
# what an external trainer's command may name: the extract store, the vocab stage's dir, the run dir, the budget
COMMAND_FIELDS = ("store", "vocab", "run", "steps", "batch", "lr", "seed", "ttt", "out", "python")
SPECS = {"3/1/4": 3, "7/1/8": 7}  # SGLang's steps/topk/draft tokens -> the offline bench's [bench] steps


def parse_recipes(names: str, extra: Iterable[str] = ()) -> dict[str, dict[str, Any]]:
    """The recipes named in ``names`` (comma-separated), after adding each ``NAME=JSON`` of ``extra``."""
    table = dict(RECIPES)
    for item in extra:
        name, sep, body = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f'--recipe {item!r}: expected NAME=JSON, e.g. lk2=\'{{"loss": "lk"}}\'')
        try:
            spec = json.loads(body)
        except ValueError as exc:
            raise ValueError(f"--recipe {name}: not JSON ({exc})") from exc
        if not isinstance(spec, dict):
            raise ValueError(f'--recipe {name}: expected a JSON object of [train] keys or {{"command": ...}}')
        table[name.strip()] = spec
    out = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in table:
            raise ValueError(f"unknown recipe {name!r} (known: {', '.join(table)})")
        out[name] = table[name]
    if not out:
        raise ValueError("no recipe named")
    return out


def parse_seeds(default: str, per_recipe: Iterable[str], names: Iterable[str]) -> dict[str, list[int]]:
    """Each recipe's seeds: ``default`` (``--seeds``, comma-separated) unless a ``NAME=0,1,2`` of ``per_recipe``
    (``--seeds-of``) names it, so a spread is paid for only where it is asked (e.g. plain EAGLE-3 and SpecForge)."""

    def ints(flag: str, text: str) -> list[int]:
        try:
            out = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected comma-separated integers, e.g. 0,1,2") from None
        if not out or len(set(out)) != len(out):
            raise ValueError(f"{flag} {text!r}: expected distinct seeds, e.g. 0,1,2")
        return out

    names = list(names)
    seeds = {n: ints("--seeds", default) for n in names}
    for item in per_recipe:
        name, sep, body = item.partition("=")
        if not sep or name.strip() not in seeds:
            raise ValueError(
                f"--seeds-of {item!r}: expected NAME=SEEDS with NAME one of the recipes run ({', '.join(names)})"
            )
        seeds[name.strip()] = ints(f"--seeds-of {name.strip()}=", body)
    return seeds


def train_keys(spec: dict[str, Any]) -> dict[str, Any]:
    """A recipe's ``[train]`` overrides: everything but the harness's own ``specs`` key."""
    return {k: v for k, v in spec.items() if k != "specs"}


def recipe_specs(name: str, spec: dict[str, Any], specs: list[str]) -> list[str]:
    """The asked-for specs this recipe is benched at (a recipe's ``specs`` narrows them)."""
    only = spec.get("specs")
    if only is None:
        return specs
    if not isinstance(only, list) or any(s not in SPECS for s in only):
        raise ValueError(f"recipe {name}: specs must be a list of {', '.join(SPECS)}")
    return [s for s in specs if s in only]


def check_command(name: str, command: str) -> None:
    """Fail early on a placeholder the harness does not fill."""
    import string

    for _, field, _, _ in string.Formatter().parse(command):
        if field is not None and field not in COMMAND_FIELDS:
            raise ValueError(
                f"recipe {name}: unknown placeholder {{{field}}} (known: {', '.join(COMMAND_FIELDS)})"
            )


def accept_by_kind(per_prompt: list[dict[str, Any]], kind_of: dict[str, str]) -> dict[str, float | None]:
    """Accept length (mean accepted drafts per verify step + 1) per prompt kind and ``all``, from the bench
    stage's ``per_prompt`` rows; a kind with no verify step is ``None``."""
    acc: dict[str, list[int]] = {}
    for row in per_prompt:
        kind = kind_of.get(str(row["id"]))
        if kind is None:
            raise ValueError(f"bench row {row['id']!r} is not one of the held-out prompts")
        acc.setdefault(kind, []).extend(row["accepted"])
        acc.setdefault("all", []).extend(row["accepted"])
    return {k: (sum(v) / len(v) + 1 if v else None) for k, v in acc.items()}


def table(rows: list[dict[str, Any]], kinds: Iterable[str]) -> str:
    """One text table: recipe × seed × spec, accept length per kind and overall, verify steps, train/bench s."""
    kinds = list(kinds)
    head = ["recipe", "seed", "spec", *kinds, "all", "verify", "sim", "train s", "bench s"]
    body = []
    for r in sorted(rows, key=lambda r: (r["recipe"], r["seed"], r["spec"])):
        al = r.get("accept_len", {})
        body.append(
            [
                r["recipe"],
                str(r["seed"]),
                r["spec"],
                *(_num(al.get(k)) for k in [*kinds, "all"]),
                str(r.get("verify_steps", "")),
                _num(r.get("sim_accept")),
                _num(r.get("train_s"), 0),
                _num(r.get("bench_s"), 0),
            ]
        )
    return _layout(head, body, left=3)


def seed_summary(rows: list[dict[str, Any]], base: str = "eagle3") -> str:
    """Per recipe and spec over its seeds: how many, the mean accept length (all prompts), the spread (min–max)
    and the mean against ``base``'s mean at the same spec ("-" where ``base`` was not run at that spec)."""
    groups: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        v = r.get("accept_len", {}).get("all")
        if v is not None:
            groups.setdefault((r["recipe"], r["spec"]), []).append(v)
    head = ["recipe", "spec", "seeds", "mean", "min-max", f"vs {base}"]
    body = []
    for (name, spec), vals in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        mean = sum(vals) / len(vals)
        ref = groups.get((base, spec))
        ratio = "-" if not ref else f"{mean / (sum(ref) / len(ref)):.3f}x"
        body.append([name, spec, str(len(vals)), f"{mean:.3f}", f"{min(vals):.3f}-{max(vals):.3f}", ratio])
    return _layout(head, body, left=2)


def _layout(head: list[str], body: list[list[str]], left: int) -> str:
    """Columns as wide as their widest cell, the first ``left`` ones left-aligned (names), the rest right (numbers)."""
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    lines = [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [head, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
