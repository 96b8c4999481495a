"""The console's telemetry model on the real H200 recording: GPU rows, owners, history, disk projection."""

from __future__ import annotations

import json
from pathlib import Path

from console.telemetry_model import TelemetryModel, duration, find_telemetry_stage, size, telemetry_path

FIXTURE = Path(__file__).parent / "fixtures" / "telemetry" / "h200-2026-12-02.jsonl"
GiB = 1 << 30


def lines() -> list[str]:
    return FIXTURE.read_text().splitlines()


def replicated(n: int) -> list[str]:
    """The one-GPU recording as an n-GPU node (each GPU a copy of GPU 0)."""
    out = []
    for line in lines():
        r = json.loads(line)
        if r["kind"] == "gpu":
            out.extend(json.dumps(dict(r, index=i)) for i in range(n))
        else:
            out.append(line)
    return out


def test_the_h200_recording_parses_into_one_gpu_with_its_owners_over_time() -> None:
    m = TelemetryModel()
    assert m.gpu_note == "waiting for telemetry…"
    ls = lines()
    # Samples 1..10: the foreign holder; the model shows it while it holds the GPU.
    first_gpu = next(i for i, line in enumerate(ls) if '"kind":"gpu"' in line)
    m.feed(ls[: first_gpu + 1])
    (g,) = m.gpu_rows()
    assert g.name == "NVIDIA H200" and g.mem_total == 150754820096
    assert g.owners == ["foreign pid 424"] and g.has_foreign
    m.feed(ls[first_gpu + 1 :])
    assert m.nvml_ok is True and m.meta["nvml"]["driver"] == "580.159.04"
    (g,) = m.gpu_rows()
    assert g.owners == ["gpuwork"] and not g.has_foreign
    assert g.util == 99 and 630 < g.power_w < 640 and g.power_cap_w == 700 and g.temp_c == 62
    assert 9 * GiB < g.mem_used < 10 * GiB
    assert len(g.util_hist) == 21 and list(g.util_hist)[:10] == [0.0] * 10 and max(g.util_hist) == 100
    assert m.host.ncpu == 16 and m.host.mem_total > 100 * GiB
    assert m.bad_lines == 0


def test_history_is_bounded_whatever_the_length_of_the_run() -> None:
    m = TelemetryModel(history_s=20, interval_s=2)
    for _ in range(50):
        m.feed(lines())
    assert len(m.gpus[0].util_hist) == 10 and len(m.host.cpu_hist) == 10
    assert len(m.disk.points) <= 512


def test_eight_gpus_and_a_host_without_a_driver() -> None:
    m = TelemetryModel()
    m.feed(replicated(8))
    assert [g.index for g in m.gpu_rows()] == list(range(8))
    cpu = TelemetryModel()
    cpu.feed(
        [
            json.dumps(
                {
                    "kind": "meta",
                    "t": 1,
                    "interval_s": 2,
                    "nvml": {"ok": False, "error": "no NVIDIA driver on this host"},
                }
            ),
            json.dumps({"kind": "host", "t": 1, "seq": 1, "cpu_pct": 12.5, "ncpu": 2}),
        ]
    )
    assert cpu.gpu_rows() == [] and cpu.nvml_ok is False
    assert cpu.gpu_note == "no GPU readings: no NVIDIA driver on this host"


def test_bad_lines_are_counted_not_fatal() -> None:
    m = TelemetryModel()
    assert m.feed(["not json", '{"kind":"gpu"}', '["list"]', lines()[1]]) == 1
    assert m.bad_lines == 3 and 0 in m.gpus


def _disk(t: float, used: int, avail: int, remaining: int | None = None, reserve: int = 0) -> str:
    return json.dumps(
        {
            "kind": "disk",
            "t": t,
            "seq": int(t),
            "path": "/runs/kimi",
            "total": 11 * 10**12,
            "used": used,
            "avail": avail,
            "reserve": reserve,
            "projected_remaining": remaining,
        }
    )


def test_disk_full_in_hours_at_the_current_rate_and_the_fit_warning() -> None:
    m = TelemetryModel(rate_window_s=60)
    tb = 10**12
    rate = 300 * 2**20  # bytes/s
    m.feed(
        [
            _disk(t, 5 * tb + int(t * rate), 6 * tb - int(t * rate), remaining=2 * tb, reserve=10**11)
            for t in range(0, 120, 2)
        ]
    )
    d = m.disk
    assert abs(d.rate_bps - rate) < 1
    assert abs(d.full_in_s - d.avail / rate) < 1
    text, level = d.status()
    assert level == "ok"
    assert f"full in {duration(d.avail / rate)} at 300.0 MiB/s" in text and "still to write: fits" in text
    m.feed([_disk(200, 10 * tb, int(1.5 * tb), remaining=2 * tb, reserve=10**11)])
    text, level = m.disk.status()
    assert level == "warning"
    assert f"⚠ {size(2 * tb)} still to write: {size(2 * tb - (int(1.5 * tb) - 10**11))} short" in text


def test_following_the_file_reads_meta_then_only_the_tail_and_survives_rotation() -> None:
    data = "\n".join(replicated(8)).encode() + b"\n"
    m = TelemetryModel(tail_bytes=16384)  # ~4 samples of 8 GPUs
    path, off = m.read_request()
    assert path == "stages/telemetry/out/telemetry.jsonl" and off == 0
    assert m.ingest(data[:8192], len(data), ino=7)  # first read: meta only, then jump to the tail
    assert m.meta and not m.gpus
    _, off = m.read_request()
    assert off == len(data) - 16384
    m.ingest(data[off:], len(data), ino=7)
    assert len(m.gpus) == 8 and m.read_request()[1] == len(data)
    # A partial line waits for its end.
    m.ingest(b'{"kind":"host","t":', len(data) + 19, ino=7)
    assert m.read_request()[1] == len(data)
    # Rotation: a new inode starts over from 0, keeping the history already shown.
    assert not m.ingest(b"", 100, ino=8)
    assert m.read_request()[1] == 0 and len(m.gpus) == 8


def test_locating_the_telemetry_stage() -> None:
    stages = [{"id": "prep.a", "run": "prep"}, {"id": "meters", "run": "telemetry"}]
    assert find_telemetry_stage(stages) == "meters"
    assert telemetry_path("meters") == "stages/meters/out/telemetry.jsonl"
    assert find_telemetry_stage([]) is None
