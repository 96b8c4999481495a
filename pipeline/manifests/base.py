"""What every manifest kind shares: the error that names the file and the key, the version rule, the
field checks (driven by the dataclass's type hints) and the atomic JSON write.

A manifest class is a frozen dataclass whose field names are the JSON keys. A field without a default is
required; a field whose default is ``None`` may be absent, and with ``metadata=OMIT`` it is left out again on
write while ``None`` (so a key a writer never wrote does not appear as ``null``). One field may be marked
``metadata=EXTRA``: it holds every key the class does not name, written back as top-level keys (a name of
the class's own always wins). ``manifest_version`` is not a field: :func:`decode` checks it against the
class's ``VERSION`` and :func:`encode` writes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

VERSION_KEY = "manifest_version"
MANIFEST_FILE = "manifest.json"
OMIT = {"omit_none": True}  # field metadata: a None value is not written
EXTRA = {"extra": True}  # field metadata: the keys the class does not name

T = TypeVar("T")


class ManifestError(ValueError):
    """A manifest that cannot be read as its kind, always naming the file and (where one is at fault) the key."""

    def __init__(self, file: Path | str, key: str, message: str) -> None:
        self.file, self.key = str(file), key
        super().__init__(f"{file}: {key}: {message}" if key else f"{file}: {message}")


# ------------------------------------------------------------------------------------- finding
def find(out_dir: Path) -> list[Path]:
    """Every ``manifest.json`` of an upstream out dir: the top-level one, else one per sub-folder."""
    out_dir = Path(out_dir)
    top = out_dir / MANIFEST_FILE
    return [top] if top.is_file() else sorted(out_dir.glob(f"*/{MANIFEST_FILE}"))


def of_kind(out_dir: Path, kinds: tuple[str, ...]) -> list[Path]:
    """The manifests of ``out_dir`` (:func:`find`) whose ``kind`` is one of ``kinds``; other kinds are skipped."""
    return [p for p in find(out_dir) if kind_of(p) in kinds]


def read_doc(path: Path, missing: str = "missing") -> dict[str, Any]:
    """The JSON object in ``path``; a missing file, bad JSON or another JSON value is a :class:`ManifestError`."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ManifestError(path, "", missing) from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise ManifestError(path, "", f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ManifestError(path, "", f"expected a JSON object, got {type(doc).__name__}")
    return doc


def kind_of(path: Path) -> str | None:
    """The ``kind`` of the manifest at ``path`` (None where it has none), to pick the class to read it with."""
    kind = read_doc(path).get("kind")
    return kind if isinstance(kind, str) else None


# ------------------------------------------------------------------------------------- decoding
def check_version(doc: Mapping[str, Any], known: int, file: Path | str) -> int:
    """The document's format version: absent is 1 (files written before versions existed); newer is refused."""
    v = doc.get(VERSION_KEY, 1)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ManifestError(file, VERSION_KEY, f"expected a positive integer, got {v!r}")
    if v > known:
        raise ManifestError(
            file,
            VERSION_KEY,
            f"version {v} was written by a newer Aerie; this one reads up to version {known}: "
            "upgrade Aerie on this host, or rerun the stage that wrote it with --fresh",
        )
    return v


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_describe(typing.get_args(tp)[0])}s"
    if origin is dict or tp is dict:
        return "an object"
    if dataclasses.is_dataclass(tp):
        return "an object"
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true or false",
        type(None): "null",
    }.get(tp, str(tp))


def _convert(value: Any, tp: Any, file: Path | str, key: str) -> Any:
    """``value`` checked against the type hint ``tp`` (and converted: lists to tuples, objects to dataclasses)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, file, key)
            except ManifestError:
                continue
        raise ManifestError(file, key, f"expected {_describe(tp)}, got {_shown(value)}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ManifestError(file, key, f"expected {_describe(tp)}, got {_shown(value)}")
        item = typing.get_args(tp)[0]
        return tuple(_convert(v, item, file, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ManifestError(file, key, f"expected an object, got {_shown(value)}")
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ManifestError(file, key, f"expected an object, got {_shown(value)}")
        return _decode_fields(tp, value, file, f"{key}.")
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, int | float) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }.get(tp)
    if ok is None:
        raise TypeError(f"manifest field {key}: unsupported type hint {tp!r}")
    if not ok:
        raise ManifestError(file, key, f"expected {_describe(tp)}, got {_shown(value)}")
    return float(value) if tp is float else value


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return f"{type(value).__name__} {text[:60]}" if value is not None else "null"


def _decode_fields(cls: type[T], doc: Mapping[str, Any], file: Path | str, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    named: set[str] = set()
    extra_field = None
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("extra"):
            extra_field = f.name
            continue
        named.add(f.name)
        key = prefix + f.name
        if f.name in doc:
            values[f.name] = _convert(doc[f.name], hints[f.name], file, key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ManifestError(file, key, "missing (a required field)")
    if extra_field is not None:
        values[extra_field] = {k: v for k, v in doc.items() if k not in named and k != VERSION_KEY}
    obj = cls(**values)
    check = getattr(cls, "_check", None)
    if callable(check):
        check(obj, file, prefix)
    return obj


def decode(cls: type[T], doc: Mapping[str, Any], file: Path | str, kinds: tuple[str, ...]) -> T:
    """``doc`` as ``cls``: its version known, its ``kind`` one of ``kinds``, every field of the right type."""
    if not isinstance(doc, Mapping):
        raise ManifestError(file, "", f"expected a JSON object, got {type(doc).__name__}")
    check_version(doc, int(getattr(cls, "VERSION", 1)), file)
    kind = doc.get("kind")
    if kind is None:
        raise ManifestError(file, "kind", f"missing (a required field; expected {' or '.join(kinds)})")
    if kind not in kinds:
        raise ManifestError(file, "kind", f"is {kind!r}, expected {' or '.join(map(repr, kinds))}")
    return _decode_fields(cls, doc, file)


# ------------------------------------------------------------------------------------- encoding
def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode_fields(value)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def encode_fields(obj: Any) -> dict[str, Any]:
    """The dataclass ``obj`` as JSON-ready keys: its extra keys first, its own fields over them."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.metadata.get("extra"):
            out = {**_plain(getattr(obj, f.name)), **out}
            continue
        v = getattr(obj, f.name)
        if v is None and f.metadata.get("omit_none"):
            continue
        out[f.name] = _plain(v)
    return out


def encode(obj: Any) -> dict[str, Any]:
    """The manifest as it goes to disk: its keys and ``manifest_version``."""
    return {**encode_fields(obj), VERSION_KEY: int(obj.VERSION)}


def write_doc(path: Path, doc: Mapping[str, Any]) -> None:
    """``doc`` as JSON (sorted keys, as every run file), so readers see the old file or the new, never a torn one.

    The same rule as ``pipeline.run.rundir.files.write_atomic`` (temp file, fsync, rename; a new folder 0700),
    restated here because the run machinery imports this package, not the other way round."""
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def reader(cls: type[T], kinds: tuple[str, ...], missing: str = "missing") -> Callable[[Path], T]:
    """``read(path)`` for one class: the file decoded, every error naming ``path``."""

    def read(path: Path) -> T:
        return decode(cls, read_doc(path, missing), path, kinds)

    return read
