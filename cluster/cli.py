"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    from pdserve.engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="LLM serving with separately sized prefill and decode worker pools.",
    )
    sub = parser.add_subparsers(title="commands")
    gen = sub.add_parser("generate", help="generate text offline with the engine",
                         description="Generate text for one prompt, streaming it to stdout.")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: all)")
    gen.add_argument("--sample-seed", type=int, default=None, help="seed of this request")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    from pdserve.cluster import cli_service

    cli_service.add_commands(sub)
    from pdserve.cluster import cli_planner

    cli_planner.add_commands(sub)
    return parser


def _generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLMEngine, SamplingParams
    from pdserve.engine.arg_utils import engine_config_from_args
    from pdserve.engine.tokenizer import apply_chat_template

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sample_seed,
                            stop=tuple(args.stop))
    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    if args.chat:
        prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": prompt}])
    start = time.perf_counter()
    engine.add_request("cli", prompt, params)
    output = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            print(output.new_text, end="", flush=True)
    elapsed = time.perf_counter() - start
    print()
    n = len(output.token_ids)
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s, finish_reason={output.finish_reason}]",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
