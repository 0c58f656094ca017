"""Shared fixtures: the bundled real target, opened once per session."""

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


def cli_exe() -> str:
    """The installed console script."""
    return str(Path(sys.executable).with_name("blockspec"))


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a user runs it."""
    return subprocess.run([cli_exe(), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
