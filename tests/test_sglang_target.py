"""Capture through SGLang (``[target] engine = "sglang"``) without a GPU: the plan key, the layers SGLang is told
to capture, SGLang's packed output laid out as the transformers capture's store, and the runner's construction
against the installed SGLang's own classes. The capture itself is ``test_sglang_capture_equals_transformers``
(GPU) and ``bench/gpu/sglang_capture.py`` on the lent H200."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.eagle3 import hidden_store as hs
from pipeline.eagle3 import sglang_packing as sp
from pipeline.eagle3 import sglang_target as st
from pipeline.eagle3 import shard_sink as ss
from pipeline.eagle3.target_capture import TargetError
from pipeline.run.plan import dag as plan_mod
from pipeline.run.plan.dag import PlanError
from pipeline.serving.sglang_capture import config_layer_ids
from tests.test_sglang_capture import _capture

PLAN = """
[run]
name = "t"
dir = "run"
[resources]
gpus = [0, 1]
[target]
model = "/models/t"
{target}
[extract]
{extract}
[train]
{train}
"""


def plan(tmp_path: Path, target: str = "", extract: str = "", train: str = "") -> plan_mod.Plan:
    p = tmp_path / "p.toml"
    p.write_text(PLAN.format(target=target, extract=extract, train=train))
    return plan_mod.load(p)


def test_engine_defaults_to_transformers_and_accepts_sglang(tmp_path: Path) -> None:
    assert plan(tmp_path).target.engine == "transformers"
    p = plan(tmp_path, 'engine = "sglang"', 'parallel = "tp"\ntp_size = 2')
    assert p.target.engine == "sglang" and p.settings.extract.tp_size == 2
    # online training on one GPU: SGLang's runner inside the train process
    p = plan(tmp_path, 'engine = "sglang"', 'mode = "online"')
    assert p.settings.storage_mode == "online" and not p.settings.train.online_tp


@pytest.mark.parametrize(
    "target, extract, train, key, words",
    [
        ('engine = "vllm"', "", "", "target.engine", "vllm"),
        ('engine = "sglang"', 'device = "cpu"', "", "extract.device", "needs a GPU"),
        ('engine = "sglang"', 'device = "auto"', "", "extract.device", 'parallel = "tp"'),
        (
            'engine = "sglang"',
            "",
            'target = "online-tp"\nnproc = 2',
            "train.target",
            "SGLang's tensor-parallel ranks",
        ),
        ('engine = "sglang"', 'mode = "online"', "nproc = 2", "train.nproc", "in the one train process"),
        ('engine = "sglang"', 'mode = "online"', 'device = "cpu"', "train.device", "needs a GPU"),
    ],
)
def test_engine_combinations_that_cannot_work_are_refused_naming_file_and_key(
    tmp_path: Path, target: str, extract: str, train: str, key: str, words: str
) -> None:
    with pytest.raises(PlanError) as err:
        plan(tmp_path, target, extract, train)
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path / 'p.toml'}: {key}:") and words in msg, msg


@pytest.mark.parametrize(
    "file, cls, arch",
    [
        ("llama.py", "LlamaForCausalLM", "LlamaForCausalLM"),
        ("deepseek_v2.py", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        ("kimi_k25.py", "KimiK25ForConditionalGeneration", "KimiK25ForConditionalGeneration"),
    ],
)
def test_the_runner_is_told_the_ids_that_make_it_capture_the_plans_aux_layers(
    file: str, cls: str, arch: str
) -> None:
    """What the extract stage passes to ``set_eagle3_layers_to_capture``, run through SGLang's own method (from
    the installed source): it hooks the inputs of ``aux + 1``, which the runner's check accepts."""
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip(
            "sglang is not installed here (pip install --no-deps -r .ci/sglang-parser-requirements.txt)"
        )
    models = Path(next(iter(spec.submodule_search_locations or []))) / "srt" / "models"
    for aux in ([1, 29, 57], [2, 30, 58], [5, 20, 40]):
        ids = config_layer_ids(aux, arch)
        hooked = _capture(models, file, cls, ids)
        st.check_hooked(hooked, aux, ids)  # the outputs of the aux layers, as the transformers hooks record
        with pytest.raises(TargetError, match="hooks the inputs of layers"):
            st.check_hooked(hooked, [a + 1 for a in aux], ids)  # one off: refused, never stored silently


def test_online_training_leaves_the_gpu_to_the_draft_beyond_the_targets_weights() -> None:
    gib = 1 << 30
    h200 = 140 * gib
    assert st.online_mem_fraction(16 * gib, h200) == pytest.approx(16 / 140 + st.ONLINE_HEADROOM, abs=1e-3)
    assert st.online_mem_fraction(270 << 20, h200) < 0.11  # the demo target: ~90 % left to training
    assert st.online_mem_fraction(200 * gib, h200) == st.ONLINE_MAX_FRACTION  # too big: never above extract's
    assert st.online_mem_fraction(gib, 0) == st.ONLINE_MAX_FRACTION


def test_the_checkpoints_size_counts_safetensors_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "model-1.safetensors").write_bytes(b"x" * 300)
    (tmp_path / "model-2.safetensors").write_bytes(b"x" * 200)
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 10_000)
    assert st.checkpoint_bytes(str(tmp_path)) == 500
    assert st.checkpoint_bytes("org/hub-id") == 0  # not a folder: the default fraction's headroom only


def test_the_train_stage_refuses_an_sglang_target_without_a_gpu() -> None:
    with pytest.raises(ValueError, match=r"p.toml: target.engine = \"sglang\" needs a GPU.*cpu"):
        st.load_for_training("/models/t", [1, 2, 3], torch.device("cpu"), 64, 2, where="p.toml")


H, K = 8, 3


def _rows(lengths: list[int], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "aux": [torch.randn(n, H, generator=g) for _ in range(K)],
            "last": torch.randn(n, H, generator=g),
            "tok": torch.randint(0, 100, (n,), generator=g),
            "ids": np.arange(n, dtype=np.int32) + 7,
        }
        for n in lengths
    ]


def _transformers_batch(rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``target_capture`` returns: padded (B, S, K*H), (B, S, H), (B, S), garbage where padded."""
    s = max(len(r["last"]) for r in rows)
    aux = torch.full((len(rows), s, K * H), 9.0)
    last = torch.full((len(rows), s, H), -9.0)
    tok = torch.full((len(rows), s), 5, dtype=torch.int64)
    for i, r in enumerate(rows):
        n = len(r["last"])
        aux[i, :n] = torch.cat(r["aux"], -1)
        last[i, :n] = r["last"]
        tok[i, :n] = r["tok"]
    return aux, last, tok


def _sglang_batch(rows: list[dict]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """What SGLang's forward hands the logits processor: rows packed, the aux states a list of K [T, H]."""
    aux = [torch.cat([r["aux"][k] for r in rows]) for k in range(K)]
    return aux, torch.cat([r["last"] for r in rows]), torch.cat([r["tok"] for r in rows])


def _store(out: Path, rows: list[dict], aux: torch.Tensor, last: torch.Tensor, tok: torch.Tensor) -> bytes:
    lengths = [len(r["last"]) for r in rows]
    out.mkdir()
    with ss.ShardSink(out, K * H, H, queue_batches=0) as sink:
        sink.begin(0, hs.shard_name(0), [f"r{i}" for i in range(len(rows))], lengths)
        loss = np.concatenate([np.ones(n, dtype=bool) for n in lengths])
        sink.put(
            ss.HostStager("cpu").stage(
                aux, last, tok, lengths, np.concatenate([r["ids"] for r in rows]), loss
            )
        )
        sink.end()
    return (out / hs.shard_name(0)).read_bytes()


def test_sglangs_packed_output_writes_the_same_store_as_the_transformers_capture(tmp_path: Path) -> None:
    rows = _rows([5, 3, 7, 2])
    ids = torch.zeros(4, 7, dtype=torch.long)
    mask = torch.zeros(4, 7, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["ids"])] = torch.from_numpy(r["ids"].astype("int64"))
        mask[i, : len(r["ids"])] = 1
    packed_rows = sp.row_tokens(ids, mask)
    assert [len(r) for r in packed_rows] == [5, 3, 7, 2] and packed_rows[1] == [7, 8, 9]
    aux_list, last, tok = _sglang_batch(rows)
    a, b, c = sp.to_padded(sp.concat_aux(aux_list, K), last, tok, [5, 3, 7, 2], 7)
    ref = _transformers_batch(rows)
    mine = _store(tmp_path / "sglang", rows, a, b, c)
    assert mine == _store(tmp_path / "transformers", rows, *ref)  # byte for byte
    # The layer order is kept: aux layer k of row 2 is columns k*H:(k+1)*H of its padded row.
    torch.testing.assert_close(a[2, :7, H : 2 * H], rows[2]["aux"][1])


def test_sglang_output_that_does_not_match_the_batch_is_refused() -> None:
    rows = _rows([4, 2])
    aux_list, last, tok = _sglang_batch(rows)
    with pytest.raises(sp.PackingError, match="captured 2 aux hidden states, the plan asks for 3"):
        sp.concat_aux(aux_list[:2], K)
    with pytest.raises(sp.PackingError, match="has 5 token rows, the batch's 2 rows hold 6"):
        sp.to_padded(torch.cat(aux_list, -1)[:5], last, tok, [4, 2], 4)
    with pytest.raises(sp.PackingError, match="padding must be on the right"):
        sp.row_tokens(torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 1, 1]]))


def _installed_sglang() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(
            "sglang is not installed here (pip install --no-deps -r .ci/sglang-parser-requirements.txt)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def test_the_runner_kwargs_fill_the_installed_model_runners_signature() -> None:
    """``ModelRunner`` cannot be imported without a GPU stack: its ``__init__`` signature is read from source."""
    src = (_installed_sglang() / "srt" / "model_executor" / "model_runner.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef) and n.name == "ModelRunner")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    names = [a.arg for a in init.args.args[1:]]
    required = names[: len(names) - len(init.args.defaults)]
    spec = st.RunnerSpec(model="/m", tp_size=8, tp_rank=3, gpu_id=3, port=1234)
    sa = SimpleNamespace(ep_size=1)
    kw = st.runner_kwargs(spec, sa, "CFG", names, required)
    assert set(required) <= kw.keys() <= set(names)
    assert kw["server_args"] is sa and kw["model_config"] == "CFG" and kw["gpu_id"] == 3
    if "tp_rank" in names:  # 0.5.14 (the lent H200's); 0.5.23 reads the rank elsewhere
        assert (kw["tp_rank"], kw["tp_size"], kw["moe_ep_rank"], kw["moe_ep_size"]) == (3, 8, 3, 1)
    with pytest.raises(TargetError, match="needs load_plan, which Aerie does not know how to fill"):
        st.runner_kwargs(spec, sa, "CFG", [*names, "load_plan"], [*required, "load_plan"])


@pytest.mark.slow  # importing sglang.srt.server_args takes ~5 s (as in test_sglang_args' parser tests)
def test_the_installed_sglangs_server_args_accepts_the_capture_runners_settings() -> None:
    _installed_sglang()
    from sglang.srt.server_args import ServerArgs

    spec = st.RunnerSpec(model="/models/t", tp_size=2, context_length=1025, batch_tokens=4096)
    kw = st.server_args_kwargs(spec)
    assert set(kw) <= st.server_args_fields(ServerArgs), set(kw) - st.server_args_fields(ServerArgs)
    a = ServerArgs(**kw)
    assert (a.model_path, a.tp_size, a.context_length, a.max_running_requests) == ("/models/t", 2, 1025, 2048)
    assert a.max_total_tokens == 2 * 4096 + 1025  # the KV pool holds one batch, not a server's worth
    assert a.disable_cuda_graph and a.enable_return_hidden_states and a.chunked_prefill_size == -1


@pytest.mark.gpu
@pytest.mark.slow
def test_sglang_capture_equals_transformers_on_a_tiny_llama(tmp_path: Path) -> None:
    """On a GPU with SGLang importable: the same rows through both engines, within bf16 kernel differences.
    On the lent H200: ``python -m bench.gpu.sglang_capture --online --pytest`` runs it with SGLang's site folder first
    on ``PYTHONPATH``, as the sglang stages run (docs/performance.md)."""
    pytest.importorskip("sglang.srt.model_executor.model_runner", reason="SGLang's runtime is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.eagle3.target_capture import load_target

    cfg = LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512,
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    aux = [1, 2, 3]
    ids = torch.randint(0, 1024, (3, 40))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    ref = load_target(str(tmp_path / "m"), aux, dtype=torch.bfloat16, device="cuda")
    a = ref.capture(ids.cuda(), mask.cuda())
    sg = st.load_sglang_target(
        st.RunnerSpec(
            model=str(tmp_path / "m"), context_length=64, batch_tokens=256, mem_fraction_static=0.3
        ),
        aux,
        config_layer_ids(aux, "LlamaForCausalLM"),
        1024,
    )
    b = sg.capture(ids.cuda(), mask.cuda())
    valid = mask.bool().cuda()
    for x, y in ((a.aux, b.aux), (a.last_hidden, b.last_hidden)):
        cos = torch.nn.functional.cosine_similarity(x[valid].float(), y[valid].float(), dim=-1)
        assert cos.min() > 0.99, cos.min()
    same = (ref.argmax(a.last_hidden) == sg.argmax(b.last_hidden))[valid].float().mean()
    # Random weights: the top two of 1024 logits are often within bf16 kernel noise (bench/gpu/sglang_capture_online.py
    # reports, never gates, this agreement); a wrong head or misplaced row agrees at ~1/1024, not 0.8.
    assert same > 0.8, same


def test_the_online_check_judges_training_not_one_low_loss_step() -> None:
    """``gpu_sglang_capture --online``'s verdict: a curve within bf16 noise passes even where one step's loss is
    tiny and its relative gap large (the H200 run's losses), a wrong first step or a drifting curve fails."""
    from bench.gpu.sglang_capture_online import compare_curves

    base = [3.61, 0.55, 1.12, 1.28, 5.71, 0.50, 1.74, 5.88, 3.11, 2.72] * 3
    a = [x * (1 - 0.02 * i) for i, x in enumerate(base)]  # one step's rows swing it; the trend falls
    b = list(a)
    b[28] = a[28] * 1.25  # one step of loss ~0.3, 25 % off: noise on a small number
    b[29] = a[29] * 0.75
    assert compare_curves(a, a)["pass"] and compare_curves(a, b)["pass"]
    wrong_start = [
        a[0] * 1.2,
        *a[1:],
    ]  # identical drafts must start equal: only the capture differs at step 1
    assert not compare_curves(a, wrong_start)["pass"]
    drift = [x * 1.05 for x in a]  # every step 5 % higher: the captures feed the draft something else
    assert not compare_curves(a, drift)["pass"]
