"""What a kernel of the engine's holds on an NVIDIA GPU, read without one: Triton compiles it for
an architecture (sm_90 by default: the H100's and the H200's) and the `cuobjdump` its wheel ships
reads the binary's resource usage. Registers a thread, bytes spilled to the stack and to local
memory, and static shared memory. Day 64c reads the varlen read's kernel (`_varlen_group`) at the
engine's launch, with wide and narrow offsets; `gemv_resources` reads the fp8 decode GEMV
(`kernels.gemv._gemv`, e4m3 weights against bf16 rows on fp16 tensor cores) at `step_config`'s
tiles for Llama-3.2-1B's projections, at the engine's 4 warps and at 8.

A CPU process runs the engine's kernels in Triton's interpreter (`nanolab.kernels`), whose kernels
cannot be compiled, so each compile runs in a child interpreter whose environment turns the
interpreter off; this process's environment is left as it is.

The numbers are the compiler's, not a timing: they say whether a kernel spills, not how fast it
runs. The Triton that compiles them is this machine's, which may not be the GPU image's.

    python -m nanolab kernelres                 # both tables: day64c_kernel_resources, day65_gemv_resources
    python -m nanolab kernelres --kernels gemv
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from nanolab.lab.report import RunLabel, run_label, save_table


class VarlenLaunch(NamedTuple):
    narrow: bool
    splits: int
    num_stages: int  # the engine's: 2 for an unsplit walk, Triton's default (3) for a split one
    persistent: bool = False  # programs that loop over the step's query tiles (`varlen_attention`'s programs)


# The engine's launch of the read after a cached prefix (8 shares) and of an unsplit one, each with
# 64-bit addresses for K and V apart and with shared int32 offsets, then the narrow ones as
# persistent programs.
LAUNCHES = (*(VarlenLaunch(narrow, splits, 3 if splits > 1 else 2) for splits in (8, 1) for narrow in (False, True)),
            *(VarlenLaunch(True, splits, 3 if splits > 1 else 2, True) for splits in (8, 1)))
_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def parse_usage(text: str) -> dict[str, int]:
    """`cuobjdump -res-usage`'s line for a kernel -> registers, stack, shared and local bytes."""
    found = _USAGE.search(text)
    if found is None:
        raise ValueError(f"no resource usage in cuobjdump's output: {text[-300:]!r}")
    reg, stack, shared, local = (int(x) for x in found.groups())
    return {"registers": reg, "stack_bytes": stack, "shared_static_bytes": shared, "local_bytes": local}


def _cuobjdump() -> Path:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        raise FileNotFoundError(f"Triton's wheel ships no cuobjdump here ({tool})")
    return tool


def _usage(fn, signature: dict[str, str], constants: dict, arch: int, num_warps: int, num_stages: int
           ) -> dict[str, int]:
    """In the child: `fn` compiled for sm_`arch` (`signature` every parameter's type in order,
    "constexpr" for those `constants` gives), its binary's resource usage read by cuobjdump."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    source = ASTSource(fn=fn, signature=signature, constexprs={(names.index(c),): v for c, v in constants.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        out = subprocess.run([str(_cuobjdump()), "-res-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    return parse_usage(out)


def _compile_varlen(launches: list[list], arch: int) -> list[dict]:
    """In the child: compile `_varlen_group` for each launch (Llama-3.2-1B's heads: 8 KV heads of 4
    query heads, head_dim 64, bf16 pools, the engine's 64 x 64 tiles and 4 warps, a captured step's
    flat grid) and read each binary's resource usage."""
    from nanolab.kernels.varlen_attention import BLOCK_M, BLOCK_N, _varlen_group

    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", table_ptr="*i32", rows_ptr="*i64",
                    starts_ptr="*i64", lens_ptr="*i64", pos_ptr="*i64", out_ptr="*bf16", acc_ptr="*fp32",
                    m_ptr="*fp32", l_ptr="*fp32")
    ints = ("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_tr", "stride_ot",
            "stride_oh")
    rows = []
    for narrow, splits, stages, persistent in launches:
        constants = dict(GROUP=4, G=4, BLOCK_Q=BLOCK_M // 4, BLOCK_N=BLOCK_N, D=64, PAGE=16, DOT=2, FLAT=True,
                         SPLITS=splits, SHARE_TILES=4, SEG=64, NARROW=narrow, PERSISTENT=persistent)
        signature = {**pointers, **dict.fromkeys(ints, "i32"), "scale": "fp32", "head_dim": "i32", "segments": "i32",
                     **dict.fromkeys(constants, "constexpr")}
        rows.append({"kernel": "_varlen_group", "narrow": narrow, "persistent": persistent, "splits": splits,
                     "num_stages": stages,
                     "arch": f"sm_{arch}", **_usage(_varlen_group, signature, constants, arch, 4, stages)})
    return rows


def _compile_gemv(jobs: list[list], arch: int) -> list[dict]:
    """In the child: compile the fp8 decode GEMV for each (projection, n, k, rows, num_warps), at
    `step_config(n, k, rows, element_size=1)`'s tiles and stages, as `fp8_linear` launches it (bf16
    rows, "mma_f16", scaled, programmatic dependent), and read each binary's resource usage."""
    from nanolab.kernels.gemv import _gemv, block_rows, step_config

    rows = []
    for name, n, k, m, warps in jobs:
        cfg = step_config(n, k, m, element_size=1)
        signature = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", out_ptr="*bf16" if cfg.split_k == 1 else "*fp32", M="i32",
                         N="i32", K="i32", stride_xm="i32", stride_wn="i32", stride_om="i32", stride_os="i32")
        constants = dict(BLOCK_M=block_rows(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                         PDL=True, PRECISION="ieee", g_ptr=None, res_ptr=None, stride_rm=0, eps=0.0, NORM=False,
                         SWIGLU=False, RESIDUAL=False)
        signature.update(dict.fromkeys(constants, "constexpr"))
        signature.update(s_ptr="*fp32", SCALED="constexpr", DOT="constexpr")
        constants.update(SCALED=True, DOT="mma_f16")
        rows.append({"kernel": "_gemv", "projection": name, "n": n, "k": k, "rows": m, "block_n": cfg.block_n,
                     "block_k": cfg.block_k, "split_k": cfg.split_k, "num_stages": cfg.num_stages,
                     "num_warps": warps, "arch": f"sm_{arch}",
                     **_usage(_gemv, signature, constants, arch, warps, cfg.num_stages)})
    return rows


def _in_child(function: str, payload: list, arch: int, timeout_s: float) -> pd.DataFrame:
    """`function` of this module run in a child interpreter with Triton's interpreter off."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = (f"import json, sys; from nanolab.lab.kernelres import {function}; "
            f"print(json.dumps({function}(json.loads(sys.argv[1]), int(sys.argv[2]))))")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(payload), str(arch)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"compiling for sm_{arch} failed: {done.stderr.strip()[-800:]}")
    return pd.DataFrame(json.loads(done.stdout.strip().splitlines()[-1]))


def gemv_resources(rows: Sequence[int] = (1, 8), warps: Sequence[int] = (4, 8), arch: int = 90,
                   timeout_s: float = 600.0) -> pd.DataFrame:
    """A row per (projection, rows, warps): the fp8 decode GEMV for Llama-3.2-1B's layer
    projections compiled for `arch` (`_compile_gemv`), registers a thread and spilled bytes."""
    if not rows or not warps or any(w not in (1, 2, 4, 8, 16) for w in warps) or any(m < 1 for m in rows):
        raise ValueError(f"rows must be positive and warps powers of two up to 16, got {list(rows)} and {list(warps)}")
    from nanolab.lab.gemvbench import projection_shapes
    from nanolab.model.config import PRESETS

    shapes = projection_shapes(PRESETS["llama-3.2-1b"])  # the preset's shapes: no weights are made
    jobs = [[name, n, k, m, w] for name, (n, k) in shapes.items() if name != "lm_head" for m in rows for w in warps]
    return _in_child("_compile_gemv", jobs, arch, timeout_s)


def varlen_resources(launches: Sequence[VarlenLaunch] = LAUNCHES, arch: int = 90, timeout_s: float = 600.0
                     ) -> pd.DataFrame:
    """A row per launch: the varlen read's kernel compiled for `arch`, its registers a thread and
    its spilled and shared bytes (`_compile_varlen`, in a child interpreter with Triton's
    interpreter off)."""
    if not launches:
        raise ValueError("launches: name at least one")
    return _in_child("_compile_varlen", [list(x) for x in launches], arch, timeout_s)


def resources_label() -> RunLabel:
    """A compile on this machine, for a GPU it may not have: the label names this machine."""
    return run_label("cpu", "none (Llama-3.2-1B's shapes; a compile, not a run)", "bfloat16",
                     weights="synthesized random")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", type=int, default=90, help="the NVIDIA architecture, e.g. 90 for sm_90 (default)")
    parser.add_argument("--kernels", default="varlen,gemv",
                        help="which: varlen (data/<prefix>_kernel_resources_cpu.csv, prefix day64c by default), "
                             "gemv (the fp8 decode GEMV, data/<prefix>_gemv_resources_cpu.csv, day65); default both")
    parser.add_argument("--prefix", default=None, help="both tables' prefix, in place of day64c and day65")


def main(args: argparse.Namespace) -> int:
    # From Ampere on (sm_80), up to what Triton's PTX backend knows; an e4m3 weight (the GEMV) needs sm_89.
    if not 80 <= args.arch <= 121:
        raise ValueError(f"--arch: {args.arch} is not an NVIDIA architecture this compiles for (80 to 121)")
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels or set(kernels) - {"varlen", "gemv"}:
        raise ValueError(f"--kernels: {args.kernels!r} must name varlen, gemv or both")
    if "gemv" in kernels and args.arch < 89:
        raise ValueError(f"--arch: {args.arch} has no e4m3 (fp8) type, which the gemv kernel reads; 89 or newer")
    label = resources_label()
    for kernel in kernels:
        table = varlen_resources(arch=args.arch) if kernel == "varlen" else gemv_resources(arch=args.arch)
        prefix = args.prefix or ("day64c" if kernel == "varlen" else "day65")
        stem = f"{prefix}_kernel_resources" if kernel == "varlen" else f"{prefix}_gemv_resources"
        path = save_table(table, stem, label)
        print(table.to_string(index=False))
        print(f"{path.name}: {label}")
    return 0
