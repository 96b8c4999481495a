"""Extraction throughput on a GPU: tokens/s and MFU of ``pipeline.eagle3.target_capture`` (what the extract stage runs).

``python bench/gpu_extract.py [--shape llama8b] [--layers 8] [--batch 8] [--seq 2048]``

A Llama-3.1-8B-shaped target with ``--layers`` decoder layers and random bf16 weights (throughput
only), the three default aux layers hooked, the final norm captured and the greedy token computed
in chunks, as the stage does. Timed three ways: the target forward with capture, the greedy-token
(LM head) pass, and end to end with the copy to the host and one hidden-state shard written to
local disk. MFU counts the model's FLOPs (linear layers + causal attention + LM head) over the bf16
matmul ceiling measured in the same run. ``--shape tiny --device cpu`` is a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_common import device_info, llama_config, matmul_ceiling_tflops, time_ms, write_out  # noqa: E402
from pipeline.eagle3 import hidden_store as hs  # noqa: E402
from pipeline.eagle3.draft_model import default_aux_layers  # noqa: E402
from pipeline.eagle3.target_capture import Target  # noqa: E402


def flops_per_token(cfg, seq: int) -> tuple[float, float]:
    """(decoder layers, LM head) forward FLOPs per token, causal attention averaged over the sequence."""
    h, nh, nkv, hd, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                             cfg.intermediate_size)
    linear = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    attn = 2 * 2 * nh * hd * (seq + 1) / 2
    return cfg.num_hidden_layers * (2 * linear + attn), 2 * h * cfg.vocab_size


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    ceiling = matmul_ceiling_tflops(dev)
    from transformers import LlamaForCausalLM

    cfg = llama_config(args.shape, args.layers)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(prev)
    model.eval()
    aux = default_aux_layers(args.layers)
    target = Target(model, aux)
    b, s = args.batch, args.seq
    ids = torch.randint(0, cfg.vocab_size, (b, s), device=dev)
    mask = torch.ones(b, s, dtype=torch.long, device=dev)
    tokens = b * s
    cap_holder = {}

    def forward() -> None:
        cap_holder["c"] = target.capture(ids, attention_mask=mask)

    def head() -> None:
        target.argmax(cap_holder["c"].last_hidden)

    tmp = Path(tempfile.mkdtemp(prefix="gpu_extract_"))

    def end_to_end() -> None:
        c = target.capture(ids, attention_mask=mask)
        am = target.argmax(c.last_hidden)
        rows = [{"aux": c.aux[i].to("cpu", torch.bfloat16), "last_hidden": c.last_hidden[i].to("cpu", torch.bfloat16),
                 "target_argmax": am[i].to("cpu", torch.int32), "input_ids": ids[i].to("cpu", torch.int32),
                 "loss_mask": torch.ones(s, dtype=torch.int8)} for i in range(b)]
        hs.write_shard(tmp / "bench.safetensors", rows, [f"r{i}" for i in range(b)])

    with torch.no_grad():
        t_fwd = statistics.median(time_ms(forward, dev, reps=args.reps))
        forward()
        t_head = statistics.median(time_ms(head, dev, reps=args.reps))
        t_e2e = statistics.median(time_ms(end_to_end, dev, warmup=1, reps=max(2, args.reps // 2)))
    shard_bytes = (tmp / "bench.safetensors").stat().st_size
    f_layers, f_head = flops_per_token(cfg, s)
    res = {
        "bench": "gpu_extract", **device_info(dev), "shape": args.shape, "layers": args.layers, "aux_layers": aux,
        "batch": b, "seq": s, "tokens_per_batch": tokens, "matmul_ceiling_tflops": ceiling,
        "forward_ms": t_fwd, "lm_head_argmax_ms": t_head, "end_to_end_ms": t_e2e,
        "forward_tok_s": tokens / (t_fwd / 1e3), "capture_tok_s": tokens / ((t_fwd + t_head) / 1e3),
        "end_to_end_tok_s": tokens / (t_e2e / 1e3),
        "forward_mfu": f_layers * tokens / (t_fwd / 1e3) / (ceiling * 1e12),
        "capture_mfu": (f_layers + f_head) * tokens / ((t_fwd + t_head) / 1e3) / (ceiling * 1e12),
        "shard_bytes": shard_bytes, "bytes_per_token": shard_bytes / tokens,
        "write_mb_s": shard_bytes / 1e6 / (t_e2e / 1e3),
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
    }
    write_out("gpu_extract.json", res)
    print(f"\ngpu_extract on {res.get('name', dev)}: {args.shape} x{args.layers} layers, batch {b}x{s}")
    print(f"  bf16 matmul ceiling          {ceiling:8.1f} TFLOP/s")
    print(f"  forward + aux capture        {res['forward_tok_s']:10,.0f} tok/s   MFU {res['forward_mfu']:.1%}")
    print(f"  + greedy token (LM head)     {res['capture_tok_s']:10,.0f} tok/s   MFU {res['capture_mfu']:.1%}")
    print(f"  end to end (+host copy+shard) {res['end_to_end_tok_s']:9,.0f} tok/s   {res['write_mb_s']:.0f} MB/s written")
    print(f"  stored {res['bytes_per_token']:.0f} B/token; peak GPU memory {res['peak_mem_gib'] or 0:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
