"""`ember generate`: complete one prompt offline and print the text."""

from __future__ import annotations

import argparse
import dataclasses

from ember.errors import EmberError


def register(subparsers: argparse._SubParsersAction) -> None:
    from ember.engine.args import EngineArgs

    parser = subparsers.add_parser("generate", help="complete one prompt with a local model and print the text",
                                   description="Complete one prompt with a local model and print the text.")
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=0, help="fewest tokens to generate (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = off")
    parser.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")
    EngineArgs.add_cli_args(parser)  # --seed also seeds this request's sampling
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ember.engine.args import EngineArgs
    from ember.engine.llm import LLM
    from ember.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    except ValueError as exc:
        raise EmberError(str(exc)) from None
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**dataclasses.asdict(engine_args))
    try:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            output = llm.chat(messages, params)[0]
        else:
            output = llm.generate(args.prompt, params)[0]
    except ValueError as exc:
        raise EmberError(str(exc)) from None
    print(output.outputs[0].text)
    return 0
