"""`python -m nanolab levers`: the floor chapter's instruments on the command line, each table saved
to data/ as it comes. Day 61. CUDA only.

- the default: each projection alone (`gemvbench.projection_table`), then the waterfall of
  `leverarms.DEFAULT_ARMS` (`leverrun.run_levers`); `--arms` picks arms of `leverarms.ARMS` by index
- `--only levers`, `--only projections`: one of the two
- `--only chain`, `--only folds`: the projections back to back, and with their neighbours folded in
  (`gemvbench`)
- `--only spread`: fresh compiles of the batch-1 step (`tuningspread.tuning_spread`)
- `--only agreement`: bf16 against fp32 (`agreement.fp32_agreement`)
- `--only mixed`, `--only mixedhost`: a mixed step's parts (`mixedsteps`)
- `--only loop`: what the GPU runs between two replays (`steploop.step_loop`)

    python -m nanolab levers --model llama-3.2-1b
"""

from __future__ import annotations

import argparse

import pandas as pd
import torch

from nanolab import LLM
from nanolab.config import CUDAGRAPH_MODES, resolve_dtype
from nanolab.lab.agreement import fp32_agreement
from nanolab.lab.gemvbench import chained_projection_table, fold_table, projection_table
from nanolab.lab.leverarms import ARMS, DEFAULT_ARMS, SPREAD_ARMS
from nanolab.lab.leverrun import run_levers
from nanolab.lab.mixedsteps import mixed_host_parts, mixed_step_anatomy
from nanolab.lab.report import run_label, save_table
from nanolab.lab.steploop import step_loop
from nanolab.lab.tuningspread import tuning_spread
from nanolab.model.config import ModelConfig
from nanolab.model.weights import resolve_weights, weights_kind

ONLY = ("levers", "projections", "chain", "agreement", "spread", "folds", "mixed", "loop", "mixedhost")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default=None, choices=ONLY)
    parser.add_argument("--trials", type=int, default=None, help="--only spread: fresh compiles of each arm "
                        "(default 3)")
    parser.add_argument("--arms", default=None, help="comma-separated indices into leverarms.ARMS (default: the "
                        "kept levers, DEFAULT_ARMS; --only spread: SPREAD_ARMS)")
    parser.add_argument("--shapes", default=None, help="batch@context pairs, comma-separated (default: 1@128, 8@128, "
                        "32@128, 64@128, 32@2048)")
    parser.add_argument("--cudagraph-modes", default="full_decode_only",
                        help="--only mixed: comma-separated cudagraph_mode values, an arm each (full_decode_only: "
                             "varlen steps eager; full: graphed)")
    parser.add_argument("--profile", default="1@128", help="batch@context pairs to profile, comma-separated")
    parser.add_argument("--stem", default="day61", help="table names' prefix: a partial run under its own name "
                        "leaves the full tables as they are")


def parse_shapes(text: str, flag: str = "--shapes") -> tuple[tuple[int, int], ...]:
    """"1@128,8@128" -> ((1, 128), (8, 128)); refuses anything else, naming `flag`."""
    try:
        shapes = tuple(tuple(int(x) for x in part.split("@")) for part in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"{flag}: expected batch@context pairs such as 1@128,8@128, got {text!r}")
    return shapes


def parse_arms(text: str | None, default: tuple) -> tuple:
    """"0,4,12" -> those arms of `leverarms.ARMS`; None -> `default`. Refuses anything else, naming --arms."""
    if text is None:
        return default
    try:
        indices = [int(i) for i in text.split(",")]
    except ValueError:
        indices = []
    if not indices or any(not 0 <= i < len(ARMS) for i in indices):
        raise ValueError(f"--arms: expected comma-separated indices from 0 to {len(ARMS) - 1} into leverarms.ARMS, "
                         f"got {text!r}")
    return tuple(ARMS[i] for i in indices)


def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise ValueError("the levers bench needs a CUDA device")
    if args.trials is not None and args.trials < 1:
        raise ValueError(f"--trials must be at least 1, got {args.trials}")
    path = resolve_weights(args.model)
    dtype = resolve_dtype(args.dtype, torch.device("cuda"))
    label = run_label(torch.device("cuda"), args.model, dtype, weights=weights_kind(path))
    tables = {}

    def keep(new: dict[str, pd.DataFrame]) -> None:  # saved as they come: a later arm's failure loses nothing
        new = {name.replace("day61", args.stem, 1): table for name, table in new.items()}
        for name, table in new.items():
            print(f"{name}: {save_table(table, name, label)}", flush=True)
        tables.update(new)

    def shown(name: str) -> pd.DataFrame:
        return tables[f"{args.stem}_{name}"]

    if args.only == "agreement":
        keep({"day61_fp32_agreement": fp32_agreement(path)})
        print(shown("fp32_agreement").to_string(index=False))
        return 0
    if args.only == "spread":
        keep(tuning_spread(path, dtype, arms=parse_arms(args.arms, SPREAD_ARMS), trials=args.trials or 3,
                           steps=args.steps, repeats=args.repeats, checkpoint=keep))
        spread = shown("tuning_spread")
        print(spread.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        print(spread.groupby("arm").ms_per_step.describe().to_string(float_format="{:.3f}".format))
        return 0
    if args.only == "chain":
        keep({"day61_chained_projections": chained_projection_table(ModelConfig.from_dir(path), dtype)})
        c = shown("chained_projections")
        best = c[c.arm != "cublas"].sort_values("us").groupby("projection").head(3)
        print(pd.concat([c[c.arm == "cublas"], c[c.arm.str.contains("step_config")], best]).to_string(index=False))
        return 0
    if args.only == "mixed":
        modes = tuple(args.cudagraph_modes.split(","))
        unknown = [m for m in modes if m not in CUDAGRAPH_MODES]
        if unknown:
            raise ValueError(f"--cudagraph-modes: {', '.join(unknown)} not among {', '.join(CUDAGRAPH_MODES)}")
        keep(mixed_step_anatomy(path, dtype, repeats=args.repeats, modes=modes))
        print(shown("mixed_anatomy").to_string(index=False, float_format=lambda x: f"{x:.3f}"))
        kernels = tables.get(f"{args.stem}_mixed_kernels")
        if kernels is not None:
            print(kernels.groupby("arm", sort=False).head(12).to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "mixedhost":
        keep(mixed_host_parts(path, dtype, repeats=args.repeats))
        print(shown("mixed_host").drop(columns=["running_rows", "context", "budget"]).to_string(
            index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "loop":
        llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=64, enable_chunked_prefill=False)
        keep(step_loop(llm))
        print(shown("loop").to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(shown("loop_ops").to_string(index=False, float_format=lambda x: f"{x:.1f}"))
        print(label.caption())
        return 0
    if args.only == "folds":
        keep({"day61_folds": fold_table(ModelConfig.from_dir(path), dtype)})
        print(shown("folds").to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        return 0
    # refused before any table is made
    arms, profile = parse_arms(args.arms, DEFAULT_ARMS), parse_shapes(args.profile, "--profile")
    shapes = {} if args.shapes is None else {"shapes": parse_shapes(args.shapes)}
    if args.only != "levers":
        keep({"day61_projections": projection_table(ModelConfig.from_dir(path), dtype)})
    if args.only != "projections":
        keep(run_levers(path, dtype, arms=arms, steps=args.steps, repeats=args.repeats, profile_shapes=profile,
                        checkpoint=keep, **shapes))
    fmt = dict(index=False, float_format=lambda x: f"{x:.3f}")
    if f"{args.stem}_projections" in tables:
        p = shown("projections")
        best = p[p.arm.str.startswith("gemv")].sort_values("us").groupby(["projection", "rows"]).head(1)
        print(best.to_string(**fmt))
        print(p[p.arm.isin(("cublas", "gemv"))].pivot_table(index=["projection", "rows"], columns="arm",
                                                             values="us").to_string(float_format="{:.1f}".format))
    for name in ("parts", "lever_agreement", "levers"):
        if f"{args.stem}_{name}" in tables:
            print(shown(name).to_string(**fmt))
    print(label.caption())
    return 0
