"""The draft model: SGLang checkpoint conventions, save/load, and TTT == drafting.

The checkpoint checks follow SGLang's EAGLE3 loader, python/sglang/srt/models/llama_eagle3.py
(sgl-project/sglang): ``LlamaForCausalLMEagle3.load_weights`` maps ``q/k/v_proj`` onto ``qkv_proj``
and ``gate/up_proj`` onto ``gate_up_proj``, tries each name as is and then prefixed with ``model.``,
turns ``d2t`` into ``hot_token_id = d2t + arange`` and skips ``t2d``; ``LlamaModel`` builds
``fc = Linear(3 * target_hidden_size, hidden_size)``, ``midlayer`` whose ``qkv_proj`` reads
``2 * hidden_size``, and uses ``lm_head = embed_tokens`` when ``tie_word_embeddings`` is set. The
aux layer ids come from ``eagle_config["eagle_aux_hidden_state_layer_ids"]``
(python/sglang/srt/model_executor/model_runner.py), to which ``set_eagle3_layers_to_capture`` adds 1.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pipeline.eagle3.draft_attention import chain_attention, chain_attention_reference
from pipeline.eagle3.draft_config import DraftConfig, DraftModelError, default_aux_layers
from pipeline.eagle3.draft_model import Eagle3Draft, load_draft, save_draft

# The parameters of SGLang's LlamaForCausalLMEagle3 (one midlayer), as its modules name them.
SGLANG_PARAMS = {
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.midlayer.self_attn.qkv_proj.weight",
    "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight",
    "model.midlayer.mlp.down_proj.weight",
    "model.midlayer.input_layernorm.weight",
    "model.midlayer.hidden_norm.weight",
    "model.midlayer.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
}
STACKED = [
    (".qkv_proj", ".q_proj"),
    (".qkv_proj", ".k_proj"),
    (".qkv_proj", ".v_proj"),
    (".gate_up_proj", ".gate_proj"),
    (".gate_up_proj", ".up_proj"),
]


def sglang_param_for(name: str) -> str | None:
    """SGLang's load_weights name resolution for one checkpoint tensor (None: not a parameter)."""
    if "d2t" in name or "t2d" in name:
        return None
    for param, shard in STACKED:
        if shard in name:
            name = name.replace(shard, param)
            break
    return name if name in SGLANG_PARAMS else f"model.{name}"


def tiny_config(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        draft_vocab_size=16,
        aux_layer_ids=[1, 3, 5],
        target_hidden_size=32,
        rope_theta=10000.0,
        max_position_embeddings=128,
    )
    base.update(kw)
    return DraftConfig(**base)


def tiny_draft(seed: int = 0, **kw) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(tiny_config(**kw))
    for p in d.parameters():
        p.data.normal_(0, 0.2)
    for n in (
        d.midlayer.input_layernorm,
        d.midlayer.hidden_norm,
        d.midlayer.post_attention_layernorm,
        d.norm,
    ):
        n.weight.data.fill_(1.0)
    ids = torch.tensor(sorted(torch.randperm(64)[:16].tolist()))
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab(ids - torch.arange(16), t2d)
    return d


def test_default_aux_layers_match_sglang_default_capture() -> None:
    # SGLang with no ids captures the inputs of layers [2, L//2, L-3]: the outputs of our ids.
    for n in (30, 32, 61):
        assert [i + 1 for i in default_aux_layers(n)] == [2, n // 2, n - 3]
    assert default_aux_layers(30) == [1, 14, 26]
    with pytest.raises(DraftModelError):
        default_aux_layers(4)


def test_checkpoint_config_and_tensor_names_match_sglang_loader(tmp_path) -> None:
    from pipeline.eagle3.target_capture import target_config

    tcfg = target_config("builtin:smollm2-135m-instruct")
    cfg = DraftConfig.from_target(tcfg, 2048, default_aux_layers(tcfg.num_hidden_layers))
    d = Eagle3Draft(cfg)
    save_draft(d, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["num_hidden_layers"] == 1
    assert conf["tie_word_embeddings"] is False  # SmolLM2 itself is tied: must not be copied over
    assert conf["vocab_size"] == 49152 and conf["draft_vocab_size"] == 2048
    assert conf["hidden_size"] == conf["target_hidden_size"] == 576
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert conf["num_attention_heads"] == 9 and conf["num_key_value_heads"] == 3 and conf["head_dim"] == 64
    assert conf["rope_theta"] == 100000.0

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        d2t = f.get_tensor("d2t")
        dtypes = {k: f.get_slice(k).get_dtype() for k in names}
    mapped = {sglang_param_for(n) for n in names} - {None}
    # every tensor lands on an SGLang parameter, and every parameter but the shared embedding is filled
    assert mapped <= SGLANG_PARAMS, mapped - SGLANG_PARAMS
    assert SGLANG_PARAMS - mapped == {"model.embed_tokens.weight"}
    assert {"d2t", "t2d"} <= names
    h = 576
    assert shapes["fc.weight"] == (h, 3 * h)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (9 * 64, 2 * h)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (3 * 64, 2 * h)
    assert shapes["lm_head.weight"] == (2048, h)
    assert shapes["t2d"] == (49152,) and dtypes["t2d"] == "BOOL"
    assert dtypes["d2t"] == "I64" and dtypes["fc.weight"] == "BF16"
    assert d2t.shape == (2048,)


def test_save_load_round_trip_keeps_vocab_and_outputs(tmp_path) -> None:
    d = tiny_draft()
    save_draft(d, tmp_path, dtype=torch.float32)
    e = load_draft(tmp_path, embed=d.embed_tokens.weight.data)
    assert torch.equal(e.d2t, d.d2t) and torch.equal(e.t2d, d.t2d)
    aux, ids = torch.randn(1, 9, 96), torch.randint(0, 64, (1, 9))
    for a, b in zip(
        d.ttt(aux, ids, torch.tensor([9]), 3), e.ttt(aux, ids, torch.tensor([9]), 3), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6)
    # hot-token map as SGLang computes it
    assert torch.equal(e.draft_to_target(torch.arange(16)), d.d2t + torch.arange(16))
    assert bool(d.t2d[e.draft_to_target(torch.arange(16))].all())


def test_load_draft_names_a_missing_tensor(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    save_draft(tiny_draft(), tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    del t["midlayer.hidden_norm.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftModelError, match="midlayer.hidden_norm.weight"):
        load_draft(tmp_path, embed=torch.zeros(64, 32))


def test_ttt_step_j_equals_drafting_the_same_chain() -> None:
    """Column t at TTT step j must be exactly what drafting computes after a context ending at t."""
    d = tiny_draft(seed=1).eval()
    s = 10
    aux, ids = torch.randn(1, s, 96), torch.randint(0, 64, (1, s))
    with torch.no_grad():
        ttt = d.ttt(aux, ids, torch.tensor([s]), 3)
        for t in (0, 3, 6):
            cols = torch.arange(t + 1)
            h, (k0, v0) = d.layer(
                ids[:, 1 : t + 2], d.fc(aux[:, : t + 1]), (cols + 1)[None], cols, None, [], None
            )
            hidden = h[:, -1:]
            assert torch.allclose(d.logits(hidden)[0, 0], ttt[0][0, t], atol=1e-5)
            chain = []
            qcol = torch.tensor([t])
            for j in (1, 2):
                hidden, kv = d.layer(
                    ids[:, t + 1 + j : t + 2 + j],
                    hidden,
                    torch.tensor([[t + 1 + j]]),
                    qcol,
                    (k0, v0),
                    chain,
                    None,
                )
                chain.append(kv)
                assert torch.allclose(d.logits(hidden)[0, 0], ttt[j][0, t], atol=1e-5), (t, j)


def test_ttt_ignores_padding_and_later_columns() -> None:
    d = tiny_draft(seed=2).eval()
    aux, ids = torch.randn(2, 12, 96), torch.randint(0, 64, (2, 12))
    aux2, ids2 = aux.clone(), ids.clone()
    aux2[1, 7:] = torch.randn(5, 96)  # row 1 is 7 tokens long: what lies beyond must not matter
    ids2[1, 7:] = 0
    with torch.no_grad():
        a = d.ttt(aux, ids, torch.tensor([12, 7]), 3)
        b = d.ttt(aux2, ids2, torch.tensor([12, 7]), 3)
    for j in range(3):
        valid = 7 - 2 - j  # columns whose prediction (token t+2+j) lies inside the row
        assert torch.allclose(a[j][1, :valid], b[j][1, :valid], atol=1e-5)
        assert torch.allclose(a[j][0], b[j][0], atol=1e-6)


def test_chain_attention_sees_exactly_its_column_and_chain() -> None:
    torch.manual_seed(0)
    q, k0, v0 = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    k1, v1 = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    out = chain_attention(q, k0, v0, torch.arange(4), None, [(k1, v1)])
    for t in range(4):
        keys = torch.cat([k0[:, :, : t + 1], k1[:, :, t : t + 1]], 2)
        vals = torch.cat([v0[:, :, : t + 1], v1[:, :, t : t + 1]], 2)
        w = torch.softmax((q[:, :, t : t + 1] @ keys.transpose(-1, -2)) / 8**0.5, -1)
        assert torch.allclose(out[:, :, t : t + 1], w @ vals, atol=1e-5)


def _chain_inputs(seed: int, b: int, nh: int, nkv: int, s: int, d: int, steps: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nh, s, d, generator=g, dtype=dtype) * 2  # scores of a few units: a peaked softmax
    k0, v0 = (torch.randn(b, nkv, s, d, generator=g, dtype=dtype) for _ in range(2))
    chain = [
        tuple(torch.randn(b, nkv, s, d, generator=g, dtype=dtype) for _ in range(2)) for _ in range(steps)
    ]
    return q, k0, v0, chain


@pytest.mark.parametrize("nkv", [4, 2])
@pytest.mark.parametrize("steps", [0, 1, 6])
def test_sink_chain_attention_equals_the_full_mask_form_with_gradients(nkv: int, steps: int) -> None:
    """The attention TTT runs now (sink key, causal kernel) == the old full (Sq, 7·Sq) mask, values and grads."""
    q, k0, v0, chain = _chain_inputs(steps, 2, 4, nkv, 11, 8, steps, torch.float64)
    leaves = [q, k0, v0, *[t for kv in chain for t in kv]]
    for t in leaves:
        t.requires_grad_(True)
    cols = torch.arange(11)
    new = chain_attention(q, k0, v0, cols, None, chain, causal=True)
    ref = chain_attention_reference(q, k0, v0, cols, None, chain)
    assert torch.allclose(new, ref, atol=1e-10)
    w = torch.randn_like(ref)
    g_new = torch.autograd.grad((new * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b in zip(g_new, g_ref, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


def test_sink_chain_attention_with_a_key_mask_and_drafting_columns() -> None:
    """The general (drafting) form: arbitrary query columns and a per-row key mask, as the reference."""
    q, k0, v0, chain = _chain_inputs(7, 2, 4, 2, 9, 8, 3, torch.float64)
    q = q[:, :, 4:7]
    chain = [(k[:, :, 4:7], v[:, :, 4:7]) for k, v in chain]
    cols = torch.tensor([4, 5, 6])
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, 2] = False  # a hidden key in row 1 only
    new = chain_attention(q, k0, v0, cols, valid, chain)
    ref = chain_attention_reference(q, k0, v0, cols, valid, chain)
    assert torch.allclose(new, ref, atol=1e-10)


def test_sink_chain_attention_in_bf16_stays_within_bf16_of_float64() -> None:
    """bf16 loses nothing extra: the sink's logsumexp travels as a hi/lo pair, not one rounded number."""
    q, k0, v0, chain = _chain_inputs(3, 1, 4, 4, 64, 16, 6, torch.float64)
    cols = torch.arange(64)
    exact = chain_attention_reference(q, k0, v0, cols, None, chain)
    bf = [t.bfloat16() for t in (q, k0, v0)]
    new = chain_attention(*bf, cols, None, [(k.bfloat16(), v.bfloat16()) for k, v in chain], causal=True)
    old = chain_attention_reference(*bf, cols, None, [(k.bfloat16(), v.bfloat16()) for k, v in chain])
    err_new, err_old = (new.double() - exact).abs().max(), (old.double() - exact).abs().max()
    assert err_new <= 2 * err_old + 1e-3, (err_new, err_old)


def test_sink_chain_attention_under_bf16_autocast_stays_within_bf16_of_float64() -> None:
    """fp32 inputs under autocast (how the GPU trains): SDPA runs them in bf16, the sink score survives."""
    q, k0, v0, chain = _chain_inputs(5, 1, 4, 2, 64, 16, 6, torch.float64)
    cols = torch.arange(64)
    exact = chain_attention_reference(q, k0, v0, cols, None, chain)
    f = [t.float() for t in (q, k0, v0)]
    fchain = [(k.float(), v.float()) for k, v in chain]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        new = chain_attention(*f, cols, None, fchain, causal=True)
        old = chain_attention_reference(*f, cols, None, fchain)
    err_new, err_old = (new.double() - exact).abs().max(), (old.double() - exact).abs().max()
    assert err_new <= 2 * err_old + 1e-3, (err_new, err_old)


def test_ttt_logits_equal_the_full_mask_ttt_in_float64(monkeypatch) -> None:
    """Whole TTT (7 steps, padded rows) with the sink attention == with the old full-mask attention."""
    import pipeline.eagle3.draft_model as dm

    d = tiny_draft(seed=4).double().eval()
    aux, ids = torch.randn(2, 12, 96, dtype=torch.float64), torch.randint(0, 64, (2, 12))
    lengths = torch.tensor([12, 8])
    with torch.no_grad():
        new = d.ttt(aux, ids, lengths, 7)

        def old(q, k0, v0, q_cols, key_valid=None, chain=None, causal=False):
            valid = torch.arange(k0.shape[2])[None, :] < (lengths[:, None] - 1) if causal else key_valid
            return chain_attention_reference(q, k0, v0, q_cols, valid, chain)

        monkeypatch.setattr(dm, "chain_attention", old)
        ref = d.ttt(aux, ids, lengths, 7)
    for j in range(7):
        for row, n in enumerate(lengths.tolist()):
            # every column before the row's last one (the last has no next token: nothing to score)
            assert torch.allclose(new[j][row, : n - 1], ref[j][row, : n - 1], atol=1e-10), (j, row)


# ------------------------------------------------------------------------------ EAGLE-3.1
def sglang_params_for(conf: dict) -> set[str]:
    """SGLang's LlamaForCausalLMEagle3 parameters for a draft config.json: ``LlamaModel.__init__`` adds
    ``fc_norm.{0,1,2}`` when ``getattr(config, "fc_norm", None) or getattr(config, "use_aux_norm", False)``."""
    extra = (
        {f"model.fc_norm.{i}.weight" for i in range(3)}
        if conf.get("fc_norm") or conf.get("use_aux_norm")
        else set()
    )
    return SGLANG_PARAMS | extra


def sglang_maps_every_tensor(path) -> None:
    """The loader check: every saved tensor lands on a parameter SGLang builds from this config, and every
    parameter but the shared embedding is filled."""
    conf = json.loads((path / "config.json").read_text())
    params = sglang_params_for(conf)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())

    def resolve(name: str) -> str | None:
        if "d2t" in name or "t2d" in name:
            return None
        for param, shard in STACKED:
            if shard in name:
                name = name.replace(shard, param)
                break
        return name if name in params else f"model.{name}"

    mapped = {resolve(n) for n in names} - {None}
    assert mapped <= params, mapped - params
    assert params - mapped == {"model.embed_tokens.weight"}


def test_sglang_reads_the_eagle31_keys_where_the_export_writes_them() -> None:
    """The pinned SGLang's llama_eagle3.py (read as text: importing it needs a GPU stack) takes both switches
    from the top level of config.json, and fc_norm as one RMSNorm per aux state applied before fc."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (pip install --no-deps -r .ci/sglang-parser-requirements.txt)")
    src = (Path(spec.origin).parent / "srt" / "models" / "llama_eagle3.py").read_text()
    assert 'getattr(config, "fc_norm", None)' in src and 'getattr(config, "norm_output", False)' in src
    assert "zip(self.fc_norm, chunks)" in src and "hidden_states = self.fc(hidden_states)" in src
    assert "aux = hidden_states_to_logits if self.norm_output else hidden_states_to_aux" in src


@pytest.mark.parametrize(("fc_norm", "norm_output"), [(True, False), (False, True), (True, True)])
def test_eagle31_switches_build_sglangs_modules_and_round_trip(
    tmp_path, fc_norm: bool, norm_output: bool
) -> None:
    d = tiny_draft(seed=3, fc_norm=fc_norm, norm_output=norm_output)
    plain = tiny_draft(seed=3)
    for n in (d.norm, *(d.fc_norm or [])):  # not the identity, so the switches change outputs
        n.weight.data.uniform_(0.5, 1.5)
    names = set(d.trainable_state())
    assert ({f"fc_norm.{i}.weight" for i in range(3)} <= names) == fc_norm
    assert names - {f"fc_norm.{i}.weight" for i in range(3)} == set(plain.trainable_state())
    if fc_norm:
        assert [tuple(n.weight.shape) for n in d.fc_norm] == [(32,)] * 3  # one per target state
    save_draft(d, tmp_path, dtype=torch.float32)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["fc_norm"] is fc_norm and conf["norm_output"] is norm_output
    sglang_maps_every_tensor(tmp_path)
    e = load_draft(tmp_path, embed=d.embed_tokens.weight.data)
    assert e.cfg.fc_norm is fc_norm and e.cfg.norm_output is norm_output
    aux, ids, n = torch.randn(1, 9, 96), torch.randint(0, 64, (1, 9)), torch.tensor([9])
    with torch.no_grad():
        got, want = e.ttt(aux, ids, n, 3), d.ttt(aux, ids, n, 3)
        plain.load_state_dict({k: v for k, v in d.state_dict().items() if "fc_norm" not in k})
        base = plain.ttt(aux, ids, n, 3)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # fc_norm changes the first step already; norm_output only what later steps are fed.
    assert torch.allclose(want[0], base[0], atol=1e-6) is not fc_norm
    assert not torch.allclose(want[2], base[2], atol=1e-4)


def test_a_config_from_another_trainer_with_use_aux_norm_loads_as_fc_norm(tmp_path) -> None:
    save_draft(tiny_draft(fc_norm=True), tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    del conf["fc_norm"], conf["norm_output"]
    conf["use_aux_norm"] = True  # SGLang's legacy key for the same modules
    (tmp_path / "config.json").write_text(json.dumps(conf))
    e = load_draft(tmp_path, embed=torch.zeros(64, 32))
    assert e.cfg.fc_norm and not e.cfg.norm_output and e.fc_norm is not None


@pytest.mark.parametrize("norm_output", [False, True])
def test_eagle31_ttt_equals_sglang_style_drafting(norm_output: bool) -> None:
    """What training unrolls equals what chain drafting proposes (the offline bench's drafter, fed as SGLang
    feeds its draft): fed the draft's own proposals, TTT step j's greedy token at the last column is the
    j-th proposal."""
    from pipeline.eagle3.spec_decode import Eagle3Drafter

    d = tiny_draft(seed=6, fc_norm=True, norm_output=norm_output).eval()
    for n in (d.norm, *d.fc_norm):
        n.weight.data.uniform_(0.5, 1.5)
    s, k = 8, 4
    aux, toks = torch.randn(s + 1 + k, 96), torch.randint(0, 64, (s + 1,)).tolist()
    drafter = Eagle3Drafter(d)
    drafter.start(toks, aux[:s])
    proposal = drafter.propose(k)
    ids = torch.tensor([toks + proposal])
    with torch.no_grad():
        ttt = d.ttt(aux[None, : ids.shape[1]], ids, torch.tensor([ids.shape[1]]), k)
    got = [int(d.draft_to_target(ttt[j][0, s - 1].argmax())) for j in range(k)]
    assert got == proposal


def test_the_exported_config_reads_back_as_the_same_draft_config() -> None:
    for cfg in (tiny_config(), tiny_config(fc_norm=True, norm_output=True, rms_norm_eps=1e-6)):
        assert DraftConfig.from_sglang_config(cfg.sglang_config()) == cfg


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
        (lambda c: c.pop("draft_vocab_size"), "draft_vocab_size"),
        (lambda c: c.update(hidden_size="32"), "hidden_size"),
        (lambda c: c.update(num_hidden_layers=2), "num_hidden_layers"),
        (lambda c: c.pop("eagle_config"), "eagle_aux_hidden_state_layer_ids is missing"),
        (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids="1,3"), "must be a list"),
    ],
)
def test_a_bad_draft_config_names_the_file_and_the_field(edit, named: str) -> None:
    conf = tiny_config().sglang_config()
    edit(conf)
    with pytest.raises(DraftModelError, match=named) as e:
        DraftConfig.from_sglang_config(conf, where="run/draft/config.json")
    assert str(e.value).startswith("run/draft/config.json: ")
