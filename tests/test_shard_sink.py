"""The extraction write path (pipeline.eagle3.shard_sink): same shards as ``write_shard``, errors named.

Captured batches are made up (random padded tensors, as the target returns them); what is checked is
what a user of the store would notice: every tensor of every shard is byte-identical to what the
synchronous ``hidden_store.write_shard`` writes from the same rows, ``HiddenStore`` reads every row
back unchanged, and a shard that cannot be written fails with its file named while the shards
before it stay whole.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3 import shard_sink as ss
from pipeline.run.hosts import nospace

H, A = 16, 48  # hidden size, 3 aux layers


def make_batches(seed: int = 0) -> list[list[dict]]:
    """Shards of batches of rows; each batch is a padded capture plus its rows' lengths, ids and masks."""
    g = torch.Generator().manual_seed(seed)
    shards = []
    for _s in range(3):
        batches = []
        for _b in range(3):
            lengths = sorted(
                torch.randint(2, 40, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist(),
                reverse=True,
            )
            b, s = len(lengths), max(lengths)
            batches.append(
                {
                    "aux": torch.randn(b, s, A, generator=g),
                    "last_hidden": torch.randn(b, s, H, generator=g),
                    "argmax": torch.randint(0, 50000, (b, s), generator=g),
                    "lengths": lengths,
                    "input_ids": [
                        torch.randint(0, 50000, (n,), generator=g).numpy().astype(np.int32) for n in lengths
                    ],
                    "loss_mask": [
                        torch.randint(0, 2, (n,), generator=g).numpy().astype(np.int8) for n in lengths
                    ],
                }
            )
        shards.append(batches)
    return shards


def reference_rows(batch: dict) -> list[dict]:
    """The rows as the stage built them before the writer thread: one host copy per row."""
    return [
        {
            "aux": batch["aux"][i, :n].to("cpu", torch.bfloat16),
            "last_hidden": batch["last_hidden"][i, :n].to("cpu", torch.bfloat16),
            "target_argmax": batch["argmax"][i, :n].to("cpu", torch.int32),
            "input_ids": torch.from_numpy(batch["input_ids"][i]),
            "loss_mask": torch.from_numpy(batch["loss_mask"][i]),
        }
        for i, n in enumerate(batch["lengths"])
    ]


def ids_of(si: int, shard: list[dict]) -> list[str]:
    return [f"s{si}-b{bi}-r{i}" for bi, b in enumerate(shard) for i in range(len(b["lengths"]))]


def write_reference(out: Path, shards: list[list[dict]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for si, shard in enumerate(shards):
        hs.write_shard(
            out / hs.shard_name(si), [r for b in shard for r in reference_rows(b)], ids_of(si, shard)
        )


def write_with_sink(
    out: Path, shards: list[list[dict]], queue_batches: int, io_threads: int = 2, first: int = 0
) -> list[ss.WrittenShard]:
    out.mkdir(parents=True, exist_ok=True)
    stager = ss.HostStager("cpu")
    written: list[ss.WrittenShard] = []
    with ss.ShardSink(out, A, H, queue_batches=queue_batches, io_threads=io_threads) as sink:
        for si, shard in enumerate(shards[first:], start=first):
            sink.begin(si, hs.shard_name(si), ids_of(si, shard), [n for b in shard for n in b["lengths"]])
            for b in shard:
                sink.put(
                    stager.stage(
                        b["aux"],
                        b["last_hidden"],
                        b["argmax"],
                        b["lengths"],
                        np.concatenate(b["input_ids"]),
                        np.concatenate(b["loss_mask"]),
                    )
                )
                written += sink.completed()
            sink.end()
        written += sink.close()
    return written


def tensor_digests(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        out: dict = {"__metadata__": f.metadata()}
        for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            t = f.get_tensor(k)
            out[k] = (
                str(t.dtype),
                tuple(t.shape),
                hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest(),
            )
    return out


def write_manifest(out: Path, written: list[ss.WrittenShard]) -> None:
    (out / "manifest.json").write_text(
        json.dumps(
            {
                "kind": hs.KIND,
                "mode": "offline",
                "aux_layer_ids": [1, 2, 3],
                "shards": [
                    {"file": w.name, "rows": w.rows, "tokens": w.tokens, "bytes": w.bytes} for w in written
                ],
            }
        )
    )


@pytest.mark.parametrize("queue_batches", [2, 0], ids=["writer-thread", "synchronous"])
def test_the_streamed_shards_hold_exactly_what_write_shard_writes(
    tmp_path: Path, monkeypatch, queue_batches: int
) -> None:
    monkeypatch.setattr(ss, "_IO_CHUNK", 100)  # split even these small tensors over the I/O threads
    shards = make_batches()
    write_reference(tmp_path / "old", shards)
    written = write_with_sink(tmp_path / "new", shards, queue_batches)
    assert [w.name for w in written] == [hs.shard_name(i) for i in range(len(shards))]
    for w in written:
        old, new = tmp_path / "old" / w.name, tmp_path / "new" / w.name
        assert tensor_digests(new) == tensor_digests(old), w.name
        assert new.stat().st_size == old.stat().st_size == w.bytes
    assert not list((tmp_path / "new").glob("*.partial"))

    write_manifest(tmp_path / "new", written)
    store = hs.HiddenStore(tmp_path / "new")
    expected = [r for shard in shards for b in shard for r in reference_rows(b)]
    assert len(store) == len(expected)
    assert store.ids == [i for si, shard in enumerate(shards) for i in ids_of(si, shard)]
    for i, ref in enumerate(expected):
        got = store[i]
        for name in ("aux", "last_hidden", "target_argmax", "input_ids", "loss_mask"):
            assert torch.equal(getattr(got, name), ref[name].to(getattr(got, name).dtype)), (i, name)


def test_a_shard_that_cannot_be_written_fails_naming_its_file_and_earlier_shards_stay_whole(
    tmp_path: Path,
) -> None:
    shards = make_batches(1)
    write_reference(tmp_path / "old", shards)
    out = tmp_path / "new"
    (out / (hs.shard_name(1) + ss.PARTIAL)).mkdir(parents=True)  # a directory where shard 1's file must go
    with pytest.raises(ss.ShardWriteError) as err:
        write_with_sink(out, shards, queue_batches=2)
    assert str(out / hs.shard_name(1)) in str(err.value)
    assert tensor_digests(out / hs.shard_name(0)) == tensor_digests(tmp_path / "old" / hs.shard_name(0))
    assert not (out / hs.shard_name(1)).exists() and not (out / hs.shard_name(2)).exists()


def test_a_full_disk_stays_recognisable_as_one_and_the_failed_shard_leaves_no_file(
    tmp_path: Path, monkeypatch
) -> None:
    shards = make_batches(2)
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd: int, data: memoryview, offset: int) -> int:
        calls["n"] += 1
        if (
            calls["n"] > 25
        ):  # into the second shard (17 writes a shard: header, offsets, 3 batches x 5 tensors)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    monkeypatch.setattr(ss.os, "pwrite", pwrite)
    with pytest.raises(ss.ShardWriteError) as err:
        write_with_sink(tmp_path, shards, queue_batches=2, io_threads=1)
    assert err.value.errno == errno.ENOSPC and nospace.is_nospace(err.value)
    assert "writing shard" in str(err.value) and str(tmp_path / hs.shard_name(1)) in str(err.value)
    assert (tmp_path / hs.shard_name(0)).is_file()
    assert not list(tmp_path.glob("*.partial"))


def test_a_shard_short_of_its_rows_is_never_renamed_into_place(tmp_path: Path) -> None:
    shards = make_batches(3)
    stager = ss.HostStager("cpu")
    sink = ss.ShardSink(tmp_path, A, H, queue_batches=2)
    shard = shards[0]
    sink.begin(0, hs.shard_name(0), ids_of(0, shard), [n for b in shard for n in b["lengths"]])
    b = shard[0]
    sink.put(
        stager.stage(
            b["aux"],
            b["last_hidden"],
            b["argmax"],
            b["lengths"],
            np.concatenate(b["input_ids"]),
            np.concatenate(b["loss_mask"]),
        )
    )
    sink.end()
    with pytest.raises(ss.ShardWriteError, match="tokens written of the"):
        sink.close()
    assert not list(tmp_path.iterdir())
