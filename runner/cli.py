"""`runner run | check | show | list`: the command line over runner/recipe.py and runner/loop.py.

Exit codes: 0 ok, 2 a user error (one line on stderr, no traceback), 130 interrupted, 1 a bug
(with its traceback). `check`, `show` and `list` never import torch: the loop, and with it the
backends, is imported inside `run` only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from backends.errors import UserError
from runner.load import DEFAULT_FILE, check_recipe, dump_recipe, load_recipe, read_tables, resolve, split_ref
from runner.threads import prefer_passive_openmp

EPILOG = f"""\
A recipe is a [recipes.<name>] table in a TOML file; FILE#NAME picks one (FILE alone when it
holds just one). KEY=VALUE overrides follow the reference: dotted keys, TOML values, plain
text when the value is not a TOML literal. They win over the recipe, which wins over defaults.

examples:
  runner list
  runner check                                   # every recipe in {DEFAULT_FILE}
  runner show {DEFAULT_FILE}#sl_basic lr=3e-4 lora.rank=8
  runner run {DEFAULT_FILE}#sl_basic backend='{{kind="tinker"}}' model=Qwen/Qwen3-8B
  runner run examples/sft_tiny.toml --dry-run
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after flags (`run REF --dry-run lr=1`), which argparse leaves unparsed.
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.command(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `runner show ... | head`
        sys.stderr.close()
        return 0
    except Exception as e:
        # A backend that gave up on a request the user can fix (backends.base.BackendError) says so;
        # checked by attribute so this module does not import the backends.
        if getattr(e, "user_error", False):
            print(f"error: {e}", file=sys.stderr)
            return 2
        # A request the backend gave up on (server down, retries exhausted): not our bug, so no traceback.
        # The run dir keeps its metrics and last checkpoint; the same command resumes.
        if hasattr(e, "request"):
            print(f"error: {e} (the run can be resumed with the same command)", file=sys.stderr)
            return 1
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="runner",
        description="Declarative LLM post-training (SFT, DPO, reward_model and RL) from TOML recipes, on a local torch "
        "backend or Tinker.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="train one recipe", description="Validate, check and run one recipe.")
    _ref_and_overrides(run)
    run.add_argument("--dry-run", action="store_true", help="print the plan (data, steps, schedule, calls) and stop")
    run.set_defaults(command=cmd_run)

    check = sub.add_parser(
        "check",
        help="validate recipes without running them",
        description="Validate every recipe in FILE (or one), check its data files exist and its Python "
        "targets import; one ok line per recipe.",
    )
    _ref_and_overrides(check, optional=True)
    check.set_defaults(command=cmd_check)

    show = sub.add_parser(
        "show",
        help="print a recipe with every default filled in",
        description="Print one recipe as TOML, overrides applied and every field resolved; the output is "
        "itself a recipe file.",
    )
    _ref_and_overrides(show)
    show.set_defaults(command=cmd_show)

    ls = sub.add_parser("list", help="one line per recipe: name, algorithm, model, backend")
    ls.add_argument("file", nargs="?", default=DEFAULT_FILE, metavar="FILE", help=f"default: {DEFAULT_FILE}")
    ls.set_defaults(command=cmd_list)
    return parser


def _ref_and_overrides(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    if optional:
        parser.add_argument("ref", nargs="?", default=DEFAULT_FILE, metavar="FILE[#NAME]",
                            help=f"a recipe file, or one recipe in it (default: {DEFAULT_FILE})")
    else:
        parser.add_argument("ref", metavar="FILE#NAME", help="a recipe (FILE alone when it holds one recipe)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="e.g. lr=3e-4 lora.rank=8 backend.kind=tinker "
                        "'algo.data={kind=\"jsonl\", path=\"x.jsonl\"}'")


def cmd_run(args: argparse.Namespace) -> int:
    name, recipe = load_recipe(args.ref, args.overrides)
    check_recipe(recipe, _where(args.ref, name))
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from runner.loop import Interrupted, run  # torch and the backends load here, and only here

    try:
        run(recipe, name, dry_run=args.dry_run)
    except Interrupted:  # Ctrl-C: the loop saved a checkpoint and said so
        return 130
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    path, name = split_ref(args.ref)
    if name is not None:
        name, recipe = load_recipe(args.ref, args.overrides)
        check_recipe(recipe, f"{path}#{name}")
        print(f"ok  {path}#{name}")
        return 0
    # Every recipe, each reported on its own line, so one bad recipe does not hide the others.
    failed = 0
    for name, raw in read_tables(path).items():
        where = f"{path}#{name}"
        try:
            recipe = resolve(path, name, raw, args.overrides)
            check_recipe(recipe, where)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"ok  {where}")
    return 2 if failed else 0


def cmd_show(args: argparse.Namespace) -> int:
    name, recipe = load_recipe(args.ref, args.overrides)
    sys.stdout.write(dump_recipe(name, recipe))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for name, raw in read_tables(args.file).items():
        recipe = resolve(args.file, name, raw)
        rows.append((name, _kind(recipe.algo), recipe.model, _kind(recipe.backend)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


def _kind(struct: object) -> str:
    return str(type(struct).__struct_config__.tag)  # type: ignore[attr-defined]


def _where(ref: str, name: str) -> str:
    return f"{split_ref(ref)[0]}#{name}"
