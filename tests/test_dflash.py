"""The DFlash draft (``[train] draft = "dflash"``): its plan keys, its export as SGLang's DFlash loader reads it,
training blocks that equal decoding blocks, a loss that falls, a lossless offline decode and the accept length.

SGLang's DFlash model cannot be imported without its GPU stack, so the export is checked with SGLang's own
config parser (``parse_dflash_draft_config`` and what it calls, lifted out of the installed
``sglang/srt/speculative/dflash_utils.py`` and run as is) and against the parameters ``sglang/srt/models/dflash.py``
builds, mapped by its ``load_weights`` rule.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.drafts.batch import Batch
from pipeline.drafts.dflash.config import DFlashConfig
from pipeline.drafts.dflash.decode import DFlashDrafter
from pipeline.drafts.dflash.loss import BlockLoss, accept_sums, anchors_of, draft_blocks
from pipeline.drafts.dflash.model import DFlashDraft, load_dflash, save_dflash
from pipeline.eagle3.draft_config import DraftModelError
from pipeline.run.plan.schema import PlanError
from pipeline.run.plan.sections import TrainSection
from tests.eagle3_fixtures import tiny_llama

AUX = [1, 14, 26]


@pytest.fixture(scope="module")
def target():
    from pipeline.eagle3.target_capture import load_target

    return load_target(tiny_llama(), AUX)


def tiny_draft(target: Any, layers: int = 2, block: int = 4, seed: int = 0) -> DFlashDraft:
    from pipeline.eagle3.target_capture import target_config

    cfg = DFlashConfig.from_target(
        target_config(tiny_llama()),
        layers=layers,
        target_layer_ids=AUX,
        block_size=block,
        mask_token_id=49151,
    )
    torch.manual_seed(seed)
    d = DFlashDraft(cfg)
    for p in d.parameters():  # larger than the default init, so a random draft is not near-constant
        if p.requires_grad and p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    d.set_target(target.embed_weight.detach().float(), target.head.weight.detach().float())
    return d


def batch_of(target: Any, rows: list[list[int]], assistant_from: int = 2) -> Batch:
    n = max(map(len, rows))
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    attn = (torch.arange(n)[None] < lengths[:, None]).long()
    with torch.no_grad():
        cap = target.capture(ids, attention_mask=attn)
        am = target.argmax(cap.last_hidden)
    mask = (torch.arange(n)[None] >= assistant_from) & attn.bool()
    return Batch(cap.aux.float(), cap.last_hidden.float(), am.long(), ids, mask, lengths)


# ------------------------------------------------------------------------------ plan keys
def test_plan_keys_default_to_eagle3_and_bad_dflash_settings_name_file_and_key() -> None:
    assert TrainSection.parse({}, "p.toml").draft == "eagle3"
    s = TrainSection.parse({"draft": "dflash", "dflash_block_size": 8}, "p.toml")
    assert s.spec_steps == 7  # a whole block's drafts, what SGLang verifies
    for table, key, words in (
        ({"draft": "medusa"}, "train.draft", "dflash"),
        ({"draft": "dflash", "loss": "lk"}, "train.loss", "EAGLE-3 only"),
        ({"draft": "dflash", "draft_fc_norm": True}, "train.draft_fc_norm", "EAGLE-3.1"),
        ({"draft": "dflash", "dflash_block_size": 4, "eval_spec_steps": 4}, "train.eval_spec_steps", "3"),
        ({"draft": "dflash", "dflash_target_layers": [14, 1]}, "train.dflash_target_layers", "ascending"),
        ({"draft": "dflash", "dflash_block_size": 1}, "train.dflash_block_size", ""),
    ):
        with pytest.raises(PlanError) as exc:
            TrainSection.parse(table, "plan.toml")
        msg = str(exc.value)
        assert "plan.toml" in msg and key in msg and words in msg, msg


def test_target_layers_outside_the_extraction_are_refused_with_the_fix() -> None:
    from pipeline.drafts.dflash.config import feature_columns

    assert feature_columns(AUX, AUX, 8) is None
    assert feature_columns(AUX, [1, 26], 2).tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match=r"dflash_target_layers.*\[2\].*extract.aux_layers"):
        feature_columns(AUX, [1, 2], 8)


# ------------------------------------------------------------------------------ the deep check
def deep_plan(tmp: Path, train: str, bench: str = "") -> Path:
    p = tmp / "plan.toml"
    p.write_text(
        f'[run]\nname = "d"\ndir = "{tmp / "run"}"\n[target]\nmodel = "{tiny_llama()}"\nmax_length = 256\n'
        f'[extract]\naux_layers = {AUX}\n[train]\ndraft = "dflash"\n{train}\n[bench]\n{bench}\n'
        '[[stage]]\nid = "bench"\nrun = "bench"\n'
    )
    return p


@pytest.mark.parametrize(
    ("train", "bench", "ok", "words"),
    [
        ("dflash_block_size = 4", "steps = 3", True, "blocks of 4 (3 drafts per verification"),
        (
            "dflash_target_layers = [1, 2]",
            "",
            False,
            "train.dflash_target_layers: layers [2] are not captured",
        ),
        ("dflash_target_layers = [1, 400]", "", False, "train.dflash_target_layers: layers [400] are past"),
        ("dflash_mask_token_id = 10000000", "", False, "train.dflash_mask_token_id: 10000000 is outside"),
        (
            "dflash_block_size = 4",
            "steps = 5",
            False,
            "bench.steps: 5 but the DFlash draft's blocks of 4 draft 3",
        ),
    ],
)
def test_the_deep_check_asks_the_plans_method_about_its_draft(
    tmp_path: Path, train: str, bench: str, ok: bool, words: str
) -> None:
    """``aerie plan check --deep`` runs DFlash's own check (its settings' ``deep_check``) for a DFlash plan."""
    from pipeline.eagle3 import chain_check
    from pipeline.run.plan import dag as plan_mod

    plan = plan_mod.load(deep_plan(tmp_path, train, bench))
    lines = [c for c in chain_check.check(plan, free_bytes=10**12).checks if c.name == "dflash"]
    assert len(lines) == 1 and lines[0].ok is ok and words in lines[0].detail, lines
    assert ok or lines[0].detail.startswith(f"{plan.path}: ")


# ------------------------------------------------------------------------------ the export SGLang reads
def sglang_source(rel: str) -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        pytest.skip("sglang is not installed (pip install --no-deps -r .ci/sglang-parser-requirements.txt)")
    return (Path(spec.origin).parent / rel).read_text()


def sglang_parser() -> Any:
    """SGLang's ``parse_dflash_draft_config`` and the helpers it calls, taken verbatim from its source."""
    src = sglang_source("srt/speculative/dflash_utils.py")
    wanted = {
        "DEFAULT_DFLASH_MASK_TOKEN",
        "build_target_layer_ids",
        "_cfg_get",
        "_get_text_config",
        "_get_dflash_config",
        "_parse_optional_int",
        "DFlashDraftConfig",
        "parse_dflash_draft_config",
    }
    tree = ast.parse(src)
    body = [
        n
        for n in tree.body
        if (isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in wanted)
        or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in wanted for t in n.targets))
    ]
    assert {getattr(n, "name", None) for n in body} >= wanted - {"DEFAULT_DFLASH_MASK_TOKEN"}
    ns: dict[str, Any] = {}
    exec(
        "from __future__ import annotations\nfrom dataclasses import dataclass\nfrom numbers import Integral\n"
        "from typing import Any, List, Optional, Sequence, Tuple\n",
        ns,
    )
    exec(compile(ast.Module(body=body, type_ignores=[]), "dflash_utils.py", "exec"), ns)
    return ns["parse_dflash_draft_config"]


def sglang_params(conf: dict) -> dict[str, tuple[int, ...]]:
    """The parameters (and shapes) SGLang's DFlashDraftModel builds for ``conf`` at tensor-parallel size 1."""
    h, d = conf["hidden_size"], conf["head_dim"]
    nh, nkv, i = conf["num_attention_heads"], conf["num_key_value_heads"], conf["intermediate_size"]
    out: dict[str, tuple[int, ...]] = {
        "norm.weight": (h,),
        "fc.weight": (h, len(conf["dflash_config"]["target_layer_ids"]) * h),
        "hidden_norm.weight": (h,),
    }
    for n in range(conf["num_hidden_layers"]):
        p = f"layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.qkv_proj.weight": ((nh + 2 * nkv) * d, h),
            p + "self_attn.o_proj.weight": (h, nh * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_up_proj.weight": (2 * i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
    return out


def test_the_export_is_what_sglangs_dflash_loader_reads(target, tmp_path: Path) -> None:
    from safetensors import safe_open

    model_src = sglang_source("srt/models/dflash.py")
    # the rules this test mirrors, as the installed SGLang states them
    for line in (
        '("qkv_proj", "q_proj", "q")',
        '("gate_up_proj", "gate_proj", 0)',
        "self.num_context_features * hidden_size, hidden_size, bias=False",
        "self.block_size = draft_config.resolve_block_size(default=16)",
        "self.hidden_norm = ",
    ):
        assert line in model_src, line
    draft = tiny_draft(target, layers=2, block=4)
    save_dflash(draft, tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"]
    parsed = sglang_parser()(draft_hf_config=conf)
    assert parsed.block_size == 4 and parsed.mask_token_id == 49151 and parsed.num_hidden_layers == 2
    assert parsed.resolve_target_layer_ids(target_num_layers=30, draft_num_layers=2) == AUX
    params = sglang_params(conf)
    stacked = {
        "q_proj": "qkv_proj",
        "k_proj": "qkv_proj",
        "v_proj": "qkv_proj",
        "gate_proj": "gate_up_proj",
        "up_proj": "gate_up_proj",
    }
    filled: dict[str, int] = {}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
            shape = tuple(f.get_slice(name).get_shape())
            mapped = next(
                (name.replace(f".{a}.", f".{b}.") for a, b in stacked.items() if f".{a}." in name), name
            )
            assert mapped in params, name
            if mapped == name:
                assert shape == params[name], (name, shape)
            filled[mapped] = filled.get(mapped, 0) + shape[0]
    assert set(filled) == set(params)  # every parameter but none of the target's (embedding, head)
    assert all(filled[k] == v[0] for k, v in params.items()), filled
    back = load_dflash(tmp_path, draft.embed_tokens.weight, draft.lm_head.weight)
    assert back.cfg == draft.cfg


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: c.update(architectures=["LlamaForCausalLMEagle3"]), "architectures"),
        (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    ],
)
def test_a_bad_dflash_config_names_the_file_and_the_field(target, edit, named: str) -> None:
    conf = tiny_draft(target).cfg.sglang_config()
    edit(conf)
    with pytest.raises(DraftModelError, match=named) as e:
        DFlashConfig.from_sglang_config(conf, where="run/draft/config.json")
    assert str(e.value).startswith("run/draft/config.json: ")


# ------------------------------------------------------------------------------ training = decoding
def test_a_training_block_equals_the_block_drafted_at_decode_time(target) -> None:
    """The training pass (all anchors of a row at once, under its mask) gives each block exactly the hidden
    states the decoder's incremental pass (context K/V cache, then the block) gives: training is what is served."""
    draft = tiny_draft(target, layers=2, block=4).double()
    b = batch_of(target, [list(range(300, 316)), list(range(500, 511))])
    b = Batch(b.aux.double(), b.last_hidden.double(), b.target_argmax, b.input_ids, b.loss_mask, b.lengths)
    anchors, keep = anchors_of(b, 5)
    with torch.no_grad():
        hidden, labels, _ = draft_blocks(draft, draft.cfg, b, anchors, keep, None)
    for r in range(2):
        for n in range(int(keep[r].sum())):
            a = int(anchors[r, n])
            dec = DFlashDrafter(draft)
            dec.start(b.input_ids[r, : a + 1].tolist(), b.aux[r, :a])
            ids = torch.full((1, 4), 49151)
            ids[0, 0] = b.input_ids[r, a]
            with torch.no_grad():
                ref = draft.blocks(ids, torch.arange(a, a + 4)[None], dec.kv)
            assert torch.allclose(hidden[r, n], ref[0], atol=1e-10), (r, a)
            assert labels[r, n, 1:].tolist() == b.input_ids[r, a + 1 : a + 4].tolist() or a + 4 > int(
                b.lengths[r]
            )


def test_a_short_training_run_lowers_the_block_loss(target) -> None:
    """The trainer's parts (the block loss from [train] settings, AdamW with its schedule) on one fixed row."""
    from pipeline.drafts.registry import TrainedDraft
    from pipeline.eagle3.target_capture import target_config
    from pipeline.stages.train.components import Optimiser

    s = TrainSection.parse(
        {
            "draft": "dflash",
            "dflash_block_size": 4,
            "dflash_anchors": 8,
            "lr": 1e-2,
            "steps": 8,
            "warmup_steps": 0,
        },
        "t.toml",
    )
    cfg = DFlashConfig.from_target(
        target_config(tiny_llama()), layers=1, target_layer_ids=AUX, block_size=4, mask_token_id=49151
    )
    torch.manual_seed(1)
    draft = DFlashDraft(cfg)
    draft.set_target(target.embed_weight.detach().float(), target.head.weight.detach().float())
    params = [p for p in draft.parameters() if p.requires_grad]
    assert not any(p is draft.lm_head.weight or p is draft.embed_tokens.weight for p in params)
    td = TrainedDraft(draft=draft, model=draft, head_d=torch.empty(0), params=params)
    loss = BlockLoss.from_settings(s, autocast=False, aux_cols=None)
    row = torch.randint(300, 2000, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    b = batch_of(target, [row])
    counts = loss.counts([b], torch.device("cpu"))
    # 8 of the 14 anchors 1..14 (their next token is an assistant token); a slot past the row's end is not trained
    a, keep = anchors_of(b, 8)
    assert int(keep.sum()) == 8 and set(a[0].tolist()) <= set(range(1, 15))
    assert counts.tolist() == [float(sum(x + k < 16 for x in a[0].tolist())) for k in (1, 2, 3)]
    optim = Optimiser.adamw(params, s)
    seen = []
    for step in range(1, s.steps + 1):
        optim.begin(step)
        losses, _ = loss.sums(td, b)
        total = loss.weighted(losses, counts)
        total.backward()
        optim.finish()
        seen.append(float(total.detach()))
    assert seen[-1] < 0.6 * seen[0], seen


# ------------------------------------------------------------------------------ offline decode
def test_speculative_decoding_with_a_dflash_draft_is_the_targets_greedy_output(target) -> None:
    from pipeline.eagle3.spec_decode import greedy_generate, speculative_generate

    prompt = list(range(400, 408))
    drafter = DFlashDrafter(tiny_draft(target, layers=1, block=4))
    res = speculative_generate(target, drafter, prompt, 3, 8, set())
    assert res.tokens == greedy_generate(target, prompt, 8, set())
    assert res.steps > 0 and 1.0 <= res.accept_len <= 4.0
    with pytest.raises(ValueError, match=r"\[bench\] steps is 4 \(at most 3"):
        drafter.propose(4)


def test_simulated_accept_length_on_a_hand_made_block(target, monkeypatch) -> None:
    """Row tokens t, target greedy g (g[i] is the target's next token after position i): an anchor's accept
    length is 1 + the leading drafts equal to g, stopping where the row itself leaves the greedy path."""
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    greedy = torch.tensor(
        [[11, 12, 77, 14, 15, 16, 17, 18]]
    )  # after position 2 the target says 77, the row 13
    b = Batch(
        torch.zeros(1, 8, 3 * 96),
        torch.zeros(1, 8, 96),
        greedy,
        ids,
        torch.ones(1, 8, dtype=torch.bool),
        torch.tensor([8]),
    )
    draft = tiny_draft(target, layers=1, block=4)

    def guesses(anchors: list[int], drafts: dict[int, list[int]]) -> None:
        def fake_anchors(batch: Batch, count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.tensor([anchors]), torch.ones(1, len(anchors), dtype=torch.bool)

        def fake_logits(hidden: torch.Tensor) -> torch.Tensor:  # (1, N, steps, H) -> one-hot of the drafts
            out = torch.zeros(*hidden.shape[:-1], 100)
            for n, a in enumerate(anchors):
                for k, t in enumerate(drafts[a]):
                    out[0, n, k, t] = 1.0
            return out

        monkeypatch.setattr("pipeline.drafts.dflash.loss.anchors_of", fake_anchors)
        monkeypatch.setattr(draft, "logits", fake_logits)

    # anchor 0 drafts 11 12 77 = greedy: all 3 accepted -> 4. Anchor 1 drafts 12 77 14: 12 and 77 accepted; the
    # row then goes on with 13, not 77, so what the target says after 77 is unknown and the count stops -> 3
    # (though 14 is the target's token after the row's 13). Anchor 4 drafts 0 16 17: the first is wrong -> 1.
    guesses([0, 1, 4], {0: [11, 12, 77], 1: [12, 77, 14], 4: [0, 16, 17]})
    total, n = accept_sums(draft, b, 3, 3, False, None)
    assert (total, n) == (4 + 3 + 1, 3)


# ------------------------------------------------------------------------------ the stages
@pytest.mark.slow
def test_train_and_bench_stages_train_export_and_losslessly_bench_a_dflash_draft(
    tmp_path_factory, tmp_path
) -> None:
    """The train stage with ``draft = "dflash"`` on the shared extraction writes the SGLang DFlash export and
    a manifest the bench stage reads; the bench verifies drafted blocks and proves the output is greedy."""
    from tests.eagle3_fixtures import TEST_SECTIONS, metrics, run_stage, shared, write_plan

    train = dict(TEST_SECTIONS["train"], draft="dflash", dflash_block_size=4, dflash_anchors=16, steps=12)
    train.pop("ttt_steps")
    plan = write_plan(
        tmp_path / "plan.toml",
        **{**TEST_SECTIONS, "train": train, "bench": {**TEST_SECTIONS["bench"], "check_lossless": True}},
    )
    out = tmp_path / "train"
    run_stage(
        "pipeline.stages.train", plan, out, [shared(tmp_path_factory, "ext"), shared(tmp_path_factory, "voc")]
    )
    man = json.loads((out / "manifest.json").read_text())
    assert man["draft"] == "dflash" and man["block_size"] == 4 and man["loss"] == "dflash"
    conf = json.loads((out / "draft" / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["dflash_config"]["target_layer_ids"] == AUX
    loss = [e.get("value") for e in metrics(out, "loss")]
    assert len(loss) == 12 and loss[-1] < loss[0]
    assert [e.get("name") for e in metrics(out, "acc_2")]  # slot 3's accuracy
    bench = tmp_path / "bench"
    run_stage("pipeline.stages.bench", plan, bench, [out])
    res = json.loads((bench / "results.json").read_text())
    assert res["draft_kind"] == "dflash" and res["lossless_checked"] and res["lossless_mismatches"] == 0
    assert 1.0 <= res["accept_len"] <= 4.0 and res["verify_steps"] > 0
