"""The same promises on a CUDA device: HF parity, batch invariance and a full LLM round trip in
bf16. Skipped on the CPU; run on the H200 before a GPU part is called done."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_cuda
from test_engine import assert_all_free, ragged_prompts, run
from test_parity import assert_logits_close, nanolab_logits

from nanolab import LLM, Engine, EngineConfig, SamplingParams, load_model
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
    eager = EngineConfig(num_blocks=64, block_size=4, enforce_eager=True)
    alone = [run(Engine(model, eager), [p])[0] for p in prompts]
    tight = Engine(model, eager.replace(num_blocks=24))
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


def test_step_gemv_on_cuda():
    """The step's GEMV on the GPU at 2 to 64 rows against Llama-3.2-1B's four projection shapes, with
    `step_config`'s tiles (split-K's shares added by `_sum_splits` for down), launched as a
    programmatic dependent where the GPU has PDL and plainly, and bit-equal from one launch to the
    next."""
    from nanolab.kernels.gemv import gemv, step_config
    from nanolab.kernels.pdl import supports_pdl

    torch.manual_seed(0)
    for m in (2, 8, 16, 64):
        for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            ref = x.float() @ w.float().T
            cfg = step_config(n, k, m)
            out = gemv(x, w, cfg, pdl=supports_pdl("cuda"))
            assert float((out.float() - ref).norm() / ref.norm()) < 1e-2, (m, n, k)
            assert torch.equal(gemv(x, w, cfg), out)


def test_step_gemv_folds_on_cuda():
    """The step's GEMV with its neighbours folded in (`lab.folds.step_projection`) on the GPU, in bf16 at
    Llama-3.2-1B's shapes and 2 to 64 rows, against fp32 torch: the norm in q/k/v and gate/up,
    SwiGLU and the residual in down (split-K, added by `_sum_splits`), the residual in o."""
    import torch.nn.functional as F

    from nanolab.lab.folds import step_projection

    torch.manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    for m in (2, 8, 16, 64):
        h, g = torch.randn(m, 1, 2048, **bf), torch.rand(2048, **bf) + 0.5
        for n in (3072, 16384):
            w = torch.randn(n, 2048, **bf) / 2048**0.5
            ref = F.linear(F.rms_norm(h.float(), (2048,), g.float(), 1e-5), w.float())
            out = step_projection(h, w, g, 1e-5)
            assert float((out.float() - ref).norm() / ref.norm()) < 1e-2, (m, n)
        gate_up, w = torch.randn(m, 1, 16384, **bf), torch.randn(2048, 8192, **bf) / 8192**0.5
        ref = F.linear(F.silu(gate_up[..., :8192].float()) * gate_up[..., 8192:].float(), w.float()) + h.float()
        out = step_projection(gate_up, w, residual=h, swiglu=True)
        assert float((out.float() - ref).norm() / ref.norm()) < 1e-2, m
        a, w = torch.randn(m, 1, 2048, **bf), torch.randn(2048, 2048, **bf) / 2048**0.5
        ref = F.linear(a.float(), w.float()) + h.float()
        assert float((step_projection(a, w, residual=h).float() - ref).norm() / ref.norm()) < 1e-2, m


def test_step_inputs_upload_from_pinned_memory_on_cuda():
    from nanolab.kernels.step_inputs import upload_step_inputs

    for rows in (1, 8, 130):
        src = (torch.arange(4 * rows, dtype=torch.int64).view(4, rows) * 7 - 3).pin_memory()
        dsts = [torch.full((rows,), -99, dtype=torch.int64, device="cuda") for _ in range(4)]
        upload_step_inputs(src, dsts)
        torch.cuda.synchronize()
        for i, d in enumerate(dsts):
            assert torch.equal(d.cpu(), src[i]), (rows, i)
    with pytest.raises(ValueError, match="pinned"):
        upload_step_inputs(torch.zeros(4, 3, dtype=torch.int64), dsts[:3] + [dsts[3][:3]])


def test_decode_plans_upload_their_inputs_while_the_gpu_lags_on_cuda():
    # The GPU sleeps first, so each plan's upload kernel waits in the queue while the host builds
    # the next plans: more of them than there are pinned slots. Each plan's vectors are cloned on
    # the stream as its kernel leaves them. A plan that overwrote a slot whose kernel had not run
    # yet would hand that kernel a later plan's values.
    from nanolab.engine.block_manager import BlockManager
    from nanolab.engine.kv_cache import UPLOAD_SLOTS, KVCache

    cache = KVCache(BlockManager(64, 4, 8), num_layers=1, num_kv_heads=1, head_dim=8, device="cuda",
                    read="reference")
    row = cache.blocks.open_row()
    cache.plan_varlen([row], [3])
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles
    seen = []
    for _ in range(3 * UPLOAD_SLOTS + 1):
        plan = cache.plan_decode([row], batch_size=4)
        seen.append([t.clone() for t in (plan.table_rows, plan.write_slots, plan.context_lens, plan.positions)])
    torch.cuda.synchronize()
    pad = cache.pad_row
    for step, (rows, slots, lens, positions) in enumerate(seen):
        assert rows.tolist() == [row, pad, pad, pad]
        assert positions.view(-1).tolist() == [3 + step, 0, 0, 0]
        assert lens.tolist() == [4 + step, 1, 1, 1]
        assert slots.tolist() == [cache.blocks.table(row).slot(3 + step), -1, -1, -1]
