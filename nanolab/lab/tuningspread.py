"""How far inductor's tuning of the batch-1 step moves it from one compile to the next: each arm
compiled afresh several times and timed (`tuning_spread`), with what coordinate descent chose and
timed while tuning (`recording_tuning`). Day 61.

    python -m nanolab levers --only spread --trials 3 --model llama-3.2-1b
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pandas as pd
import torch
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from nanolab import load_model
from nanolab.engine.block_manager import cdiv
from nanolab.lab.capturebench import _profile
from nanolab.lab.leverarms import SPREAD_ARMS, lever_engine, release_arm_memory
from nanolab.lab.stepparts import replay_ms
from nanolab.lab.timing import random_prompts, time_engine
from nanolab.progress import progress_bar

NAN = float("nan")


@contextlib.contextmanager
def recording_tuning(configs: list[dict], timings: list[dict] | None = None):
    """While inside, every config inductor's coordinate descent settles on is appended to `configs`
    (kernel, config), and, into `timings` when given, every timing its benchmarker returned (kernel,
    config, us). Kernels are named as inductor names them, which two graphs compiled inside may
    share. Wraps `CachingAutotuner`'s two methods (inductor's, not the engine's) and puts them back
    after."""
    tune, bench = CachingAutotuner.coordinate_descent_tuning, CachingAutotuner.bench

    def recorded_tune(self, launcher, *args, **kwargs):
        best = tune(self, launcher, *args, **kwargs)
        configs.append({"kernel": self.inductor_meta.get("kernel_name"), "config": config_text(best.config)})
        return best

    def recorded_bench(self, launcher, *args, **kwargs):
        ms = bench(self, launcher, *args, **kwargs)
        if timings is not None:
            timings.append({"kernel": self.inductor_meta.get("kernel_name"), "config": config_text(launcher.config),
                            "us": 1000 * float(ms)})
        return ms

    CachingAutotuner.coordinate_descent_tuning, CachingAutotuner.bench = recorded_tune, recorded_bench
    try:
        yield
    finally:
        CachingAutotuner.coordinate_descent_tuning, CachingAutotuner.bench = tune, bench


def config_text(config) -> str:
    """A Triton config as "XBLOCK: 4, R0_BLOCK: 2048, num_warps: 16": its block sizes and warps, and
    its stages where not 1 (inductor's reductions use one)."""
    parts = [f"{k}: {v}" for k, v in config.kwargs.items()] + [f"num_warps: {config.num_warps}"]
    return ", ".join(parts + ([f"num_stages: {config.num_stages}"] if config.num_stages != 1 else []))


def tuning_spread(model_path, dtype=torch.bfloat16, arms=SPREAD_ARMS, trials: int = 3, steps: int = 32,
                  repeats: int = 3, context: int = 128, progress: bool = True,
                  checkpoint: Callable[[dict[str, pd.DataFrame]], None] | None = None) -> dict[str, pd.DataFrame]:
    """Tables `day61_tuning_spread` (arm, trial, ms_per_step, replay_ms, build_s at batch 1), `day61_spread_profile`
    (each trial's kernels), `day61_configs` (the config coordinate descent chose for each kernel, with the fastest
    time its benchmarker gave that config while tuning, `tuning_us`) and `day61_tuning_timings` (the same for every
    config it timed): every arm's batch-1 engine built `trials` times with inductor's caches off, so coordinate
    descent tunes each kernel anew, and timed as `run_levers` times a step. The spread between trials of one arm is
    the tuning's, not the code's. Arms alternate trial by trial, so drift on the card falls on both."""
    device = torch.device("cuda")
    model = load_model(model_path, dtype=dtype, device=device)
    prompts = random_prompts(1, context - steps, model.config.vocab_size)
    fields = dict(num_blocks=cdiv(context, 16) + 18, block_size=16, max_num_seqs=1)
    records, profiles, configs, timings = [], [], [], []
    jobs = [(trial, lever) for trial in range(trials) for lever in arms]
    for trial, lever in progress_bar(jobs, desc="tuning spread", enabled=progress):
        torch._dynamo.reset()
        chosen, timed = [], []
        with torch._inductor.config.patch(force_disable_caches=True), recording_tuning(chosen, timed):
            engine, build_s = lever_engine(model, lever, **fields)
            timing = time_engine(engine, prompts, steps, repeats, lever.name)
            records.append({"arm": lever.name, "trial": trial, "batch": 1, "context": context,
                            "ms_per_step": timing.ms_per_step, "replay_ms": replay_ms(engine, 1), "build_s": build_s})
            profiles.append(_profile(engine, prompts, steps, lever.name).assign(trial=trial, batch=1, context=context))
        fastest = pd.DataFrame(timed, columns=["kernel", "config", "us"]).groupby(["kernel", "config"]).us.min()
        configs += [{"arm": lever.name, "trial": trial, **c, "tuning_us": fastest.get((c["kernel"], c["config"]), NAN)}
                    for c in chosen]
        timings += [{"arm": lever.name, "trial": trial, "kernel": kernel, "config": config, "tuning_us": us}
                    for (kernel, config), us in fastest.items()]
        del engine
        release_arm_memory()
        if checkpoint is not None:
            checkpoint(_spread_tables(records, profiles, configs, timings))
    return _spread_tables(records, profiles, configs, timings)


def once_a_step(profile: pd.DataFrame, steps: int = 32) -> pd.DataFrame:
    """Per (arm, trial) of a `tuning_spread` profile, the longest kernel a step launches once: at
    batch 1 the LM head, whose 525 MB (Llama-3.2-1B) dwarf the sampler's and the first norm's.
    Columns arm, trial, kernel, us_per_step."""
    once = profile[profile.calls == steps]
    longest = once.loc[once.groupby(["arm", "trial"]).us_per_step.idxmax()]
    return longest[["arm", "trial", "kernel", "us_per_step"]].reset_index(drop=True)


def _spread_tables(records, profiles, configs, timings) -> dict[str, pd.DataFrame]:
    columns = ["arm", "trial", "kernel", "config", "tuning_us"]
    return {"day61_tuning_spread": pd.DataFrame(records),
            "day61_spread_profile": pd.concat(profiles, ignore_index=True),
            "day61_configs": pd.DataFrame(configs, columns=columns),
            "day61_tuning_timings": pd.DataFrame(timings, columns=columns)}
