"""A TCP relay that impairs a link in user space: the stand-in for ``tc netem`` where the kernel lacks ``sch_netem``.

``ImpairedProxy(host, port)`` listens on 127.0.0.1 (:attr:`port`) and relays every connection to
``host:port``, holding each chunk, in each direction, for ``delay_ms ± jitter_ms`` (uniform) before passing
it on, in order (TCP never reorders what the application sees). Loss cannot be made above TCP — the
kernel retransmits and the application only sees the wait — so a lost segment is modelled as that wait:
with probability ``loss_pct`` a chunk is held a further ``loss_stall_ms`` (default 500 ms: about one RTO on
a 300 ms RTT link, Linux's minimum RTO being 200 ms), and everything behind it waits too (head-of-line
blocking, as in TCP). It runs its own event loop on a thread, like a network would, so it takes nothing
from the event loop under test.

This is an emulation and is named as one wherever its numbers are reported: the delay and the jitter are
what netem does to the application; loss here is a stall per chunk, not per packet, so a chunk of many
packets suffers it at most once (milder than netem for bulk transfers, the same for the console's small
polls).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading


class ImpairedProxy:
    def __init__(
        self,
        host: str,
        port: int,
        delay_ms: float = 150,
        jitter_ms: float = 30,
        loss_pct: float = 2.0,
        loss_stall_ms: float = 500,
        seed: int = 0,
    ) -> None:
        self.target = (host, port)
        self.delay, self.jitter = delay_ms / 1000, jitter_ms / 1000
        self.loss, self.stall = loss_pct / 100, loss_stall_ms / 1000
        self.rng = random.Random(seed)
        self.port = 0
        self.stalls = 0
        self.impairment = (
            f"user-space relay (no sch_netem here): delay {delay_ms:g} ms ± {jitter_ms:g} ms each way, "
            f"{loss_pct:g} % of chunks stalled {loss_stall_ms:g} ms (a retransmission)"
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None

    def __enter__(self) -> ImpairedProxy:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main()), name="impaired-proxy", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the impaired proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _client(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(
                self._pipe(c_reader, s_writer), self._pipe(s_reader, c_writer), return_exceptions=True
            )
        except asyncio.CancelledError:
            pass  # the relay is shutting down: end quietly (a cancelled handler task is logged as an error)
        finally:
            for w in (c_writer, s_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(Exception):
                writer.write_eof()

        sender = asyncio.create_task(deliver())
        last_due = 0.0
        try:
            while data := await reader.read(65536):
                hold = self.delay + self.rng.uniform(-self.jitter, self.jitter)
                if self.rng.random() < self.loss:
                    hold += self.stall
                    self.stalls += 1
                last_due = max(loop.time() + hold, last_due)  # in order: a stalled chunk holds back the rest
                queue.put_nowait((last_due, data))
        finally:
            queue.put_nowait((0.0, None))
            with contextlib.suppress(Exception):
                await sender
