"""Speculative decoding on real text: acceptance and per-token latency at batch 1, with prompt
lookup on and off (Day 65).

Each prompt of a set (`tests/data/spec/<set>.jsonl`, chat messages: a summarization-like set and
a code-editing-like one) runs alone and greedy through one `LLM` per arm, off and on, so a
token's time is the request's alone. A row per prompt and arm: tokens, wall time, steps, and the
engine's speculative counts (verify steps, drafts proposed, drafts kept); the summary per set and
arm: ms a token, the acceptance rate (drafts kept over drafts proposed), tokens a verify step
gives, the speedup over off, and whether every output equals off's.

    python -m nanolab specbench --device cpu --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from nanolab import LLM, SamplingParams
from nanolab.config import resolve_device, resolve_dtype
from nanolab.lab.report import REPO_ROOT, run_label, save_table
from nanolab.model.weights import resolve_weights, weights_kind

PROMPT_SETS = ("summarize", "code_edit")
SETS_DIR = REPO_ROOT / "tests" / "data" / "spec"


def load_prompt_set(name: str, directory: Path = SETS_DIR) -> list[list[dict]]:
    """The conversations of `directory/<name>.jsonl`, one {"messages": [...]} a line."""
    path = Path(directory) / f"{name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no prompt set {name!r}: {path} does not exist")
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def run_prompt(llm: LLM, messages: list[dict], max_tokens: int) -> dict:
    """One conversation alone, greedy, stepped to its end: its tokens, time, steps and the
    engine's speculative counts over it."""
    engine = llm.engine
    before = (engine.spec_steps, engine.spec_draft_tokens, engine.spec_accepted_tokens)
    seq = engine.add_request(llm.tokenizer.encode_chat(messages), SamplingParams(temperature=0, max_tokens=max_tokens))
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    spec = [after - b for after, b in zip((engine.spec_steps, engine.spec_draft_tokens, engine.spec_accepted_tokens),
                                          before)]
    return {"prompt_tokens": len(seq.prompt_token_ids), "output_tokens": len(seq.output_token_ids),
            "seconds": seconds, "ms_per_token": 1e3 * seconds / max(1, len(seq.output_token_ids)), "steps": steps,
            "verify_steps": spec[0], "draft_tokens": spec[1], "accepted_tokens": spec[2],
            "token_ids": seq.output_token_ids}


def run_specbench(model: str, device: str, sets: Sequence[str] = PROMPT_SETS, k: int = 4, max_tokens: int = 64,
                  directory: Path = SETS_DIR, log: Callable[[str], None] = print) -> pd.DataFrame:
    """A row per prompt of each set and arm ("off", f"ngram k={k}"), each arm one `LLM`."""
    prompts = {name: load_prompt_set(name, directory) for name in sets}
    arms = {"off": None, f"ngram k={k}": {"num_speculative_tokens": k}}
    rows = []
    for arm, spec in arms.items():
        llm = LLM(model, device=device, speculative_config=spec, enable_prefix_caching=False)
        for name, conversations in prompts.items():
            for i, messages in enumerate(conversations):
                rows.append({"set": name, "arm": arm, "prompt": i, **run_prompt(llm, messages, max_tokens)})
            done = [r for r in rows if r["arm"] == arm and r["set"] == name]
            log(f"{arm}, {name}: {sum(r['output_tokens'] for r in done)} tokens in "
                f"{sum(r['seconds'] for r in done):.2f} s")
        llm.close()
    return pd.DataFrame(rows)


def spec_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per set and arm: output tokens, ms a token (all tokens over all time), the acceptance
    rate, tokens a verify step gives (kept drafts plus the one it adds), the speedup in ms a token
    over "off", and whether every output equals off's."""
    rows = []
    for (name, arm), g in table.groupby(["set", "arm"], sort=False):
        off = table[(table.set == name) & (table.arm == "off")].set_index("prompt")
        drafts, kept, verify = int(g.draft_tokens.sum()), int(g.accepted_tokens.sum()), int(g.verify_steps.sum())
        ms = 1e3 * g.seconds.sum() / g.output_tokens.sum()
        same = all(list(t) == list(off.token_ids[p]) for p, t in zip(g.prompt, g.token_ids))
        rows.append({"set": name, "arm": arm, "prompts": len(g), "output_tokens": int(g.output_tokens.sum()),
                     "ms_per_token": ms, "acceptance_rate": kept / drafts if drafts else float("nan"),
                     "tokens_per_verify_step": (kept + verify) / verify if verify else float("nan"),
                     "speedup_over_off": 1e3 * off.seconds.sum() / off.output_tokens.sum() / ms,
                     "outputs_equal_off": same})
    return pd.DataFrame(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a preset name or a model folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--sets", default=",".join(PROMPT_SETS), help="comma-separated prompt sets of tests/data/spec")
    parser.add_argument("--k", type=int, default=4, help="the most drafts a row (num_speculative_tokens)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefix", default="day65", help="tables go to data/<prefix>_spec_<device>.csv, ...")


def main(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    table = run_specbench(args.model, str(device), args.sets.split(","), args.k, args.max_tokens)
    summary = spec_summary(table)
    label = run_label(device, args.model, resolve_dtype("auto", device),
                      weights=weights_kind(resolve_weights(args.model)))
    print(summary.round(3).to_string(index=False))
    for stem, df in ((f"{args.prefix}_spec", table.assign(token_ids=table.token_ids.map(json.dumps))),
                     (f"{args.prefix}_spec_summary", summary)):
        print(f"{stem}: {save_table(df, stem, label)}")
    return 0 if summary.outputs_equal_off.all() else 1
