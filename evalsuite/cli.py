"""The `evalsuite` command: one subcommand per job; bad input gets one line and exit code 2."""
from __future__ import annotations

import argparse
import json
import sys


def _capacity(text: str):
    """'8' -> 8 experts, '0.25' -> a quarter of all experts, '512MiB' / 'all' kept as text."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-capacity", type=_capacity, default=0.5,
                   help="experts the device cache holds: a count, a fraction of all experts, '512MiB', 'all'")
    p.add_argument("--cache-policy", default="lru", help="lru | lfu")
    p.add_argument("--cache-pools", default="global", help="global | per-layer")
    p.add_argument("--link", default=None, help="pcie3 | pcie4 | pcie5 | nvlink-c2c | ufs4 | ufs3 | sdcard | '8GB/s+20us'")
    p.add_argument("--store", default="host", help="host (pinned memory) | disk (mmap of the safetensors files)")


def cmd_generate(args) -> int:
    from .generate import compare_modes, format_table, load_model

    model, tokenizer = load_model(args.model, args.dtype, args.device)
    rows = compare_modes(model, tokenizer, args.modes.split(","), prompts=args.prompt or _default_prompts(),
                         max_new_tokens=args.max_new_tokens, cache_capacity=args.cache_capacity,
                         cache_policy=args.cache_policy, cache_pools=args.cache_pools, link=args.link,
                         store=args.store)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0 if all(r["same_as_resident"] is not False for r in rows) else 1


def _default_prompts():
    from .generate import DEMO_PROMPTS

    return DEMO_PROMPTS


def cmd_train_tiny(args) -> int:
    from .zoo import train

    return train.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evalsuite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="greedy generation under several modes, with engine metrics")
    g.add_argument("--model", default="tiny:qwen3_moe", help="model directory, or tiny:<model_type> (random weights)")
    g.add_argument("--modes", default="resident,on-demand", help="comma-separated execution modes")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", help="also write the rows to this JSON file")
    _add_engine_options(g)
    g.set_defaults(run=cmd_generate)

    t = sub.add_parser("train-tiny", help="train the shipped tiny MoE models", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(run=cmd_train_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as exc:  # bad input: one line, exit 2
        print(f"evalsuite: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
