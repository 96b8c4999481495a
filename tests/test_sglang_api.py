"""The SGLang source Aerie calls, checked in every release of ``pipeline/tested_versions.py``'s table.

Aerie's capture through SGLang (``pipeline/eagle3/sglang_target.py``) drives SGLang's internal batch API —
``Req``, ``ScheduleBatch.init_new``, ``prepare_for_extend``, ``ForwardBatch.init_new``, ``ModelRunner``,
``ServerArgs`` — which changes between releases without notice. Importing SGLang needs its CUDA
dependencies, so this test reads each release's **wheel** (downloaded without dependencies by CI: ``bash
.ci/sglang-wheels``) and parses the modules Aerie imports with :mod:`ast`, never executing them: every class,
function, signature and attribute name Aerie uses must be there. A tested release must have all of it; a
release the table calls known-broken must miss exactly what its row says. So a rename fails here, not on day
four of a run, and the table's status is a checked fact.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import tested_versions as tv
from pipeline.eagle3 import sglang_target as st
from pipeline.run.plan import dag as plan_mod
from pipeline.serving.sglang_args import settings_from_plan, sglang_argv

ROOT = Path(__file__).resolve().parent.parent


def wheel_dir() -> Path:
    """Where ``.ci/sglang-wheels`` puts the wheels (``AERIE_SGLANG_WHEELS`` overrides)."""
    return Path(os.environ.get("AERIE_SGLANG_WHEELS") or Path.home() / ".cache" / "aerie" / "sglang-wheels")


def wheel_of(version: str) -> Path:
    found = sorted(wheel_dir().glob(f"sglang-{version}-*.whl"))
    if not found:
        pytest.skip(
            f"no sglang {version} wheel in {wheel_dir()}; fetch every release of the tested-versions table "
            "with `bash .ci/sglang-wheels` (pip download --no-deps, ~50 MB)"
        )
    return found[-1]


class Source:
    """The modules of one SGLang wheel, parsed (never imported)."""

    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            name = module.replace(".", "/")
            for path in (f"{name}.py", f"{name}/__init__.py"):
                try:
                    self._trees[module] = ast.parse(self.zip.read(path).decode(), path)
                    break
                except KeyError:
                    continue
            else:
                self._trees[module] = None
        return self._trees[module]

    def cls(self, module: str, name: str) -> ast.ClassDef | None:
        tree = self.tree(module)
        if tree is None:
            return None
        return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)

    def defines(self, module: str, name: str) -> bool:
        tree = self.tree(module)
        if tree is None:
            return False
        for n in tree.body:
            if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name:
                return True
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
                return True
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name:
                return True
            if isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == name for a in n.names):
                return True  # re-exported
        return False

    def modules_under(self, package: str) -> list[str]:
        prefix = package.replace(".", "/") + "/"
        return [
            n[:-3].replace("/", ".")
            for n in self.zip.namelist()
            if n.startswith(prefix) and n.endswith(".py")
        ]

    def server_args_fields(self) -> set[str]:
        """``ServerArgs``' fields: its own annotations (0.5.14, a dataclass), or those of the namespace classes
        under ``sglang/srt/arg_groups/fields/`` it is assembled from (0.5.23, a ``msgspec`` struct)."""
        out: set[str] = set()
        for module in ["sglang.srt.server_args", *self.modules_under("sglang.srt.arg_groups.fields")]:
            tree = self.tree(module)
            for c in tree.body if tree is not None else []:
                if isinstance(c, ast.ClassDef) and (
                    module != "sglang.srt.server_args" or c.name == "ServerArgs"
                ):
                    out |= {
                        n.target.id
                        for n in c.body
                        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                    }
        return out

    def server_flags(self) -> set[str]:
        """Every flag the launch parser can know: ``--field-name`` of each field, and every string literal of
        the modules that declare them (aliases such as ``--tp``, flags registered by hand)."""
        out = {"--" + f.replace("_", "-") for f in self.server_args_fields()}
        for module in ["sglang.srt.server_args", *self.modules_under("sglang.srt.arg_groups")]:
            tree = self.tree(module)
            if tree is not None:
                out |= {
                    n.value
                    for n in ast.walk(tree)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }
        return out


def method(c: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return next((n for n in c.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def bound(f: ast.FunctionDef) -> int:
    """1 when the first parameter is self/cls (a method or classmethod), 0 for a staticmethod."""
    return 0 if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in f.decorator_list) else 1


def params(f: ast.FunctionDef) -> list[str]:
    a = f.args
    return [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]][bound(f) :]


def required(f: ast.FunctionDef) -> list[str]:
    a = f.args
    pos = [*a.posonlyargs, *a.args]
    req = [x.arg for x in pos[: len(pos) - len(a.defaults)]][bound(f) :]
    return req + [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None]


def class_names(c: ast.ClassDef) -> set[str]:
    """Fields, class attributes, methods/properties, and every ``self.X = …`` in its methods."""
    out: set[str] = set()
    for n in c.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            out.add(n.name)
    for n in ast.walk(c):
        targets: list[ast.expr] = []
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, ast.AnnAssign | ast.AugAssign):
            targets = [n.target]
        for t in targets:
            for x in ast.walk(t):
                if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                    out.add(x.attr)
    return out


def accepts(c: ast.ClassDef) -> set[str]:
    """The keywords a class's constructor takes: ``__init__``'s parameters, else its fields (dataclass,
    msgspec.Struct)."""
    init = method(c, "__init__")
    if init is not None:
        return set(params(init))
    return {n.target.id for n in c.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


# What Aerie uses, module -> class -> what of it (sglang_target.py; the serve stage uses only the argv).
SB = "sglang.srt.managers.schedule_batch"
FBI = "sglang.srt.model_executor.forward_batch_info"
LP = "sglang.srt.layers.logits_processor"


KEYWORD_CALLS = {("ScheduleBatch", "init_new")}


@dataclass(frozen=True)
class Use:
    module: str
    cls: str
    takes: tuple[str, ...] = ()  # keywords Aerie passes to the constructor
    # method -> the arguments Aerie passes: by keyword for those in KEYWORD_CALLS, else by position (in order)
    calls: dict[str, tuple[str, ...]] | None = None
    has: tuple[str, ...] = ()  # attributes Aerie reads or sets


# What runner_kwargs can fill (it passes those the installed ModelRunner names): a required one beyond is a miss.
RUNNER_KEYS = tuple(
    st.runner_kwargs(st.RunnerSpec("m"), object(), None, params=st.RUNNER_PARAMS, required=()).keys()
)

SURFACE: tuple[Use, ...] = (
    Use(
        SB,
        "Req",
        takes=("rid", "origin_input_text", "origin_input_ids", "sampling_params"),
        has=(
            "full_untruncated_fill_ids",
            "fill_len",
            "extend_input_len",
            "logprob_start_len",
            "prefix_indices",
        ),
    ),
    Use(
        SB,
        "ScheduleBatch",
        calls={
            "init_new": (
                "reqs",
                "req_to_token_pool",
                "token_to_kv_pool_allocator",
                "tree_cache",
                "model_config",
                "enable_overlap",
                "spec_algorithm",
            ),  # fmt: skip
            "prepare_for_extend": (),
        },
        has=("prefill_input_ids_cpu", "input_ids", "capture_hidden_mode", "device"),
    ),
    Use(
        "sglang.srt.mem_cache.cache_init_params",
        "CacheInitParams",
        takes=("disable", "req_to_token_pool", "token_to_kv_pool_allocator", "page_size"),
    ),
    Use("sglang.srt.mem_cache.radix_cache", "RadixCache", calls={"__init__": ("params",)}),
    Use(FBI, "CaptureHiddenMode", has=("FULL",)),
    Use(FBI, "ForwardBatch", calls={"init_new": ("batch", "model_runner")}, has=("capture_hidden_mode",)),
    Use(
        "sglang.srt.sampling.sampling_params",
        "SamplingParams",
        takes=("temperature", "max_new_tokens", "top_k"),
    ),
    Use("sglang.srt.speculative.spec_info", "SpeculativeAlgorithm", has=("NONE",)),
    Use("sglang.srt.configs.model_config", "ModelConfig", calls={"from_server_args": ("server_args",)}),
    Use(
        "sglang.srt.model_executor.model_runner",
        "ModelRunner",
        calls={
            "alloc_memory_pool": (),
            "init_attention_backends": (),
            "init_cuda_graphs": (),
            "forward": ("forward_batch",),
        },
        has=(
            "req_to_token_pool",
            "token_to_kv_pool_allocator",
            "server_args",
            "model_config",
            "gpu_id",
            "model",
        ),
    ),
    Use(
        "sglang.srt.server_args",
        "ServerArgs",
        takes=tuple(st.server_args_kwargs(st.RunnerSpec("m"))),
        has=("page_size", "ep_size"),
    ),
    Use(
        LP,
        "LogitsProcessor",
        calls={
            "_get_logits": ("hidden_states", "lm_head", "logits_metadata"),
        },
    ),
    Use(LP, "LogitsMetadata", calls={"from_forward_batch": ("forward_batch",)}),
)


def problems(src: Source) -> list[str]:
    """Every name of :data:`SURFACE` this release lacks, as ``Class.name`` (empty: Aerie's calls fit)."""
    out: list[str] = []
    for use in SURFACE:
        c = src.cls(use.module, use.cls)
        if c is None:
            out.append(f"{use.cls} (not in {use.module})")
            continue
        names = class_names(c)
        fields = src.server_args_fields() if use.cls == "ServerArgs" else accepts(c)
        names |= fields if use.cls == "ServerArgs" else set()
        if use.takes:
            out += [f"{use.cls}.{k}" for k in use.takes if k not in fields]
            init = method(c, "__init__")
            if init is not None:
                out += [f"{use.cls}.__init__ needs {k}" for k in required(init) if k not in use.takes]
        for name, passed in (use.calls or {}).items():
            f = method(c, name)
            if f is None:
                out.append(f"{use.cls}.{name}")
                continue
            got = params(f)
            if (use.cls, name) in KEYWORD_CALLS:
                out += [f"{use.cls}.{name}.{k}" for k in passed if k not in got]
                out += [f"{use.cls}.{name} needs {k}" for k in required(f) if k not in passed]
            else:  # by position: the names may differ, the count of required ones may not exceed Aerie's
                out += [f"{use.cls}.{name} needs {k}" for k in required(f)[len(passed) :]]
                if len(got) < len(passed):
                    out.append(f"{use.cls}.{name}({', '.join(got)})")
        out += [f"{use.cls}.{k}" for k in use.has if k not in names]
    # CaptureHead stands in for the model's LogitsProcessor: the model calls it with the same arguments.
    lp = src.cls(LP, "LogitsProcessor")
    fwd = method(lp, "forward") if lp is not None else None
    ours = [n for n in inspect.signature(st.CaptureHead.forward).parameters if n not in ("self", "_", "__")]
    if fwd is None or params(fwd)[: len(ours)] != ours:
        out.append(f"LogitsProcessor.forward({', '.join(params(fwd)[: len(ours)] if fwd else [])})")
    runner = src.cls("sglang.srt.model_executor.model_runner", "ModelRunner")
    init = method(runner, "__init__") if runner is not None else None
    if init is not None:  # runner_kwargs fills what the installed signature names, and fails on the rest
        out += [f"ModelRunner.__init__ needs {k}" for k in required(init) if k not in RUNNER_KEYS]
    return out


@functools.cache
def source(version: str) -> Source:
    return Source(wheel_of(version))


def sglang_imports() -> Iterator[tuple[Path, str, str]]:
    """Every ``from sglang… import Name`` in pipeline/ (function-level ones included)."""
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sglang":
                for a in node.names:
                    yield path, node.module, a.name


VERSIONS = [s.sglang for s in tv.SGLANG_STACKS]


def test_every_sglang_name_aerie_imports_is_on_the_checked_surface() -> None:
    """A new ``from sglang… import X`` in pipeline/ must be added to SURFACE (or this list), or CI fails."""
    checked = {(u.module, u.cls) for u in SURFACE}
    unchecked = [f"{p.relative_to(ROOT)}: {m}.{n}" for p, m, n in sglang_imports() if (m, n) not in checked]
    assert not unchecked, unchecked
    assert {n for _, _, n in sglang_imports()} >= {"Req", "ScheduleBatch", "ModelRunner", "ServerArgs"}


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_has_what_aerie_calls_or_its_row_says_what_it_lacks(version: str) -> None:
    row = tv.stack_of(version)
    assert row is not None
    src = source(version)
    assert src.zip.read(f"sglang-{version}.dist-info/METADATA").decode().count(f"Version: {version}")
    missing = problems(src)
    if row.status == tv.TESTED_STATUS:
        assert missing == [], f"sglang {version} (tested) lacks what Aerie calls: {missing}"
    else:
        assert missing, f"sglang {version} has every name Aerie calls: its row need not say known-broken"
        unnamed = [m for m in missing if re.split(r"[.( ]", m.split(".", 1)[-1])[0] not in row.why]
        assert not unnamed, f"sglang {version}'s row does not say it lacks {unnamed}: {row.why}"


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_defines_every_name_aerie_imports(version: str) -> None:
    src = source(version)
    absent = [f"{m}.{n}" for _, m, n in sglang_imports() if not src.defines(m, n)]
    assert not absent, f"sglang {version}: {absent}"


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_pins_what_its_row_says(version: str) -> None:
    row = tv.stack_of(version)
    assert row is not None
    meta = source(version).zip.read(f"sglang-{version}.dist-info/METADATA").decode()
    pins = dict(re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)==([^;\s]+)\s*$", meta, re.M))
    assert (pins["torch"], pins["transformers"], pins["sglang-kernel"]) == (
        row.torch,
        row.transformers,
        row.sglang_kernel,
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_each_release_knows_every_flag_of_our_launch_argv(version: str, tmp_path: Path) -> None:
    """The serve stage's argv on a release whose parser is not installed here: every flag is one its
    ``server_args.py`` declares (tests/test_sglang_args.py runs the installed release's parser itself)."""
    p = tmp_path / "plan.toml"
    p.write_text(
        '[run]\nname = "t"\ndir = "run"\n[resources]\ngpus = [0, 1]\n[target]\nmodel = "/m"\nmax_length = 64\n'
        '[serve]\nmem_fraction_static = 0.8\nserved_model_name = "x"\ndtype = "bfloat16"\n'
        '[deploy]\ndraft_model_path = "/d"\n[[stage]]\nid = "serve"\nrun = "serve"\nservice = true\ngpus = "all"\n'
    )
    plan = plan_mod.load(p)
    flags = {
        a
        for mode in ("plain", "eagle3")
        for a in sglang_argv(settings_from_plan(plan, mode=mode, gpus=plan.stage("serve").gpus))
        if a.startswith("--")
    }
    declared = source(version).server_flags()
    assert len(flags) >= 10 and flags <= declared, sorted(flags - declared)


def test_every_release_hooks_the_aux_layers_by_one_rule() -> None:
    """``pipeline/serving/sglang_capture.py``'s table is run against the installed sglang's own
    ``set_eagle3_layers_to_capture`` (tests/test_sglang_capture.py); it holds for every release of the table
    only if their methods are the same code. Compared as syntax trees, per model family."""
    from tests.test_sglang_capture import FAMILIES

    for file, cls, _ in FAMILIES:
        dumps = {}
        for version in VERSIONS:
            c = source(version).cls(f"sglang.srt.models.{file[:-3]}", cls)
            f = method(c, "set_eagle3_layers_to_capture") if c is not None else None
            assert f is not None, f"sglang {version}: {file} {cls} has no set_eagle3_layers_to_capture"
            dumps[version] = ast.dump(f, include_attributes=False)
        assert len(set(dumps.values())) == 1, (
            f"{file} {cls}: the capture rule differs between {sorted(dumps)}"
        )
