"""The structured synthetic target of the SGLang speedup bench (``bench/gpu/structured_target.py``), on a tiny Llama."""

from __future__ import annotations

import string

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.gpu import structured_target as st


class _Vocab:
    """A tokenizer stand-in: 300 word tokens (``Ġabc``…) among 512, the rest punctuation and pieces."""

    def get_vocab(self) -> dict[str, int]:
        letters = string.ascii_lowercase
        words = {"Ġ" + letters[i % 26] + letters[i // 26 % 26] + letters[i // 676]: i for i in range(300)}
        return {**words, **{f"<{i}>": i for i in range(300, 512)}}


def _model() -> LlamaForCausalLM:
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_the_map_is_one_cycle_through_word_tokens() -> None:
    words = st.word_tokens(_Vocab())
    assert words == list(range(300))
    succ, cycle = st.successor_map(512, words, 64, seed=3)
    assert sorted(cycle.tolist()) == sorted(set(cycle.tolist())) and len(cycle) == 64
    t, seen = int(cycle[0]), []
    for _ in range(64):  # one cycle of length 64, not several short ones
        seen.append(t)
        t = int(succ[t])
    assert t == int(cycle[0]) and len(set(seen)) == 64
    assert (succ[[i for i in range(512) if i not in set(seen)]] == -1).all()


def test_the_branch_scale_dials_how_often_the_context_overturns_the_map() -> None:
    model = _model()
    succ, cycle = st.successor_map(512, st.word_tokens(_Vocab()), 64, seed=0)
    originals = st.restructure(model, cycle, seed=0)
    st.set_scale(model, originals, 1e-3)
    assert st.follow_rate(model, succ, cycle, rows=4, length=48)[0] == 1.0
    st.set_scale(model, originals, 1e3)
    assert st.follow_rate(model, succ, cycle, rows=4, length=48)[0] < 0.5
    info = st.calibrate(model, succ, cycle, originals, follow=0.8, iters=10, rows=4, length=48)
    assert abs(info["follow_teacher_forced"] - 0.8) < 0.1
    assert abs(st.follow_rate(model, succ, cycle, rows=4, length=48)[1] - 30.0) < 10  # lm_head rescaled


def test_text_stats_count_jumps_and_repeats() -> None:
    succ = [1, 2, 0, -1]
    stats = st.text_stats([[0, 1, 2, 0, 1, 2, 0], [3, 0, 1, 1]], succ)
    assert stats["distinct_answers"] == 2 and stats["distinct_tokens"] == 4
    assert stats["follow"] == round(7 / 9, 4)  # 3->0 and 1->1 are jumps
    assert stats["longest_run"] == 6
    assert stats["repeated_4grams"] == round(1 / 5, 4)  # (0,1,2,0) twice in the first answer
