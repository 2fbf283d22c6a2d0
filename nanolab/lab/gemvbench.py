"""The decode step's projections alone, through the Triton GEMV (`kernels.gemv`) and cuBLAS: each
on its own with L2 flushed (`projection_table`), back to back in a CUDA graph as a step runs them
(`chained_projection_table`), and with its neighbours folded in (`fold_table`). Day 61. CUDA only.

    python -m nanolab levers --only projections --model llama-3.2-1b
    python -m nanolab levers --only chain --model llama-3.2-1b
    python -m nanolab levers --only folds --model llama-3.2-1b
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
import triton

from nanolab.kernels.gemv import MAX_ROWS, GemvConfig, gemv, step_config
from nanolab.kernels.pdl import supports_pdl
from nanolab.lab.timing import time_us
from nanolab.model.quant import quantize_fp8
from nanolab.progress import progress_bar

NAN = float("nan")


def projection_shapes(config) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection a decode step runs."""
    h, d = config.hidden_size, config.head_dim
    return {"qkv": ((config.num_attention_heads + 2 * config.num_key_value_heads) * d, h),
            "o": (h, config.num_attention_heads * d), "gate_up": (2 * config.intermediate_size, h),
            "down": (h, config.intermediate_size), "lm_head": (config.vocab_size, h)}


def choose_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """The isolated sweep's default tiles for an [n, k] weight (its "gemv" arm): 64 columns a
    program, K in 256-wide tiles, and as many shares of K as bring the grid to about two programs
    per SM (at most 8, each at least one tile)."""
    block_n, block_k = 64, 256
    programs = triton.cdiv(n, block_n)
    split = 1
    while programs * split * 2 <= 2 * num_sms and k % (split * 2 * block_k) == 0 and split < 8:
        split *= 2
    return GemvConfig(block_n, block_k, split)


def sweep_configs(n: int, k: int, element_size: int = 2) -> list[GemvConfig]:
    """Tiles to sweep for an [n, k] weight of `element_size`-byte elements (bf16 activations)."""
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (128, 256, 512) + ((1024,) if element_size == 1 and block_n <= 64 else ()):
            for split in (1, 2, 4, 8):
                stage_bytes = (block_n * element_size + 16 * 2) * block_k  # a weight tile and the activation tile
                stages = min(4, 200_000 // stage_bytes)  # what an H200 SM's 227 KiB of shared memory holds
                if k % (split * block_k) == 0 and stages >= 2:
                    out.append(GemvConfig(block_n, block_k, split, num_stages=stages))
    return out


def projection_table(config, dtype=torch.bfloat16, rows=(1, 2, 4, 8, 16), sweep_rows=(1, 16), repeats: int = 30,
                     progress: bool = True) -> pd.DataFrame:
    """Each projection alone, L2 flushed before every launch: cuBLAS (`F.linear`), `gemv` with
    `choose_config`'s tiles, and at `sweep_rows` the best of `sweep_configs`. TB/s counts the
    weight, the activations and the output once."""
    device = torch.device("cuda")
    jobs = [(name, nk, m) for name, nk in projection_shapes(config).items() for m in rows]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="projections", enabled=progress):
        records += _time_projection(name, n, k, m, dtype, device, m in sweep_rows, repeats)
    df = pd.DataFrame(records)
    df["chosen"] = [a == "gemv" for a in df.arm]
    return df


def chained_projection_table(config, dtype=torch.bfloat16, rows=(8,), layers: int = 16, repeats: int = 20,
                             progress: bool = True) -> pd.DataFrame:
    """Each layer projection as a decode step runs it: `layers` launches back to back in one CUDA
    graph, each against a weight of its own (so none is warm in L2), `us` per launch. Arms: cuBLAS
    (`F.linear`), and `gemv` with every tile of `sweep_configs` and `step_config`'s, launched as
    programmatic dependents, so each one's start overlaps the one before it as in the step."""
    device = torch.device("cuda")
    shapes = {name: nk for name, nk in projection_shapes(config).items() if name != "lm_head"}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in rows]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="chained projections", enabled=progress):
        ws = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(layers)]
        x = torch.randn(m, k, dtype=dtype, device=device)
        ref = F.linear(x.double(), ws[-1].double())
        chosen = step_config(n, k, m)
        arms = [("cublas", None)] + [(f"gemv {c.block_n}x{c.block_k} split {c.split_k} stages {c.num_stages}"
                                      + (" (step_config)" if c == chosen else ""), c)
                                     for c in dict.fromkeys([chosen, *sweep_configs(n, k)])]
        for arm, c in arms:
            try:
                err, us = _time_chain(x, ws, c, ref, repeats)
            except Exception as e:  # a tile the card cannot hold: recorded, and the sweep goes on
                records.append({"projection": name, "n": n, "k": k, "rows": m, "arm": arm, "us": NAN,
                                "tb_s": NAN, "rel_err": NAN, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            records.append({"projection": name, "n": n, "k": k, "rows": m, "arm": arm, "us": us,
                            "tb_s": n * k * ws[0].element_size() / us / 1e6, "rel_err": err, "error": ""})
        del ws
    return pd.DataFrame(records)


# How the fp8 GEMV multiplies a tile (`kernels.gemv.gemv`'s `dot`); "fma" only for one row, over tiles
# whose fp32 products [BLOCK_N, BLOCK_K] fit in registers.
FP8_DOTS = ("mma", "mma_f16", "fma")
FMA_TILE = 64 * 128


def dot_sweep(n: int, k: int) -> list[GemvConfig]:
    """The one-byte tiles of `sweep_configs` that led its sweeps (32 to 128 columns, K tiles up to
    512, up to four shares), for comparing `FP8_DOTS` in less time than the whole sweep."""
    return [c for c in sweep_configs(n, k, element_size=1)
            if c.block_n >= 32 and c.block_k <= 512 and c.split_k <= 4]


def fp8_chain_table(config, rows=(1, 8), layers: int = 16, repeats: int = 20, progress: bool = True,
                    dots: Sequence[str] = ("mma",), sweep: Callable[[int, int], list[GemvConfig]] | None = None
                    ) -> pd.DataFrame:
    """Each layer projection with an e4m3 weight and its scale per output channel, as
    `chained_projection_table` times it (`layers` launches in one CUDA graph, a weight each, as
    programmatic dependents), `us` per launch. Arms: the bf16 weight through `gemv` with
    `step_config`'s tiles (batch 1: inductor's compiled reduction, which the bf16 step runs there);
    the fp8 weight through `gemv` with `step_config(element_size=1)`'s tiles and every tile of
    `sweep` (default `sweep_configs` for one-byte weights), each way of `dots` (from `FP8_DOTS`; the
    arm names a way other than "mma"); at batch 1, the fp8 weight widened inside inductor's compiled
    reduction. TB/s counts the stored weight once (and its fp32 scales)."""
    shapes = {name: nk for name, nk in projection_shapes(config).items() if name != "lm_head"}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in rows]
    reduce_bf16 = torch.compile(lambda x, w: (x.unsqueeze(-2) * w).sum(-1), dynamic=False)
    reduce_fp8 = torch.compile(lambda x, q, s: ((x.unsqueeze(-2) * q.to(x.dtype)).sum(-1) * s).to(x.dtype),
                               dynamic=False)
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="fp8 projections", enabled=progress):
        records += _time_fp8_chain(name, n, k, m, layers, repeats, reduce_bf16, reduce_fp8, dots,
                                   sweep or (lambda n, k: sweep_configs(n, k, element_size=1)))
    return pd.DataFrame(records)


def _time_fp8_chain(name: str, n: int, k: int, m: int, layers: int, repeats: int, reduce_bf16, reduce_fp8,
                    dots: Sequence[str], sweep: Callable[[int, int], list[GemvConfig]]) -> list[dict]:
    device = torch.device("cuda")
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5 for _ in range(layers)]
    qs = [quantize_fp8(w) for w in ws]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    q_last, s_last = qs[-1]
    ref = F.linear(x.double(), q_last.double() * s_last.double()[:, None])
    ref_bf16 = F.linear(x.double(), ws[-1].double())
    chosen = step_config(n, k, m, element_size=1)
    arms: list[tuple[str, Callable, torch.Tensor, int]] = []  # (arm, launch i, reference, bytes a launch)
    if m == 1:
        arms.append(("bf16 compiled reduction", lambda i: reduce_bf16(x, ws[i]), ref_bf16, 2 * n * k))
        arms.append(("fp8 compiled reduction", lambda i: reduce_fp8(x, *qs[i]), ref, n * k + 4 * n))
    else:
        cfg16 = step_config(n, k, m)
        arms.append(("bf16 gemv (step_config)", lambda i: gemv(x, ws[i], cfg16, pdl=True), ref_bf16, 2 * n * k))
    for dot in dots:
        # the chosen tiles at 8 warps too: at 4, the fp8 GEMV spills (`lab.kernelres.gemv_resources`)
        for c in dict.fromkeys([chosen, chosen._replace(num_warps=8), *sweep(n, k)]):
            if dot == "fma" and (m != 1 or c.block_n * c.block_k > FMA_TILE):
                continue
            arm = (f"fp8 gemv {c.block_n}x{c.block_k} split {c.split_k} stages {c.num_stages}"
                   + ("" if c.num_warps == 4 else f" warps {c.num_warps}")
                   + ("" if dot == "mma" else f" {dot}") + (" (step_config)" if c == chosen else ""))
            arms.append((arm, lambda i, c=c, dot=dot: gemv(x, qs[i][0], c, pdl=True, scale=qs[i][1], dot=dot), ref,
                         n * k + 4 * n))
    records = []
    for arm, one, reference, nbytes in arms:
        row = {"projection": name, "n": n, "k": k, "rows": m, "arm": arm}
        try:
            err = float((one(layers - 1).double() - reference).norm() / reference.norm())
            us = time_us(lambda one=one: [one(i) for i in range(layers)], device, repeats) / layers
        except Exception as e:  # a tile the card cannot hold: recorded, and the sweep goes on
            records.append({**row, "us": NAN, "tb_s": NAN, "rel_err": NAN, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        records.append({**row, "us": us, "tb_s": nbytes / us / 1e6, "rel_err": err, "error": ""})
    return records


# Each layer projection's neighbours `lab.folds.step_projection` folds into it (`fold_table`).
FOLDS = {"qkv": ("norm",), "o": ("residual",), "gate_up": ("norm",), "down": ("swiglu", "swiglu + residual")}


def fold_table(config, dtype=torch.bfloat16, rows=(8, 64), layers: int = 16, repeats: int = 20,
               progress: bool = True) -> pd.DataFrame:
    """Each layer projection through `gemv` as `chained_projection_table` times it (`layers` launches
    in one CUDA graph, each with a weight of its own, as programmatic dependents), plain and with
    each neighbour of `FOLDS` folded in (`gemv`'s norm, residual, SwiGLU, as `lab.folds` runs
    them): `us` per launch, what the fold added to the plain launch, and the error against fp32
    torch."""
    device = torch.device("cuda")
    shapes = {name: nk for name, nk in projection_shapes(config).items() if name in FOLDS}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in rows]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="folded projections", enabled=progress):
        ws = [torch.randn(n, k, dtype=dtype, device=device) / k**0.5 for _ in range(layers)]
        x, gate_up = torch.randn(m, k, dtype=dtype, device=device), torch.randn(m, 2 * k, dtype=dtype, device=device)
        g, res = torch.rand(k, dtype=dtype, device=device) + 0.5, torch.randn(m, n, dtype=dtype, device=device)
        silu_up = F.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
        arms = {"none": (dict(), x, x.float()),
                "norm": (dict(norm=g), x, F.rms_norm(x.float(), (k,), g.float(), 1e-5)),
                "residual": (dict(residual=res), x, x.float()),
                "swiglu": (dict(swiglu=True), gate_up, silu_up),
                "swiglu + residual": (dict(swiglu=True, residual=res), gate_up, silu_up)}
        plain = NAN
        for fold in ("none", *FOLDS[name]):
            kw, a, a_ref = arms[fold]
            cfg = step_config(n, k, m, swiglu=kw.get("swiglu", False), norm="norm" in kw)
            ref = F.linear(a_ref.double(), ws[-1].double()) + (res.double() if "residual" in kw else 0)
            err, us = _time_chain(a, ws, cfg, ref, repeats, kw)
            plain = us if fold == "none" else plain
            records.append({"projection": name, "n": n, "k": k, "rows": m, "fold": fold,
                            "tiles": f"{cfg.block_n}x{cfg.block_k} split {cfg.split_k} stages {cfg.num_stages}",
                            "us": us, "us_added": us - plain, "tb_s": n * k * ws[0].element_size() / us / 1e6,
                            "rel_err": err})
        del ws
    return pd.DataFrame(records)


def _time_chain(x, ws, config: GemvConfig | None, ref, repeats: int, fold: dict | None = None
                ) -> tuple[float, float]:
    """(relative error of the last weight's product against `ref`, us per launch) of `x` against each
    of `ws` in turn, through cuBLAS (`config` None) or `gemv`, with `fold` (`gemv`'s norm, residual
    or swiglu) folded in."""
    def one(w):
        return F.linear(x, w) if config is None else gemv(x, w, config, pdl=supports_pdl(x.device), **(fold or {}))
    err = float((one(ws[-1]).double() - ref).norm() / ref.norm())
    return err, time_us(lambda: [one(w) for w in ws], x.device, repeats) / len(ws)


def _time_projection(name: str, n: int, k: int, m: int, dtype, device, sweep: bool, repeats: int) -> list[dict]:
    w = torch.randn(n, k, dtype=dtype, device=device) / k**0.5
    x = torch.randn(m, k, dtype=dtype, device=device)
    nbytes = (n * k + m * k + m * n) * w.element_size()
    ref = F.linear(x.double(), w.double())
    arms: list[tuple[str, Callable]] = [("cublas", lambda: F.linear(x, w))]
    if m <= MAX_ROWS:
        arms.append(("gemv", lambda: gemv(x, w, choose_config(n, k))))
        if sweep:
            arms += [(f"gemv {c.block_n}x{c.block_k} split {c.split_k}", lambda c=c: gemv(x, w, c))
                     for c in sweep_configs(n, k)]
    records = []
    for arm, fn in arms:
        err = float((fn().double() - ref).norm() / ref.norm())
        us = time_us(fn, device, repeats)
        records.append({"projection": name, "n": n, "k": k, "rows": m, "arm": arm, "us": us,
                        "tb_s": nbytes / us / 1e6, "rel_err": err})
    return records
