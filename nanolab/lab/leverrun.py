"""The floor chapter's waterfall: one decode step's time with each lever of `leverarms.ARMS` pulled
in turn (`run_levers`), and a committed run of it shown as the chapter shows it (`show_lever_run`).
Day 61.

CUDA only. Every arm is a graphed engine over the same weights, built with its own config and
forward (`leverarms.lever_engine`), so the arms read as a waterfall: the step before, then each
lever added to the one before it. A step is timed as the engine runs it (`lab.timing.time_engine`),
host work included; a profile of graphed steps at one shape splits the GPU's part by kernel class
(`stepparts.breakdown`), and the rest of the step is the host's. Nothing here asserts a time.

    python -m nanolab levers --model llama-3.2-1b
"""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import torch

from nanolab import load_model
from nanolab.engine.block_manager import cdiv
from nanolab.lab.agreement import LogitsSampler, decode_logits
from nanolab.lab.capturebench import _profile, rows_equal
from nanolab.lab.costs import kv_read_bytes, weight_bytes
from nanolab.lab.leverarms import DEFAULT_ARMS, lever_engine, release_arm_memory
from nanolab.lab.reference import engine_greedy
from nanolab.lab.report import load_table, measured_table, show
from nanolab.lab.stepparts import breakdown, replay_ms, step_anatomy
from nanolab.lab.timing import copy_bandwidth, random_prompts, time_engine
from nanolab.progress import progress_bar


def run_levers(model_path, dtype=torch.bfloat16, shapes=((1, 128), (8, 128), (32, 128), (64, 128), (32, 2048)),
               arms=DEFAULT_ARMS, steps: int = 32, repeats: int = 3, profile_shapes=((1, 128),), block_size: int = 16,
               progress: bool = True, checkpoint: Callable[[dict[str, pd.DataFrame]], None] | None = None
               ) -> dict[str, pd.DataFrame]:
    """Tables `day61_levers` (arm, batch, context, ms_per_step, floor_ms, x_floor, build_s, the step's
    anatomy and its replay alone), `day61_parts` (arm, part, ms at each of `profile_shapes`),
    `day61_lever_profile` (its kernels) and `day61_lever_agreement` (greedy tokens and first-step
    logits of each arm against the first). `checkpoint`, when given, gets the tables so far after
    each arm, so a run cut short keeps its finished arms. Each arm compiles afresh, with inductor's
    caches off, as in a new process on a new machine: two arms whose graphs are the same (one that
    changes only how batch 1 is tuned, say) would otherwise share the first one's tuned kernels."""
    device = torch.device("cuda")
    model = load_model(model_path, dtype=dtype, device=device)
    config = model.config
    max_batch = max(b for b, _ in shapes)
    num_blocks = max_batch * (cdiv(max(c for _, c in shapes), block_size) + 2) + 16
    fields = dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_batch)
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(model)
    check = random_prompts(8, 64, config.vocab_size, seed=1).tolist()
    records, parts, profiles, agreement, first = [], [], [], [], None
    for lever in progress_bar(arms, desc="levers", enabled=progress):
        torch._dynamo.reset()
        sampler = LogitsSampler()
        with torch._inductor.config.patch(force_disable_caches=True):
            engine, build_s = lever_engine(model, lever, sampler, **fields)
            for batch, context in shapes:
                prompts = random_prompts(batch, context - steps, config.vocab_size)
                timing = time_engine(engine, prompts, steps, repeats, lever.name)
                floor = (weights + kv_read_bytes(config, batch, context, dtype)) / bandwidth * 1000
                records.append({"arm": lever.name, "batch": batch, "context": context,
                                "ms_per_step": timing.ms_per_step, "floor_ms": floor,
                                "x_floor": timing.ms_per_step / floor, "build_s": build_s,
                                "bandwidth_tb_s": bandwidth / 1e12, **step_anatomy(engine, prompts, steps),
                                "replay_ms": replay_ms(engine, batch)})
                if (batch, context) in set(map(tuple, profile_shapes)):
                    profile = _profile(engine, prompts, steps, lever.name).assign(batch=batch, context=context)
                    profiles.append(profile)
                    parts.append(breakdown(profile, timing.ms_per_step).assign(arm=lever.name, batch=batch,
                                                                               context=context))
            tokens, logits = engine_greedy(engine, check, 32), decode_logits(engine, check, sampler)
        first = first or (tokens, logits)
        agreement.append({"arm": lever.name, "rows": len(check), "steps": 32,
                          "rows equal to the first arm": rows_equal(tokens, first[0]),
                          "logits rel err to the first arm": float((logits - first[1]).norm() / first[1].norm())})
        del engine
        release_arm_memory()
        if checkpoint is not None:
            checkpoint(_lever_tables(records, parts, agreement, profiles))
    return _lever_tables(records, parts, agreement, profiles)


def _lever_tables(records, parts, agreement, profiles) -> dict[str, pd.DataFrame]:
    tables = {"day61_levers": pd.DataFrame(records), "day61_lever_agreement": pd.DataFrame(agreement)}
    if parts:
        tables["day61_parts"] = pd.concat(parts, ignore_index=True)
        tables["day61_lever_profile"] = pd.concat(profiles, ignore_index=True)
    return tables


def show_lever_run(stem: str, values: str, command: str, slug: str = "h200"
                   ) -> tuple[pd.DataFrame, pd.DataFrame, list[str]] | None:
    """A partial levers run committed under `stem` (`levers --stem STEM`), shown as a chapter shows
    it: its label, `values` by batch and arm, and the parts by arm of each profiled batch (a part
    an arm lacks is 0). Returns (levers table, the smallest profiled batch's parts by arm, arms in
    run order), or None with how to make it (`command`) when data/ lacks it."""
    levers = measured_table(f"{stem}_levers", command, slug)
    parts = load_table(f"{stem}_parts", slug)  # the same run's
    if levers is None:
        return None
    if parts is None:
        print(f"data/{stem}_parts_{slug}.csv, the same run's parts, is missing: `{command}` makes both")
        return None
    order = list(dict.fromkeys(levers.arm))
    show(levers.pivot_table(index=["batch", "context"], columns="arm", values=values)[order].round(3))
    by_batch = {b: p.pivot_table(index="part", columns="arm", values="ms", aggfunc="sum")[order].fillna(0.0)
                for b, p in parts.groupby("batch")}
    for b, by_arm in by_batch.items():
        if len(by_batch) > 1:
            print(f"batch {b}, ms per step by part:")
        show(by_arm.round(3))
    return levers, by_batch[min(by_batch)], order
