"""Command line: `python -m nanolab generate "prompt"`, `python -m nanolab weights PRESET`,
`python -m nanolab bench`, `python -m nanolab capturebench`, `python -m nanolab streambench`.

Engine core (before Day 49). The bench commands run instruments from `nanolab.lab`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _generate(args: argparse.Namespace) -> int:
    from nanolab.llm import LLM
    from nanolab.sampling import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos)
        llm = LLM(args.model, device=args.device, dtype=args.dtype)
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta)
            sys.stdout.flush()
    except (ValueError, FileNotFoundError) as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("\n")
    return 0


def _weights(args: argparse.Namespace) -> int:
    from nanolab.model.weights import resolve_weights

    try:
        print(resolve_weights(args.preset))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    from nanolab.lab.decodebench import main

    return main(args)


def _capturebench(args: argparse.Namespace) -> int:
    from nanolab.lab.capturebench import main

    return main(args)


def _streambench(args: argparse.Namespace) -> int:
    from nanolab.lab.streambench import main

    return main(args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m nanolab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream a completion to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--model", default="smollm2-135m", help="a preset name or a Hugging Face model folder")
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    gen.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--stop", action="append", help="a stop string; repeat for several")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(run=_generate)

    weights = sub.add_parser("weights", help="prepare a preset's weights (convert or synthesize) and print the folder")
    weights.add_argument("preset")
    weights.set_defaults(run=_weights)

    bench = sub.add_parser("bench", help="decode ms/step and tokens/s, nanolab against HF transformers")
    from nanolab.lab.decodebench import add_arguments

    add_arguments(bench)
    bench.set_defaults(run=_bench)

    capture = sub.add_parser("capturebench", help="decode with CUDA graphs on and off against HF static (CUDA)")
    from nanolab.lab.capturebench import add_arguments as capture_arguments

    capture_arguments(capture)
    capture.set_defaults(run=_capturebench)

    stream = sub.add_parser("streambench", help="the decode read alone: reference, streamed kernels, SDPA (CUDA)")
    from nanolab.lab.streambench import add_arguments as stream_arguments

    stream_arguments(stream)
    stream.set_defaults(run=_streambench)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
