"""Command line: `python -m nanolab generate "prompt"`, `python -m nanolab weights PRESET`,
`python -m nanolab serve` (the OpenAI-compatible server), and the lab's benches: `bench`,
`capturebench`, `streambench`, `graphbench`, `levers`, `floorbench`, `tpbench`,
`prefixbench`, `prefixsteps`, `varlenbench`, `specbench`, `hostbench`, `fp8bench`, `frontcosts`, `kernelres`.

Bad input (a ValueError, TypeError or FileNotFoundError, a CUDA
device this machine lacks among them) ends in one `error: ...` line on stderr and exit code 2;
Ctrl-C ends quietly with 130. `serve` and the benches are imported only when run, so a missing
optional extra (`serve`, `lab`) fails only the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys

from nanolab.config import EngineConfig

# Commands whose module is imported only when they run: name -> (module, extra, help). The module
# provides `add_arguments(parser)` and `main(args) -> int`.
LAZY_COMMANDS = {
    "serve": ("nanolab.entrypoints.openai.api_server", "serve",
              "serve the OpenAI-compatible HTTP API (completions and chat completions)"),
    "bench": ("nanolab.lab.decodebench", "lab",
              "decode ms/step and tokens/s, nanolab against HF transformers' eager path"),
    "capturebench": ("nanolab.lab.capturebench", "lab",
                     "decode with CUDA graphs on and off against HF static, eager (CUDA)"),
    "streambench": ("nanolab.lab.streambench", "lab",
                    "the decode read alone: reference, streamed kernels, SDPA (CUDA)"),
    "graphbench": ("nanolab.lab.graphbench", "lab",
                   "the server over loopback with CUDA graphs on and off: TTFT, TPOT, ITL, goodput (Day 58)"),
    "levers": ("nanolab.lab.levers", "lab",
               "the decode step with each speed lever added in turn, by kernel class (CUDA)"),
    "floorbench": ("nanolab.lab.floorbench", "lab",
                   "decode ms/step against the bandwidth floor: nanolab, HF (compiled and eager), gpt-fast (Day 61)"),
    "tpbench": ("nanolab.lab.tpbench", "lab",
                "decode ms/step at tensor-parallel sizes 1 and 2, with the NCCL time per step (CUDA)"),
    "prefixsteps": ("nanolab.lab.prefixsteps", "lab",
                    "a prompt step after a cached prefix: its time and kernels, beside a decode step (Day 64)"),
    "varlenbench": ("nanolab.lab.varlenbench", "lab",
                    "the varlen read alone over its tiles and launch: chunks, prefix hits, verify steps (CUDA)"),
    "specbench": ("nanolab.lab.specbench", "lab",
                  "speculative decoding on real text: acceptance and ms a token at batch 1, on and off (Day 65)"),
    "hostbench": ("nanolab.lab.hostbench", "lab",
                  "the host's work a decode step, plain, synchronous verify and chained verify (Day 65)"),
    "fp8bench": ("nanolab.lab.fp8bench", "lab",
                 "fp8 weights against bf16: ms a decode step against each floor, and perplexity (Day 65)"),
    "kernelres": ("nanolab.lab.kernelres", "lab",
                  "a kernel's registers and spills on an NVIDIA GPU, compiled without one (Day 64c)"),
    "frontcosts": ("nanolab.lab.frontcosts", "lab",
                   "a request's host work, stage by stage, around its prompt step, by prompt length (Day 64b)"),
    "prefixbench": ("nanolab.lab.prefixbench", "lab",
                    "prefix caching on and off: TTFT at a shared prefix and a chat's second turn, the cost "
                    "with no hits, the hit rate (Day 64)"),
}

# Errors that mean the input was bad, not that nanolab is broken: reported in one line, exit 2.
INPUT_ERRORS = (ValueError, TypeError, FileNotFoundError)


def _error(message: object, code: int = 2) -> int:
    """Print `message` as one `error:` line on stderr and return `code`."""
    print("error: " + " ".join(str(message).splitlines()), file=sys.stderr)
    return code


class _Refused(Exception):
    """What argparse refused, as `main` prints it."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, its own refusals (a value of the wrong type, an unknown choice or flag)
    printed as every other refusal is (`main`): one `error:` line naming the command and the flag,
    exit 2."""

    def error(self, message: str):
        command = self.prog.removeprefix("python -m nanolab").strip()
        raise _Refused(f"{command or 'nanolab'}: {message} (see python -m nanolab{' ' + command if command else ''} "
                       "--help)")


def _generate(args: argparse.Namespace) -> int:
    from nanolab.llm import LLM
    from nanolab.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos)
    llm = LLM.from_config(EngineConfig.from_cli_args(args))
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    streamed = False
    try:
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
            streamed = True
    except BaseException as e:
        if streamed:  # end the half-written line, so the error or the shell prompt starts its own
            sys.stdout.write("\n")
            sys.stdout.flush()
        if isinstance(e, RuntimeError):  # the stream's request failed while running: not bad input
            return _error(e, code=1)
        raise
    finally:
        llm.close()  # a tensor-parallel group's workers
    sys.stdout.write("\n")
    return 0


def _weights(args: argparse.Namespace) -> int:
    from nanolab.model.weights import resolve_weights

    print(resolve_weights(args.preset))
    return 0


def _run(args: argparse.Namespace) -> int:
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except INPUT_ERRORS as e:
        return _error(e)
    except MemoryError as e:  # sizes the host cannot hold (a --max-num-seqs of billions)
        return _error(f"out of memory building what was asked for ({e or 'MemoryError'}): lower the sizes given")


def _missing_dependency(e: ImportError) -> bool:
    """True when `e` is a third-party module that is absent (an optional extra), not nanolab's own."""
    return isinstance(e, ModuleNotFoundError) and bool(e.name) and e.name.split(".")[0] != "nanolab"


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _Parser(prog="python -m nanolab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="a stop string; repeat for several")
    gen.add_argument("--ignore-eos", action="store_true")
    EngineConfig.add_cli_args(gen)
    gen.set_defaults(run=_generate)

    weights = sub.add_parser("weights", help="prepare a preset's weights (convert or synthesize) and print the folder")
    weights.add_argument("preset")
    weights.set_defaults(run=_weights)

    # A command whose module this install lacks is left out; only the command being run imports its
    # module and registers its options.
    lazy = {name: spec for name, spec in LAZY_COMMANDS.items() if _module_exists(spec[0])}
    for name, (_, _, text) in lazy.items():
        sub.add_parser(name, help=text)
    command = argv[0] if argv else None
    if command in lazy:
        module_name, extra, _ = lazy[command]
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            if not _missing_dependency(e):
                raise
            return _error(f"python -m nanolab {command} needs the {extra} extra: pip install 'nanolab[{extra}]' "
                          f"({e})")
        module.add_arguments(sub.choices[command])
        sub.choices[command].set_defaults(run=module.main)

    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # the command's own parser names them, and its help
            sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extras)}")
    except _Refused as e:
        return _error(e)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
