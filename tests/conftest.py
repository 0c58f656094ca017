"""Shared fixtures: the bundled real target (opened once per session), the shipped SpecBlock drafter,
and one torch thread for modules that run torch beside llama.cpp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from blockspec.runtime.format.modelfile import bundled_model_path

    return bundled_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from blockspec.runtime.llama.target import Target, TargetConfig

    with Target(smollm2_path, TargetConfig(n_ctx=2048)) as t:
        yield t


@pytest.fixture(scope="session")
def shipped_specblock() -> str:
    from blockspec.runtime.engine.setup import shipped_drafter

    path = shipped_drafter("specblock")
    if path is None:
        pytest.skip("no shipped SpecBlock drafter")
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """llama.cpp and torch take turns on 2 busy cores: one torch thread avoids spinning barriers.
    A module asks for it with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    torch = pytest.importorskip("torch")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cli_exe() -> str:
    """The installed console script."""
    return str(Path(sys.executable).with_name("blockspec"))


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    return subprocess.run([cli_exe(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
