"""FP8 weights against bf16: the decode step's time and bytes, and the quality they cost (Day 65).

Seven parts, each its own table:

- `steps` (`day65_fp8_steps_<device>`): ms a decode step of whole `generate` calls
  (`lab.timing.time_generate`, as floorbench times them) with the weights in bf16 and with
  `quantization="fp8"`, both engines in one process, their timed calls alternated shape by shape.
  Each arm's floor is the bytes its step must read (every weight once, as stored: e4m3 bytes and
  fp32 scales for a quantized layer; and the K/V of the history) over the copy bandwidth measured in
  the same run.
- `quality` (`day65_fp8_quality_<device>`, real weights only): the perplexity of
  `tests/data/perplexity.txt` in bf16, with the layers in fp8 (what `quantization="fp8"` holds), and
  with the LM head quantized as well (a lab variant of the loaded model: the engine keeps its head
  in bf16), and with prompt steps through an fp8 GEMM, activations quantized a row at a time
  (`torch._scaled_mm`, another lab variant: the W8A8 design not kept); and how many of the first 32 greedy tokens
  of each prompt of the speculation prompt sets agree with bf16's.
- `tiles` (`day65_fp8_tiles_<device>`, CUDA): each layer projection with an e4m3 weight, chained
  in a graph as a step runs it, through every GEMV tile and inductor's compiled reduction
  (`lab.gemvbench.fp8_chain_table`), beside bf16's.
- `dots` (`day65_fp8_dots_<device>`, CUDA): as `tiles`, over the tiles that led it
  (`lab.gemvbench.dot_sweep`), each way the GEMV can multiply an fp8 tile (`lab.gemvbench.FP8_DOTS`:
  tensor cores in bf16 or in fp16, or one row's products in fp32).
- `prefill` (`day65_fp8_prefill_<device>`, CUDA): each layer projection of a prompt step at 128 and
  512 tokens: bf16, the engine's fp8 op (`kernels.gemv.fp8_linear`, the W8A16 matmul on CUDA), the
  design it replaced (the weight widened in memory), and the W8A16 kernel at every tile
  (`lab.w8a16`).
- `prompt` (`day65_fp8_prompt_<device>`): a prompt of each length in the engine, bf16 and fp8 in
  one process (`run_prompt_steps`): the wall time of `generate` with one new token, which is the
  prompt's steps (chunks of the default token budget) and one token's sampling.
- `profile` (`day65_fp8_profile_<device>`, CUDA): the GPU kernels of whole `generate` calls' decode
  steps in bf16 and fp8, the prompt step's taken out, by kernel and class
  (`lab.stepparts.kernel_class`), per step.

    python -m nanolab fp8bench --model llama-3.2-1b --parts steps
    python -m nanolab fp8bench --model smollm2-135m --parts quality
    python -m nanolab fp8bench --model llama-3.2-1b --parts tiles,profile
    python -m nanolab fp8bench --model llama-3.2-1b --parts prefill,prompt
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence

import pandas as pd
import torch

from nanolab import LLM, SamplingParams
from nanolab.kernels.gemv import MAX_ROWS
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.costs import kv_read_bytes
from nanolab.lab.floorbench import nanolab_generate, nanolab_label
from nanolab.lab.gemvbench import FP8_DOTS, dot_sweep, fp8_chain_table
from nanolab.lab.report import REPO_ROOT, run_label, save_table
from nanolab.lab.specbench import PROMPT_SETS, load_prompt_set
from nanolab.lab.stepparts import class_line, decode_kernels
from nanolab.lab.timing import copy_bandwidth, random_prompts, time_generate, wall_s
from nanolab.model.layers import Linear
from nanolab.model.quant import quantize_fp8

PARTS = ("steps", "quality", "tiles", "dots", "profile", "prefill", "prompt")
PROMPT_LENS = (128, 512, 2048)
BATCHES = (1, 8)
PROMPT_LEN = 128
STEPS = 256
AGREEMENT_TOKENS = 32
TEXT = REPO_ROOT / "tests" / "data" / "perplexity.txt"
# The targets at Llama-3.2-1B shapes on the H200.
TARGET_MS = {1: 0.55}  # batch -> fp8 ms a step
TARGET_SPEEDUP = {1: 1.7, 8: 1.5}  # batch -> bf16 ms over fp8 ms
TARGET_X_FLOOR = 1.3  # fp8 at batch 1, against the fp8 floor


def stored_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct weight as the model holds it: parameters, and for a quantized
    `Linear` its e4m3 weight and fp32 scales. What a decode step must stream at least once."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    for m in model.modules():
        if isinstance(m, Linear) and m.qweight is not None:
            for t in (m.qweight, m.scale):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def scaled_mm_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [rows, K] @ (qweight * scale[:, None]).T -> [rows, N] in x's dtype, on fp8 tensor cores (or
    the CPU's `torch._scaled_mm`): x's rows quantized to e4m3 with a scale each, by the rule a
    weight's output channels are (`quantize_fp8`; vLLM's dynamic per-token scales), the row scales
    [rows, 1] and the weight's [1, N] applied to the fp32 sum.
    K and N must be multiples of 16. The design Day 65 measured for a prompt's chunk and did not
    keep: SmolLM2's perplexity moves 1.85% with it, over the 1% gate."""
    xq, x_scale = quantize_fp8(x)
    return torch._scaled_mm(xq, qweight.t(), scale_a=x_scale[:, None], scale_b=scale[None, :], out_dtype=x.dtype)


def fp8_gemm_chunks_(llm: LLM) -> None:
    """The lab variant of W8A8 prompt steps: every quantized `Linear` of this `LLM`'s model
    multiplies more than `MAX_ROWS` rows through `scaled_mm_linear` (activations quantized to e4m3
    a row at a time) instead of the widened weight. Changes this `LLM`'s model alone."""
    for module in llm.model.modules():
        if isinstance(module, Linear) and module.qweight is not None:
            def forward(x, m=module):
                rows = x.numel() // x.shape[-1]
                if rows <= MAX_ROWS:
                    return Linear.forward(m, x)
                out = scaled_mm_linear(x.reshape(rows, x.shape[-1]), m.qweight, m.scale)
                return out.reshape(*x.shape[:-1], out.shape[-1])
            module.forward = forward


def quantize_head_(llm: LLM) -> None:
    """The lab variant: also hold the LM head in e4m3 (a tied head gets its own quantized copy; the
    embedding stays as it is). Changes this `LLM`'s model alone."""
    llm.model.lm_head.quantize_fp8_()


# --- steps ---------------------------------------------------------------------------------------


def run_steps(model: str, device: str | None, batches: Sequence[int] = BATCHES, prompt_len: int = PROMPT_LEN,
              steps: int = STEPS, repeats: int = 3, log: Callable[[str], None] = print) -> pd.DataFrame:
    """A row per arm ("bf16", "fp8") and batch: ms a step, the bytes a step reads, its floor."""
    engine_args = dict(device=device, max_num_seqs=max(64, *batches), enable_chunked_prefill=False,
                       enable_prefix_caching=False)
    arms = {"bf16": LLM(model, **engine_args), "fp8": LLM(model, quantization="fp8", **engine_args)}
    first = arms["bf16"]
    dev, config = first.device, first.config
    bandwidth = copy_bandwidth(dev, nbytes=1 << 30 if dev.type == "cuda" else 1 << 26)
    rows = []
    for batch in batches:
        prompts = random_prompts(batch, prompt_len, config.vocab_size)
        kv_tokens = prompt_len + steps // 2  # the history the average timed step reads
        for name, llm in arms.items():
            run = nanolab_generate(llm, prompts)
            ms = time_generate(run, steps, repeats, device=dev, warmup=1)
            weights = stored_weight_bytes(llm.model)
            kv = kv_read_bytes(config, batch, kv_tokens, llm.dtype)
            floor = (weights + kv) / bandwidth * 1e3
            rows.append({"arm": name, "label": nanolab_label(llm), "batch": batch, "prompt_len": prompt_len,
                         "steps": steps, "kv_tokens": kv_tokens, "ms_per_step": ms,
                         "tokens_per_s": 1e3 * batch / ms, "weight_bytes": weights, "kv_bytes": kv,
                         "bandwidth_tb_s": bandwidth / 1e12, "floor_ms": floor, "x_floor": ms / floor})
            log(f"{name} batch {batch}: {ms:.3f} ms a step, {ms / floor:.2f}x its floor of {floor:.3f} ms")
    for llm in arms.values():
        llm.close()
    table = pd.DataFrame(rows)
    bf16 = table[table.arm == "bf16"].set_index("batch").ms_per_step
    table["speedup_over_bf16"] = [bf16[b] / ms for b, ms in zip(table.batch, table.ms_per_step, strict=True)]
    return table


def run_prompt_steps(model: str, device: str | None, lengths: Sequence[int] = PROMPT_LENS, repeats: int = 5,
                     log: Callable[[str], None] = print) -> pd.DataFrame:
    """A row per arm ("bf16", "fp8") and prompt length: the median, fastest and slowest wall ms of
    `generate` over one random prompt of that length with one new token (the prompt's steps, in
    chunks of the engine's default token budget, and the first token), prefix caching off. Both
    engines live in one process; after one untimed call each, the arms alternate call by call
    (AB, BA, ...) `repeats` times. `fp8_over_bf16`: the arm's median over bf16's."""
    for name, value in (("repeats", repeats), *((f"lengths[{i}]", n) for i, n in enumerate(lengths))):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    if not lengths:
        raise ValueError("lengths: no prompt length")
    engine_args = dict(device=device, enable_prefix_caching=False)
    arms = {"bf16": LLM(model, **engine_args), "fp8": LLM(model, quantization="fp8", **engine_args)}
    dev = arms["bf16"].device
    rows = []
    for n in lengths:
        runs = {name: nanolab_generate(llm, random_prompts(1, n, llm.config.vocab_size, seed=n))
                for name, llm in arms.items()}
        for run in runs.values():
            run(1)
        times = {name: [] for name in arms}
        for r in range(repeats):
            for name in (arms if r % 2 == 0 else reversed(list(arms))):
                times[name].append(1e3 * wall_s(lambda run=runs[name]: run(1), dev))
        for name, ms in times.items():
            rows.append({"arm": name, "label": nanolab_label(arms[name]), "prompt_len": n, "repeats": repeats,
                         "ms": float(pd.Series(ms).median()), "ms_min": min(ms), "ms_max": max(ms)})
        log(f"prompt of {n}: " + ", ".join(f"{r['arm']} {r['ms']:.2f} ms" for r in rows[-len(arms):]))
    for llm in arms.values():
        llm.close()
    table = pd.DataFrame(rows)
    bf16 = table[table.arm == "bf16"].set_index("prompt_len").ms
    table["fp8_over_bf16"] = [ms / bf16[n] for n, ms in zip(table.prompt_len, table.ms, strict=True)]
    return table


def run_profile(model: str, batches: Sequence[int] = BATCHES, prompt_len: int = PROMPT_LEN, steps: int = 64,
                log: Callable[[str], None] = print) -> pd.DataFrame:
    """A row per arm, batch and kernel: its GPU us a decode step over `steps` decode steps of a
    whole `generate` call, its prompt step's kernels taken out (`stepparts.decode_kernels`), and
    its class."""
    engine_args = dict(device="cuda", max_num_seqs=max(64, *batches), enable_chunked_prefill=False,
                       enable_prefix_caching=False)
    tables = []
    for name, quantization in (("bf16", None), ("fp8", "fp8")):
        llm = LLM(model, quantization=quantization, **engine_args)
        for batch in batches:
            run = nanolab_generate(llm, random_prompts(batch, prompt_len, llm.config.vocab_size))
            run(steps)  # warm
            torch.cuda.synchronize()
            t = decode_kernels(run, steps, name).assign(batch=batch)
            tables.append(t)
            log(f"{name} batch {batch}: {class_line(t, digits=1)}")
        llm.close()
    return pd.concat(tables, ignore_index=True)


def step_lines(table: pd.DataFrame) -> list[str]:
    """fp8 against the targets, as ratios."""
    lines = []
    for r in table[table.arm == "fp8"].itertuples():
        line = (f"batch {r.batch}: fp8 {r.ms_per_step:.3f} ms, {r.speedup_over_bf16:.2f}x bf16 "
                f"(target {TARGET_SPEEDUP.get(r.batch, math.nan)}x), {r.x_floor:.2f}x its floor")
        if r.batch in TARGET_MS:
            line += (f"; {r.ms_per_step / TARGET_MS[r.batch]:.2f}x the {TARGET_MS[r.batch]} ms target, "
                     f"floor target {TARGET_X_FLOOR}x")
        lines.append(line)
    return lines


# --- quality -------------------------------------------------------------------------------------


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:], from the engine's prompt logprobs."""
    (out,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return float(torch.tensor([-lp for lp, _ in out.prompt_logprobs]).mean().exp())


def greedy_tokens(llm: LLM, prompts: list[list[int]], n: int = AGREEMENT_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def agreed_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_quality(model: str, device: str | None, dtype: str = "bfloat16",
                log: Callable[[str], None] = print) -> pd.DataFrame:
    """A row per variant ("bf16", "fp8 layers", and the lab's variants of it): perplexity of the text and
    its change against bf16, and the greedy agreement with bf16 over the prompt sets."""
    variants = {"bf16": (None, None), "fp8 layers": ("fp8", None), "fp8 layers and head": ("fp8", quantize_head_),
                "fp8 layers, W8A8 prompt steps": ("fp8", fp8_gemm_chunks_)}  # name -> (quantization, lab variant)
    rows, reference = [], None
    for name, (quantization, variant) in variants.items():
        llm = LLM(model, device=device, dtype=dtype, quantization=quantization, enable_prefix_caching=False)
        if variant is not None:
            variant(llm)
        ids = llm.tokenizer.encode(TEXT.read_text())
        prompts = [llm.tokenizer.encode_chat(m) for s in PROMPT_SETS for m in load_prompt_set(s)]
        ppl, tokens = perplexity(llm, ids), greedy_tokens(llm, prompts)
        llm.close()
        if reference is None:
            reference = (ppl, tokens)
        agreed = [agreed_prefix(t, r) for t, r in zip(tokens, reference[1], strict=True)]
        rows.append({"variant": name, "text_tokens": len(ids), "perplexity": ppl,
                     "perplexity_change": ppl / reference[0] - 1, "prompts": len(prompts),
                     "agreement_tokens": AGREEMENT_TOKENS,
                     "prompts_agreeing": sum(a == AGREEMENT_TOKENS for a in agreed),
                     "mean_agreed_prefix": sum(agreed) / len(agreed)})
        log(f"{name}: perplexity {ppl:.3f} ({ppl / reference[0] - 1:+.2%}), {rows[-1]['prompts_agreeing']} of "
            f"{len(prompts)} prompts agree with bf16 over {AGREEMENT_TOKENS} tokens")
    return pd.DataFrame(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset name or a model folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--parts", default="steps", help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--steps", type=int, default=STEPS, help="timed decode steps a call")
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs a shape")
    parser.add_argument("--prefix", default="day65", help="tables go to data/<prefix>_fp8_<part>_<device>.csv")


def main(args: argparse.Namespace) -> int:
    from nanolab.config import resolve_device, resolve_dtype
    from nanolab.model.weights import resolve_weights, weights_kind

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"--parts {args.parts!r}: choose from {', '.join(PARTS)}")
    batches = int_list(args.batches, "--batches")
    positive_int(args.steps, "--steps")
    positive_int(args.repeats, "--repeats")
    device = resolve_device(args.device)
    cuda_only = [p for p in parts if p in ("tiles", "dots", "profile", "prefill")]
    if cuda_only and device.type != "cuda":  # refused before weights are prepared and any part runs
        raise ValueError(f"--parts {','.join(cuda_only)} runs on CUDA only")
    kind = weights_kind(resolve_weights(args.model))
    if "quality" in parts and kind != "real":
        raise ValueError(f"--parts quality needs real weights; {args.model} has {kind} weights")
    for part in parts:
        if part in ("tiles", "dots"):
            from nanolab.model.config import ModelConfig
            shapes = ModelConfig.from_dir(resolve_weights(args.model))
            table = (fp8_chain_table(shapes) if part == "tiles"
                     else fp8_chain_table(shapes, dots=FP8_DOTS, sweep=dot_sweep))
            dtype = torch.bfloat16
            best = table.dropna(subset=["us"]).sort_values("us").groupby(["projection", "rows"]).head(3)
            print(pd.concat([table[~table.arm.str.startswith("fp8 gemv") | table.arm.str.contains("step_config")],
                             best]).to_string(index=False))
        elif part == "profile":
            table = run_profile(args.model, batches)
            dtype = torch.bfloat16
        elif part == "prefill":
            from nanolab.lab.w8a16 import layer_prefill, prefill_table
            from nanolab.model.config import ModelConfig
            table = prefill_table(ModelConfig.from_dir(resolve_weights(args.model)))
            dtype = torch.bfloat16
            print(table.drop(columns=[c for c in ("error",) if c in table]).round(3).to_string(index=False))
            print(layer_prefill(table).round(1).to_string(index=False))
        elif part == "prompt":
            table = run_prompt_steps(args.model, str(device), repeats=max(args.repeats, 5))
            dtype = resolve_dtype("auto", device)
        elif part == "steps":
            table = run_steps(args.model, str(device), batches, steps=args.steps, repeats=args.repeats)
            dtype = resolve_dtype("auto", device)
            print("\n".join(step_lines(table)))
        else:
            dtype = torch.bfloat16
            table = run_quality(args.model, str(device))
        label = run_label(device, args.model, dtype, weights=kind)
        if part not in ("tiles", "dots", "profile", "prefill"):
            print(table.round(4).to_string(index=False))
        print(f"wrote {save_table(table, f'{args.prefix}_fp8_{part}', label)}")
    return 0
