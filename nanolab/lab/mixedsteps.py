"""Where a mixed step's time goes: the steps of chunked prefill that carry decode rows beside a
prompt's chunk. Day 61.

`mixed_step_anatomy` splits each mixed step, as the engine runs it, into:
- the host's time inside `ModelRunner.run_varlen`, which plans the step and launches its forward
  (the GPU runs behind it);
- the forward's span on the GPU, between CUDA events recorded as `run_varlen` is called (before
  its planning) and as it returns;
- sampling and its read-back, which waits for the forward to finish;
- the rest of `Engine.step` (scheduling, emitting).
A profile of a few mixed steps gives the GPU's busy time by kernel. Decode steps of the same rows
are timed beside them.

`mixed_host_parts` splits the host's time inside an eager mixed step's `run_varlen` by the code
that spends it: planning, each kind of module of the model (its own time, its children's taken
out), the rotary tables, the rotation and K/V write, the attention read, and what `run_varlen` does
around them. It times the engine through the model's forward hooks and a wrapper on the cache view
the model is handed, and wraps two methods on the engine's own instances; nothing of a class or a
module is replaced. Nothing here asserts a time. (The mixed step through a compiled varlen graph,
measured and not kept, is committed: `data/day61_mixed_anatomy_h200.csv`'s "compiled" arm.)

    python -m nanolab levers --only mixed --model llama-3.2-1b
    python -m nanolab levers --only mixedhost --model llama-3.2-1b
"""

from __future__ import annotations

import time
from collections import defaultdict

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from nanolab import Engine, EngineConfig, SamplingParams, load_model
from nanolab.engine.block_manager import cdiv
from nanolab.lab.capturebench import kernel_table
from nanolab.lab.timing import prefill, random_prompts, timed_steps
from nanolab.progress import progress_bar
from nanolab.sampling import sample_tokens

NAN = float("nan")
MIXED_PROMPTS = (64, 512, 2048)  # prompt tokens added to the running rows: the last past a step's budget


class _StepClock:
    """Times a mixed step's parts: `sampler` is the engine's sampler (`sample_tokens`) timed, to be
    given to the engine at construction, and `attach(engine)` wraps its `runner.run_varlen` (on the
    instance, as `stepparts.step_anatomy` wraps a step's parts). In a mixed step the timed sampler
    waits for the device, so `sample_ms` holds sampling and what is left of the forward on the
    GPU, as the engine's read-back right after it would; a decode step is left asynchronous.
    `take()` returns the last step's parts in ms and clears them; `close()` unwraps the runner."""

    def __init__(self, device: torch.device) -> None:
        self.parts, self.engine = {}, None
        self.cuda = device.type == "cuda"

    def sampler(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = sample_tokens(*args, **kwargs)
        if "forward_host_ms" in self.parts:  # a mixed step: sampled, then read back at once
            if self.cuda:
                torch.cuda.synchronize()
            self.parts["sample_ms"] = 1e3 * (time.perf_counter() - t0)
        return out

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        run_varlen = engine.runner.run_varlen

        def timed_forward(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True) if self.cuda else None
            end = torch.cuda.Event(enable_timing=True) if self.cuda else None
            t0 = time.perf_counter()
            if start is not None:
                start.record()
            out = run_varlen(*args, **kwargs)
            if end is not None:
                end.record()
            self.parts["forward_host_ms"] = 1e3 * (time.perf_counter() - t0)
            self.parts["events"] = (start, end)
            return out

        engine.runner.run_varlen = timed_forward

    def take(self) -> dict[str, float]:
        parts, self.parts = self.parts, {}
        start, end = parts.pop("events", (None, None))
        if start is not None:
            end.synchronize()
            parts["forward_span_ms"] = start.elapsed_time(end)
        return parts

    def close(self) -> None:
        del self.engine.runner.run_varlen  # an instance attribute: the class's method shows through again


def _mixed_steps(engine: Engine, clock: _StepClock, prompt: list[int], max_steps: int = 64) -> list[dict]:
    """Add `prompt` to the running rows and step until its first token: one record per step that ran
    as a mixed step (its phase, which of the prompt's chunks it carried, rows, tokens and parts in
    ms)."""
    seq = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    records = []
    for _ in range(max_steps):
        t0 = time.perf_counter()
        engine.step()
        step_ms = 1e3 * (time.perf_counter() - t0)
        parts, last = clock.take(), engine.last_step
        if last is not None and last.phase == "mixed":
            records.append({"phase": "mixed", "chunk": len(records), "rows": last.rows, "tokens": last.tokens,
                            "step_ms": step_ms, **parts})
        if seq.output_token_ids or seq.finished:
            return records
    raise RuntimeError(f"a {len(prompt)}-token prompt was not prefilled within {max_steps} steps")


def _decode_steps(engine: Engine, clock: _StepClock, steps: int) -> list[dict]:
    """`steps` decode steps of the running rows, timed as every bench times them (`timing.timed_steps`)."""
    shapes = []

    def after() -> None:
        clock.take()
        last = engine.last_step
        shapes.append(None if last is None or last.phase != "decode" else (last.rows, last.tokens))

    times = timed_steps(engine, steps, after)
    return [{"phase": "decode", "rows": shape[0], "tokens": shape[1], "step_ms": 1e3 * t}
            for t, shape in zip(times, shapes, strict=True) if shape is not None]


def _kernels(engine: Engine, clock: _StepClock, prompt: list[int], arm: str) -> pd.DataFrame:
    """GPU kernels of the mixed steps that prefill `prompt`, by total time."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = len(_mixed_steps(engine, clock, prompt))
        torch.cuda.synchronize()
    return kernel_table(prof, max(steps, 1), arm).assign(prompt_len=len(prompt))


RUNNING_TOKENS = 512  # each running row's new tokens: more decode steps than a run takes


def _running_engine(model, rows: int, context: int, longest_prompt: int, budget: int,
                    sampler=sample_tokens, cudagraph_mode: str = "full_decode_only") -> Engine:
    """The server's engine (`EngineConfig`'s defaults: on CUDA graphs, the compiled decode step, the
    streamed read and asynchronous scheduling; eager with the reference read on the CPU) with `rows`
    rows running, each past a `context`-token prompt, chunked prefill with a `budget` of tokens a
    step, and room for one more prompt of `longest_prompt`; `cudagraph_mode` "full" replays varlen
    steps as graphs too."""
    cuda = model.lm_head.weight.is_cuda
    torch._dynamo.reset()
    blocks = rows * cdiv(context + RUNNING_TOKENS, 16) + cdiv(longest_prompt + 64, 16) + 16
    config = EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=rows + 2,
                          read="streamed" if cuda else "reference", max_num_batched_tokens=budget,
                          cudagraph_mode=cudagraph_mode, enable_prefix_caching=False)  # every prompt's chunks computed
    engine = Engine(model, config, sampler=sampler, progress=False)
    prefill(engine, random_prompts(rows, context, model.config.vocab_size, seed=2), RUNNING_TOKENS)
    return engine


def mixed_step_anatomy(model_path, dtype=torch.bfloat16, rows: int = 16, context: int = 512,
                       prompt_lens=MIXED_PROMPTS, repeats: int = 5, budget: int = 2048,
                       device: torch.device | str | None = None, profile_prompt: int = 512,
                       progress: bool = True, modes: tuple[str, ...] = ("full_decode_only",)
                       ) -> dict[str, pd.DataFrame]:
    """`day61_mixed_anatomy`: the engine's mixed step (arm "eager": a varlen step runs the model
    eagerly), per prompt length and chunk of it, the median over `repeats` of each mixed step's
    parts (ms): the whole step, the host inside `run_varlen`, the forward's span on the GPU,
    sampling, and the rest; beside them, decode steps (prompt_len 0) of the same `rows` running rows
    at about `context` tokens, whose parts are not split. The engine is the server's
    (`_running_engine`), with chunked prefill at a `budget` of tokens a step.
    `day61_mixed_kernels` (CUDA only): the kernels of the mixed steps of one `profile_prompt`-token
    prompt. `modes`: one arm per `cudagraph_mode`, "eager" for "full_decode_only" (varlen steps
    run eagerly) and "graphed" for "full"."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    model = load_model(model_path, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    records, kernels = [], []
    for mode in modes:
        arm = {"full_decode_only": "eager", "full": "graphed"}[mode]
        clock = _StepClock(device)
        engine = _running_engine(model, rows, context, max(prompt_lens, default=0), budget, clock.sampler, mode)
        clock.attach(engine)
        try:
            _mixed_steps(engine, clock, random_prompts(1, 64, vocab, seed=3)[0].tolist())  # warm: first calls
            found = _decode_steps(engine, clock, 2 * repeats)
            for n, prompt_len in enumerate(progress_bar(prompt_lens, desc=f"mixed steps, {arm}", enabled=progress)):
                for r in range(repeats):
                    prompt = random_prompts(1, prompt_len, vocab, seed=100 * n + r)[0].tolist()
                    found += [dict(rec, prompt_len=prompt_len) for rec in _mixed_steps(engine, clock, prompt)]
            if cuda:
                prompt = random_prompts(1, profile_prompt, vocab, seed=9)[0].tolist()
                kernels.append(_kernels(engine, clock, prompt, arm))
        finally:
            clock.close()
        for rec in found:
            records.append({"arm": arm, "running_rows": rows, "context": context, "budget": budget, **rec})
        del engine
    steps = pd.DataFrame(records)
    for col in ("prompt_len", "chunk", "forward_host_ms", "forward_span_ms", "sample_ms"):
        if col not in steps:
            steps[col] = NAN
    steps["prompt_len"] = steps.prompt_len.fillna(0).astype(int)  # 0: a decode step
    steps["chunk"] = steps.chunk.fillna(0).astype(int)
    steps["rest_ms"] = steps.step_ms - steps.forward_host_ms - steps.sample_ms  # NaN where not split
    by = steps.groupby(["arm", "phase", "prompt_len", "chunk"], sort=False)
    cols = ["rows", "tokens", "step_ms", "forward_host_ms", "forward_span_ms", "sample_ms", "rest_ms"]
    table = by[cols].median().reset_index().assign(steps=by.size().to_numpy())
    out = {"day61_mixed_anatomy": table.assign(running_rows=rows, context=context, budget=budget)}
    if kernels:
        out["day61_mixed_kernels"] = pd.concat(kernels, ignore_index=True)
    return out


def _part_of(name: str) -> str:
    """A module's qualified name -> its part: "layers.3.self_attn.qkv_proj" -> "qkv_proj"; the
    containers' own time is what they do around their children."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "":
        return "model: the sampled rows' gather, the rest"
    if leaf.isdigit():
        return "decoder layer: residual adds, the rest"
    return {"self_attn": "attention: views, the rest", "mlp": "mlp: SwiGLU, the rest"}.get(leaf, leaf)


class _TimedView:
    """A cache view (`engine.kv_cache.CacheView`) whose rotation-and-write and read are timed as parts
    of `parts`; every other attribute is the view's own."""

    def __init__(self, view, parts: _HostParts) -> None:
        self.view, self.parts = view, parts

    def __getattr__(self, name: str):
        return getattr(self.view, name)

    def write_rotated(self, *args, **kwargs):
        return self.parts.timed(self.view.write_rotated, "rotation and K/V write")(*args, **kwargs)

    def read(self, *args, **kwargs):
        return self.parts.timed(self.view.read, "attention read")(*args, **kwargs)


class _HostParts:
    """Host time inside `run_varlen`, by part, each part's own (the time of what it calls that is
    timed too taken out): a stack of timers that module hooks and wrapped methods push and pop.
    `attach(engine)` installs them on the engine's model (forward hooks; the model's pre-hook hands
    its layers a `_TimedView` of the cache view, and the gap between the embedding and the first
    layer is the rotary tables') and on two of the engine's instances (`run_varlen`, `plan_varlen`);
    `take()` returns {part: (calls, us)} since the last take; close() removes them. The hooks add a
    few microseconds a call of their own."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.stack: list[list[float]] = []
        self.spent: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self.undo: list = []

    def push(self) -> None:
        self.stack.append([self.clock(), 0.0])

    def pop(self, part: str) -> None:
        start, children = self.stack.pop()
        inclusive = self.clock() - start
        if self.stack:
            self.stack[-1][1] += inclusive
        rec = self.spent[part]
        rec[0] += 1
        rec[1] += 1e6 * (inclusive - children)

    def timed(self, fn, part: str):
        def wrapper(*args, **kwargs):
            self.push()
            try:
                return fn(*args, **kwargs)
            finally:
                self.pop(part)
        return wrapper

    def _timed_view(self, module, args, kwargs):
        """The model's pre-hook: its `cache` argument (positional or keyword) as a `_TimedView`."""
        if "cache" in kwargs:
            return args, {**kwargs, "cache": _TimedView(kwargs["cache"], self)}
        if len(args) > 2:
            return (*args[:2], _TimedView(args[2], self), *args[3:]), kwargs
        return None

    def attach(self, engine: Engine) -> None:
        runner = engine.runner
        model = runner.model
        for target, name, part in ((runner, "run_varlen", "run_varlen: ids, the view, the rest"),
                                   (runner.kv_cache, "plan_varlen", "plan (plan_varlen)")):
            own = vars(target).get(name)  # an instance's own wrapper (`_StepClock`'s) stays beneath
            setattr(target, name, self.timed(getattr(target, name), part))
            self.undo.append(lambda target=target, name=name, own=own:
                             setattr(target, name, own) if own is not None else delattr(target, name))
        for name, module in model.named_modules():
            part = _part_of(name)
            pre = module.register_forward_pre_hook(lambda *_: self.push())
            post = module.register_forward_hook(lambda *_, part=part: self.pop(part))
            self.undo += [pre.remove, post.remove]
        self.undo.append(model.register_forward_pre_hook(self._timed_view, with_kwargs=True).remove)
        if hasattr(model, "embed_tokens") and len(model.layers):
            # From the embedding's end to the first layer's start, the model builds the rotary tables.
            after_embed = model.embed_tokens.register_forward_hook(lambda *_: self.push())
            before_layers = model.layers[0].register_forward_pre_hook(lambda *_: self.pop("rotary tables"),
                                                                      prepend=True)
            self.undo += [after_embed.remove, before_layers.remove]

    def take(self) -> dict[str, tuple[int, float]]:
        spent, self.spent = self.spent, defaultdict(lambda: [0, 0.0])
        return {part: (int(calls), us) for part, (calls, us) in spent.items()}

    def close(self) -> None:
        for undo in reversed(self.undo):
            undo()
        self.undo = []


def mixed_host_parts(model_path, dtype=torch.bfloat16, rows: int = 16, context: int = 512, prompt_lens=(64, 512, 1536),
                     repeats: int = 5, budget: int = 2048, device: torch.device | str | None = None,
                     progress: bool = True) -> dict[str, pd.DataFrame]:
    """`day61_mixed_host`: the host's time inside the eager mixed step's `run_varlen` by part
    (`_HostParts`), the median over `repeats` mixed steps of each `prompt_lens` prompt (each fits
    one step) joining `rows` running rows, as us a step and calls a step, with the whole
    `run_varlen` timed with the parts' timers in place (`run_varlen_us`), and without (`plain_us`,
    the median of as many mixed steps again)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    for name, value in (("rows", rows), ("context", context), ("repeats", repeats), ("budget", budget)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1")
    if any(not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= budget - rows for n in prompt_lens) \
            or not prompt_lens:
        raise ValueError(f"prompt_lens={prompt_lens!r}: each must fit one step beside the {rows} rows "
                         f"(1 to {budget - rows})")
    model = load_model(model_path, dtype=dtype, device=device)
    vocab = model.config.vocab_size
    clock, parts = _StepClock(device), _HostParts()
    engine = _running_engine(model, rows, context, max(prompt_lens), budget, clock.sampler)
    records = []
    try:
        clock.attach(engine)
        _mixed_steps(engine, clock, random_prompts(1, 64, vocab, seed=3)[0].tolist())  # warm: first calls
        for n, prompt_len in enumerate(progress_bar(prompt_lens, desc="mixed host", enabled=progress)):
            plain = []
            for r in range(repeats):
                prompt = random_prompts(1, prompt_len, vocab, seed=100 * n + r)[0].tolist()
                plain += [rec["forward_host_ms"] for rec in _mixed_steps(engine, clock, prompt)]
            try:
                parts.attach(engine)  # over the clock's wrapper: it comes off first
                for r in range(repeats):
                    prompt = random_prompts(1, prompt_len, vocab, seed=100 * n + r + 50)[0].tolist()
                    steps = _mixed_steps(engine, clock, prompt)
                    if len(steps) != 1:
                        raise RuntimeError(f"a {prompt_len}-token prompt took {len(steps)} mixed steps, not one")
                    for part, (calls, us) in parts.take().items():
                        records.append({"prompt_len": prompt_len, "repeat": r, "part": part, "calls": calls,
                                        "us": us, "run_varlen_us": 1e3 * steps[0]["forward_host_ms"],
                                        "plain_us": 1e3 * float(pd.Series(plain).median()),
                                        "tokens": steps[0]["tokens"]})
            finally:
                parts.close()
    finally:
        parts.close()
        clock.close()
    table = (pd.DataFrame(records).groupby(["prompt_len", "part"], sort=False)
             .median(numeric_only=True).drop(columns="repeat").reset_index())
    table = table.sort_values(["prompt_len", "us"], ascending=[True, False], ignore_index=True)
    return {"day61_mixed_host": table.assign(running_rows=rows, context=context, budget=budget)}
