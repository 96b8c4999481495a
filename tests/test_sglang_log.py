"""The SGLang log parser on real scheduler lines (tests/fixtures/sglang/*.log, sources in their headers)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeline.serving.sglang_log import ServerStats, normalise_key, parse_line, parse_value

FIX = Path(__file__).parent / "fixtures" / "sglang"


def lines(name: str) -> list[str]:
    return [ln for ln in (FIX / name).read_text().splitlines() if ln and not ln.startswith("#")]


def test_every_fixture_names_its_source():
    files = sorted(FIX.glob("*.log"))
    assert len(files) >= 6
    for f in files:
        head = [ln for ln in f.read_text().splitlines() if ln.startswith("#")]
        assert any("https://github.com/" in ln for ln in head), f"{f.name}: no source URL in the header"


def test_decode_lines_with_period_and_tp_prefix():
    recs = [parse_line(ln) for ln in lines("decode_period_tp0.log")]
    assert all(r is not None and r.kind == "decode" for r in recs)
    first = recs[0]
    assert first.rank == "TP0" and first.stamp == "2025-02-27 04:46:39"
    assert first.metrics() == {
        "running_req": 8.0,
        "kv_tokens": 62531.0,
        "token_usage": 0.12,
        "gen_throughput": 186.64,
        "queue_req": 0.0,
    }
    unprefixed = recs[-1]
    assert unprefixed.rank is None and unprefixed.metrics()["queue_req"] == 12279


def test_eagle3_accept_length_and_trailing_comma():
    recs = [parse_line(ln) for ln in lines("eagle3_accept_len.log")]
    assert [r.kind for r in recs] == ["prefill", "decode", "decode", "decode"]
    d = recs[1]
    assert d.fields["cuda_graph"] is True
    m = d.metrics()
    assert m["accept_len"] == 2.17 and m["accept_rate"] == 0.54 and m["gen_throughput"] == 0.39
    assert "cuda_graph" not in m  # booleans are fields, not metrics
    assert recs[0].metrics()["new_token"] == 28


def test_comma_form_prefill_and_access_lines():
    recs = [parse_line(ln) for ln in lines("comma_form_with_access.log")]
    kinds = [r.kind for r in recs]
    assert kinds == ["decode", "access", "prefill", "access", "prefill", "access"]
    assert recs[0].stamp == "2026-04-05 20:02:51" and recs[0].rank is None
    assert recs[2].metrics()["input_throughput"] == 559.53
    assert recs[1].fields == {"method": "POST", "path": "/v1/chat/completions", "status": 200}


def test_cache_hit_rate_percent_becomes_a_fraction():
    r = parse_line(lines("prefill_cache_hit_rate.log")[0])
    assert r.kind == "prefill"
    assert r.metrics()["cache_hit_rate"] == 0.0 and r.metrics()["cached_token"] == 888
    assert parse_value("12.5%") == 0.125


def test_hybrid_model_full_token_usage_maps_to_token_usage():
    pre, dec = (parse_line(ln) for ln in lines("hybrid_full_token_usage.log"))
    assert pre.metrics()["token_usage"] == 0.14 and pre.metrics()["pending_token"] == 109585
    assert dec.metrics()["token_usage"] == 0.74 and dec.metrics()["kv_tokens"] == 350592
    assert dec.fields["mamba_usage"] == 0.80  # unknown keys are kept as fields


def test_format_variants():
    recs = [parse_line(ln) for ln in lines("variants.log")]
    assert all(r is not None and r.kind == "decode" for r in recs)
    assert recs[0].fields["largest_len"] == 0 and recs[0].metrics()["gen_throughput"] == 7897.87
    assert recs[1].rank is None and recs[1].metrics()["accept_len"] == 1.0
    assert recs[2].rank == "TP0" and recs[2].stamp == "04:40:55"


def test_startup_lines_pass_through_and_garbled_lines_keep_what_is_readable():
    ls = lines("garbled_and_startup.log")
    assert [parse_line(ln) for ln in ls[:4]] == [None, None, None, None]
    dec = parse_line(ls[4])
    assert dec.kind == "decode"
    m = dec.metrics()
    assert m["running_req"] == 45 and m["gen_throughput"] == 863.65
    assert "token_usage" not in m and "accept_rate" not in m  # the garbled field is not guessed
    pre = parse_line(ls[5])
    assert pre.kind == "prefill" and pre.metrics()["queue_req"] == 81
    assert "running_req" not in pre.metrics()
    # An access line without a status (cut off) is not an access record.
    assert parse_line(ls[6]) is None


def test_unknown_and_hostile_input_never_raises():
    assert parse_line("") is None
    assert parse_line("Traceback (most recent call last):") is None
    odd = parse_line(b"\xff\xfe Decode batch. #running-req: \xff")
    assert odd.kind == "decode" and odd.metrics() == {}  # undecodable value: a field, never a number
    assert parse_line("Decode batch.") is None  # no fields: nothing to report
    assert parse_line("Decode batch. " + "x: 1, " * 100_000).kind == "decode"  # cut at MAX_LINE, still read
    rng = random.Random(7)
    src = lines("eagle3_accept_len.log") + lines("comma_form_with_access.log")
    for _ in range(2000):
        s = list(rng.choice(src))
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(s))
            s[i] = rng.choice([":", ",", "%", "(", ")", "[", "]", "#", " ", "\x00", "é", "9", "."])
        parse_line("".join(s))  # must not raise


@pytest.mark.parametrize(
    "raw,key",
    [
        ("#running-req", "running_req"),
        ("gen throughput (token/s)", "gen_throughput"),
        (" token usage", "token_usage"),
        ("#new-seq", "new_seq"),
        ("cache hit rate", "cache_hit_rate"),
    ],
)
def test_normalise_key(raw, key):
    assert normalise_key(raw) == key


def test_server_stats_live_line():
    st = ServerStats()
    assert st.line() == "no server statistics yet"
    for ln in lines("eagle3_accept_len.log") + lines("comma_form_with_access.log"):
        st.update(parse_line(ln))
    st.update(
        parse_line('INFO:     127.0.0.1:1 - "POST /v1/chat/completions HTTP/1.1" 503 Service Unavailable')
    )
    st.update(parse_line('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK'))  # not a generation request
    assert st.gen_throughput == 1635.11 and st.accept_len == 1.80
    assert st.running_req == 31 and st.queue_req == 0 and st.requests == 4 and st.errors == 1
    assert st.line() == "1635.1 tok/s · running 31 · queued 0 · tokens 8% · accept 1.80 · 4 req (1 5xx)"
