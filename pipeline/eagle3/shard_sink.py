"""Writing hidden-state shards behind the target: pinned host buffers, a writer thread, one fsync per shard.

What ``pipeline.stages.extract`` (and ``bench/gpu/extract.py``) run between the target's capture and
the disk, so that the host copy and the write overlap the next batch instead of following it:

* :class:`HostStager` packs one captured batch (padded ``(B, S, ·)`` device tensors) into its rows'
  real tokens, back to back, on the device, and copies them to the host. On CUDA the copy goes into a
  reused *pinned* buffer, ``non_blocking``, on a side stream, and a CUDA event marks when it has
  landed; on the CPU it is the plain synchronous conversion it always was.
* :class:`ShardSink` takes a shard's row list up front (so the safetensors header and every tensor's
  place in the file are known before the first byte), then its batches one at a time, and writes each
  batch's slice of each tensor straight into ``<shard>.partial`` with ``pwrite``: no whole shard is
  ever assembled in memory. With ``queue_batches > 0`` a writer thread does this while the caller
  runs the next batch (at most that many batches wait; the caller blocks on a full queue); with 0 it
  writes in the caller's thread. A finished shard is fsynced once, renamed to its name and the
  directory fsynced, so a killed extraction leaves whole shards only (and ``.partial`` leftovers).

The file is the one :func:`pipeline.eagle3.hidden_store.write_shard` writes (same tensors, dtypes,
shapes, metadata and data order); only the order of the metadata keys in the JSON header, which
safetensors itself leaves to chance, is fixed here. A write that fails raises
:class:`ShardWriteError` in the caller's thread, naming the shard file, with the ``errno`` of the
cause (so a full disk is still recognised as one).

Over 450 lines because the stager and the sink are two halves of one pipeline whose buffer hand-off
(slots, events, the writer queue) is easiest to check read together.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from pipeline.eagle3.hidden_store import FORMAT
from pipeline.run.rundir.files import fsync_dir

PARTIAL = ".partial"
_IO_CHUNK = 32 << 20  # a pwrite larger than this is split over the I/O threads


class ShardWriteError(OSError):
    """Writing a shard failed; ``str()`` names the shard file, ``errno`` is the cause's."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


@dataclass
class HostBatch:
    """One batch's rows on the host, back to back; ``ready`` is set once the copy has landed."""

    aux: torch.Tensor  # (n, A) bf16
    last_hidden: torch.Tensor  # (n, H) bf16
    target_argmax: torch.Tensor  # (n,) int32
    input_ids: np.ndarray  # (n,) int32
    loss_mask: np.ndarray  # (n,) int8
    ready: torch.cuda.Event | None = None
    release: Callable[[], None] | None = None  # gives a pinned buffer back to its pool

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def done(self) -> None:
        if self.release is not None:
            self.release()
            self.release = None


class _Slot:
    """Pinned host buffers for one batch in flight."""

    def __init__(self, tokens: int, aux_width: int, hidden: int) -> None:
        self.capacity = tokens
        self.aux = torch.empty(tokens, aux_width, dtype=torch.bfloat16, pin_memory=True)
        self.last_hidden = torch.empty(tokens, hidden, dtype=torch.bfloat16, pin_memory=True)
        self.target_argmax = torch.empty(tokens, dtype=torch.int32, pin_memory=True)


class HostStager:
    """Device → host for captured batches; pinned, asynchronous copies on CUDA, plain copies otherwise.

    ``slots`` pinned buffers are reused round robin (a batch's buffer returns to the pool when the
    writer is done with it); :meth:`stage` blocks while every one is still in use, which bounds how
    far the GPU can run ahead of the disk.
    """

    def __init__(self, device: torch.device | str, slots: int = 4) -> None:
        self.device = torch.device(device)
        self._free: queue.Queue[_Slot | None] = queue.Queue()
        for _ in range(max(1, slots)):
            self._free.put(None)  # pinned on first use (CUDA only), at the size the batches need
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # one copy stream per source GPU

    def stage(
        self,
        aux: torch.Tensor,
        last_hidden: torch.Tensor,
        argmax: torch.Tensor,
        lengths: list[int],
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
    ) -> HostBatch:
        """Rows ``i`` of the padded ``(B, S, ·)`` capture, first ``lengths[i]`` positions each, on the host.

        ``input_ids`` / ``loss_mask`` are the rows' own (host) values, already back to back.
        """
        b, s = aux.shape[0], aux.shape[1]
        n = sum(lengths)
        idx = torch.cat([torch.arange(n_i, dtype=torch.long) + i * s for i, n_i in enumerate(lengths)])
        ids = np.ascontiguousarray(input_ids, dtype=np.int32)
        mask = np.ascontiguousarray(loss_mask, dtype=np.int8)
        if len(ids) != n or len(mask) != n:
            raise ValueError(f"{len(ids)} input ids / {len(mask)} mask values for {n} captured tokens")
        if aux.device.type != "cuda":  # on the CPU: the plain conversions the stage always made
            return HostBatch(
                aux.reshape(b * s, -1).index_select(0, idx.to(aux.device)).to("cpu", torch.bfloat16),
                last_hidden.reshape(b * s, -1).index_select(0, idx.to(aux.device)).to("cpu", torch.bfloat16),
                argmax.reshape(b * s).index_select(0, idx.to(argmax.device)).to("cpu", torch.int32),
                ids,
                mask,
            )
        dev_idx = idx.to(aux.device, non_blocking=True)
        packed = (
            aux.reshape(b * s, -1).index_select(0, dev_idx).to(torch.bfloat16),
            last_hidden.reshape(b * s, -1).index_select(0, dev_idx).to(torch.bfloat16),
            argmax.reshape(b * s).index_select(0, dev_idx.to(argmax.device)).to(torch.int32),
        )
        slot = self._free.get()
        if (
            slot is None
            or slot.capacity < n
            or slot.aux.shape[1] != packed[0].shape[1]
            or slot.last_hidden.shape[1] != packed[1].shape[1]
        ):
            slot = _Slot(max(n, slot.capacity if slot else 0), packed[0].shape[1], packed[1].shape[1])
        host = (slot.aux[:n], slot.last_hidden[:n], slot.target_argmax[:n])
        # The copy runs on a side stream of the GPU holding the capture (with ``device = "auto"`` that is
        # the final norm's, not the embedding's), after what produced it, so the next batch need not wait.
        stream = self._streams.get(aux.device)
        if stream is None:
            stream = self._streams[aux.device] = torch.cuda.Stream(device=aux.device)
        stream.wait_stream(torch.cuda.current_stream(aux.device))
        with torch.cuda.stream(stream):
            for dst, src in zip(host, packed, strict=True):
                dst.copy_(src, non_blocking=True)
                src.record_stream(stream)  # the allocator must not reuse it before the copy ran
            ready = torch.cuda.Event()
            ready.record(stream)
        return HostBatch(*host, ids, mask, ready=ready, release=lambda: self._free.put(slot))


# -------------------------------------------------------------------------------------------- layout
_DTYPES = {
    torch.int64: ("I64", 8),
    torch.int32: ("I32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.int8: ("I8", 1),
}


@dataclass
class ShardLayout:
    """Where each tensor of one shard lies in its file (safetensors: 8-byte header size, JSON, data)."""

    tokens: int
    aux_width: int
    hidden: int
    ids: list[str]
    lengths: list[int]
    header: bytes = b""
    start: dict[str, int] = field(default_factory=dict)  # absolute file offset of each tensor's data
    size: int = 0

    def __post_init__(self) -> None:
        n = self.tokens
        # safetensors' own order: by dtype, widest first, then by name (what save_file writes).
        specs = [
            ("offsets", torch.int64, [len(self.lengths) + 1]),
            ("input_ids", torch.int32, [n]),
            ("target_argmax", torch.int32, [n]),
            ("aux", torch.bfloat16, [n, self.aux_width]),
            ("last_hidden", torch.bfloat16, [n, self.hidden]),
            ("loss_mask", torch.int8, [n]),
        ]
        meta: dict[str, object] = {"__metadata__": {"format": str(FORMAT), "ids": json.dumps(self.ids)}}
        rel, off = {}, 0
        for name, dtype, shape in specs:
            code, width = _DTYPES[dtype]
            nbytes = width * int(np.prod(shape))
            meta[name] = {"dtype": code, "shape": shape, "data_offsets": [off, off + nbytes]}
            rel[name] = off
            off += nbytes
        text = json.dumps(meta, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self.header = struct.pack("<Q", len(text)) + text
        self.start = {k: len(self.header) + v for k, v in rel.items()}
        self.size = len(self.header) + off

    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(np.asarray(self.lengths, dtype=np.int64))]).astype(np.int64)


def _as_bytes(t: torch.Tensor | np.ndarray) -> memoryview:
    if isinstance(t, torch.Tensor):
        t = t.contiguous().view(torch.uint8).numpy()
    return memoryview(np.ascontiguousarray(t)).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        k = os.pwrite(fd, data, offset)
        data, offset = data[k:], offset + k


@dataclass
class WrittenShard:
    """A shard that is whole on disk (renamed, synced)."""

    index: int
    name: str
    rows: int
    tokens: int
    bytes: int


class _OpenShard:
    """One ``.partial`` file being filled batch by batch."""

    def __init__(self, path: Path, index: int, layout: ShardLayout, pool: ThreadPoolExecutor | None) -> None:
        self.path, self.index, self.layout, self.pool = path, index, layout, pool
        self.tmp = path.with_name(path.name + PARTIAL)
        self.cursor = 0
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, layout.size)  # the file's final size from the start (sparse until written)
        _pwrite_all(self.fd, memoryview(layout.header), 0)
        _pwrite_all(self.fd, _as_bytes(layout.offsets()), layout.start["offsets"])

    def write(self, batch: HostBatch) -> None:
        n, lay = batch.tokens, self.layout
        if self.cursor + n > lay.tokens:
            raise ValueError(
                f"{self.path}: more tokens than the shard's rows hold ({self.cursor + n} > {lay.tokens})"
            )
        batch.wait()
        parts = [
            (batch.aux, lay.aux_width * 2, "aux"),
            (batch.last_hidden, lay.hidden * 2, "last_hidden"),
            (batch.target_argmax, 4, "target_argmax"),
            (batch.input_ids, 4, "input_ids"),
            (batch.loss_mask, 1, "loss_mask"),
        ]
        jobs = []
        for t, row_bytes, name in parts:
            if t.shape[0] != n or tuple(t.shape[1:]) not in ((), (row_bytes // 2,)):
                raise ValueError(
                    f"{self.path}: {name} has shape {tuple(t.shape)}, expected ({n}, {row_bytes // 2})"
                )
            data, off = _as_bytes(t), lay.start[name] + self.cursor * row_bytes
            for a in range(0, len(data), _IO_CHUNK):
                jobs.append((data[a : a + _IO_CHUNK], off + a))
        if self.pool is not None and len(jobs) > 1:
            for f in [self.pool.submit(_pwrite_all, self.fd, d, o) for d, o in jobs]:
                f.result()
        else:
            for d, o in jobs:
                _pwrite_all(self.fd, d, o)
        self.cursor += n

    def finish(self) -> WrittenShard:
        if self.cursor != self.layout.tokens:
            raise ValueError(
                f"{self.path}: {self.cursor} tokens written of the {self.layout.tokens} its rows hold"
            )
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return WrittenShard(
            self.index, self.path.name, len(self.layout.lengths), self.layout.tokens, self.layout.size
        )

    def abandon(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            self.tmp.unlink()


class ShardSink:
    """Shards written from host batches, on a writer thread (``queue_batches > 0``) or in the caller.

    Per shard: :meth:`begin` (its rows' ids and lengths), :meth:`put` for each batch in row order,
    :meth:`end`. :meth:`completed` returns the shards made whole since the last call (in order);
    :meth:`close` waits for the rest. Any write error is raised by the next call as
    :class:`ShardWriteError`; the shard that failed is removed, earlier shards are untouched.
    """

    def __init__(
        self, out_dir: Path, aux_width: int, hidden: int, queue_batches: int = 2, io_threads: int = 4
    ) -> None:
        self.dir = Path(out_dir)
        self.aux_width, self.hidden = aux_width, hidden
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="shard-io") if io_threads > 1 else None
        self._done: queue.Queue[WrittenShard] = queue.Queue()
        self._error: ShardWriteError | None = None
        self._aborting = False
        self._open: _OpenShard | None = None
        self._thread: threading.Thread | None = None
        if queue_batches > 0:
            self._q: queue.Queue[tuple] = queue.Queue(maxsize=queue_batches)
            self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
            self._thread.start()

    # -- caller side --------------------------------------------------------------------------
    def begin(self, index: int, name: str, ids: list[str], lengths: list[int]) -> None:
        self._send(("begin", index, name, list(ids), [int(x) for x in lengths]))

    def put(self, batch: HostBatch) -> None:
        self._send(("batch", batch))

    def end(self) -> None:
        self._send(("end",))

    def completed(self) -> list[WrittenShard]:
        self.check()
        return self.drain()

    def drain(self) -> list[WrittenShard]:
        """The shards made whole since the last call, without raising a pending error (for cleanup)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> list[WrittenShard]:
        """Wait until every shard ended so far is on disk; returns those not yet reported."""
        if self._thread is not None:
            if self._thread.is_alive():
                self._q.put(("stop",))
                self._thread.join()
            self._thread = None
        if self._open is not None:  # begun but never ended: not a whole shard
            self._open.abandon()
            self._open = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        return self.completed()

    def abort(self) -> None:
        """Stop without finishing the open shard (its ``.partial`` file is removed)."""
        self._aborting = True
        if self._thread is not None:
            while self._thread.is_alive():  # the writer drains quickly once aborting: room for the stop soon
                try:
                    self._q.put(("stop",), timeout=0.5)
                    break
                except queue.Full:
                    continue
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                return  # stuck in a write: leave its file alone (it is only a .partial)
            self._thread = None
        if self._open is not None:
            self._open.abandon()
            self._open = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> ShardSink:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def _send(self, item: tuple) -> None:
        self.check()
        if self._thread is None:
            self._handle(item)
            self.check()
            return
        while True:  # never block forever on a writer that died: re-check its error while waiting
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                self.check()

    # -- writer side --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item[0] == "stop":
                return
            self._handle(item)

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if (
            self._error is not None or self._aborting
        ):  # after a failure: drain, give buffers back, write nothing
            if kind == "batch":
                item[1].done()
            return
        path = (
            self._open.path if self._open is not None else self.dir / str(item[2] if kind == "begin" else "?")
        )
        try:
            if kind == "begin":
                _, index, name, ids, lengths = item
                path = self.dir / name
                layout = ShardLayout(sum(lengths), self.aux_width, self.hidden, ids, lengths)
                self._open = _OpenShard(path, index, layout, self._pool)
            elif kind == "batch":
                try:
                    if self._open is None:
                        raise ValueError("a batch outside a shard (put() before begin())")
                    self._open.write(item[1])
                finally:
                    item[1].done()
            elif kind == "end":
                if self._open is None:
                    raise ValueError("end() before begin()")
                shard, self._open = self._open, None
                try:
                    self._done.put(shard.finish())
                except BaseException:
                    shard.abandon()
                    raise
        except Exception as exc:  # noqa: BLE001 - handed to the caller's thread with the shard named
            if self._open is not None:
                self._open.abandon()
                self._open = None
            code = exc.errno if isinstance(exc, OSError) else None
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            err = (
                ShardWriteError(code, f"writing shard {path}: {reason}")
                if code is not None
                else ShardWriteError(f"writing shard {path}: {reason}")
            )
            err.__cause__ = exc
            self._error = err
