"""Benchmark: rows/s of the prep path vs a naive per-row ``apply_chat_template`` loop on the same rows.

Both produce the same thing per row (input_ids and a loss mask on the assistant turns, cut to max_length)
from the same normalised conversations. The prep path is the stage's own code (``RowProcessor.process``:
normalise, hash, batched render + one tokenisation with offsets, text cut before tokenising). The naive
loop is what a one-off script does: ``apply_chat_template(tokenize=True)`` for the whole conversation and
again for the prefixes before and after every assistant turn to find the mask boundaries. A third line,
bare ``apply_chat_template`` without any mask, is printed for reference. One run, same process, same
tokenizer threads (1, as the stage uses by default).

    python bench/prep.py [--rows 150] [--max-length 2048] [--prep-only] [--json]

``--prep-only`` times the prep path alone (the naive loop takes minutes on agent trajectories); ``--json``
prints one JSON object instead of the table (what ``bench/record.py`` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("USE_TORCH", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.data import sources  # noqa: E402
from pipeline.data.conversation import trim_to_last_assistant  # noqa: E402
from pipeline.data.tokenise import ChatTokenizer, load_hf_tokenizer  # noqa: E402
from pipeline.stages.prep.rows import RowProcessor  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"


def trajectories(n: int) -> list[sources.RawRow]:
    """Agent trajectories in the DeepSWE (tool-call) schema: 12-40 turns, long tool outputs."""
    rows = []
    for i in range(n):
        msgs = [
            {
                "role": "system",
                "content": "You are a software engineering agent. Use the tools, then call finish.",
            },
            {
                "role": "user",
                "content": f"<issue>\nTest {i}: the parser drops field {i % 13} on empty input.\n</issue>",
            },
        ]
        for step in range(6 + i % 14):
            msgs.append(
                {
                    "role": "assistant",
                    "content": f"Step {step}: inspecting module_{step}.py.",
                    "tool_calls": [
                        {
                            "id": f"c{step}",
                            "type": "function",
                            "function": {
                                "name": "execute_bash",
                                "arguments": json.dumps({"command": f"sed -n 1,80p module_{step}.py"}),
                            },
                        }
                    ],
                }
            )
            body = "\n".join(
                f"{n}:     value_{n} = parse(field_{n}, mode={step})  # case {i}"
                for n in range(40 + step * 3)
            )
            msgs.append({"role": "tool", "content": body, "tool_call_id": f"c{step}"})
        msgs.append({"role": "assistant", "content": f"Fixed the parser for case {i}; the tests pass."})
        rows.append(sources.RawRow(i, {"messages": msgs}))
    return rows


def reasoning(n: int) -> list[sources.RawRow]:
    """Single-turn distilled reasoning rows in the Kimi flat schema."""
    return [
        sources.RawRow(
            i,
            {
                "problem": f"Problem {i}: how many ways can {i % 9 + 3} books be arranged on a shelf?",
                "thinking": " ".join(
                    f"Consider position {k}; {i % 9 + 3 - k} choices remain." for k in range(60)
                ),
                "response": f"There are {i % 9 + 3}! arrangements.\n\n**Answer:** see above ({i}).",
            },
        )
        for i in range(n)
    ]


def chats(n: int) -> list[sources.RawRow]:
    """Multi-turn chat rows in the UltraChat schema (target-native for this benchmark)."""
    rows = []
    for i in range(n):
        msgs = []
        for t in range(2 + i % 5):
            msgs.append(
                {"role": "user", "content": f"Question {t} of chat {i}: explain topic {t * 7 + i} briefly."}
            )
            msgs.append(
                {
                    "role": "assistant",
                    "content": " ".join(f"Point {k} about topic {t * 7 + i}." for k in range(25)),
                }
            )
        rows.append(sources.RawRow(i, {"messages": msgs}))
    return rows


def naive(
    tok, convs: list[list[dict]], max_length: int, with_mask: bool = True
) -> list[tuple[list[int], list[int]]]:  # noqa: ANN001
    """The per-row loop: apply_chat_template for the whole conversation and every assistant prefix."""
    out = []
    trail = len(
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True, return_dict=False)
    ) - len(
        tok(
            tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).rstrip(),
            add_special_tokens=False,
        )["input_ids"]
    )
    for msgs in convs:
        ids = list(tok.apply_chat_template(msgs, tokenize=True, return_dict=False))[:max_length]
        mask = [0] * len(ids)
        if with_mask:
            for i, m in enumerate(msgs):
                if m["role"] != "assistant":
                    continue
                a = len(
                    tok.apply_chat_template(
                        msgs[:i], tokenize=True, add_generation_prompt=True, return_dict=False
                    )
                )
                b = len(tok.apply_chat_template(msgs[: i + 1], tokenize=True, return_dict=False)) - trail
                for j in range(min(a, len(ids)), min(b, len(ids))):
                    mask[j] = 1
        out.append((ids, mask))
    return out


def timed_prep(src: sources.Source, raw: list[sources.RawRow], ct: ChatTokenizer) -> tuple[float, list]:
    """Seconds the stage's own path takes on these rows (batches of 64), and its outcome for each."""
    proc = RowProcessor(src, "target-native", {}, ct)
    t0 = time.perf_counter()
    outs = []
    for k in range(0, len(raw), 64):  # the stage's batches
        outs.extend(proc.process(raw[k : k + 64]))
    return time.perf_counter() - t0, outs


def prep_only(kinds: list[tuple[str, str, list[sources.RawRow]]], ct: ChatTokenizer, as_json: bool) -> int:
    """The prep path's rows/s per kind and over all, without the naive loops."""
    per: dict[str, float] = {}
    tot, total = 0.0, 0
    for label, key, raw in kinds:
        dt, outs = timed_prep(sources.get(key), raw, ct)
        accepted = sum(o.kind == "accept" for o in outs)
        if accepted != len(raw):
            raise SystemExit(f"prep: {label}: {accepted}/{len(raw)} rows accepted")
        per[label] = len(raw) / dt
        tot, total = tot + dt, total + len(raw)
    if as_json:
        print(json.dumps({"rows_per_s": total / tot, "per_kind": per, "rows": total}))
    else:
        for label, rate in per.items():
            print(f"{label:<24}{rate:>12.0f} prep rows/s")
        print(f"{'all':<24}{total / tot:>12.0f} prep rows/s")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=150, help="rows per kind")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--prep-only", action="store_true", help="skip the naive and bare loops")
    ap.add_argument("--json", action="store_true", help="print one JSON object (bench/record.py reads it)")
    args = ap.parse_args()
    hf = load_hf_tokenizer(MODEL)
    ct = ChatTokenizer(hf, args.max_length, tokenizer_id=MODEL)
    kinds = [
        ("agent trajectories", "deepswe-kimi-k2", trajectories(args.rows)),
        ("single-turn reasoning", "kimik2-5-2000x", reasoning(args.rows)),
        ("multi-turn chat", "ultrachat", chats(args.rows)),
    ]
    if args.prep_only or args.json:
        return prep_only(kinds, ct, args.json)
    print(
        f"prep benchmark: {MODEL}, max_length {args.max_length}, {args.rows} rows per kind, "
        f"tokenizer threads {os.environ['RAYON_NUM_THREADS']}"
    )
    print(
        f"{'rows':<24}{'prep rows/s':>12}{'naive rows/s':>14}{'speed-up':>10}{'bare ACT rows/s':>17}{'identical':>11}"
    )
    tot_prep = tot_naive = tot_bare = 0.0
    total = 0
    for label, key, raw in kinds:
        src = sources.get(key)
        t_prep, outs = timed_prep(src, raw, ct)
        convs = [ct.template_messages(trim_to_last_assistant(sources.normalise(src, r.row, {}))) for r in raw]
        t0 = time.perf_counter()
        ref = naive(
            hf, [[{k: v for k, v in m.items() if k != "_src"} for m in c] for c in convs], args.max_length
        )
        t_naive = time.perf_counter() - t0
        t0 = time.perf_counter()
        naive(hf, convs, args.max_length, with_mask=False)
        t_bare = time.perf_counter() - t0
        same = sum(
            o.kind == "accept"
            and o.encoded.input_ids.tolist() == ids
            and o.encoded.loss_mask.tolist() == mask
            for o, (ids, mask) in zip(outs, ref, strict=True)
        )
        n = len(raw)
        total += n
        tot_prep, tot_naive, tot_bare = tot_prep + t_prep, tot_naive + t_naive, tot_bare + t_bare
        print(
            f"{label:<24}{n / t_prep:>12.0f}{n / t_naive:>14.0f}{t_naive / t_prep:>9.1f}x{n / t_bare:>17.0f}"
            f"{same:>7}/{n}"
        )
    print(
        f"{'all':<24}{total / tot_prep:>12.0f}{total / tot_naive:>14.0f}{tot_naive / tot_prep:>9.1f}x"
        f"{total / tot_bare:>17.0f}"
    )
    print(f"prep vs bare apply_chat_template (no mask at all): {tot_bare / tot_prep:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
