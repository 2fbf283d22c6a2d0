"""The host's work a decode step, by kind of step, where the device has next to nothing to do
(Day 65): what a chained verify step costs the host against a plain one, and so whether the
chain can keep ahead of a real model's step.

One greedy request over the `tiny` preset, whose decode steps run a stand-in forward handed to the
engine (`forward=`): its logits point every token at the next one of a fixed cycle of `CYCLE`
tokens, whatever the cache holds. The prompt is that cycle over and over, so prompt lookup always
finds drafts, and all of them are kept. The stand-in is one gather: a step's device time is small
next to the host's, and on CUDA a graph replays it as it would a model. Three arms, each its own
engine with the engine's defaults for the device otherwise:

- "decode": no speculation, under asynchronous scheduling: the chain's baseline;
- "sync verify": speculation with `async_scheduling` off, each verify step read back before the
  next is planned;
- "chained": speculation under asynchronous scheduling;
- "chained, no match": the same engine over a cycle of `LONG_CYCLE` tokens, its prompt and its
  output a stretch of the cycle that never repeats, so that no lookup finds a draft: what the chain
  costs a step that carries none (this arm's requests stop short of the cycle's end).

`async_scheduling` is set for each arm (CUDA graphs make it the default; on the CPU it is off
unless asked for).

A row per arm and repeat: steps (`Engine.step` calls that ran a forward), tokens emitted, drafts
proposed and kept (the prompt's step runs the tiny model itself, so the first token is off the
cycle and a few drafts after it miss), and the wall time per step and per token. On the CPU the
read's inputs (the slot mapping, the mask) are host work too, since there the device is the
host: read CUDA's table for what a GPU step costs the host.

    python -m nanolab hostbench
    python -m nanolab hostbench --device cpu --k 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch

from nanolab.config import EngineConfig, SpeculativeConfig, resolve_device, resolve_dtype
from nanolab.engine.llm_engine import Engine
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.report import run_label, save_table
from nanolab.model.config import PRESETS
from nanolab.model.llama import LlamaModel
from nanolab.sampling import SamplingParams

ARMS = ("decode", "sync verify", "chained", "chained, no match")
CYCLE = 24  # tokens 100 .. 123, each followed by the next
LONG_CYCLE = 400  # tokens 100 .. 499: "chained, no match"'s, longer than its prompt and output together
NO_K = ("decode", "chained, no match")  # arms whose steps carry no drafts: run once, whatever k


def arm_cycle(arm: str) -> int:
    """The length of the cycle `arm`'s forward and prompts follow."""
    return LONG_CYCLE if arm == "chained, no match" else CYCLE


class CycleForward:
    """A decode forward whose logits [batch, 1, vocab] fp32 put token 100 + (t - 99) % cycle after
    each fed token t of 100 .. 99 + cycle, and 100 after any other: one gather from a fixed table."""

    def __init__(self, vocab_size: int, device: torch.device, cycle: int = CYCLE) -> None:
        if not 1 <= cycle <= vocab_size - 100:
            raise ValueError(f"cycle={cycle}: must fit the vocabulary's ids 100 .. {vocab_size - 1}")
        nxt = torch.full((vocab_size,), 100, dtype=torch.int64)
        nxt[100:100 + cycle] = 100 + (torch.arange(cycle) + 1) % cycle
        self.table = torch.full((vocab_size, vocab_size), -1.0, device=device)
        self.table[torch.arange(vocab_size), nxt.to(device)] = 1.0

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache=None) -> torch.Tensor:
        return self.table[ids.view(-1)][:, None, :]


def make_engine(arm: str, device: torch.device, k: int) -> Engine:
    """The `tiny` preset's engine for `arm`, decode steps through `CycleForward`."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}: must be one of {', '.join(ARMS)}")
    torch.manual_seed(0)
    model = LlamaModel(PRESETS["tiny"]).to(device=device, dtype=resolve_dtype("auto", device)).eval()
    spec = None if arm == "decode" else SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2,
                                                          max_draft_backoff=0)
    overlap = arm != "sync verify"
    config = EngineConfig(model="tiny", device=device, num_blocks=1024, speculative_config=spec,
                          async_scheduling=overlap)
    return Engine(model, config, forward=CycleForward(model.config.vocab_size, device, arm_cycle(arm)), progress=False)


def run_request(engine: Engine, tokens: int, prompt_len: int, cycle: int = CYCLE) -> tuple[int, int, float]:
    """One greedy request of `tokens` new tokens over a prompt of the cycle's tokens in order,
    stepped to its end: (steps that ran a forward after the prompt's, tokens emitted, seconds). The
    prompt's step is run first, untimed."""
    prompt = [100 + i % cycle for i in range(prompt_len)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
    engine.step()  # the prompt and its first token
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += engine.last_step is not None
    seconds = time.perf_counter() - start  # the last step was read back: the device is done
    return steps, tokens, seconds


def run_hostbench(device: str | None = None, k: int = 8, tokens: int = 512, prompt_len: int = 96,
                  repeats: int = 5, arms=ARMS, log=print) -> pd.DataFrame:
    """A row per arm and repeat, each arm's engine warmed by one untimed request."""
    dev = resolve_device(device)
    for name, value in (("k", k), ("tokens", tokens), ("prompt_len", prompt_len), ("repeats", repeats)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int")
    if prompt_len < CYCLE + 2:
        raise ValueError(f"prompt_len={prompt_len}: the prompt must hold the cycle of {CYCLE} and a match after it")
    room = PRESETS["tiny"].max_position_embeddings - prompt_len - 1  # the prompt's step gives a token untimed
    if tokens > room:
        raise ValueError(f"tokens={tokens}: a timed request holds at most {room} new tokens after its "
                         f"{prompt_len}-token prompt in the tiny model's context")
    if "chained, no match" in arms and prompt_len + 66 > LONG_CYCLE:
        raise ValueError(f"prompt_len={prompt_len}: the no-match arm's prompt and warm-up request must fit "
                         f"the cycle of {LONG_CYCLE}")
    rows = []
    for arm in arms:
        engine = make_engine(arm, dev, k)
        cycle = arm_cycle(arm)
        n = min(tokens, cycle - prompt_len - 2) if cycle == LONG_CYCLE else tokens  # never back to the prompt
        run_request(engine, 64, prompt_len, cycle)
        for r in range(repeats):
            drafts, kept = engine.spec_draft_tokens, engine.spec_accepted_tokens
            steps, emitted, seconds = run_request(engine, n, prompt_len, cycle)
            rows.append({"arm": arm, "k": 0 if arm == "decode" else k, "repeat": r, "steps": steps, "tokens": emitted,
                         "drafts": engine.spec_draft_tokens - drafts, "kept": engine.spec_accepted_tokens - kept,
                         "us_per_step": 1e6 * seconds / steps, "us_per_token": 1e6 * seconds / emitted,
                         "async_scheduling": engine.async_scheduling, "graphs": engine.runner.graphs is not None})
        table = pd.DataFrame([row for row in rows if row["arm"] == arm])
        log(f"{arm:12s} {statistics.median(table.us_per_step):7.1f} us a step, "
            f"{statistics.median(table.us_per_token):6.1f} us a token ({int(table.steps.median())} steps)")
        engine.close()
    return pd.DataFrame(rows)


def host_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Medians per arm, and each arm's step over the decode arm's."""
    out = table.groupby(["arm", "k"], sort=False).agg(steps=("steps", "median"), us_per_step=("us_per_step", "median"),
                                                      us_per_token=("us_per_token", "median")).reset_index()
    if "decode" in set(out.arm):
        out["step_over_decode"] = out.us_per_step / float(out[out.arm == "decode"].us_per_step.iloc[0])
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--ks", default="8", help="drafts a verify step, comma-separated: one run each (default: 8)")
    parser.add_argument("--tokens", default="512", help="new tokens a timed request (default: 512)")
    parser.add_argument("--repeats", default="5", help="timed requests an arm (default: 5)")
    parser.add_argument("--prefix", default="day65", help="tables go to data/<prefix>_host_<device>.csv")


def main(args: argparse.Namespace) -> int:
    dev = resolve_device(args.device)
    ks = int_list(args.ks, "--ks")
    tokens, repeats = positive_int(args.tokens, "--tokens"), positive_int(args.repeats, "--repeats")
    tables = []
    for k in ks:
        print(f"k = {k}")
        arms = ARMS if not tables else tuple(a for a in ARMS if a not in NO_K)  # arms without drafts once
        tables.append(run_hostbench(str(dev), k=k, tokens=tokens, repeats=repeats, arms=arms))
    table = pd.concat(tables, ignore_index=True)
    label = run_label(dev, "tiny (stand-in decode forward)", resolve_dtype("auto", dev), weights="synthesized random")
    path = save_table(table, f"{args.prefix}_host", label)
    print(host_summary(table).round(2).to_string(index=False))
    print(f"{path.name}: {label}")
    return 0
