"""The extract stage's shard writer against the disk's own write rate, in one run, on the CPU.

``python bench/shard_write.py [--out-dir DIR] [--hidden 4096] [--batch-tokens 16384] [--batches 8] [--shard-batches 4]``

Writes ``--batches`` host batches of the Llama-3.1-8B store layout (3 aux layers + final hidden in
bf16, greedy token, ids, mask: 32,777 B a token at hidden 4096) through
:class:`pipeline.eagle3.shard_sink.ShardSink` into shards of ``--shard-batches`` batches, for each
``queue:io_threads`` pair of ``--modes``, and then the same bytes in the same pattern with nothing but
``os.pwrite`` (file sized up front, 32 MiB writes, one fsync per file): the rate the directory's
filesystem gives a single writer. Prints GB/s of each and the sink's share of the raw rate. This is
the host half of issue 15's extraction goal: what a GPU run's end-to-end rate is capped by whatever
the model does (``bench/gpu/extract.py`` times the whole path on a GPU). ``--json`` prints one JSON
object instead of the text (what ``bench/record.py`` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.eagle3 import hidden_store as hs  # noqa: E402
from pipeline.eagle3.shard_sink import HostBatch, ShardSink  # noqa: E402

CHUNK = 32 << 20


def host_batch(tokens: int, hidden: int) -> HostBatch:
    g = torch.Generator().manual_seed(0)
    return HostBatch(
        torch.randn(tokens, 3 * hidden, generator=g).to(torch.bfloat16),
        torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),
        torch.randint(0, 1 << 16, (tokens,), generator=g, dtype=torch.int32),
        np.zeros(tokens, np.int32),
        np.ones(tokens, np.int8),
    )


def sink_rate(
    out: Path, batch: HostBatch, hidden: int, batches: int, per_shard: int, queue: int, io: int
) -> float:
    n = batch.tokens
    t = time.perf_counter()
    with ShardSink(out, 3 * hidden, hidden, queue_batches=queue, io_threads=io) as sink:
        for k in range(0, batches, per_shard):
            nb = min(per_shard, batches - k)
            sink.begin(k, hs.shard_name(k), [f"b{k + j}" for j in range(nb)], [n] * nb)
            for _ in range(nb):
                sink.put(batch)
            sink.end()
        shards = sink.close()
    dt = time.perf_counter() - t
    return sum(s.bytes for s in shards) / dt / 1e9


def raw_rate(out: Path, batch: HostBatch, batches: int, per_shard: int) -> float:
    sizes = [
        x.nbytes
        for x in (batch.aux, batch.last_hidden, batch.target_argmax, batch.input_ids, batch.loss_mask)
    ]
    data = memoryview(np.random.default_rng(0).bytes(max(sizes)))
    parts = [data[:n] for n in sizes]  # the same write sizes as the sink's tensors (contents do not matter)
    per_batch = sum(sizes)
    t, total = time.perf_counter(), 0
    for k in range(0, batches, per_shard):
        nb = min(per_shard, batches - k)
        fd = os.open(out / f"raw-{k}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fd, nb * per_batch)
        off = 0
        for _ in range(nb):
            for p in parts:
                for a in range(0, len(p), CHUNK):
                    off += os.pwrite(fd, p[a : a + CHUNK], off)
        os.fsync(fd)
        os.close(fd)
        total += off
    return total / (time.perf_counter() - t) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--out-dir", default=None, help="where to write (default: a temp dir; point it at the run disk)"
    )
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--shard-batches", type=int, default=4)
    ap.add_argument("--modes", default="2:4,0:1", help="queue:io_threads pairs for the sink")
    ap.add_argument("--json", action="store_true", help="print one JSON object (bench/record.py reads it)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="aerie-shard-write-", dir=args.out_dir))
    try:
        batch = host_batch(args.batch_tokens, args.hidden)
        rows = []
        for mode in args.modes.split(","):
            q, io = (int(x) for x in mode.split(":"))
            d = base / f"sink-{q}-{io}"
            d.mkdir()
            rows.append(
                (
                    f"ShardSink, queue {q}, io_threads {io}",
                    sink_rate(d, batch, args.hidden, args.batches, args.shard_batches, q, io),
                )
            )
            shutil.rmtree(d)
        d = base / "raw"
        d.mkdir()
        raw = raw_rate(d, batch, args.batches, args.shard_batches)
        shutil.rmtree(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = args.batches * args.batch_tokens * (8 * args.hidden + 9) / 1e9
    if args.json:
        print(json.dumps({"sink_gbps": dict(rows), "raw_gbps": raw, "gb": gb}))
        return 0
    print(
        f"shard_write: {gb:.1f} GB in {args.batches} batches of {args.batch_tokens} tokens, "
        f"{args.shard_batches} batches a shard, into {args.out_dir or tempfile.gettempdir()}"
    )
    for name, r in rows:
        print(f"  {name:<36} {r:6.2f} GB/s  = {r / raw:6.1%} of raw")
    print(f"  {'raw os.pwrite, one writer':<36} {raw:6.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
