"""The SGLang API check from Aerie's own code: every SGLang attribute, method and function ``pipeline/`` reaches.

``tests/test_sglang_api.py`` checks a hand-written surface; this scans the code instead. Every module of
``pipeline/`` that imports SGLang is parsed (:mod:`ast`), and every attribute chain on an SGLang object is
collected: ``r.req_to_token_pool.clear()``, ``batch.prepare_for_extend()``, and what ``getattr``/``hasattr``
fallbacks read (``getattr(getattr(text, "model", None), "layers_to_capture", None)``). An object is an SGLang
one when Aerie's code makes it from an imported SGLang name (``batch = ScheduleBatch.init_new(...)``,
``meta = LogitsMetadata.from_forward_batch(...)``) or is one of the few roots declared below (the runner the
target holds, the model it runs). Each chain is then followed through a release's **wheel** (parsed, never
imported): the class's own names (with its bases), and the class an attribute holds, from the wheel's own
``self.x = Cls(...)`` / ``self.x = param`` with ``param: Optional[Cls]`` / ``x: Cls``. So renaming
``ReqToTokenPool.clear`` in a copy of the 0.5.14 wheel fails here (a test doctors one), and so does renaming
``layers_to_capture``, which only a ``getattr`` reads.
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import tested_versions as tv
from tests.test_sglang_api import Source, source, wheel_of

ROOT = Path(__file__).resolve().parent.parent
# Roots Aerie's code receives rather than builds: what they are, by the name the code uses for them.
DECLARED_ROOTS = {
    "r": "ModelRunner",  # SGLangTarget._extend: r = self.runner
    "self.runner": "ModelRunner",
    "runner": "ModelRunner",
    "runner.model": "LlamaForCausalLM",  # the model the runner loaded (the Llama family: the tested one)
    "text": "LlamaForCausalLM",  # getattr(runner.model, "language_model", runner.model)
    "logits_metadata": "LogitsMetadata",
}
SKIP = {"to", "shape", "device"}  # tensor attributes of SGLang's tensors (batch.prefill_input_ids_cpu.to)
# Names read through getattr with a fallback that only another model family has (not a rename to catch).
OTHER_FAMILY = {"language_model": "Kimi-K2.5's wrapper around its DeepSeek-V3; a Llama is its own text model"}


@dataclass(frozen=True)
class Chain:
    where: str  # file:line
    cls: str
    attrs: tuple[str, ...]


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and _is_getattr(node):
        base = _dotted(node.args[0])
        return f"{base}.{node.args[1].value}" if base else None  # type: ignore[union-attr]
    return None


def _is_getattr(node: ast.Call) -> bool:
    return (
        isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def sglang_modules() -> list[Path]:
    out = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        text = path.read_text()
        if re.search(r"^\s*(from|import) sglang", text, re.M):
            out.append(path)
    return out


def scan(path: Path) -> list[Chain]:
    """Every attribute chain on an SGLang object in ``path``, its root typed as described above."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("sglang")
        for a in n.names
    }
    roots = dict(DECLARED_ROOTS)
    for n in ast.walk(tree):  # x = Cls(...) / x = Cls.factory(...) of an imported SGLang class
        if (
            isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and isinstance(n.targets[0], ast.Name)
            and isinstance(n.value, ast.Call)
        ):
            made = (_dotted(n.value.func) or "").split(".")[0]
            if made in imported:
                roots[n.targets[0].id] = made
    chains = []
    for n in ast.walk(tree):
        dotted = None
        if isinstance(n, ast.Attribute) or isinstance(n, ast.Call) and _is_getattr(n):
            dotted = _dotted(n)
        if not dotted or "." not in dotted:
            continue
        parts = dotted.split(".")
        for k in range(len(parts) - 1, 0, -1):
            root = ".".join(parts[:k])
            if root in roots:
                attrs = tuple(a for a in parts[k:] if a not in SKIP and a not in OTHER_FAMILY)
                if attrs:
                    chains.append(Chain(f"{path.relative_to(ROOT)}:{n.lineno}", roots[root], attrs))
                break
            if parts[0] in imported and k == 1:  # Cls.method / Enum.MEMBER of an imported name
                chains.append(Chain(f"{path.relative_to(ROOT)}:{n.lineno}", parts[0], tuple(parts[1:])))
                break
    return sorted(set(chains), key=lambda c: (c.cls, c.attrs))


def aerie_chains() -> list[Chain]:
    return [c for p in sglang_modules() for c in scan(p)]


class Classes:
    """Every class of one wheel's ``sglang/srt`` by name (parsed once), its names and what its attributes hold.
    A class is ``(module, name)``; a name used inside a module resolves to that module's class first."""

    def __init__(self, src: Source) -> None:
        self.by_name: dict[str, dict[str, ast.ClassDef]] = {}
        for name in src.zip.namelist():
            if name.startswith("sglang/srt/") and name.endswith(".py"):
                try:
                    tree = ast.parse(src.zip.read(name).decode(), name)
                except SyntaxError:
                    continue
                for n in tree.body:
                    if isinstance(n, ast.ClassDef):
                        self.by_name.setdefault(n.name, {})[name] = n

    def resolve(self, name: str, module: str | None = None) -> list[tuple[str, ast.ClassDef]]:
        defs = self.by_name.get(name, {})
        if module in defs:
            return [(module, defs[module])]  # type: ignore[list-item]
        return list(defs.items())

    def mro(self, cls: tuple[str, str], seen: frozenset[str] = frozenset()) -> list[tuple[str, ast.ClassDef]]:
        out = []
        for module, c in self.resolve(cls[1], cls[0] or None):
            out.append((module, c))
            for b in c.bases:
                base = _dotted(b)
                name = base.split(".")[-1] if base else None
                if name and name not in seen:
                    out += self.mro((module, name), seen | {cls[1]})
        return out

    def names(self, cls: tuple[str, str]) -> set[str]:
        from tests.test_sglang_api import class_names

        out: set[str] = set()
        for _, c in self.mro(cls):
            out |= class_names(c)
        return out

    def _classes_in(self, expr: ast.expr | None, module: str) -> set[tuple[str, str]]:
        found = set()
        for x in ast.walk(expr) if expr is not None else ():
            name = x.id if isinstance(x, ast.Name) else x.attr if isinstance(x, ast.Attribute) else ""
            found |= {(m, name) for m, _ in self.resolve(name, module)}
        return found

    def _returned(self, cls: tuple[str, str], meth: str) -> set[tuple[str, str]]:
        """What ``self.meth(...)`` returns: its annotation, else the classes its ``return`` statements call."""
        found: set[tuple[str, str]] = set()
        for module, c in self.mro(cls):
            for f in (x for x in c.body if isinstance(x, ast.FunctionDef) and x.name == meth):
                found |= self._classes_in(f.returns, module)
                for r in (x for x in ast.walk(f) if isinstance(x, ast.Return) and x.value is not None):
                    if isinstance(r.value, ast.Call):
                        found |= self._classes_in(r.value.func, module)
        return found

    def holds(self, cls: tuple[str, str], attr: str) -> set[tuple[str, str]]:
        """The classes ``cls.attr`` holds, as the wheel's own code says (assignments and annotations)."""
        found: set[tuple[str, str]] = set()
        for module, c in self.mro(cls):
            params: dict[str, ast.expr] = {}
            for f in (x for x in c.body if isinstance(x, ast.FunctionDef)):
                for a in [*f.args.args, *f.args.kwonlyargs]:
                    if a.annotation is not None:
                        params[a.arg] = a.annotation
            for n in ast.walk(c):
                target, value, ann = None, None, None
                if isinstance(n, ast.Assign) and len(n.targets) == 1:
                    target, value = n.targets[0], n.value
                elif isinstance(n, ast.AnnAssign):
                    target, value, ann = n.target, n.value, n.annotation
                if not (isinstance(target, ast.Attribute) and target.attr == attr) and not (
                    isinstance(target, ast.Name) and target.id == attr and ann is not None
                ):
                    continue
                found |= self._classes_in(ann, module)
                if isinstance(value, ast.Name):
                    found |= self._classes_in(params.get(value.id), module)
                elif isinstance(value, ast.Call):
                    fn = value.func
                    if (
                        isinstance(fn, ast.Attribute)
                        and isinstance(fn.value, ast.Name)
                        and fn.value.id == "self"
                    ):
                        found |= self._returned((module, c.name), fn.attr)
                    else:
                        found |= self._classes_in(fn, module)
        return found


@functools.cache
def classes(version: str) -> Classes:
    return Classes(source(version))


def misses(cl: Classes, chains: list[Chain]) -> list[str]:
    """Each chain followed through the wheel: ``Class.attr`` where a name is missing from a class the previous
    attribute may hold (every such class must have it; empty: all found)."""
    out = []
    for ch in chains:
        types = {(m, ch.cls) for m, _ in cl.resolve(ch.cls)}
        for attr in ch.attrs:
            if not types:
                break  # what the last attribute holds is not typed in the wheel: not followed further
            lacking = sorted(name for m, name in types if attr not in cl.names((m, name)))
            if lacking:
                out.append(f"{'/'.join(lacking)}.{attr} ({ch.where})")
                break
            types = {h for t in types for h in cl.holds(t, attr)}
    return sorted(set(out))


def test_the_scan_finds_what_aerie_calls_through_attributes_and_getattr() -> None:
    found = {(c.cls, c.attrs) for c in aerie_chains()}
    for want in (
        ("ModelRunner", ("req_to_token_pool", "clear")),
        ("ModelRunner", ("token_to_kv_pool_allocator", "clear")),
        ("ModelRunner", ("server_args", "page_size")),
        ("ScheduleBatch", ("prepare_for_extend",)),
        ("LlamaForCausalLM", ("model", "layers_to_capture")),  # read only through getattr
        ("LlamaForCausalLM", ("set_eagle3_layers_to_capture",)),
    ):
        assert want in found, (want, sorted(found))


@pytest.mark.slow
@pytest.mark.parametrize("version", [s.sglang for s in tv.SGLANG_STACKS if s.status == tv.TESTED_STATUS])
def test_every_sglang_name_aerie_reaches_is_in_each_tested_wheel(version: str) -> None:
    assert misses(classes(version), aerie_chains()) == []


def _doctored(tmp_path: Path, version: str, member: str, edit: tuple[str, str, str]) -> Path:
    """A copy of the release's wheel with one name renamed inside one class (``edit``: class, old, new)."""
    src = wheel_of(version)
    dst = tmp_path / src.name
    shutil.copy(src, dst)
    cls, old, new = edit
    with zipfile.ZipFile(src) as zin:
        text = zin.read(member).decode()
    start = text.index(f"\nclass {cls}")
    end = text.find("\nclass ", start + 1)
    end = len(text) if end < 0 else end
    body = text[start:end]
    assert old in body
    doctored = text[:start] + body.replace(old, new) + text[end:]
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, doctored if item.filename == member else zin.read(item.filename))
    return dst


@pytest.mark.slow
@pytest.mark.parametrize(
    "member,edit,miss",
    [
        (
            "sglang/srt/mem_cache/memory_pool.py",
            ("ReqToTokenPool", "def clear(self)", "def clear_all(self)"),
            "ReqToTokenPool.clear",
        ),
        (
            "sglang/srt/models/llama.py",
            ("LlamaModel", "self.layers_to_capture", "self.capture_layer_ids"),
            "LlamaModel.layers_to_capture",
        ),
    ],
)
def test_renaming_any_name_aerie_reaches_fails(tmp_path: Path, member: str, edit: tuple, miss: str) -> None:
    version = next(s.sglang for s in tv.SGLANG_STACKS if s.status == tv.TESTED_STATUS)
    wheel = _doctored(tmp_path, version, member, edit)
    got = misses(Classes(Source(wheel)), aerie_chains())
    assert any(m.startswith(miss) for m in got), got
    assert misses(classes(version), aerie_chains()) == []  # the real wheel has it
