"""The same promises on a CUDA device: HF parity, batch invariance and a full LLM round trip in
bf16. Skipped on the CPU; run on the H200 before a GPU part is called done."""

from __future__ import annotations

import torch
from conftest import needs_cuda
from test_engine import assert_all_free, ragged_prompts, run
from test_parity import assert_logits_close, nanolab_logits

from nanolab import LLM, Engine, SamplingParams, load_model
from nanolab.lab.reference import hf_greedy, load_hf, nanolab_greedy

pytestmark = needs_cuda


def test_tiny_parity_on_cuda(tiny_path):
    model = load_model(tiny_path, device="cuda")
    hf = load_hf(tiny_path, torch.float32, "cuda")
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(ids[None].cuda()).logits[0]
    assert_logits_close(nanolab_logits(model, ids.tolist()).cuda(), ref)
    prompts = ragged_prompts(512)[:4]
    assert nanolab_greedy(model, prompts, 32) == [hf_greedy(hf, p, 32) for p in prompts]


def test_batch_invariance_and_preemption_on_cuda(tiny_path):
    model = load_model(tiny_path, device="cuda")
    prompts = ragged_prompts(512)
    alone = [run(Engine(model, num_blocks=64, block_size=4), [p])[0] for p in prompts]
    tight = Engine(model, num_blocks=24, block_size=4)
    assert run(tight, prompts) == alone
    assert tight.scheduler.num_preemptions > 0
    assert_all_free(tight)


def test_llm_bf16_round_trip_on_cuda():
    llm = LLM("tiny", device="cuda", dtype="bf16")
    outs = llm.generate(["hello", "a longer prompt about paging"],
                        SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20), use_tqdm=False)
    again = llm.generate(["hello", "a longer prompt about paging"],
                         SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20), use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 20 or o.finish_reason == "stop" for o in outs)
    assert_all_free(llm.engine)
