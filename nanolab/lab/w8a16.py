"""The fp8 prompt step's projections, timed (`fp8bench --parts prefill`, Day 65d).

The engine's fp8 prompt step runs `kernels.w8a16.w8a16_linear`, which reads each e4m3 weight's
bytes once and widens a tile in registers, at the tile `kernels.w8a16.prompt_tile` picks. The
design it replaced widened each weight to bf16 in memory, multiplied with `F.linear` and scaled
each output column after: a weight read once as bytes, then written and read again at two bytes
each. It stays here as an arm beside bf16's `F.linear`, the engine's op, and every tile of
`CONFIGS` through each dot. (Quantizing the activations too, W8A8 through `torch._scaled_mm`, cost
SmolLM2 1.85% of perplexity: `fp8bench.scaled_mm_linear`.)
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch
import torch.nn.functional as F

from nanolab.kernels.gemv import fp8_linear
from nanolab.kernels.w8a16 import PROMPT_TILES, MMConfig, w8a16_linear
from nanolab.model.quant import quantize_fp8

NAN = float("nan")
WIDENED = "fp8 widened, F.linear, scaled"  # the design fp8_linear's prompt path replaced
ENGINE = "fp8_linear (engine)"


# Tiles the prefill sweep tries: `kernels.w8a16.PROMPT_TILES`, one more of 128 rows by 64 columns, and
# the smallest tile with K split in 2 and 4 shares (down's 64 programs at 128 tokens become 128 and 256).
CONFIGS = (*PROMPT_TILES, MMConfig(128, 64, 64, num_warps=4, num_stages=4), MMConfig(64, 64, 128, split_k=2),
           MMConfig(64, 64, 128, split_k=4))


def prefill_table(config, tokens: Sequence[int] = (128, 512), repeats: int = 20, progress: bool = True
                  ) -> pd.DataFrame:
    """Each layer projection of a prompt step (`gemvbench.projection_shapes`, the head left out) at
    each count of `tokens`, on CUDA, `us` a launch (`timing.time_us`: a CUDA graph replay after an
    L2 flush). Arms: the bf16 weight through `F.linear` (a bf16 model's prompt step); the e4m3
    weight widened to bf16 in memory, `F.linear`, then each column scaled (the replaced design);
    the engine's op (`kernels.gemv.fp8_linear`); and `w8a16_linear` at every tile of `CONFIGS`,
    each dot.
    TB/s counts the stored weight once (e4m3 bytes and fp32 scales, or bf16); `rel_err` is the
    largest error over the largest output, against the dequantized weight's matmul in float64."""
    from nanolab.lab.gemvbench import projection_shapes
    from nanolab.progress import progress_bar

    shapes = {name: nk for name, nk in projection_shapes(config).items() if name != "lm_head"}
    jobs = [(name, nk, m) for name, nk in shapes.items() for m in tokens]
    records = []
    for name, (n, k), m in progress_bar(jobs, desc="fp8 prompt-step projections", enabled=progress):
        records += _time_prefill(name, n, k, m, repeats)
    return pd.DataFrame(records)


def _time_prefill(name: str, n: int, k: int, m: int, repeats: int) -> list[dict]:
    from nanolab.lab.timing import time_us

    device = torch.device("cuda")
    w = torch.randn(n, k, dtype=torch.bfloat16, device=device) / k**0.5
    q, scale = quantize_fp8(w)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    ref = x.double() @ (q.double() * scale.double()[:, None]).T
    scale_bf16 = scale.to(torch.bfloat16)
    arms = {"bf16 F.linear": (lambda: F.linear(x, w), 2 * n * k),
            WIDENED: (lambda: F.linear(x, q.to(torch.bfloat16)).mul_(scale_bf16), n * k + 4 * n),
            ENGINE: (lambda: fp8_linear(x, q, scale), n * k + 4 * n)}
    for c in CONFIGS:
        for dot in ("x", "f16"):
            arms[f"fp8 w8a16 {c.name()} dot {dot}"] = (lambda c=c, dot=dot: w8a16_linear(x, q, scale, c, dot),
                                                      n * k + 4 * n)
    records = []
    for arm, (fn, weight_bytes) in arms.items():
        row = {"projection": name, "n": n, "k": k, "tokens": m, "arm": arm}
        try:
            err = NAN if arm == "bf16 F.linear" else float((fn().double() - ref).abs().max() / ref.abs().max())
            us = time_us(fn, device, repeats)
            row.update(us=us, tb_s=weight_bytes / us / 1e6, rel_err=err)
        except Exception as e:  # a tile this card cannot build is a row that says so
            row.update(us=NAN, tb_s=NAN, rel_err=NAN, error=f"{type(e).__name__}: {e}"[:200])
        records.append(row)
    return records


def layer_prefill(table: pd.DataFrame) -> pd.DataFrame:
    """Per token count: a layer's four projections summed for each arm of `prefill_table` but the
    tiles, and for the W8A16 kernel at each projection's fastest tile and dot."""
    ok = table.dropna(subset=["us"])
    best = ok[ok.arm.str.startswith("fp8 w8a16")].sort_values("us").groupby(["projection", "tokens"]).head(1)
    parts = [ok[~ok.arm.str.startswith("fp8 w8a16")], best.assign(arm="fp8 w8a16 (each projection's best tile)")]
    return (pd.concat(parts).groupby(["tokens", "arm"]).us.sum().unstack("arm").reset_index())
