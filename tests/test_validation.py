"""Bad input is refused up front with an error that names the field, and loses nothing: SamplingParams
edge cases, chat messages, `LLM`'s constructor arguments and prompts, all-or-nothing batches, an
interrupted `generate`, and a request that fails while running."""

import argparse
import dataclasses
import re
from functools import cache

import pytest
import torch

from nanolab import LLM, EngineConfig, SamplingParams
from nanolab.engine.llm_engine import RequestLimits
from nanolab.model.tokenizer import CHATML_TEMPLATE, SPECIAL_TOKENS, Tokenizer, build_byte_tokenizer, validate_messages
from nanolab.sampling import MIN_TEMPERATURE, sample

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [72, 101, 108, 108, 111]}, {"prompt_token_ids": [7, 300, 12, 5, 99, 41, 3]},
           {"prompt_token_ids": [250, 251]}]


# SamplingParams: what would fail later in the sampler or the generator fails here.

REFUSED = [
    ("temperature", True), ("temperature", 1e-3), ("temperature", MIN_TEMPERATURE / 2), ("temperature", 1e-40),
    ("temperature", 5e-324),
    ("top_p", True), ("top_k", False), ("max_tokens", True),
    ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 10**30),
    ("stop", 0), ("stop", {"a"}), ("stop", ("a", "")), ("stop", b"ab"),
    ("ignore_eos", 1), ("ignore_eos", 0), ("ignore_eos", "yes"), ("ignore_eos", None),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v!r}" for f, v in REFUSED])
def test_sampling_params_refuse_naming_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_a_tiny_temperature_points_to_greedy() -> None:
    with pytest.raises(ValueError, match="use 0 for greedy"):
        SamplingParams(temperature=1e-3)


def test_the_seed_range_is_torch_generators() -> None:
    # The edges SamplingParams accepts are exactly the ones manual_seed accepts.
    for seed in (2**64 - 1, -(2**63)):
        torch.Generator().manual_seed(SamplingParams(seed=seed).seed)
    for seed in (2**64, -(2**63) - 1):
        with pytest.raises((ValueError, RuntimeError, OverflowError)):
            torch.Generator().manual_seed(seed)
        with pytest.raises(ValueError, match=r"^SamplingParams\.seed="):
            SamplingParams(seed=seed)


def test_the_smallest_temperature_samples_finite_tokens() -> None:
    # fp32 logits as large as a model produces, at the smallest temperature accepted.
    logits = torch.randn((8, 1000), generator=torch.Generator().manual_seed(0)) * 50
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    tokens = sample(logits, [SamplingParams(temperature=MIN_TEMPERATURE)] * 8, gens)
    assert all(0 <= t < 1000 for t in tokens)
    # Far below the floor the division overflows and the draw fails: what the floor guards against.
    with pytest.raises(RuntimeError):
        torch.multinomial((logits[0] / 1e-40).softmax(-1), 1)


@pytest.mark.parametrize("kwargs", [{"temperature": MIN_TEMPERATURE}, {"stop": ("a", "bc")}, {"ignore_eos": True},
                                    {"seed": 2**64 - 1}, {"top_p": 1e-9}])
def test_edge_values_that_work_are_accepted(kwargs) -> None:
    SamplingParams(**kwargs)


# Chat messages.

GOOD_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": ""}]
BAD_MESSAGES = [
    ("not a list", "hello", r"^messages: must be a non-empty list"),
    ("empty", [], r"^messages: must be a non-empty list"),
    ("a string message", [GOOD_MESSAGES[0], "hi"], r"^messages\[1\]: must be a dict with 'role' and 'content'"),
    ("no role", [{"content": "x"}], r"^messages\[0\]\.role: missing"),
    ("no content", [GOOD_MESSAGES[0], {"role": "user"}], r"^messages\[1\]\.content: missing"),
    ("unknown role", [{"role": "bot", "content": "x"}], r"^messages\[0\]\.role: must be one of"),
    ("role not a str", [{"role": 1, "content": "x"}], r"^messages\[0\]\.role: must be one of"),
    ("content None", [{"role": "user", "content": None}], r"^messages\[0\]\.content: must be a str"),
    ("content a list of strs", [{"role": "user", "content": ["x"]}], r"^messages\[0\]\.content\[0\]: must be a"),
    ("content an image part", [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "image_url", "image_url": {"url": "x"}}]}],
     r"^messages\[0\]\.content\[1\]\.type: 'image_url' is not supported"),
    ("a text part without text", [{"role": "user", "content": [{"type": "text"}]}],
     r"^messages\[0\]\.content\[0\]\.text: must be a str"),
    ("name not a str", [{"role": "user", "content": "x", "name": 3}], r"^messages\[0\]\.name: must be a str"),
    ("a lone surrogate", [{"role": "user", "content": "a\ud800"}], r"^messages\[0\]\.content: not valid Unicode"),
    ("a lone surrogate in a part", [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
     r"^messages\[0\]\.content\[0\]\.text: not valid Unicode"),
    ("extra key", [*GOOD_MESSAGES, {"role": "user", "content": "x", "tool_calls": []}],
     r"^messages\[3\]\.tool_calls: not supported"),
]


@cache
def chatml_tokenizer() -> Tokenizer:
    return Tokenizer(build_byte_tokenizer(512), CHATML_TEMPLATE, SPECIAL_TOKENS[1], SPECIAL_TOKENS[2])


def test_good_messages_pass() -> None:
    validate_messages(GOOD_MESSAGES)


def test_text_parts_and_a_name_render_as_their_text() -> None:
    """Content as a list of text parts is the parts joined with newlines (vLLM's rule); a `name` is
    accepted and left to the template (ChatML's ignores it)."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}],
              "name": "bob"}]
    tok = chatml_tokenizer()
    assert tok.encode_chat(parts) == tok.encode_chat([{"role": "user", "content": "Hi\nthere"}])
    assert parts[0]["content"][0] == {"type": "text", "text": "Hi"}, "the caller's messages were changed"


@pytest.mark.parametrize("messages,match", [b[1:] for b in BAD_MESSAGES], ids=[b[0] for b in BAD_MESSAGES])
def test_bad_messages_name_the_message_and_field(messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)
    with pytest.raises(ValueError, match=match):
        chatml_tokenizer().encode_chat(messages)


def test_a_template_that_refuses_is_a_value_error() -> None:
    tok = Tokenizer(build_byte_tokenizer(512), "{{ raise_exception('no system role here') }}", None, None)
    with pytest.raises(ValueError, match="no system role here"):
        tok.apply_chat_template(GOOD_MESSAGES)


# EngineConfig: every field is checked when the config is made, before any weights are read, and
# LLM(**fields), `serve` and the benches all go through it.

BAD_FIELDS = {
    "model": [3, None, "no-such-preset", "/no/such/folder"],
    "device": ["gpu", "meta", 0, "cuda:x", "cpu:1"],
    "dtype": ["fp8", None, torch.int8],
    "block_size": [0, True, 16.0],
    "max_num_seqs": [0, False],
    "max_model_len": [1, True],
    "num_blocks": [0, -3, True],
    "kv_cache_bytes": [0, 1.5],
    "enforce_eager": [1, "no"],
    "cudagraph_mode": ["piecewise", None, "FULL"],
    "max_cudagraph_capture_size": [0, 8.0, True],
    "read": ["fast", None],
    "compile": [1, "yes"],
    "async_scheduling": [0, "on"],
    "enable_chunked_prefill": [1, None],
    "enable_prefix_caching": [1, None],
    "quantization": ["int4", "FP8", 8, ""],
    "speculative_config": [{"num_speculative_tokens": 0}, {"k": 1}, {1: 2, "a": 3}, "ngram", 4],
    "max_num_batched_tokens": [0, 2048.0],
    "tensor_parallel_size": [0, True],
    "distributed_timeout_s": [0, -1.0, "10", True, float("inf"), float("nan")],
    "unverified_nccl": [1, None],
}
BAD_ARGS = [(field, value) for field, values in BAD_FIELDS.items() for value in values]


def test_every_field_of_the_config_has_bad_values_here() -> None:
    assert set(BAD_FIELDS) == {f.name for f in dataclasses.fields(EngineConfig)}


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if LLM gets as far as finding the weights."""
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were looked up before the arguments were checked")

    monkeypatch.setattr("nanolab.llm.resolve_weights", refuse)


@pytest.mark.parametrize("field,value", BAD_ARGS, ids=[f"{f}={v!r}" for f, v in BAD_ARGS])
def test_llm_refuses_bad_fields_before_loading(no_weights, field: str, value) -> None:
    with pytest.raises(ValueError, match=rf"^{field}="):
        EngineConfig(**{field: value})
    if field != "model":
        with pytest.raises(ValueError, match=rf"^{field}="):
            LLM("smollm2-135m", **{field: value})
    else:
        with pytest.raises(ValueError, match=r"^model="):
            LLM(value)


def test_an_unknown_field_is_refused_by_name(no_weights) -> None:
    with pytest.raises(TypeError, match="compile_varlen"):
        LLM("smollm2-135m", compile_varlen=True)


def test_the_command_line_has_a_flag_for_every_field() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", "tiny", "--device", "cpu", "--num-blocks", "8", "--no-compile",
                              "--no-enable-chunked-prefill", "--distributed-timeout-s", "5"])
    config = EngineConfig.from_cli_args(args)
    assert config == EngineConfig(model="tiny", device="cpu", num_blocks=8, compile=False,
                                  enable_chunked_prefill=False, distributed_timeout_s=5.0)
    assert EngineConfig.from_cli_args(parser.parse_args([])) == EngineConfig()
    with pytest.raises(ValueError, match=r"^num_blocks=0"):
        EngineConfig.from_cli_args(parser.parse_args(["--num-blocks", "0"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_cuda_names_the_device(no_weights, device) -> None:
    with pytest.raises(ValueError, match=r"^device='cuda(:0)?': CUDA is not available on this machine"):
        LLM("smollm2-135m", device=device)


def test_a_cuda_device_other_than_the_current_one_is_refused_by_name(no_weights, monkeypatch) -> None:
    """A second GPU is refused, before any weight is read, unless it is the current device: Triton's
    kernels and the graphs would run on the current one. (A machine of two GPUs, faked.)"""
    from nanolab.config import check_current_cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=r"^device='cuda:1': the engine runs its Triton kernels and CUDA graphs on "
                                         r"the current CUDA device, cuda:0; make cuda:1 current first"):
        LLM("smollm2-135m", device="cuda:1")
    check_current_cuda(torch.device("cuda:0"))
    check_current_cuda(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    check_current_cuda(torch.device("cuda:1"))
    with pytest.raises(ValueError, match=r"^device='cuda:0'"):
        check_current_cuda(torch.device("cuda:0"))


def test_a_kv_budget_smaller_than_a_block_is_refused(tiny_path) -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_bytes=100: holds no block"):
        LLM("tiny", device="cpu", kv_cache_bytes=100)


def test_sizes_the_model_or_the_machine_cannot_hold_are_refused_by_name(tiny_path) -> None:
    """A context past the model's, and a pool or a batch of rows past the device's memory, are
    refused when the engine is built, before anything that size is allocated."""
    with pytest.raises(ValueError, match=r"^max_model_len=1000000: the model's context is \d+ tokens"):
        LLM("tiny", device="cpu", max_model_len=10**6)
    with pytest.raises(ValueError, match=r"^num_blocks=1000000000000: a pool of .* more than the device's"):
        LLM("tiny", device="cpu", num_blocks=10**12)
    with pytest.raises(ValueError, match=r"^kv_cache_bytes=\d+: a pool of .* more than the device's"):
        LLM("tiny", device="cpu", kv_cache_bytes=10**16)
    with pytest.raises(ValueError, match=r"^max_num_seqs=10000000000: that many rows need .* more than the device's"):
        LLM("tiny", device="cpu", max_num_seqs=10**10)


@pytest.mark.parametrize("config,match", [("{}", "missing 'num_attention_heads'"), ("[]", "must hold a JSON object"),
                                          ("{bad", "not valid JSON"), ("no heads", "malformed")])
def test_a_broken_config_json_names_the_file(tiny_path, tmp_path, config: str, match: str) -> None:
    import json
    import shutil

    for f in tiny_path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f) if f.is_file() else shutil.copytree(f, tmp_path / f.name)
    if config == "no heads":  # the tiny model's own config with no heads: a head's size divides by zero
        raw = json.loads((tiny_path / "config.json").read_text())
        raw.pop("head_dim", None)
        config = json.dumps({**raw, "num_attention_heads": 0})
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ValueError, match=f"config.json: .*{match}"):
        LLM(str(tmp_path), device="cpu")


# LLM at run time, on the sharp GQA model (whose greedy tokens change if the cache is read wrong).

@pytest.fixture(scope="module")
def llm(sharp_gqa24):
    return LLM(str(sharp_gqa24.path), device="cpu", dtype="float32", num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def expected(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_idle(llm: LLM) -> None:
    """No request left, every block and row back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.allocator.num_free == engine.block_manager.num_blocks
    assert engine.block_manager.free_row_count() == engine.block_manager.max_rows


@pytest.mark.parametrize("batch,params,error,match", [
    (["fine", ""], GREEDY, ValueError, r"^prompt 1: the prompt is empty"),
    (["fine", {"prompt_token_ids": [1, True]}], GREEDY, TypeError, r"^prompt 1: prompt_token_ids\[1\]=True"),
    (["fine", {"prompt_token_ids": [1, 99999]}], GREEDY, ValueError, r"^prompt 1: prompt token ids must be ints"),
    (["fine", {"prompt_token_ids": "abc"}], GREEDY, TypeError, r"^prompt 1: prompt_token_ids must be a list"),
    (["fine", {"prompt": "x"}], GREEDY, ValueError, r"^prompt 1: 'prompt': not supported"),
    (["fine", 7], GREEDY, TypeError, r"^prompt 1: a prompt is a str"),
    (["fine", "also fine"], [GREEDY, {"temperature": 0}], TypeError, r"^prompt 1: params must be SamplingParams"),
    (["fine", "also fine"], [GREEDY], ValueError, "2 prompts but 1 SamplingParams"),
    (["fine", "also fine"], {}, TypeError, r"^sampling_params must be SamplingParams, a list of them, or None"),
    (["fine", "also fine"], 0, TypeError, r"^sampling_params must be SamplingParams, a list of them, or None"),
], ids=["empty", "bool id", "id range", "ids a str", "unknown key", "not a prompt", "bad params", "count",
        "params a dict", "params falsy"])
def test_a_batch_with_one_bad_request_adds_nothing(llm, batch, params, error, match) -> None:
    with pytest.raises(error, match=match):
        llm.generate(batch, params, use_tqdm=False)
    assert_idle(llm)


def test_stream_refuses_params_of_the_wrong_type(llm) -> None:
    with pytest.raises(TypeError, match="sampling_params must be SamplingParams, got dict"):
        next(llm.stream("hi", {"max_tokens": 3}))
    assert_idle(llm)


def test_prompts_of_the_wrong_type_are_refused(llm) -> None:
    with pytest.raises(TypeError, match="prompts must be"):
        llm.generate(5, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="^use_tqdm='no': must be a bool"):
        llm.generate("hi", GREEDY, use_tqdm="no")
    assert_idle(llm)


@pytest.mark.parametrize("prompt", [{1: 2}, {3, 1, 2}, None, 5, "12"], ids=repr)
def test_the_engine_takes_a_prompt_only_as_a_list_of_ids(llm, prompt) -> None:
    with pytest.raises(TypeError, match="^the prompt must be a list of token ids"):
        llm.engine.add_request(prompt, GREEDY)
    with pytest.raises(TypeError, match="^request 1: the prompt must be a list of token ids"):
        llm.engine.add_requests([[5, 6], prompt], [GREEDY, GREEDY])
    with pytest.raises(TypeError, match="^add_requests takes a list of prompts and a list of SamplingParams"):
        llm.engine.add_requests([[5, 6]], GREEDY)
    assert_idle(llm)


def test_abort_takes_a_request_id(llm) -> None:
    for bad in (True, 6.0, "x", None, [1]):
        with pytest.raises(TypeError, match=f"^request_id={re.escape(repr(bad))}: must be an int"):
            llm.engine.abort_request(bad)
    llm.engine.abort_request(10**9)  # no live request has it: nothing changes
    assert_idle(llm)


def test_a_block_the_default_budget_cannot_hold_names_block_size(tiny_path) -> None:
    with pytest.raises(ValueError, match=r"^block_size=\d+: one block is \d+ bytes"):
        LLM("tiny", device="cpu", block_size=2**40)


def test_interrupted_generate_aborts_its_requests(llm, expected, monkeypatch) -> None:
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:  # after the prefill and a decode step, with blocks held
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(calls) == 3
    monkeypatch.undo()
    assert_idle(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected


def test_a_failed_request_comes_back_with_its_error(llm, expected, monkeypatch) -> None:
    real_sampler = llm.engine.sampler

    def sampler(logits, params, generators):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("injected sampler failure")
        return real_sampler(logits, params, generators)

    monkeypatch.setattr(llm.engine, "sampler", sampler)
    doomed = SamplingParams(temperature=1.0, seed=13, max_tokens=12)
    outs = llm.generate(PROMPTS, [GREEDY, doomed, GREEDY], use_tqdm=False)
    assert outs[1].finish_reason == "error" and "injected sampler failure" in outs[1].error
    assert outs[1].outputs[0].error == outs[1].error
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert outs[0].error is None and outs[0].finish_reason == "length"
    assert_idle(llm)
    with pytest.raises(RuntimeError, match="injected sampler failure"):
        list(llm.stream(PROMPTS[0], doomed))
    assert_idle(llm)


def test_chat_names_the_conversation(llm) -> None:
    good = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^conversation 1: messages\[0\]\.role: must be one of"):
        llm.chat([good, [{"role": "robot", "content": "x"}]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\[1\]\.content: must be a str"):
        llm.chat([*good, {"role": "user", "content": 5}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role: missing"):
        list(llm.stream([{"content": "x"}], GREEDY))
    assert_idle(llm)
    outs = llm.chat([good, good], GREEDY, use_tqdm=False)
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == GREEDY.max_tokens


def test_the_context_is_what_the_pool_holds() -> None:
    """A pool smaller than the model's context caps it, so a request without max_tokens is not
    refused for a context the pool could never hold."""
    llm = LLM("tiny", device="cpu", num_blocks=8, block_size=16)
    assert llm.engine.max_model_len == 128
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)
    assert out[0].finish_reason == "length" and len(out[0].prompt_token_ids) + len(out[0].token_ids) == 128


BAD_IDS = {"True": [True], "False": [3, False], "float": [1.0], "str": ["3"], "None": [None], "negative": [-1],
           "vocab": [512], "int64 + 1": [2**63], "below int64": [-(2**63) - 1], "huge": [2**70]}


@pytest.mark.parametrize("ids", BAD_IDS.values(), ids=BAD_IDS.keys())
def test_request_limits_refuse_every_id_that_is_not_a_token(ids) -> None:
    limits = RequestLimits(vocab_size=512, max_model_len=64, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match=r"^prompt token ids must be ints in \[0, 512\)$"):
        limits.check([5, *ids, 6], SamplingParams(max_tokens=2))


def test_request_limits_pack_the_checked_ids_as_a_copy() -> None:
    limits = RequestLimits(vocab_size=512, max_model_len=64, num_blocks=16, block_size=4)
    prompt = [0, 511, 7]
    packed = limits.check(prompt, SamplingParams(max_tokens=2))
    prompt[0] = 9
    assert packed.typecode == "q" and packed.tolist() == [0, 511, 7]
    assert [p.tolist() for p in limits.check_all([[1], [2, 3]], [SamplingParams(max_tokens=2)] * 2)] == [[1], [2, 3]]
