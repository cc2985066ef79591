"""`runner sample | chat | eval`: their flags, checked, then runner/tools/talk.py on a checkpoint of a run.
Split from runner/cli.py."""

from __future__ import annotations

import argparse
import sys

from backends.errors import UserError
from runner.threads import prefer_passive_openmp


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`runner sample | chat | eval` (runner/tools/talk.py)."""
    target_help = "a run dir, or a recipe FILE#name (its run dir)"
    ckpt_help = "a checkpoint by name (checkpoints.jsonl); default: the last one; 'base': the base model"

    sample = sub.add_parser("sample", help="sample completions from a checkpoint of a run",
                            description="Sample replies to prompts from any checkpoint, through the run's backend.")
    sample.add_argument("target", metavar="RUN_DIR|FILE#NAME", help=target_help)
    sample.add_argument("prompt", nargs="?", help="a user message (or --file)")
    sample.add_argument("--checkpoint", metavar="NAME", help=ckpt_help)
    sample.add_argument("--file", metavar="PROMPTS.jsonl", help='rows {"prompt": "..."} or {"messages": [...]}')
    sample.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    sample.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1)")
    sample.add_argument("--max-tokens", type=int, default=128, help="default 128")
    sample.add_argument("--seed", type=int, default=None, help="make the samples reproducible")
    sample.add_argument("--system", metavar="TEXT", help="a system message before each prompt")
    sample.add_argument("--json", action="store_true", help="one JSON line per prompt")
    sample.set_defaults(command=cmd_sample)

    chat = sub.add_parser("chat", help="chat with a checkpoint of a run (stdin/stdout)",
                          description="A multi-turn chat with any checkpoint; /reset starts over, /quit or EOF ends.")
    chat.add_argument("target", metavar="RUN_DIR|FILE#NAME", help=target_help)
    chat.add_argument("--checkpoint", metavar="NAME", help=ckpt_help)
    chat.add_argument("--temperature", type=float, default=0.7, help="default 0.7")
    chat.add_argument("--max-tokens", type=int, default=256, help="default 256")
    chat.add_argument("--system", metavar="TEXT", help="a system message")
    chat.set_defaults(command=cmd_chat)

    ev = sub.add_parser("eval", help="run the recipe's evaluators on a checkpoint",
                        description="The recipe's held-out evals (SFT test/nll, RL test reward, DPO and reward-model "
                        "test/accuracy, distillation test/teacher_kl) and its pinned [[evals]] on one checkpoint; "
                        "appended to evals.jsonl.")
    ev.add_argument("target", metavar="RUN_DIR|FILE#NAME", help=target_help)
    ev.add_argument("--checkpoint", metavar="NAME|STEP",
                    help="a checkpoint by name, or by the steps it was saved after (e.g. 20); default: the last one")
    ev.set_defaults(command=cmd_eval)



def at_least_one(value: int, flag: str) -> None:
    if value < 1:
        raise UserError(f"{flag} must be >= 1, got {value}")


def cmd_sample(args: argparse.Namespace) -> int:
    from runner.tools.talk import check_text, read_prompts, sample

    if (args.prompt is None) == (args.file is None):
        raise UserError("give a prompt or --file PROMPTS.jsonl (one of them)")
    at_least_one(args.n, "--n")
    at_least_one(args.max_tokens, "--max-tokens")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    prompts = read_prompts(args.file) if args.file else [[{"role": "user", "content": check_text(args.prompt, "the prompt")}]]
    if args.system:
        prompts = [[{"role": "system", "content": check_text(args.system, "--system")}, *p] for p in prompts]
    prefer_passive_openmp()
    sample(args.target, args.checkpoint, prompts, args.n, args.temperature, args.max_tokens, args.seed, args.json,
           sys.stdout)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from runner.tools.talk import chat

    at_least_one(args.max_tokens, "--max-tokens")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    prefer_passive_openmp()
    chat(args.target, args.checkpoint, args.temperature, args.max_tokens, args.system, sys.stdin, sys.stdout)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from runner.tools.talk import evaluate

    prefer_passive_openmp()
    evaluate(args.target, args.checkpoint, sys.stdout)
    return 0

