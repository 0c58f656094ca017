"""Bad input: one line naming the problem, exit code 1, no traceback."""

from __future__ import annotations

import pytest

from conftest import run_cli


def _one_line_error(r, *needles):
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("blockspec: error:")
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_model(tmp_path):
    _one_line_error(run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf")), "not found", "nope.gguf")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_text("this is not a model\n" * 10)
    _one_line_error(run_cli("generate", "hi", "--model", str(bad)), "not a GGUF", "model.gguf")


@pytest.mark.parametrize("keep", [0.5, 0.0005])  # cut in the tensor data, cut in the header
def test_truncated_gguf(tmp_path, smollm2_path, keep):
    data = smollm2_path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    _one_line_error(run_cli("generate", "hi", "--model", str(cut)), "GGUF", "cut.gguf")


def test_prompt_longer_than_context():
    _one_line_error(run_cli("generate", "word " * 600, "--raw", "--n-ctx", "256"), "prompt is", "256")


def test_unknown_fetch_name():
    r = run_cli("models", "fetch", "llama-70b")
    assert r.returncode == 2 and "Invalid value" in r.stderr


def test_ctrl_c_mid_generation_keeps_the_text():
    import os
    import signal
    import subprocess
    import time

    from conftest import cli_exe

    # a shell running the suite in the background hands its children SIGINT ignored; give the CLI
    # the default disposition, as an interactive terminal would
    p = subprocess.Popen([cli_exe(), "generate", "Write a long story about a dragon.", "--max-tokens", "4000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "BLOCKSPEC_THREADS": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(40)  # blocks until generation is under way
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=60)
    out, err = (first + rest).decode(), err.decode()
    assert p.returncode == 130, err
    assert len(out) > 40 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "blockspec: interrupted"
    assert "finish: interrupted" in err
