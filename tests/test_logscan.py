"""Log scanning (pipeline.run.rundir.logscan) and the log model (console.logindex) on real files.

The scanner is checked against a brute-force reading of random logs (every chunk and block size
edge: lines across chunk boundaries, an unfinished last line, empty lines); the model through the
real LocalTransport (growth, truncation, replacement, long lines, filters) and the remote agent's
``lines``/``find`` requests on pipes, as the SSH channel carries them.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from console.logindex import CUT_MARK, MAX_LINE_BYTES, LogFilter, LogIndex, clean
from console.transport import LocalTransport
from pipeline.run.rundir import logscan
from pipeline.run.rundir.logscan import ERROR_PATTERN, ScanError, compile_pattern, count_blocks, find_lines

ROOT = Path(__file__).resolve().parent.parent


def random_log(rng: random.Random) -> bytes:
    lines = [
        "".join(rng.choice("ab xAB\t") for _ in range(rng.randint(0, 30))) for _ in range(rng.randint(0, 200))
    ]
    return ("\n".join(lines) + rng.choice(["", "\n"])).encode()


def complete_lines(data: bytes) -> list[tuple[int, int, bytes]]:
    """(number, start offset, text) of every line that has its newline."""
    out, pos, n = [], 0, 0
    while (nl := data.find(b"\n", pos)) >= 0:
        out.append((n, pos, data[pos:nl]))
        pos, n = nl + 1, n + 1
    return out


@pytest.mark.parametrize("seed", range(6))
def test_block_counts_and_matches_equal_a_brute_force_reading(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        data = random_log(rng)
        monkeypatch.setattr(logscan, "READ_CHUNK", rng.choice([32, 64, 4096]))
        block = rng.choice([4, 16, 32])

        def read(off: int, n: int, data: bytes = data) -> bytes:
            return data[off : off + n]

        counts, off, res = [], 0, {}
        while True:  # in bounded steps, as the console asks
            res = count_blocks(
                read, len(data), off, max_bytes=rng.choice([block, 3 * block, 10**6]), block=block
            )
            counts += res["counts"]
            off = res["end"]
            if res["tail"] is not None:
                break
        assert counts == [data[i * block : (i + 1) * block].count(b"\n") for i in range(len(counts))]
        assert sum(counts) + res["tail"] == data.count(b"\n")
        assert res["ends_nl"] == (not data or data.endswith(b"\n"))

        pattern = rng.choice(["a", "ab", "^x", "b$", "a.*b", "A", "x\\s"])
        m = compile_pattern(pattern)
        ref = [
            [n, s]
            for n, s, text in complete_lines(data)
            if m.rx.search(m.hay(text + (b"\n" if pattern == "x\\s" else b"")))
        ]
        got, pos, ln = [], 0, 0
        while True:
            r = find_lines(
                read,
                len(data),
                m,
                pos,
                None,
                ln,
                limit=rng.choice([1, 2, 1000]),
                max_bytes=rng.choice([8, 10**6]),
            )
            got += r["hits"]
            pos, ln = r["next"], r["next_line"]
            if r["done"]:
                break
        assert got == ref
        lines = complete_lines(data)
        if lines:
            n0, s0, _ = rng.choice(lines)
            got, pos, ln = [], s0, n0
            while True:
                r = find_lines(
                    read,
                    len(data),
                    m,
                    0,
                    pos,
                    ln,
                    backward=True,
                    limit=rng.choice([1, 3, 1000]),
                    max_bytes=rng.choice([8, 10**6]),
                )
                got += r["hits"]
                pos, ln = r["next"], r["next_line"]
                if r["done"]:
                    break
            assert got == [h for h in ref if h[1] < s0][::-1]


def test_smart_case_bad_regex_and_the_error_pattern() -> None:
    data = b"an Error: x\nno error here\nERROR: y\n"
    hits = find_lines(lambda o, n: data[o : o + n], len(data), compile_pattern("error"), 0, None, 0)["hits"]
    assert [h[0] for h in hits] == [0, 1, 2]  # lower-case pattern: any case
    hits = find_lines(lambda o, n: data[o : o + n], len(data), compile_pattern("ERROR"), 0, None, 0)["hits"]
    assert [h[0] for h in hits] == [2]  # a capital: exact case
    with pytest.raises(ScanError, match=r"bad regex '\(unclosed'"):
        compile_pattern("(unclosed")
    log = (
        b"INFO fine\nTraceback (most recent call last):\n  File x\nValueError: boom\nno Error found\n"
        b"errors=3\nRuntimeError\nerror: bad flag\n"
    )
    hits = find_lines(lambda o, n: log[o : o + n], len(log), compile_pattern(ERROR_PATTERN), 0, None, 0)[
        "hits"
    ]
    assert [h[0] for h in hits] == [1, 3, 6, 7]


def run_async(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def make_log(tmp: Path, data: bytes) -> tuple[LocalTransport, Path]:
    path = tmp / "stages" / "s" / "stage.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return LocalTransport(str(tmp)), path


def test_index_reads_any_lines_follows_growth_and_restarts_on_truncation(tmp_path: Path) -> None:
    rng = random.Random(7)
    lines = [f"L{i} " + "y" * rng.choice([0, 5, 50, 300, 20_000]) for i in range(3000)]
    data = "\n".join(lines) + "\n"
    t, path = make_log(tmp_path, data.encode())

    async def check() -> None:
        ix = LogIndex(t, "stages/s/stage.log", block=4096)
        while not ix.caught_up:
            await ix.update()
        assert ix.lines == 3000
        for first in (0, 1, 917, 1500, 2990):
            rows = await ix.read_lines(first, 20)
            assert [r.line for r in rows] == list(range(first, min(first + 20, 3000)))
            for r in rows:
                ref = lines[r.line]
                assert r.text == ref if len(ref) <= MAX_LINE_BYTES else r.text.endswith(CUT_MARK)
            assert data.encode()[await ix.line_start(first) :].startswith(lines[first][:50].encode())
        with open(path, "a") as fh:
            fh.write("grown 1\ngrown 2\nunfinis")
        assert await ix.update()
        assert ix.lines == 3003  # the unfinished line counts, and shows
        assert [r.text for r in await ix.read_lines(3000, 5)] == ["grown 1", "grown 2", "unfinis"]
        with open(path, "a") as fh:
            fh.write("hed\n")
        await ix.update()
        assert ix.lines == 3003 and (await ix.read_lines(3002, 1))[0].text == "unfinished"
        path.write_text("fresh\nstart\n")  # truncated: a --fresh retry, a rotated log
        assert await ix.update()
        assert ix.resets == 1 and ix.lines == 2
        assert [r.text for r in await ix.read_lines(0, 5)] == ["fresh", "start"]
        path.unlink()
        await ix.update()
        assert ix.size == -1 and ix.lines == 0

    run_async(check())


def test_tail_before_indexing_and_filter_as_the_log_grows(tmp_path: Path) -> None:
    body = "".join(f"step {i} {'WARN slow' if i % 100 == 0 else 'ok'}\n" for i in range(50_000))
    t, path = make_log(tmp_path, body.encode())

    async def check() -> None:
        ix = LogIndex(t, "stages/s/stage.log")
        r = await t.count_lines("stages/s/stage.log", 0, max_bytes=64 << 10)  # a first bounded step
        assert r["tail"] is None and r["size"] == len(body)
        ix.size = r["size"]
        tail = await ix.tail_lines(3)
        assert [x.text for x in tail] == ["step 49997 ok", "step 49998 ok", "step 49999 ok"]
        assert all(x.line is None for x in tail)  # numbers unknown until indexed
        while not ix.caught_up:
            await ix.update()
        f = LogFilter(ix, "warn")
        while not f.done:
            await f.update(limit=100)
        assert f.count == 500 and list(f.lines[:3]) == [0, 100, 200]
        rows = await f.read_rows(498, 5)
        assert [(x.line, x.text) for x in rows] == [
            (49800, "step 49800 WARN slow"),
            (49900, "step 49900 WARN slow"),
        ]
        with open(path, "a") as fh:
            fh.write("step 50000 WARN late\nstep 50001 WARN unfini")
        await ix.update()
        assert await f.update()
        assert f.count == 501  # the unfinished line is not matched until it is complete
        with pytest.raises(ScanError):
            LogFilter(ix, "[")

    run_async(check())


def test_clean_shows_what_a_terminal_would() -> None:
    assert clean(b"\x1b[31mred\x1b[0m plain") == "red plain"
    assert clean(b"progress 10%\rprogress 55%\rprogress 90%") == "progress 90%"
    assert clean(b"a\tb") == "a   b"
    assert clean("caf\u00e9".encode() + b"\xff") == "caf\u00e9\ufffd"
    assert clean(b"x" * (MAX_LINE_BYTES + 5)).endswith(CUT_MARK)


def test_remote_agent_counts_and_searches_on_the_host(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "stages" / "s").mkdir(parents=True)
    (run / "plan.toml").write_text("[run]\n")
    log = run / "stages" / "s" / "stage.log"
    log.write_bytes(
        b"".join(b"line %d%s\n" % (i, b" ERROR" if i in (7, 70_000) else b"") for i in range(100_000))
    )
    reqs = [
        {"id": 1, "op": "lines", "path": "stages/s/stage.log", "offset": 0},
        {
            "id": 2,
            "op": "find",
            "path": "stages/s/stage.log",
            "pattern": "ERROR",
            "start": 0,
            "end": None,
            "line0": 0,
            "limit": 10,
        },
        {"id": 3, "op": "find", "path": "stages/s/stage.log", "pattern": "(", "start": 0, "line0": 0},
        {"id": 4, "op": "lines", "path": "../outside", "offset": 0},
    ]
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.run.hosts.remote_agent", str(run)],
        input="".join(json.dumps(r) + "\n" for r in reqs).encode(),
        capture_output=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    by_id = {a["id"]: a for a in map(json.loads, p.stdout.splitlines())}
    raw = log.read_bytes()
    assert by_id[1]["ok"] and sum(by_id[1]["counts"]) + by_id[1]["tail"] == raw.count(b"\n") == 100_000
    assert by_id[1]["size"] == len(raw) and by_id[1]["ino"] == log.stat().st_ino
    assert [h[0] for h in by_id[2]["hits"]] == [7, 70_000]
    assert raw[by_id[2]["hits"][1][1] :].startswith(b"line 70000 ERROR")
    assert not by_id[3]["ok"] and "bad regex" in by_id[3]["error"]
    assert not by_id[4]["ok"] and "leaves the run directory" in by_id[4]["error"]
