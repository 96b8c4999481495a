"""Client overhead of regeneration: requests/s the regen client sustains against a server that answers instantly.

    python bench/regen_client.py [--requests 20000] [--concurrency 64]

A minimal HTTP/1.1 keep-alive server (raw asyncio protocol, canned chat-completions JSON) runs in
a separate process, so the number measured is the client's own cost per request: building the
body, aiohttp, parsing the answer, and appending it to the resumable log (``responses.jsonl``).
The baseline in the same run is a bare aiohttp loop against the same server (no bookkeeping);
the ratio says what the client's bookkeeping costs. Goal: >= 2,000 req/s here (a real server
answers tens to thousands per second, so the client is never the bottleneck).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import aiohttp  # noqa: E402

from pipeline.stages.regen.client import ClientConfig, Regenerator  # noqa: E402
from pipeline.stages.regen.store import ResponseLog  # noqa: E402

ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "model": "bench-model",
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {
                    "role": "assistant",
                    "content": "An instant answer of a few words, as a server gives.",
                },
            }
        ],
        "usage": {"prompt_tokens": 21, "completion_tokens": 12, "total_tokens": 33},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "bench-model", "object": "model"}]}).encode()


class InstantHTTP(asyncio.Protocol):
    """Answers every complete request at once; POST -> the canned completion, GET -> the model list."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end].decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                k, _, v = line.partition(":")
                if k.strip().lower() == "content-length":
                    length = int(v)
            end = head_end + 4 + length
            if len(self.buf) < end:
                return
            self.buf = self.buf[end:]
            body = MODELS if head.startswith("GET") else ANSWER
            self.t.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )


def serve(port: int, ready: mp.Event) -> None:  # type: ignore[valid-type]
    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = await loop.create_server(InstantHTTP, "127.0.0.1", port, backlog=1024)
        ready.set()
        async with srv:
            await srv.serve_forever()

    asyncio.run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def baseline(url: str, n: int, concurrency: int) -> float:
    """Bare aiohttp: same requests, no retry bookkeeping, no parsing into records, no log."""
    body = json.dumps(
        {"model": "bench-model", "messages": [{"role": "user", "content": "q"}], "max_tokens": 16}
    ).encode()
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn) as s:
        it = iter(range(n))

        async def worker() -> None:
            for _ in it:
                async with s.post(
                    url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def ours(url: str, n: int, concurrency: int, out: Path) -> float:
    log = ResponseLog(out / "responses.jsonl")
    prompts = [
        (f"r{i:07d}", [{"role": "user", "content": f"question number {i}, please answer briefly"}])
        for i in range(n)
    ]
    cfg = ClientConfig(url=url, concurrency=concurrency, sampling={"temperature": 0.7, "max_tokens": 16})
    r = Regenerator(cfg, log.append)
    t0 = time.perf_counter()
    stats = asyncio.run(r.run(prompts))
    dt = time.perf_counter() - t0
    log.close()
    assert stats.answered == n and len(ResponseLog(out / "responses.jsonl")) == n
    return n / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each; the best is reported")
    args = ap.parse_args()
    port = free_port()
    ready = mp.Event()
    server = mp.Process(target=serve, args=(port, ready), daemon=True)
    server.start()
    try:
        if not ready.wait(10):
            raise SystemExit("the bench server did not start")
        url = f"http://127.0.0.1:{port}"
        base, mine = [], []
        for _ in range(args.repeat):
            base.append(asyncio.run(baseline(url, args.requests, args.concurrency)))
            with tempfile.TemporaryDirectory() as d:
                mine.append(ours(url, args.requests, args.concurrency, Path(d)))
    finally:
        server.terminate()
        server.join(5)
    b, m = max(base), max(mine)
    print(f"requests per run:        {args.requests} (concurrency {args.concurrency}, best of {args.repeat})")
    print(f"bare aiohttp baseline:   {b:8.0f} req/s")
    print(f"regen client + log:      {m:8.0f} req/s   ({m / b:.2f}x the baseline)")
    print(f"goal >= 2000 req/s:      {'met' if m >= 2000 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
