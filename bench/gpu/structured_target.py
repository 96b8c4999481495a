"""A learnable synthetic target for the SGLang speedup bench (issue 26 item 3): random Llama weights, restructured.

A random-weight Llama's greedy text cannot be predicted (near-flat logits, every token a function of the whole
context), so a draft trained on it accepts nothing and the speedup table only shows the engine's overhead. This
module rewrites three things of an already built ``LlamaForCausalLM`` — the compute per token stays exactly the
shape's — so its greedy continuation is *mostly* a fixed map of the current token, with departures that depend on
the context:

- ``embed_tokens``: fresh N(0, 1) rows ``e_u``.
- ``lm_head``: ``succ`` walks one random cycle through ``words`` word tokens (a leading-space, letters-only token
  of the tokenizer, so decoded text re-tokenizes the same way); the row of ``succ[t]`` is ``e_t`` and every other
  row is zero, so a final hidden state ~``e_t`` scores ``succ[t]`` highest by ~``hidden_size`` against random
  ~``sqrt(hidden_size)`` for the other cycle tokens and 0 for the rest of the vocabulary. A token off the cycle
  (the prompt's, the chat template's) has no row of its own: the context picks which cycle token follows it.
  Rescaled last so the top logit averages ``top_logit`` (argmax-neutral; keeps bf16 logits well resolved).
- every layer's residual branches (``o_proj``, ``down_proj``) multiplied by one ``scale``: the random layers then
  add a context vector to the residual stream that is small next to what the argmax needs; the larger ``scale``,
  the more often that vector overturns ``succ[t]``. :func:`calibrate` bisects ``scale`` (on a log scale) until
  the teacher-forced share of positions whose argmax is ``succ[t]`` is ``follow``.

So greedy text walks the cycle and jumps elsewhere on it wherever the context says so: varied (thousands of
distinct tokens, no short cycle) and prompt-dependent, learnable up to the jumps. It says nothing about a real
model's text; it makes the accept length a dial. :func:`text_stats` measures what came out.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch


def word_tokens(tok: Any) -> list[int]:
    """Ids of the tokens that are one whole lower-case word with a leading space (``Ġword``, ≥ 3 letters)."""
    out = []
    for piece, i in tok.get_vocab().items():
        w = piece[1:]
        if piece.startswith("Ġ") and len(w) >= 3 and w.isascii() and w.isalpha() and w.islower():
            out.append(int(i))
    return sorted(out)


def successor_map(vocab: int, words: list[int], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``succ`` over the whole vocabulary, -1 off the cycle; the ``n`` cycle tokens in cycle order): one random
    cycle through ``n`` of ``words``."""
    if n > len(words):
        raise ValueError(
            f"structured target: {n} cycle tokens asked for, the tokenizer has {len(words)} words"
        )
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(words)[torch.randperm(len(words), generator=g)[:n]]
    cycle = pool[torch.randperm(n, generator=g)]
    succ = torch.full((vocab,), -1, dtype=torch.long)
    succ[cycle] = torch.roll(cycle, -1)
    return succ, cycle


def _branches(model: Any) -> list[torch.nn.Linear]:
    return [m for layer in model.model.layers for m in (layer.self_attn.o_proj, layer.mlp.down_proj)]


@torch.no_grad()
def restructure(model: Any, cycle: torch.Tensor, seed: int) -> list[torch.Tensor]:
    """Write the embeddings and the ``lm_head`` of the cycle; return copies of the residual branches' weights as built
    (what :func:`set_scale` multiplies)."""
    emb = model.model.embed_tokens.weight
    vocab, hidden = emb.shape
    g = torch.Generator().manual_seed(seed + 1)
    e = torch.randn(vocab, hidden, generator=g)
    head = torch.zeros(vocab, hidden)
    head[torch.roll(cycle, -1)] = e[cycle]
    emb.copy_(e.to(emb))
    model.lm_head.weight.copy_(head.to(model.lm_head.weight))
    return [m.weight.detach().clone() for m in _branches(model)]


@torch.no_grad()
def set_scale(model: Any, originals: list[torch.Tensor], scale: float) -> None:
    for m, w in zip(_branches(model), originals, strict=True):
        m.weight.copy_(w * scale)


@torch.no_grad()
def follow_rate(
    model: Any, succ: torch.Tensor, cycle: torch.Tensor, rows: int = 8, length: int = 160, seed: int = 7
) -> tuple[float, float]:
    """Teacher-forced on ``rows`` sequences (16 random tokens, then the cycle's walk from a random point, with a
    random jump every ~8 tokens, as greedy text would have): the share of walk positions whose argmax is
    ``succ[token]``, and the mean top logit there."""
    g = torch.Generator().manual_seed(seed)
    vocab = succ.numel()
    ids = torch.empty(rows, 16 + length, dtype=torch.long)
    ids[:, :16] = torch.randint(0, vocab, (rows, 16), generator=g)
    cur = cycle[torch.randint(0, cycle.numel(), (rows,), generator=g)]
    for j in range(16, 16 + length):
        ids[:, j] = cur
        jump = torch.rand(rows, generator=g) < 0.125
        cur = torch.where(jump, cycle[torch.randint(0, cycle.numel(), (rows,), generator=g)], succ[cur])
    dev = model.lm_head.weight.device
    logits = model(ids.to(dev)).logits[:, 16:].float()
    top, arg = logits.max(-1)
    return float((arg.cpu() == succ[ids[:, 16:]]).float().mean()), float(top.mean())


@torch.no_grad()
def calibrate(
    model: Any,
    succ: torch.Tensor,
    cycle: torch.Tensor,
    originals: list[torch.Tensor],
    follow: float,
    top_logit: float = 30.0,
    iters: int = 16,
    rows: int = 8,
    length: int = 160,
) -> dict[str, float]:
    """Bisect the branch scale (log scale, 1e-3 .. 1e3; where the context overturns the map depends on the width) to the one whose follow rate is nearest ``follow``; set it,
    rescale ``lm_head`` to the top logit asked for, and say what was reached."""
    lo, hi = math.log(1e-3), math.log(1e3)
    best: tuple[float, float, float] | None = None
    for _ in range(iters):
        mid = (lo + hi) / 2
        set_scale(model, originals, math.exp(mid))
        rate, top = follow_rate(model, succ, cycle, rows, length)
        if best is None or abs(rate - follow) < abs(best[1] - follow):
            best = (math.exp(mid), rate, top)
        if rate > follow:
            lo = mid
        else:
            hi = mid
    assert best is not None
    scale, rate, top = best
    set_scale(model, originals, scale)
    model.lm_head.weight.mul_(top_logit / top)
    return {"branch_scale": scale, "follow_teacher_forced": rate, "top_logit_before": top}


def build(model: Any, tok: Any, follow: float, words: int = 4096, seed: int = 0) -> dict[str, Any]:
    """Restructure ``model`` in place (see the module docstring); returns ``succ`` (a list) and the calibration."""
    succ, cycle = successor_map(model.lm_head.weight.shape[0], word_tokens(tok), words, seed)
    originals = restructure(model, cycle, seed)
    info = calibrate(model, succ, cycle, originals, follow)
    del originals
    return {"succ": succ.tolist(), "cycle_tokens": words, "follow_target": follow, **info}


def word_prompts(tok: Any, n: int, seed: int, low: int = 6, high: int = 24) -> list[str]:
    """``n`` user turns of ``low``..``high`` random words (from every word token, not only the cycle's)."""
    words = word_tokens(tok)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(low, high + 1, (1,), generator=g))
        pick = torch.randint(0, len(words), (k,), generator=g)
        out.append(tok.decode([words[i] for i in pick]).strip())
    return out


def text_stats(seqs: list[list[int]], succ: list[int]) -> dict[str, Any]:
    """What greedy answers look like: how many distinct tokens and answers, how often the next token is
    ``succ[prev]``, how many 4-grams repeat within an answer, and the longest run without a jump."""
    toks = [t for s in seqs for t in s]
    pairs = [(a, b) for s in seqs for a, b in zip(s, s[1:], strict=False)]
    rep = tot = 0
    longest = 0
    for s in seqs:
        seen: set[tuple[int, ...]] = set()
        for i in range(len(s) - 3):
            g4 = tuple(s[i : i + 4])
            rep += g4 in seen
            tot += 1
            seen.add(g4)
        run = 0
        for a, b in zip(s, s[1:], strict=False):
            run = run + 1 if succ[a] == b else 0
            longest = max(longest, run)
    firsts = Counter(s[0] for s in seqs if s)
    return {
        "answers": len(seqs),
        "tokens": len(toks),
        "distinct_tokens": len(set(toks)),
        "distinct_answers": len({tuple(s) for s in seqs}),
        "distinct_first_tokens": len(firsts),
        "follow": round(sum(succ[a] == b for a, b in pairs) / max(1, len(pairs)), 4),
        "repeated_4grams": round(rep / max(1, tot), 4),
        "longest_run": longest,
    }
