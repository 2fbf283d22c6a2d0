"""Speculative decoding on real text: acceptance and per-token latency at batch 1, with prompt
lookup on and off (Day 65).

Each prompt of a set (`tests/data/spec/<set>.jsonl`, chat messages: a summarization-like set and
a code-editing-like one) runs alone and greedy through one `LLM` per arm, off and one per lookup
setting (`--lookups`: k, the shortest match a draft needs, and the shortest until a draft is kept),
after one untimed prompt of each set (kernels compile for a shape's first step), so a token's time
is the request's alone. Each prompt runs `--repeats` times, a pass over the arm's prompts at a
time, and its run of median time is kept: one slow stretch of the host sets no arm's number. A row
per prompt and arm: tokens, wall time, steps, and the engine's speculative counts (verify steps,
drafts proposed, drafts kept); the summary per set and arm: ms a token, the acceptance rate
(drafts kept over drafts proposed), tokens a verify step gives, the speedup over off, and whether
every output equals off's.

Two more parts:

- `batches` (`<prefix>_spec_batches_<device>`): output tokens a second against batch size, off and
  on, the on arm never switching off (its `max_num_seqs` is the largest batch), so the table shows
  where verifying starts to cost more than it saves: the switch-off point.
- `verify` (`<prefix>_spec_verify_<device>`): what a verify step costs against a decode step at the
  runner, whatever the weights (random ones accept nothing worth reporting): a batch of rows at
  `--prompt-len` tokens, each step planned, run (a graph replayed where one fits) and its argmax read
  back, the decode step one token a row, the verify step k + 1 (the pending token and k drafts,
  `ModelRunner.verify`), logits at every one; each row is shortened back after the step, so every
  step sees the same history. The two alternate; medians. On CUDA, `<prefix>_spec_verify_kernels_<device>` adds both
  steps' GPU kernels under the profiler, by kernel and class, us a step.

`replay_lookup` and `lookup_settings` price other lookup settings (k, the shortest match) from a
latency table alone: at temperature 0 plain greedy's output fixes every step speculation takes.

    python -m nanolab specbench --device cpu --model smollm2-135m
    python -m nanolab specbench --model llama-3.2-1b --parts verify
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from nanolab import LLM, SamplingParams
from nanolab.config import resolve_device, resolve_dtype
from nanolab.lab.cliargs import int_list, positive_int
from nanolab.lab.report import REPO_ROOT, run_label, save_table
from nanolab.lab.stepparts import class_line, profiled_kernels
from nanolab.lab.timing import prefill, random_prompts, sync
from nanolab.model.tokenizer import Tokenizer
from nanolab.model.weights import resolve_weights, weights_kind
from nanolab.spec_decode import propose_ngram

PROMPT_SETS = ("summarize", "code_edit")
PARTS = ("latency", "batches", "verify")
BATCHES = (1, 2, 4, 8, 16, 32)
VERIFY_BATCHES = (1, 8)
VERIFY_COST_TARGET = 1.2  # a verify step at k = 4 over a decode step, at most
SETS_DIR = REPO_ROOT / "tests" / "data" / "spec"


def load_prompt_set(name: str, directory: Path = SETS_DIR) -> list[list[dict]]:
    """The conversations of `directory/<name>.jsonl`, one {"messages": [...]} a line."""
    path = Path(directory) / f"{name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no prompt set {name!r}: {path} does not exist")
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def run_prompt(llm: LLM, messages: list[dict], max_tokens: int) -> dict:
    """One conversation alone, greedy, stepped to its end: its tokens, time, steps, the engine's
    speculative counts over it, and the wall time of its steps by kind: the first (its prompt), and
    the median decode step and verify step. With asynchronous scheduling a step's wall time is its
    host's (the GPU runs behind it); the steps' sum is the request's time either way."""
    engine = llm.engine
    before = (engine.spec_steps, engine.spec_draft_tokens, engine.spec_accepted_tokens)
    seq = engine.add_request(llm.tokenizer.encode_chat(messages), SamplingParams(temperature=0, max_tokens=max_tokens))
    times = {"prompt": [], "decode": [], "verify": []}  # each step's wall seconds, by what it ran
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        verified, at = engine.spec_steps, time.perf_counter()
        engine.step()
        kind = "prompt" if not times["prompt"] else "verify" if engine.spec_steps > verified else "decode"
        times[kind].append(time.perf_counter() - at)
    seconds = time.perf_counter() - start
    spec = [after - b for after, b in zip((engine.spec_steps, engine.spec_draft_tokens, engine.spec_accepted_tokens),
                                          before)]
    return {"prompt_tokens": len(seq.prompt_token_ids), "output_tokens": len(seq.output_token_ids),
            "seconds": seconds, "ms_per_token": 1e3 * seconds / max(1, len(seq.output_token_ids)),
            "steps": sum(map(len, times.values())), "verify_steps": spec[0], "draft_tokens": spec[1],
            "accepted_tokens": spec[2], "prompt_step_ms": 1e3 * sum(times["prompt"]),
            "decode_step_ms": 1e3 * statistics.median(times["decode"]) if times["decode"] else float("nan"),
            "verify_step_ms": 1e3 * statistics.median(times["verify"]) if times["verify"] else float("nan"),
            "token_ids": seq.output_token_ids}


def median_run(runs: Sequence[dict]) -> dict:
    """Of one prompt's `run_prompt` results, the run of median time (the lower middle of an even
    count), with `repeats`, `seconds_min` and `seconds_max` added, and `distinct_outputs`: how many
    different token lists the greedy repeats emitted. On CUDA a repeat may differ at a near-tie,
    since a verify step's rows go through other kernels than a decode step's and where steps
    speculate depends on the engine's step count; more than one is then reported, not hidden."""
    if not runs:
        raise ValueError("runs: no run of the prompt")
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "repeats": len(runs), "seconds_min": ordered[0]["seconds"],
            "seconds_max": ordered[-1]["seconds"],
            "distinct_outputs": len({tuple(r["token_ids"]) for r in runs})}


def lookup_arm(k: int, min_n: int = 1, until_kept: int | None = None) -> str:
    """A speculating arm's name: "ngram k=4", with " min_n=2" when its shortest match is not 1 and
    " until_kept=1" when it sets `prompt_lookup_min_until_kept` (else the engine's default rule)."""
    return (f"ngram k={k}" + (f" min_n={min_n}" if min_n != 1 else "")
            + (f" until_kept={until_kept}" if until_kept is not None else ""))


def parse_lookups(text: str, flag: str = "--lookups") -> list[tuple[int, ...]]:
    """"4,8:2,4:1:1" -> [(4, 1), (8, 2), (4, 1, 1)]: each k, k:min_n (the shortest match, at most
    `SpeculativeConfig.prompt_lookup_max`'s default 4), or k:min_n:until_kept (the shortest match
    until a draft is kept, `prompt_lookup_min_until_kept`; left out, the engine's default)."""
    settings = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) > 3:
            raise ValueError(f"{flag}: {part!r}: a setting is k, k:min_n or k:min_n:until_kept")
        k, min_n, *until = [positive_int(f, flag) for f in fields] + ([1] if len(fields) == 1 else [])
        if min_n > 4 or any(not min_n <= u <= 4 for u in until):
            raise ValueError(f"{flag}: {part!r}: the shortest match must be at most 4 (prompt_lookup_max), and "
                             "until_kept at least min_n")
        setting = (k, min_n, *until)
        if setting in settings:
            raise ValueError(f"{flag}: {part!r} is given twice")
        settings.append(setting)
    if not settings:
        raise ValueError(f"{flag}: {text!r} holds no setting (comma-separated k, k:min_n or k:min_n:until_kept)")
    return settings


def run_specbench(model: str, device: str, sets: Sequence[str] = PROMPT_SETS, k: int = 4, max_tokens: int = 64,
                  directory: Path = SETS_DIR, log: Callable[[str], None] = print, dtype: str = "auto",
                  lookups: Sequence[tuple[int, ...]] | None = None, repeats: int = 1) -> pd.DataFrame:
    """A row per prompt of each set and arm, each arm one `LLM`: "off", then one speculating arm
    per (k, shortest match[, shortest until a draft is kept]) of `lookups` (`lookup_arm`; default
    `k` alone). What an arm does not set is the engine's default: since Day 65e, matches of two
    tokens until a draft is kept, so an arm named "ngram k=4" ran one-token matches throughout
    before then, and runs that rule now as "ngram k=4 until_kept=1".
    Each prompt runs `repeats` times, a pass over all of an arm's prompts at a time, so that a slow
    stretch of the host lands on different prompts; a prompt's row is its run of median time
    (`median_run`), with `repeats` and the fastest and slowest run's seconds beside it."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be a positive int")
    prompts = {name: load_prompt_set(name, directory) for name in sets}
    arms: dict[str, dict | None] = {"off": None}
    for k_, min_n, *until in lookups or [(k, 1)]:
        arms[lookup_arm(k_, min_n, *until)] = {"num_speculative_tokens": k_, "prompt_lookup_min": min_n,
                                               "prompt_lookup_min_until_kept": until[0] if until else None}
    rows = []
    for arm, spec in arms.items():
        llm = LLM(model, device=device, dtype=dtype, speculative_config=spec, enable_prefix_caching=False)
        for conversations in prompts.values():  # untimed: first uses (kernels compiled for new shapes)
            run_prompt(llm, conversations[0], max_tokens)
        runs = {(name, i): [] for name, conversations in prompts.items() for i in range(len(conversations))}
        for _ in range(repeats):
            for name, i in runs:
                runs[name, i].append(run_prompt(llm, prompts[name][i], max_tokens))
        rows += [{"set": name, "arm": arm, "prompt": i, **median_run(made)} for (name, i), made in runs.items()]
        for name in prompts:
            done = [r for r in rows if r["arm"] == arm and r["set"] == name]
            log(f"{arm}, {name}: {sum(r['output_tokens'] for r in done)} tokens in "
                f"{sum(r['seconds'] for r in done):.2f} s")
        llm.close()
    return pd.DataFrame(rows)


def spec_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per set and arm: output tokens, ms a token (all tokens over all time), the acceptance
    rate, tokens a verify step gives (kept drafts plus the one it adds), the speedup in ms a token
    over "off", the median over prompts of each prompt's median decode and verify step, whether
    every output equals off's, and how many prompts' repeats emitted more than one output."""
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
                     "decode_step_ms": g.decode_step_ms.median(), "verify_step_ms": g.verify_step_ms.median(),
                     "outputs_equal_off": same,
                     "prompts_repeats_differ": int((g["distinct_outputs"] > 1).sum())
                     if "distinct_outputs" in g else 0})
    return pd.DataFrame(rows)


def _token_lists(token_ids) -> list[list[int]]:
    """A table's `token_ids` column as lists: `run_specbench`'s lists, or their JSON as saved."""
    return [json.loads(t) if isinstance(t, str) else list(t) for t in token_ids]


def _off_outputs(table: pd.DataFrame) -> dict[tuple[str, int], list[int]]:
    """Off's output for each (set, prompt) of `table`."""
    off = table[table.arm == "off"]
    return dict(zip(zip(off.set, off.prompt), _token_lists(off.token_ids)))


def divergences(table: pd.DataFrame) -> pd.DataFrame:
    """Each output of `table` (`run_specbench`'s, token ids as lists or as their JSON) that differs
    from off's for the same prompt: its set, arm and prompt, the first position where they part,
    and the token each has there (-1 where one output ends first)."""
    offs = _off_outputs(table)
    rows = []
    for name, arm, prompt, got in zip(table.set, table.arm, table.prompt, _token_lists(table.token_ids)):
        want = offs[name, prompt]
        if arm == "off" or got == want:
            continue
        at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        rows.append({"set": name, "arm": arm, "prompt": prompt, "position": at,
                     "off_token": want[at] if at < len(want) else -1, "arm_token": got[at] if at < len(got) else -1})
    return pd.DataFrame(rows, columns=["set", "arm", "prompt", "position", "off_token", "arm_token"])


def tie_margins(llm: LLM, table: pd.DataFrame, prompts: dict[str, list[list[int]]]) -> pd.DataFrame:
    """`divergences(table)`, each with the log-probability `llm` (run in fp32, say) gives each of
    the two tokens where the outputs part (`off_logprob`, `arm_logprob`), fed the prompt
    (`prompts[set][prompt]`, token ids) and off's output up to there, and off's minus the arm's
    (`margin`). A margin near 0 is a near tie, where a step's rounding can pick either token; a
    large one would be a fault. An output that ends first has no token there: NaN."""
    parts, offs = divergences(table), _off_outputs(table)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    rows = []
    for d in parts.itertuples(index=False):
        fed = list(prompts[d.set][d.prompt]) + offs[d.set, d.prompt][:d.position]
        lp = {}
        for which, token in (("off", d.off_token), ("arm", d.arm_token)):
            if token >= 0:  # the last prompt token's log-probability given everything before it
                (out,) = llm.generate({"prompt_token_ids": fed + [token]}, params, use_tqdm=False)
                lp[which] = out.prompt_logprobs[-1][0]
        off_lp, arm_lp = lp.get("off", float("nan")), lp.get("arm", float("nan"))
        rows.append({**d._asdict(), "off_logprob": off_lp, "arm_logprob": arm_lp, "margin": off_lp - arm_lp})
    return pd.DataFrame(rows, columns=[*parts.columns, "off_logprob", "arm_logprob", "margin"])


def run_batches(model: str, device: str, sets: Sequence[str] = PROMPT_SETS, batches: Sequence[int] = BATCHES,
                k: int = 4, max_tokens: int = 64, directory: Path = SETS_DIR,
                log: Callable[[str], None] = print, dtype: str = "auto") -> pd.DataFrame:
    """A row per arm and batch: the sets' prompts, cycled to `batch` of them, generated together,
    greedy; output tokens a second over the whole call. The on arm speculates at every batch."""
    conversations = [m for name in sets for m in load_prompt_set(name, directory)]
    arms = {"off": None, f"ngram k={k}": {"num_speculative_tokens": k, "max_num_seqs": max(batches)}}
    rows = []
    for arm, spec in arms.items():
        llm = LLM(model, device=device, dtype=dtype, speculative_config=spec, enable_prefix_caching=False,
                  max_num_seqs=max(64, *batches))
        engine = llm.engine
        prompts = [llm.tokenizer.encode_chat(m) for m in conversations]
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        for batch in batches:
            chosen = list(itertools.islice(itertools.cycle(prompts), batch))
            llm.generate([{"prompt_token_ids": p} for p in chosen], params, use_tqdm=False)  # untimed: first uses
            before = (engine.spec_steps, engine.spec_draft_tokens, engine.spec_accepted_tokens)
            sync(llm.device)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in chosen], params, use_tqdm=False)
            sync(llm.device)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            spec = [after - b for after, b in zip((engine.spec_steps, engine.spec_draft_tokens,
                                                   engine.spec_accepted_tokens), before)]
            rows.append({"arm": arm, "batch": batch, "output_tokens": tokens, "seconds": seconds,
                         "tokens_per_s": tokens / seconds, "verify_steps": spec[0], "draft_tokens": spec[1],
                         "accepted_tokens": spec[2]})
            log(f"{arm}, batch {batch}: {tokens / seconds:.0f} tokens/s")
        llm.close()
    table = pd.DataFrame(rows)
    off = table[table.arm == "off"].set_index("batch").tokens_per_s
    table["speedup_over_off"] = [t / off[b] for b, t in zip(table.batch, table.tokens_per_s, strict=True)]
    return table


def replay_lookup(prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 4,
                  max_tokens: int | None = None, min_until_kept: int | None = None) -> dict[str, int]:
    """The steps greedy speculation takes to emit `output_ids` after `prompt_ids` (a request of
    `max_tokens`, default the output's length), with drafts of up to `k` by prompt lookup
    (`propose_ngram(.., max_n, min_n)`) at every step and no pauses. At temperature 0 a verify step
    keeps exactly the drafts that match the output and adds the next token, so plain greedy's
    output alone fixes every step: a step with drafts is a verify step, one without a plain decode
    step. The first output token comes from the prompt step and is not counted; an output shorter
    than `max_tokens` ended at EOS, past which no draft is kept. `min_until_kept` (default `min_n`):
    the shortest match until a draft has been kept, as `SpeculativeConfig.min_until_kept`."""
    out = list(output_ids)
    limit = len(out) if max_tokens is None else max_tokens
    i, verify, plain, kept = 1, 0, 0, 0
    while i < len(out):
        room = min(k, limit - i - 1)
        shortest = min_n if kept or min_until_kept is None else min_until_kept
        drafts = propose_ngram(list(prompt_ids) + out[:i], room, max_n, shortest) if room >= 1 else []
        j = 0
        while j < len(drafts) and i + j < len(out) and drafts[j] == out[i + j]:
            j += 1
        verify, plain, kept = verify + bool(drafts), plain + (not drafts), kept + j
        i += j + 1
    return {"verify_steps": verify, "plain_steps": plain, "accepted_tokens": kept}


def replay_chained(prompt_ids: Sequence[int], output_ids: Sequence[int], k: int, min_n: int = 1, max_n: int = 4,
                   max_tokens: int | None = None, min_until_kept: int | None = None) -> dict[str, int]:
    """`replay_lookup` for chained speculation (`Engine`'s, under asynchronous scheduling): each
    step is launched before the one in flight is read back, so its drafts are looked up over the
    tokens known a step earlier and the drafts in flight, as if all were kept (unless those rest
    on a premise already seen to fail: then over the known tokens alone), and the lookup's first
    token is a guess at what the step in flight adds, not fed. A step that a request's end makes
    useless is launched all the same and counted. No pauses. Counts and `min_until_kept` as
    `replay_lookup`'s: a step's lookup runs before the step in flight is read back, so it knows
    only the drafts kept before that one."""
    out = list(output_ids)
    prompt = list(prompt_ids)
    limit = len(out) if max_tokens is None else max_tokens

    def room(known: int, ahead: int) -> int:
        return min(k, limit - known - ahead - 1)

    def shortest() -> int:
        return min_n if kept or min_until_kept is None else min_until_kept

    i = 1  # output tokens known; the last is the one the step in flight was fed first
    r = room(i, 0)
    stale, verify, plain, kept = False, 0, 0, 0
    fed = propose_ngram(prompt + out[:i], r, max_n, shortest()) if r >= 1 else []
    while True:
        if i + 1 >= limit:  # the step in flight ends the request: it is read back and nothing follows
            verify, plain = verify + bool(fed), plain + (not fed)
            kept += _matched(fed, out, i)
            break
        r = room(i, len(fed) + 1)
        assumed = 0 if stale else len(fed)
        proposed = propose_ngram(prompt + out[:i] + fed[:assumed], r + 1, max_n, shortest()) if r >= 1 else []
        guess, drafts = (proposed[0], proposed[1:]) if len(proposed) >= 2 else (None, [])
        a = _matched(fed, out, i)  # the step in flight read back
        verify, plain, kept = verify + bool(fed), plain + (not fed), kept + a
        i += a + 1
        if i >= len(out):  # it ended the request: the step just launched is read back for nothing
            verify, plain = verify + bool(drafts), plain + (not drafts)
            break
        stale = a != assumed or (guess is not None and guess != out[i - 1])
        fed = drafts
    return {"verify_steps": verify, "plain_steps": plain, "accepted_tokens": kept}


def _matched(drafts: list[int], out: list[int], at: int) -> int:
    """How many of `drafts` greedy keeps fed after out[at - 1]: those matching out from `at`."""
    a = 0
    while a < len(drafts) and at + a < len(out) and drafts[a] == out[at + a]:
        a += 1
    return a


def lookup_settings(table: pd.DataFrame, prompts: dict[str, list[list[int]]], ks: Sequence[int] = (4, 8, 16),
                    min_ns: Sequence[int] = (1, 2, 3), max_n: int = 4, max_tokens: int = 64,
                    arm: str | None = None) -> pd.DataFrame:
    """What other lookup settings would give on a latency table's prompts (`run_specbench`'s rows
    at its `max_tokens`; `prompts[set][i]` the ids of prompt i), predicted from its "off" outputs
    (`replay_lookup`) and its measured step times: per set, k and min_n, the steps, tokens a verify
    step gives, and ms a token (the tokens after each prompt's first) with every verify step at the
    speculating arm's median verify step and every plain step either overlapped (at off's median
    decode step, the switch-off rules at their best) or synchronous (at the speculating arm's
    median decode step). The speedups are over off's decode step. A verify step is priced the same
    at every k, which holds while its rows fit the graph bucket it was measured in and the step
    reads little but the weights. `arm`: the speculating arm whose steps price it (default: the
    table's first that is not off)."""
    if arm is None:
        arm = next(a for a in table.arm.unique() if a != "off")
    rows = []
    for name, g in table.groupby("set", sort=False):
        off, on = g[g.arm == "off"], g[g.arm == arm]
        plain_ms = off.decode_step_ms.median()  # overlapped: off runs every step asynchronously
        verify_ms, sync_ms = on.verify_step_ms.median(), on.decode_step_ms.median()
        # a table read back from CSV holds each output as its JSON text
        outputs = _token_lists(off.token_ids)
        for k, min_n in itertools.product(ks, min_ns):
            steps = [replay_lookup(prompts[name][int(p)], out, k, min_n, max_n, max_tokens)
                     for p, out in zip(off.prompt, outputs, strict=True)]
            verify, plain, kept = (sum(s[key] for s in steps) for key in ("verify_steps", "plain_steps",
                                                                            "accepted_tokens"))
            tokens = sum(len(out) - 1 for out in outputs)
            overlapped = (verify * verify_ms + plain * plain_ms) / tokens
            synchronous = (verify * verify_ms + plain * sync_ms) / tokens
            rows.append({"set": name, "k": k, "min_n": min_n, "max_n": max_n, "tokens": tokens,
                         "verify_steps": verify, "plain_steps": plain,
                         "tokens_per_verify_step": (kept + verify) / verify if verify else float("nan"),
                         "ms_per_token_overlapped": overlapped, "ms_per_token_synchronous": synchronous,
                         "speedup_overlapped": plain_ms / overlapped, "speedup_synchronous": plain_ms / synchronous,
                         "plain_step_ms": plain_ms, "verify_step_ms": verify_ms, "sync_step_ms": sync_ms})
    return pd.DataFrame(rows)


def replay_inputs(runs: pd.DataFrame, summary: pd.DataFrame, verify_arm: str, priced_set: str = "code_edit"
                  ) -> tuple[Tokenizer, dict[str, list[list[int]]], float, float]:
    """What replaying a latency table's outputs (`run_specbench`'s rows, and its `spec_summary`)
    takes from it: its model's tokenizer, each of its sets' prompts as that tokenizer's chat ids,
    and the prices: a plain step at off's median decode step on `priced_set`, a verify step at
    `verify_arm`'s median there."""
    tokenizer = Tokenizer.from_dir(resolve_weights(str(runs.model.iloc[0])))
    prompts = {name: [tokenizer.encode_chat(m) for m in load_prompt_set(name)] for name in runs.set.unique()}
    by = summary.set_index(["set", "arm"])
    return (tokenizer, prompts, float(by.loc[(priced_set, "off"), "decode_step_ms"]),
            float(by.loc[(priced_set, verify_arm), "verify_step_ms"]))


def chained_settings(table: pd.DataFrame, prompts: dict[str, list[list[int]]], plain_ms: float, verify_ms: float,
                     settings: Sequence[tuple[int, ...]] = ((4, 1), (8, 2), (16, 2), (32, 2)), max_n: int = 4,
                     max_tokens: int = 64) -> pd.DataFrame:
    """What chained speculation would give on a latency table's prompts, from its "off" outputs:
    per set and (k, min_n) or (k, min_n, min_until_kept) of `settings` (`min_until_kept` NaN where
    not given: min_n throughout), the steps `replay_chained` and `replay_lookup` count,
    and the speedup over off with every step at the GPU's time for its kind, a plain step at
    `plain_ms` and a verify step at `verify_ms` (steps that chain leave the GPU no gap), off's
    steps all plain."""
    rows = []
    for name, g in table.groupby("set", sort=False):
        off = g[g.arm == "off"]
        outputs = _token_lists(off.token_ids)
        tokens = sum(len(out) - 1 for out in outputs)
        for k, min_n, *until in settings:
            until = until[0] if until else None
            counts = {}
            for how, replay in (("chained", replay_chained), ("synchronous", replay_lookup)):
                steps = [replay(prompts[name][int(p)], out, k, min_n, max_n, max_tokens, until)
                         for p, out in zip(off.prompt, outputs, strict=True)]
                counts[how] = {key: sum(s[key] for s in steps) for key in ("verify_steps", "plain_steps")}
            chained = counts["chained"]
            ms = chained["verify_steps"] * verify_ms + chained["plain_steps"] * plain_ms
            rows.append({"set": name, "k": k, "min_n": min_n,
                         "min_until_kept": float("nan") if until is None else until, "tokens": tokens,
                         "verify_steps": chained["verify_steps"], "plain_steps": chained["plain_steps"],
                         "verify_steps_synchronous": counts["synchronous"]["verify_steps"],
                         "plain_steps_synchronous": counts["synchronous"]["plain_steps"],
                         "speedup_chained": tokens * plain_ms / ms, "plain_step_ms": plain_ms,
                         "verify_step_ms": verify_ms})
    return pd.DataFrame(rows)


def switch_off_batch(table: pd.DataFrame) -> int | None:
    """The smallest batch at which speculation is no faster than off (None: faster at every one)."""
    on = table[table.arm != "off"].sort_values("batch")
    return next((int(r.batch) for r in on.itertuples() if r.speedup_over_off <= 1.0), None)


def _steps(llm: LLM, seqs: list, k: int) -> dict[str, Callable[[], None]]:
    """The decode and the verify step over `seqs` (each holding its pending token), each row
    shortened back after the step, so every step sees the same history."""
    runner, blocks = llm.engine.runner, llm.engine.block_manager
    held = [s.num_tokens - 1 for s in seqs]  # in the cache: all but each row's pending token
    batch = len(seqs)

    def decode() -> None:
        runner.decode(seqs).argmax(-1).tolist()

    def verify() -> None:
        for s in seqs:  # k drafts: the pending token again, which is as good as any to time
            s.output_token_ids.extend([s.output_token_ids[-1]] * k)
        try:
            runner.verify(seqs, [k + 1] * batch).argmax(-1).tolist()
        finally:
            for s in seqs:
                del s.output_token_ids[-k:]

    def shortened(step: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            step()
            for s, n in zip(seqs, held, strict=True):
                blocks.truncate(s.row, n)
        return run

    return {"decode": shortened(decode), "verify": shortened(verify)}


def _step_times(llm: LLM, steps: dict[str, Callable[[], None]],
                repeats: int) -> tuple[dict[str, list[float]], dict[str, bool]]:
    """Seconds of each of `steps`, alternated, two untimed rounds first; and whether each last
    replayed a graph."""
    times, graphed = {name: [] for name in steps}, {}
    for i in range(repeats + 2):
        for name, step in steps.items():
            sync(llm.device)
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            graphed[name] = llm.engine.runner.last_decode[1]
            if i >= 2:
                times[name].append(elapsed)
    return times, graphed


def _step_kernels(steps: dict[str, Callable[[], None]], repeats: int, batch: int, k: int) -> pd.DataFrame:
    """Each step's CUDA kernels under the profiler over `repeats` runs (`stepparts.profiled_kernels`)."""
    return pd.concat([profiled_kernels(lambda step=step: [step() for _ in range(repeats)], repeats, name)
                      .assign(batch=batch, k=k) for name, step in steps.items()], ignore_index=True)


def run_verify_cost(model: str, device: str, batches: Sequence[int] = VERIFY_BATCHES, k: int = 4,
                    prompt_len: int = 128, repeats: int = 30, profile: bool | None = None,
                    log: Callable[[str], None] = print,
                    dtype: str = "auto") -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """(costs, kernels): a row per batch, the median ms of a decode step and of a verify step of k
    drafts a row, at the runner (see the module's docstring), and their ratio; with `profile`
    (default: on CUDA), both steps' kernels per batch."""
    llm = LLM(model, device=device, dtype=dtype, enable_prefix_caching=False, async_scheduling=False,
              max_num_seqs=max(64, *batches))
    engine = llm.engine
    profile = llm.device.type == "cuda" if profile is None else profile
    rows, kernels = [], []
    for batch in batches:
        seqs = prefill(engine, random_prompts(batch, prompt_len, llm.config.vocab_size), new_tokens=1 << 20)
        steps = _steps(llm, seqs, k)
        times, graphed = _step_times(llm, steps, repeats)
        decode_ms, verify_ms = (1e3 * statistics.median(times[n]) for n in ("decode", "verify"))
        rows.append({"batch": batch, "k": k, "prompt_len": prompt_len, "repeats": repeats, "decode_ms": decode_ms,
                     "verify_ms": verify_ms, "verify_over_decode": verify_ms / decode_ms,
                     "decode_graphed": graphed["decode"], "verify_graphed": graphed["verify"],
                     "verify_tokens": batch * (k + 1)})
        log(f"batch {batch}: decode {decode_ms:.3f} ms, verify of k={k} {verify_ms:.3f} ms "
            f"({verify_ms / decode_ms:.2f}x, target {VERIFY_COST_TARGET}x)")
        if profile:
            kernels.append(_step_kernels(steps, repeats, batch, k))
            for arm, t in kernels[-1].groupby("arm", sort=False):
                log(f"  {arm}: {class_line(t)} ({t.calls.sum() / repeats:.0f} launches)")
        for s in seqs:
            engine.abort_request(s.request_id)
        while engine.has_unfinished_requests():
            engine.step()
    llm.close()
    return pd.DataFrame(rows), (pd.concat(kernels, ignore_index=True) if kernels else None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a preset name or a model folder")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--sets", default=",".join(PROMPT_SETS), help="comma-separated prompt sets of tests/data/spec")
    parser.add_argument("--k", type=int, default=4, help="the most drafts a row (num_speculative_tokens)")
    parser.add_argument("--lookups", default=None,
                        help="latency: the speculating arms, comma-separated k, k:min_n (the shortest match) or "
                             "k:min_n:until_kept (the shortest until a draft is kept), e.g. 4,4:1:1,8:2 "
                             "(default: --k, the engine's lookup rule)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", default="3",
                        help="latency: runs of each prompt, a pass over the prompts at a time; a prompt's row is "
                             "its run of median time (default: 3)")
    parser.add_argument("--dtype", default="auto", help="the weights' dtype")
    parser.add_argument("--parts", default="latency", help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--batches", default=None,
                        help=f"batch sizes: for batches (default {','.join(map(str, BATCHES))}) and verify "
                             f"(default {','.join(map(str, VERIFY_BATCHES))})")
    parser.add_argument("--prefix", default="day65", help="tables go to data/<prefix>_spec_<device>.csv, ...")


def _parse_batches(text: str | None, default: Sequence[int]) -> list[int]:
    return list(default) if text is None else int_list(text, "--batches")


def main(args: argparse.Namespace) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"--parts {args.parts!r}: choose from {', '.join(PARTS)}")
    if args.k < 1 or args.max_tokens < 1:
        raise ValueError("--k and --max-tokens must be positive")
    lookups = None if args.lookups is None else parse_lookups(args.lookups)
    # Every part's values, checked before the first part runs and writes its table.
    repeats = positive_int(args.repeats, "--repeats")
    batches = {"batches": _parse_batches(args.batches, BATCHES), "verify": _parse_batches(args.batches, VERIFY_BATCHES)}
    sets = [s.strip() for s in args.sets.split(",")]
    available = sorted(path.stem for path in SETS_DIR.glob("*.jsonl"))
    if any(s not in available for s in sets) or len(set(sets)) != len(sets):
        raise ValueError(f"--sets {args.sets!r}: comma-separated, each once, from {', '.join(available)}")
    device = resolve_device(args.device)
    label = run_label(device, args.model, resolve_dtype(args.dtype, device),
                      weights=weights_kind(resolve_weights(args.model)))
    status = 0
    for part in parts:
        if part == "latency":
            table = run_specbench(args.model, str(device), sets, args.k, args.max_tokens, dtype=args.dtype,
                                  lookups=lookups, repeats=repeats)
            summary = spec_summary(table)
            print(summary.round(3).to_string(index=False))
            for stem, df in ((f"{args.prefix}_spec", table.assign(token_ids=table.token_ids.map(json.dumps))),
                             (f"{args.prefix}_spec_summary", summary)):
                print(f"{stem}: {save_table(df, stem, label)}")
            status |= 0 if summary.outputs_equal_off.all() else 1
        elif part == "batches":
            table = run_batches(args.model, str(device), sets, batches["batches"], args.k,
                                args.max_tokens, dtype=args.dtype)
            print(table.round(3).to_string(index=False))
            where = switch_off_batch(table)
            print("speculation is faster at every batch measured" if where is None
                  else f"speculation is no faster from batch {where}")
            print(f"{args.prefix}_spec_batches: {save_table(table, f'{args.prefix}_spec_batches', label)}")
        else:
            table, kernels = run_verify_cost(args.model, str(device), batches["verify"],
                                             args.k, dtype=args.dtype)
            print(table.round(3).to_string(index=False))
            print(f"{args.prefix}_spec_verify: {save_table(table, f'{args.prefix}_spec_verify', label)}")
            if kernels is not None:
                print(kernels.groupby(["batch", "arm"], sort=False).head(10).round(1).to_string(index=False))
                stem = f"{args.prefix}_spec_verify_kernels"
                print(f"{stem}: {save_table(kernels, stem, label)}")
    return status
