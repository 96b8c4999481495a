"""Kimi-K2.5 (a DeepSeek-V3-class MoE with MLA and YaRN inside a vision-language wrapper) through Aerie.

The target is ``tests/kimi_fixture.py``: Kimi-K2.5's published ``config.json`` at its real sizes for
shape-only checks (nothing loaded), and a tiny random-weight model of the same architecture built
with transformers' own ``kimi_k25`` classes for the stages themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from pipeline.eagle3.draft_config import (
    DraftConfig,
    DraftModelError,
    default_aux_layers,
    normalise_aux_layers,
)
from pipeline.eagle3.draft_model import Eagle3Draft, save_draft
from pipeline.eagle3.rope import rope_attention_scale, rope_inv_freq
from pipeline.eagle3.target_capture import checkpoint_key, target_config, tensor_roles
from tests.eagle3_fixtures import assert_stores_match
from tests.kimi_fixture import KIMI_K25_CONFIG, build_tiny_kimi, write_config
from tests.tolerance import SEED

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def kimi_real(tmp_path_factory) -> Path:
    """Kimi-K2.5's config.json at its real sizes (no weights)."""
    return write_config(tmp_path_factory.mktemp("kimi-real"))


@pytest.fixture(scope="session")
def tiny_kimi(tmp_path_factory) -> Path:
    return build_tiny_kimi(tmp_path_factory.mktemp("kimi-tiny"), seed=SEED)


# ------------------------------------------------------------------------------ shapes (real sizes)
def test_the_real_config_is_read_as_a_deepseek_v3_text_model_inside_kimi_k25(kimi_real: Path) -> None:
    tcfg = target_config(str(kimi_real))
    assert tcfg.model_type == "deepseek_v3"  # transformers maps Kimi's "kimi_k2" text config
    assert (tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.vocab_size) == (61, 7168, 163840)
    assert (tcfg.kv_lora_rank, tcfg.q_lora_rank, tcfg.qk_rope_head_dim) == (512, 1536, 64)
    assert (tcfg.n_routed_experts, tcfg.n_shared_experts, tcfg.first_k_dense_replace) == (384, 1, 1)


def test_mla_target_gets_specforges_kimi_draft_layout_with_yarn(kimi_real: Path) -> None:
    # Today's code took head_dim from the MLA target's qk_rope_head_dim (64) and refused yarn.
    cfg = DraftConfig.from_target(target_config(str(kimi_real)), 32000, default_aux_layers(61))
    assert cfg.head_dim == 128 and cfg.num_attention_heads == 64 and cfg.num_key_value_heads == 64
    assert cfg.hidden_size == cfg.target_hidden_size == 7168 and cfg.intermediate_size == 18432
    assert cfg.vocab_size == 163840 and cfg.draft_vocab_size == 32000
    assert cfg.aux_layer_ids == [1, 29, 57]  # SpecForge's default for 61 layers (its DeepSeek-V3 config)
    sc = cfg.rope_scaling or {}
    assert sc.get("rope_type", sc.get("type")) == "yarn" and sc["factor"] == 64.0
    assert sc["original_max_position_embeddings"] == 4096 and cfg.rope_theta == 50000.0
    assert rope_inv_freq(cfg).shape == (64,)
    assert rope_attention_scale(cfg) == pytest.approx(1.0)  # mscale == mscale_all_dim


def test_the_draft_config_json_carries_yarn_and_the_sglang_capture_ids(tmp_path: Path) -> None:
    cfg = DraftConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=512,
        draft_vocab_size=64,
        aux_layer_ids=[1, 3, 4],
        target_hidden_size=64,
        rope_theta=50000.0,
        rope_scaling=dict(KIMI_K25_CONFIG["text_config"]["rope_scaling"], rope_type="yarn"),
        max_position_embeddings=262144,
    )
    save_draft(Eagle3Draft(cfg), tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["rope_theta"] == 50000.0
    assert conf["rope_scaling"]["rope_type"] == "yarn" and conf["rope_scaling"]["factor"] == 64.0
    assert conf["rope_scaling"]["mscale"] == conf["rope_scaling"]["mscale_all_dim"] == 1.0
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert conf["eagle_config"]["sglang_layers_to_capture"] == [2, 4, 5]
    # transformers reads it back as a Llama config with the same rope (what SGLang's loader gets)
    from transformers import LlamaConfig

    lc = LlamaConfig.from_pretrained(str(tmp_path))
    rp = getattr(lc, "rope_parameters", None) or {**(lc.rope_scaling or {}), "rope_theta": lc.rope_theta}
    assert rp["rope_type"] == "yarn" and rp["factor"] == 64.0 and rp["rope_theta"] == 50000.0


@pytest.mark.parametrize("with_mscale", [True, False])
def test_draft_yarn_equals_sglangs_own_rotary_embedding(with_mscale: bool) -> None:
    """SGLang serves the draft with YaRNScalingRotaryEmbedding built from the config's rope_scaling:
    the draft must train with exactly those cos/sin (its own code computes them here)."""
    yarn_mod = pytest.importorskip("sglang.srt.layers.rotary_embedding.yarn")
    base_mod = pytest.importorskip("sglang.srt.layers.rotary_embedding.base")

    def light_init(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype, *a, **k):
        # RotaryEmbedding.__init__ picks a GPU kernel; keep only what builds the cos/sin cache.
        torch.nn.Module.__init__(self)
        self.head_size, self.rotary_dim, self.max_position_embeddings = (
            head_size,
            rotary_dim,
            max_position_embeddings,
        )
        self.base, self.is_neox_style, self.dtype = base, is_neox_style, dtype
        self.cos_sin_cache = self._compute_cos_sin_cache()

    sc = {
        k: v
        for k, v in KIMI_K25_CONFIG["text_config"]["rope_scaling"].items()
        if with_mscale or not k.startswith("mscale")
    }
    cfg = DraftConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=512,
        draft_vocab_size=64,
        aux_layer_ids=[1, 3, 4],
        target_hidden_size=64,
        rope_theta=50000.0,
        rope_scaling=sc,
        max_position_embeddings=262144,
    )
    orig = base_mod.RotaryEmbedding.__init__
    base_mod.RotaryEmbedding.__init__ = light_init
    try:
        extra = {k: v for k, v in sc.items() if k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
        sgl = yarn_mod.YaRNScalingRotaryEmbedding(
            128,
            128,
            sc["original_max_position_embeddings"],
            50000.0,
            True,
            sc["factor"],
            torch.float32,
            **extra,
        )
    finally:
        base_mod.RotaryEmbedding.__init__ = orig
    pos = torch.tensor([0, 1, 7, 100, 4095, 4096, 30000, 262143])
    freqs = pos.float()[:, None] * rope_inv_freq(cfg)[None]
    ours = torch.cat([freqs.cos(), freqs.sin()], -1) * rope_attention_scale(cfg)
    torch.testing.assert_close(ours, sgl.cos_sin_cache[pos], rtol=0, atol=1e-6)


def test_the_final_norm_is_the_text_models_not_the_vision_projectors(kimi_real: Path) -> None:
    # Kimi-K2.5's checkpoint keys (its own layout): the shortest key ending in "norm.weight" is the
    # vision projector's, which is what the old suffix rule picked.
    keys = [
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "mm_projector.pre_norm.weight",
        "mm_projector.pre_norm.bias",
        "vision_tower.encoder.final_layernorm.weight",
        "language_model.model.layers.0.input_layernorm.weight",
    ]
    roles = tensor_roles(str(kimi_real))  # from the meta-device model's modules, no weights
    assert roles == {
        "embed": "model.language_model.embed_tokens.weight",
        "norm": "model.language_model.norm.weight",
        "head": "lm_head.weight",
    }
    assert checkpoint_key(roles["norm"], keys) == "language_model.model.norm.weight"
    assert checkpoint_key(roles["embed"], keys) == "language_model.model.embed_tokens.weight"
    assert checkpoint_key(roles["head"], keys) == "language_model.lm_head.weight"


def test_aux_layers_are_sorted_as_sglang_captures_them() -> None:
    assert normalise_aux_layers([26, 1, 14], 30) == [1, 14, 26]
    with pytest.raises(DraftModelError, match="3 distinct"):
        normalise_aux_layers([1, 1, 14], 30)
    with pytest.raises(DraftModelError, match="out of range"):
        normalise_aux_layers([1, 14, 30], 30)


# ------------------------------------------------------------------------------ the stages (tiny model)
def _plan(tmp: Path, model: Path, extract_extra: str = "") -> Path:
    fixture = ROOT / "pipeline" / "data" / "fixtures" / "datasets" / "kimik2-5-2000x.jsonl"
    body = f"""
[run]
name = "kimi"
dir = "{tmp / "run"}"

[target]
model = "{model}"
max_length = 256

[[datasets]]
name = "kimi"
source = "kimik2-5-2000x"
kind = "target-native"
quota = 24
path = "{fixture}"

[prep]
shard_rows = 8
batch_rows = 8
check_rows = 8
reject_threshold = 0.5

[extract]
shard_tokens = 1500
batch_tokens = 1024
aux_layers = [4, 1, 2]
{extract_extra}
[vocab]
draft_vocab_size = 128

[train]
steps = 6
batch_size = 4
micro_batch = 2
ttt_steps = 2
checkpoint_every = 3
log_every = 1

[bench]
holdout = 0.2
prompts = 2
max_new_tokens = 8
steps = 2
check_lossless = true

[[stage]]
id = "prep"
run = "prep"
for_each = "dataset"

[[stage]]
id = "extract"
run = "extract"
after = ["prep.*"]

[[stage]]
id = "vocab"
run = "vocab"
after = ["prep.*"]

[[stage]]
id = "train"
run = "train"
after = ["extract", "vocab"]

[[stage]]
id = "bench"
run = "bench"
after = ["train"]
"""
    p = tmp / "plan.toml"
    p.write_text(body)
    return p


@pytest.mark.slow
def test_every_stage_runs_on_the_kimi_architecture(tmp_path: Path, tiny_kimi: Path) -> None:
    from tests.test_eagle3_model import SGLANG_PARAMS, sglang_param_for

    plan = _plan(tmp_path, tiny_kimi)
    plan.write_text(
        plan.read_text().replace("check_lossless = true", 'check_lossless = true\ndevice = "cpu"')
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    p = subprocess.run(
        [sys.executable, "-m", "console.cli", "run", str(plan), "--headless"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    run = tmp_path / "run"
    assert p.returncode == 0, (
        p.stdout[-3000:]
        + p.stderr[-3000:]
        + "".join(f"\n--- {f}\n" + f.read_text()[-2000:] for f in run.glob("stages/*/stage.log"))
    )
    out = run / "stages"
    prep_man = json.loads((out / "prep.kimi" / "out" / "manifest.json").read_text())
    assert prep_man["kind"] == "tokenized" and prep_man["rows"] > 0
    ext = json.loads((out / "extract" / "out" / "manifest.json").read_text())
    assert ext["aux_layer_ids"] == [1, 2, 4] and ext["sglang_layers_to_capture"] == [2, 3, 5]
    assert ext["hidden_size"] == 64 and ext["num_layers"] == 6
    draft = out / "train" / "out" / "draft"
    conf = json.loads((draft / "config.json").read_text())
    assert conf["head_dim"] == 128 and conf["num_attention_heads"] == 4 and conf["hidden_size"] == 64
    assert conf["rope_scaling"]["factor"] == 64.0 and conf["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [1, 2, 4]
    from safetensors import safe_open

    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    mapped = {sglang_param_for(n) for n in names} - {None}
    assert mapped <= SGLANG_PARAMS and SGLANG_PARAMS - mapped == {"model.embed_tokens.weight"}
    assert shapes["fc.weight"] == (64, 3 * 64) and shapes["midlayer.self_attn.q_proj.weight"] == (
        4 * 128,
        2 * 64,
    )
    bench = json.loads((out / "bench" / "out" / "manifest.json").read_text())
    assert bench["lossless_checked"] and bench["lossless_mismatches"] == 0
    assert 1.0 <= bench["accept_len"] <= 3.0

    # The offline bench with the target tensor-parallel over 2 gloo ranks (as the reference plan
    # runs it over 8 GPUs) decodes the same tokens and accepts the same drafts.
    tp_plan = plan.with_name("plan-tp.toml")
    tp_plan.write_text(
        plan.read_text().replace(
            "check_lossless = true", 'check_lossless = true\nparallel = "tp"\ntp_size = 2'
        )
    )
    argv = [
        sys.executable,
        "-m",
        "pipeline.stages.bench",
        "--plan",
        str(tp_plan),
        "--out",
        str(tmp_path / "bench-tp"),
        "--input",
        str(out / "train" / "out"),
    ]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    one = json.loads((out / "bench" / "out" / "results.json").read_text())
    two = json.loads((tmp_path / "bench-tp" / "results.json").read_text())
    assert [r["accepted"] for r in two["per_prompt"]] == [r["accepted"] for r in one["per_prompt"]]
    assert two["accept_len"] == one["accept_len"] and two["lossless_mismatches"] == 0


def _extract(plan: Path, out: Path, inputs: list[Path]) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "pipeline.stages.extract", "--plan", str(plan), "--out", str(out)]
    for i in inputs:
        argv += ["--input", str(i)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


@pytest.mark.slow
def test_tensor_parallel_capture_over_two_gloo_ranks_equals_one_process(
    tmp_path: Path, tiny_kimi: Path
) -> None:
    """Two CPU ranks each holding half of every MLP and of the experts (transformers' tp_plan) store
    what one process stores. Tolerance: both compute in fp32 and differ only in the order the
    all-reduce sums partial products (~1e-6); the store keeps bf16, so a value may land on the
    neighbouring bf16 number: at most one bf16 step apart (bf16 keeps 8 significant bits, so adjacent
    values differ by at most 2**-7 of their magnitude). The greedy tokens match exactly."""
    from pipeline.eagle3 import hidden_store as hs

    prep = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.stages.prep",
            "--plan",
            str(_plan(tmp_path, tiny_kimi)),
            "--dataset",
            "kimi",
            "--out",
            str(tmp_path / "tok"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert prep.returncode == 0, prep.stderr[-3000:]
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = _plan(tmp_path / "one", tiny_kimi, 'device = "cpu"')
    two = _plan(tmp_path / "two", tiny_kimi, 'parallel = "tp"\ntp_size = 2\ndevice = "cpu"')
    _extract(one, tmp_path / "ext1", [tmp_path / "tok"])
    p = _extract(two, tmp_path / "ext2", [tmp_path / "tok"])
    assert "2 ranks" in p.stderr or "tensor-parallel" in (tmp_path / "ext2" / "events.jsonl").read_text()
    assert_stores_match(tmp_path / "ext1", tmp_path / "ext2")
    m2 = json.loads((tmp_path / "ext2" / "manifest.json").read_text())
    assert m2["aux_layer_ids"] == [1, 2, 4] and m2["rows"] == len(hs.HiddenStore(tmp_path / "ext2"))
    ev = [json.loads(line) for line in (tmp_path / "ext2" / "events.jsonl").read_text().splitlines()]
    started = [
        e
        for e in ev
        if e.get("type") == "message" and "loaded tensor-parallel over 2 ranks" in e.get("text", "")
    ]
    assert len(started) == 1  # rank 0 alone speaks for the stage


# ------------------------------------------------------------------------------ aerie plan check --deep
@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory, tiny_kimi: Path) -> Path:
    """A local Hugging Face cache holding ``moonshotai/Kimi-K2.5`` as the reference plan names it: its
    real-size config.json (no weights) and the fixture tokenizer with Kimi-K2.5's chat template."""
    import shutil

    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / "models--moonshotai--Kimi-K2.5"
    snap = repo / "snapshots" / "0123456789abcdef"
    write_config(snap)
    for f in tiny_kimi.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123456789abcdef")
    return cache


def deep(plan: Path, cache: Path, *extra: str) -> tuple[int, dict]:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AERIE_")},
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
    }
    p = subprocess.run(
        [sys.executable, "-m", "pipeline.eagle3.chain_check", str(plan), "--json", *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.stdout.strip(), p.stderr[-3000:]
    return p.returncode, json.loads(p.stdout)


def by_name(rep: dict) -> dict[str, dict]:
    return {c["name"]: c for c in rep["checks"]}


def failed_but_sglang(rep: dict) -> list[str]:
    """The failing checks but the ``sglang`` line, which judges this machine's SGLang, not the plan (CI's parser
    install, 0.5.23, is known broken for capture: tests/test_tested_versions.py)."""
    from pipeline import tested_versions

    line = by_name(rep).get("sglang")
    if line is not None:  # it says what the table says of the installed release, for this plan's uses
        assert line["ok"] == tested_versions.classify_sglang(("serve", "capture")).ok, line
    return [c["name"] for c in rep["checks"] if not c["ok"] and c["name"] != "sglang"]


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, gib", [("kimi-k2.5.toml", 8, 80), ("kimi-k2.5-slurm.toml", 16, 45)])
def test_the_reference_plans_capture_through_sglang_and_fit_h200s(
    hf_cache: Path, name: str, tp: int, gib: int
) -> None:
    """The reference plans capture with target.engine = "sglang": the deep check counts SGLang's layout (the
    INT4 routed experts packed) and passes on 8 H200s (16 for the Slurm plan) (issue 26)."""
    rc, rep = deep(ROOT / "examples" / name, hf_cache, "--free-bytes", str(16 * 10**12))
    checks = by_name(rep)
    assert failed_but_sglang(rep) == [] and rc == (0 if rep["ok"] else 1), rep["checks"]
    n = rep["numbers"]
    assert n["engine"] == "sglang" and n["tp_size"] == tp and n["target_dequantized_bytes"] == 0
    assert n["capture_bytes_per_rank"] == n["sglang_bytes_per_rank"] < gib * 2**30
    mem = checks["gpu memory"]["detail"]
    assert "capture through SGLang" in mem and "quantized experts packed" in mem and f"(TP {tp}:" in mem
    assert (
        "bench" not in checks
    )  # their benches run online, through SGLang: nothing offline to hold the target


@pytest.mark.slow
def test_the_deep_check_tells_the_truth_about_holding_kimi_k25_on_8_h200(
    tmp_path: Path, hf_cache: Path
) -> None:
    """With target.engine = "transformers", which dequantizes the INT4 routed experts (3.56x) and cannot load
    them tensor-parallel, the reference plan fails with the real per-rank figure and says what would hold it."""
    text = (ROOT / "examples" / "kimi-k2.5.toml").read_text()
    assert '\nengine = "sglang"' in text
    plan = tmp_path / "kimi-k2.5.toml"
    plan.write_text(text.replace('\nengine = "sglang"', '\nengine = "transformers"', 1))
    rc, rep = deep(plan, hf_cache, "--free-bytes", str(16 * 10**12))  # a 16 TB volume
    checks = by_name(rep)
    assert rc == 1 and not rep["ok"]
    assert [c["name"] for c in rep["checks"] if not c["ok"]] == ["gpu memory"]  # everything else holds
    assert (
        "61 layers" in checks["architecture"]["detail"]
        and "model.language_model.norm.weight" in checks["architecture"]["detail"]
    )
    assert checks["aux layers"]["detail"].startswith("[1, 29, 57]")
    assert "64 heads x 128" in checks["draft"]["detail"] and "yarn" in checks["draft"]["detail"]
    n = rep["numbers"]
    assert n["bytes_per_token"] == 4 * 7168 * 2 + 9  # ~57 KB/token: 3 aux + final hidden, bf16
    assert n["tp_size"] == 8
    # ~1.8 TiB of experts held as bf16: 384 experts x 60 layers x 3 x 7168 x 2048 weights x 2 bytes
    assert n["target_dequantized_bytes"] == 384 * 60 * 3 * 7168 * 2048 * 2
    assert n["capture_bytes_per_rank"] > 250 * 2**30 > 141e9  # ~255 GiB per H200, not the 85 GiB once printed
    assert n["sglang_bytes_per_rank"] < 80 * 2**30  # SGLang keeps them packed: it would fit
    mem = checks["gpu memory"]["detail"]
    assert "kimi-k2.5.toml" in mem and "does not fit" in mem and "dequantized to bf16" in mem
    assert (
        "cannot load this checkpoint tensor-parallel" in mem and "SGLang keeps the INT4 experts packed" in mem
    )


@pytest.mark.slow
def test_an_offline_bench_of_kimi_k25_is_refused_at_plan_time_not_on_day_four(
    tmp_path: Path, hf_cache: Path
) -> None:
    """Capture through SGLang fits, but an offline bench stage would load Kimi-K2.5 through transformers,
    dequantized: the deep check fails on that stage alone, names it and says to measure through SGLang."""
    text = (ROOT / "examples" / "kimi-k2.5.toml").read_text()
    engine_line = next(x for x in text.splitlines() if x.startswith('engine = "sglang"') and "measured" in x)
    text = text.replace(engine_line, 'parallel = "tp"')  # [bench]: the offline bench, TP over the 8 GPUs
    text += '\n[[stage]]\nid = "bench-offline"\nrun = "bench"\nafter = ["train"]\ngpus = "all"\ncpu = 1\n'
    plan = tmp_path / "kimi-k2.5.toml"
    plan.write_text(text)
    rc, rep = deep(plan, hf_cache, "--free-bytes", str(16 * 10**12))
    assert rc == 1 and failed_but_sglang(rep) == ["bench"]
    detail = by_name(rep)["bench"]["detail"]
    assert "kimi-k2.5.toml" in detail and "stage bench-offline" in detail and "(TP 8)" in detail
    assert 'engine = "sglang"' in detail and "serve stage" in detail


def test_the_deep_check_says_when_transformers_is_a_release_it_was_not_tested_with(
    tmp_path: Path, tiny_kimi: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.25 shards DeepSeek-V3 differently from 5.24 (routed experts under an EP plan): the
    memory lines must not look as certain on a release nobody ran them on."""
    from pipeline import tested_versions
    from pipeline.eagle3 import chain_check
    from pipeline.run.plan import dag as plan_mod

    plan = plan_mod.load(_plan(tmp_path, tiny_kimi))
    assert tested_versions.untested({"torch": "2.13.0+cpu", "transformers": "5.24.0"}) == []
    assert tested_versions.untested({"torch": "2.11.0+cu130", "transformers": "5.17.0"}) == []
    for versions, warned in (
        ({"transformers": "5.25.0", "torch": "2.13.0+cpu"}, True),
        ({"transformers": "5.24.0", "torch": "2.13.0+cpu"}, False),
    ):
        monkeypatch.setattr(tested_versions, "installed", versions.get)
        line = by_name(asdict(chain_check.check(plan, free_bytes=10**13)))["versions"]
        assert line["ok"] and line["warning"] == warned, line
        if warned:
            assert "transformers 5.25.0 is not a release Aerie was tested with" in line["detail"]
            assert "5.24 (the CPU lock)" in line["detail"] and "TP plan" in line["detail"]
        else:
            assert line["detail"] == "torch 2.13.0+cpu, transformers 5.24.0 (tested)"


@pytest.mark.slow
@pytest.mark.parametrize(
    "edit, key",
    [
        (("[extract]\n", "[extract]\naux_layers = [1, 29, 61]\n"), "extract.aux_layers"),
        (("draft_vocab_size = 32000", "draft_vocab_size = 200000"), "vocab.draft_vocab_size"),
        (("gpu_memory_gb = 141", "gpu_memory_gb = 40"), "does not fit"),
    ],
)
def test_deep_check_refuses_a_plan_naming_the_file_and_key(
    tmp_path: Path, hf_cache: Path, edit: tuple, key: str
) -> None:
    text = (ROOT / "examples" / "kimi-k2.5.toml").read_text()
    assert edit[0] in text
    plan = tmp_path / "bad.toml"
    plan.write_text(text.replace(edit[0], edit[1], 1))
    rc, rep = deep(plan, hf_cache, "--free-bytes", str(16 * 10**12))
    assert rc == 1 and not rep["ok"]
    failed = [c for c in rep["checks"] if not c["ok"]]
    assert failed and any(key in c["detail"] for c in failed), failed
    assert any("bad.toml" in c["detail"] or key == "does not fit" for c in failed)


@pytest.mark.slow
def test_deep_check_refuses_a_disk_too_small_for_the_hidden_states(hf_cache: Path) -> None:
    rc, rep = deep(ROOT / "examples" / "kimi-k2.5.toml", hf_cache, "--free-bytes", str(9 * 10**12))  # 9 TB
    disk = by_name(rep)["disk"]
    assert rc == 1 and not disk["ok"] and "kimi-k2.5.toml" in disk["detail"] and "TiB" in disk["detail"]


@pytest.mark.slow
def test_deep_check_names_an_architecture_it_cannot_capture(tmp_path: Path) -> None:
    model = tmp_path / "enc"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "bert",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 100,
            }
        )
    )
    plan = tmp_path / "plan.toml"
    plan.write_text(
        f'[run]\nname = "x"\ndir = "{tmp_path / "run"}"\n[target]\nmodel = "{model}"\n'
        '[[stage]]\nid = "extract"\nrun = "extract"\n'
    )
    rc, rep = deep(plan, tmp_path)
    arch = by_name(rep)["architecture"]
    assert rc == 1 and not arch["ok"] and "'bert'" in arch["detail"] and "get_decoder()" in arch["detail"]
    assert "target.model" in arch["detail"]


@pytest.mark.slow
def test_aerie_plan_check_deep_prints_the_checks(hf_cache: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AERIE_")},
        "HF_HUB_CACHE": str(hf_cache),
        "HF_HUB_OFFLINE": "1",
    }
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "console.cli",
            "plan",
            "check",
            "--deep",
            str(ROOT / "examples" / "kimi-k2.5.toml"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    # this machine's disk is far from the ~11 TB the reference run needs: the deep check says so
    assert "deep check of" in p.stdout and "architecture" in p.stdout and "gpu memory" in p.stdout
    assert (p.returncode == 0) == ("not ok" not in p.stdout)


def split_layers(model: torch.nn.Module, base: torch.nn.Module, on_gpu: list[int]) -> None:
    """Place the embedding and layers ``on_gpu`` on cuda:0, the rest on the CPU, each layer moving its
    inputs to its own device first — what accelerate's dispatch does over several GPUs."""

    def to_own_device(mod, args, kwargs):  # noqa: ANN001, ANN202
        dev = next(mod.parameters()).device

        def mv(x):  # noqa: ANN001, ANN202
            if isinstance(x, torch.Tensor):
                return x.to(dev)
            if isinstance(x, tuple | list):
                return type(x)(mv(y) for y in x)
            return x

        return mv(args), {k: mv(v) for k, v in kwargs.items()}

    base.embed_tokens.to("cuda:0")
    base.rotary_emb.to("cuda:0")
    for i, layer in enumerate(base.layers):
        layer.to("cuda:0" if i in on_gpu else "cpu")
        layer.register_forward_pre_hook(to_own_device, with_kwargs=True)
    base.norm.register_forward_pre_hook(to_own_device, with_kwargs=True)


@pytest.mark.gpu  # the model is split between cuda:0 and the CPU
def test_a_target_split_between_gpu_and_cpu_is_captured_on_one_device(tiny_kimi: Path) -> None:
    """device = "auto" spreads layers over devices; the aux states come back from each layer's own
    device and must be gathered (today's torch.cat failed across devices)."""
    from pipeline.eagle3.target_capture import load_target

    ref = load_target(str(tiny_kimi), [1, 2, 4], dtype=torch.float32, device="cpu")
    spread = load_target(str(tiny_kimi), [1, 2, 4], dtype=torch.float32, device="cpu")
    split_layers(spread.model, spread.base, on_gpu=[0, 1, 2])
    assert spread.device.type == "cuda"
    ids = torch.randint(3, 500, (2, 24))
    a = ref.capture(ids, torch.ones_like(ids))
    b = spread.capture(ids.to(spread.device), torch.ones_like(ids).to(spread.device))
    assert {t.device.type for t in spread._aux.values()} == {
        "cuda",
        "cpu",
    }  # layers 1, 2 on the GPU, 4 on the CPU
    assert b.aux.device == b.last_hidden.device
    torch.testing.assert_close(b.aux.cpu(), a.aux, rtol=1e-4, atol=1e-4)
    assert torch.equal(spread.argmax(b.last_hidden).cpu(), ref.argmax(a.last_hidden))


@pytest.mark.slow
def test_the_online_tp_reference_plan_counts_the_draft_beside_the_target_shard(
    tmp_path: Path, hf_cache: Path
) -> None:
    rc, rep = deep(ROOT / "examples" / "kimi-k2.5-online.toml", hf_cache, "--free-bytes", str(10**12))
    checks = by_name(rep)
    assert rc == 1 and [c["name"] for c in rep["checks"] if not c["ok"]] == ["gpu memory"]
    assert checks["disk"]["detail"].startswith("online training: no hidden states")
    assert rep["numbers"]["hidden_state_bytes"] == 0
    mem = checks["gpu memory"]["detail"]
    assert "online-tp, per rank: target shard" in mem and "(TP 8)" in mem and "draft and AdamW" in mem
    n = rep["numbers"]
    assert (
        n["online_tp_bytes_per_rank"] > n["training_bytes_per_rank"] + 250 * 2**30
    )  # shard + draft, one rank
    big = tmp_path / "big.toml"
    big.write_text(
        (ROOT / "examples" / "kimi-k2.5-online.toml")
        .read_text()
        .replace("micro_batch = 2", "micro_batch = 16")
    )
    rc, rep2 = deep(big, hf_cache, "--free-bytes", str(10**12))
    mem = by_name(rep2)["gpu memory"]["detail"]
    assert rc == 1 and "micro_batch 16" in mem
    assert rep2["numbers"]["online_tp_bytes_per_rank"] > n["online_tp_bytes_per_rank"]  # more activations
