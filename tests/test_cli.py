"""`python -m nanolab`: generate and weights on the tiny preset, and how bad input is refused
(non-zero exit, one clear line on stderr, no traceback)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanolab.model.config import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def nanolab(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nanolab", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def assert_refused(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    assert "error:" in result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def test_generate_streams_a_completion() -> None:
    result = nanolab("generate", "hello", "--model", "tiny", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.strip(), "nothing was printed"


def test_generate_chat() -> None:
    result = nanolab("generate", "hello", "--chat", "--model", "tiny", "--max-tokens", "5", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    # The tiny preset's random weights may well produce only whitespace; the run still ends its line.
    assert result.stdout.endswith("\n")


def test_weights_prints_the_folder() -> None:
    result = nanolab("weights", "tiny")
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip().splitlines()[-1])
    assert (folder / "config.json").is_file()


@pytest.mark.parametrize("flag,value,field", [("--max-tokens", "0", "max_tokens"),
                                              ("--temperature", "-1", "temperature")])
def test_generate_refuses_bad_sampling_params(flag: str, value: str, field: str) -> None:
    assert_refused(nanolab("generate", "hello", "--model", "tiny", flag, value), field)


def test_generate_refuses_an_unknown_preset_naming_the_presets() -> None:
    assert_refused(nanolab("generate", "hello", "--model", "no-such-preset"), "no-such-preset", *PRESETS)


def test_weights_refuses_an_unknown_preset_naming_the_presets() -> None:
    assert_refused(nanolab("weights", "no-such-preset"), "no-such-preset", *PRESETS)


def test_generate_refuses_an_empty_prompt() -> None:
    result = nanolab("generate", "", "--model", "tiny")
    assert_refused(result, "prompt is empty")
    assert not result.stdout.strip()
