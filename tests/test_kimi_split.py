"""Kimi-K2.5's text is cut with Kimi's own split pattern (pipeline/data/split_pattern.py), read from the
checkpoint's ``tokenization_kimi.py`` with ``ast``, never executed.

The ranks: the committed fixture's, plus byte-pair merges learnt over the test corpus *without* any pre-split,
so the vocabulary has tokens across the places where Kimi's pattern and transformers' generic one cut
differently (a space before Han, letters before Han, CamelCase, ...). On such a vocabulary the ids depend on
the pattern, so the test can fail: they must equal ``tiktoken.Encoding`` built with Kimi's pattern, and the
generic pattern must give other ids on the same corpus."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.data import split_pattern
from pipeline.data.tokenise import load_hf_tokenizer
from tests.kimi_fixture import KIMI_PAT_STR, build_tiktoken_kimi, tiktoken_ranks, write_tiktoken_fixture

tiktoken = pytest.importorskip("tiktoken")

CORPUS = [
    "def parse_config(path: str) -> dict:\n    with open(path) as fh:\n        return json.load(fh)  # 42\n",
    "使用PyTorch训练模型，然后用SGLang部署。 中文和English混合 测试",
    "The user's answer isn't what we'd expect; they'll say it's CamelCaseWords and getHTTPResponse.",
    "Numbers: 1234567890, 3.14159, 1e-9, 2026-12-05 and 0xDEADBEEF.",
    "a    b\n\n\n   c\t\t d      \n  end   ",
    "Emoji 🚀🔥 ok 👍🏽 done",
    "日本語のテキスト、한국어 텍스트, Ελληνικά and Русский.",
]


def merged_ranks(n: int = 600) -> dict[bytes, int]:
    """The fixture's ranks, then ``n`` merges of the most frequent adjacent pair over the raw corpus."""
    ranks = dict(tiktoken_ranks())
    seqs = [[bytes([b]) for b in text.encode()] for text in CORPUS]
    for _ in range(n):
        pairs: dict[tuple[bytes, bytes], int] = {}
        for s in seqs:
            for a, b in zip(s, s[1:], strict=False):
                if a + b not in ranks:
                    pairs[(a, b)] = pairs.get((a, b), 0) + 1
        if not pairs:
            break
        best = max(sorted(pairs), key=lambda p: pairs[p])
        ranks[best[0] + best[1]] = len(ranks)
        out = []
        for s in seqs:
            m, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    m.append(s[i] + s[i + 1])
                    i += 2
                else:
                    m.append(s[i])
                    i += 1
            out.append(m)
        seqs = out
    return ranks


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[bytes, int]]:
    ranks = merged_ranks()
    folder = build_tiktoken_kimi(tmp_path_factory.mktemp("kimi") / "kimi")
    write_tiktoken_fixture(folder, ranks)  # these ranks, Kimi's special tokens after them
    return folder, ranks


def encoding(ranks: dict[bytes, int], pat: str) -> object:
    return tiktoken.Encoding(name="t", pat_str=pat, mergeable_ranks=ranks, special_tokens={})


def test_kimi_text_gets_the_ids_of_kimis_own_pattern_never_running_its_code(kimi) -> None:
    folder, ranks = kimi
    tok = load_hf_tokenizer(str(folder))
    pat = tok.aerie_split_pattern
    assert (
        pat.own
        and pat.regex == KIMI_PAT_STR
        and pat.source == "tokenization_kimi.py: TikTokenTokenizer.pat_str"
    )
    ours, theirs = encoding(ranks, KIMI_PAT_STR), encoding(ranks, split_pattern.GENERIC)
    differ = []
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ours.encode_ordinary(text), text
        assert tok.decode(ids) == text
        differ.append(ids != theirs.encode_ordinary(text))
    # Where the patterns differ by design (Han next to other letters and spaces; contractions, CamelCase), the
    # generic pattern gives other ids on this vocabulary: the assertion above can fail.
    assert differ[1] and differ[2], differ
    assert not (folder / "CODE_RAN").exists(), "tokenization_kimi.py was executed"


def test_transformers_alone_splits_with_its_generic_pattern(kimi) -> None:
    """Why the module exists: the converted tokenizer, untouched, cuts Kimi's text into other ids."""
    from transformers import AutoTokenizer

    folder, ranks = kimi
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    generic = encoding(ranks, split_pattern.GENERIC)
    assert all(tok.encode(t, add_special_tokens=False) == generic.encode_ordinary(t) for t in CORPUS)


def test_a_pattern_in_tokenizer_config_wins_and_none_readable_warns_loudly(
    kimi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder, _ = kimi
    copy = tmp_path / "k"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**cfg, "pat_str": r"\S+|\s+"}))
    assert split_pattern.read(copy) == split_pattern.Pattern(
        r"\S+|\s+", "tokenizer_config.json: pat_str", True
    )
    # The class builds its pattern at run time: not a literal, so it is not evaluated.
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    (copy / "tokenization_kimi.py").write_text("class TikTokenTokenizer:\n    pat_str = make_pattern()\n")
    tok = load_hf_tokenizer(str(copy))
    pat = tok.aerie_split_pattern
    assert not pat.own and pat.regex == split_pattern.GENERIC
    assert (
        pat.source
        == "transformers' generic pattern: tokenization_kimi.py has no pat_str built from string literals"
    )
    err = capsys.readouterr().err
    assert "WARNING" in err and str(copy) in err and "other ids" in err


def test_a_folder_with_a_tokenizer_json_is_left_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_text("")
    (tmp_path / "tokenizer.json").write_text("{}")
    assert split_pattern.read(tmp_path) is None
