"""Shared test setup: no hub access, a private AERIE_HOME, and helpers to run real plans.

The model cache ($AERIE_CACHE, default ~/.cache/aerie) is shared on purpose: the bundled demo model
is converted once per machine, not once per test.
"""

from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _aerie_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AERIE_HOME", str(tmp_path_factory.mktemp("aerie-home")))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run tests marked slow (model loads, the whole demo); CI does")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow (the README's test command and CI do)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
