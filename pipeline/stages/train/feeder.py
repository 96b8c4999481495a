"""Feeding the GPU: the coming steps' batches assembled on a background thread while the current step trains.

Measured on an H200 before this existed, the training step waited on the host most of the time: the
rows of each batch were read, padded and copied to the GPU on the training thread, one after the other
(12k tokens/s against 93–98k on ready-made batches). The feeder reads the store and pads the rows into
pinned host memory on its own thread, ``depth`` steps ahead, and copies them to the GPU on a separate
CUDA stream, so the copy overlaps the previous step's compute; the training thread only waits on an
event. The stage uses it on a GPU only: on a CPU the step itself is the bottleneck and the thread only
competes with it for the cores (``bench/gpu/train.py --store --device cpu``: 74 % of the synthetic rate
with the feeder, 100 % without, on 2 cores). It works there too, without pinning or streams (the tests).

The thread does only reads and copies (torch releases the GIL in both); an error there (an unreadable
shard) is raised on the training thread at the step that needed the batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from pipeline.drafts.batch import Batch
from pipeline.stages.train.batches import to_device

_DONE = object()


class Feeder:
    """Iterates ``(step, [device batches])`` for ``steps``; ``chunks(step)`` names each batch's rows."""

    def __init__(
        self,
        data: Any,
        steps: Iterable[int],
        chunks: Callable[[int], list[list[int]]],
        device: torch.device,
        dtype: torch.dtype,
        depth: int = 2,
    ) -> None:
        self.data, self.chunks, self.device, self.dtype = data, chunks, device, dtype
        self.cuda = device.type == "cuda"
        if (
            self.cuda and device.index is None
        ):  # "cuda" means the caller's current GPU; the thread must name it
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self._run, args=(list(steps),), name="aerie-train-feeder", daemon=True
        )
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, steps: list[int]) -> None:
        try:
            if self.cuda:
                torch.cuda.set_device(self.device)
            for step in steps:
                if self.stop.is_set():
                    return
                host = [self.data.host_batch(c, pin=self.cuda) for c in self.chunks(step)]
                event = None
                if self.stream is not None:
                    with torch.cuda.stream(self.stream):
                        batches = [to_device(h, self.device, self.dtype) for h in host]
                        event = torch.cuda.Event()
                        event.record(self.stream)
                else:
                    batches = [to_device(h, self.device, self.dtype) for h in host]
                if not self._put((step, batches, event)):
                    return
            self._put(_DONE)
        except BaseException as exc:  # surfaced on the training thread, at the step that needed it
            self._put(exc)

    def next(self, step: int) -> list[Batch]:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is _DONE:
            raise RuntimeError(f"the feeder ran out of batches before step {step}")
        got, batches, event = item
        if got != step:
            raise RuntimeError(f"the feeder produced step {got} where step {step} was due")
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for b in batches:  # allocated on the copy stream, used (and freed) on this one
                for t in (b.aux, b.last_hidden, b.target_argmax, b.input_ids, b.loss_mask, b.lengths):
                    t.record_stream(current)
        return batches

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


class Inline:
    """The same interface, assembling each step's batches when asked (online data: the target runs here)."""

    def __init__(
        self, data: Any, chunks: Callable[[int], list[list[int]]], device: torch.device, dtype: torch.dtype
    ) -> None:
        self.data, self.chunks, self.device, self.dtype = data, chunks, device, dtype

    def next(self, step: int) -> list[Batch]:
        return [self.data.batch(c, self.device, self.dtype) for c in self.chunks(step)]

    def close(self) -> None:
        pass
