"""`runner run | check | show | list | serve`: the command line over runner/recipe.py and runner/loop.py.

Exit codes: 0 ok, 2 a user error (one line on stderr, no traceback), 130 interrupted, 1 a bug
(with its traceback). `check`, `show` and `list` never import torch: the loop, and with it the
backends, is imported inside `run` only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from backends.errors import UserError
from runner.chain import run_chain, upstreams
from runner.load import DEFAULT_FILE, check_recipe, dump_recipe, load_recipe, read_tables, resolve, split_ref
from runner.recipe import Recipe
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
        description="Declarative LLM post-training (SFT and RL) from TOML recipes, on a local torch "
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

    serve = sub.add_parser(
        "serve",
        help="serve the local backend as a Tinker-compatible API, so Tinker programs run offline",
        description="Serve the Tinker API (the routes the tinker SDK and tinker-cookbook use) over the local "
        "torch backend. Point a Tinker program at it with TINKER_BASE_URL=http://HOST:PORT and any "
        "TINKER_API_KEY starting with tml- (or the key in --api-key-env).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  runner serve                                  # tiny, on 127.0.0.1:8000\n"
        "  runner serve --model Qwen/Qwen3-0.6B=/models/qwen3-0.6b --storage ~/.runner-serve\n"
        "  runner serve --port 0 --port-file /tmp/port  # a free port, written to the file once listening\n",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port (0: a free one; see --port-file)")
    serve.add_argument("--port-file", type=Path, help="write the bound port to this file once listening")
    serve.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                       help="serve the model at PATH (a Hugging Face folder, a cached hub id, or tiny) under NAME; "
                       "repeatable; default: tiny")
    serve.add_argument("--storage", type=Path, default=Path("serve-storage"),
                       help="folder for training runs and checkpoints (kept across restarts; default ./serve-storage)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    serve.add_argument("--api-key-env", metavar="VAR", help="require the API key held in environment variable VAR")
    serve.add_argument("--sampler-idle-s", type=float, default=None,
                       help="free a sampling session's model after this many idle seconds (default 30)")
    serve.add_argument("--max-live-samplers", type=int, default=None,
                       help="sampling sessions that may hold a loaded model at once (default 4)")
    serve.add_argument("-v", "--verbose", action="store_true", help="log every request")
    serve.set_defaults(command=cmd_serve)

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
    where = _where(args.ref, name)
    check_chain(recipe, where)
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from runner.loop import Interrupted  # torch and the backends load here, and only here

    try:
        run_chain(recipe, name, where, dry_run=args.dry_run)
    except Interrupted:  # Ctrl-C: the loop saved a checkpoint and said so
        return 130
    return 0


def check_chain(recipe: Recipe, where: str) -> None:
    """check_recipe for a recipe and every recipe its init_from chain runs first."""
    check_recipe(recipe, where)
    for stage in upstreams(recipe, where):
        if stage.runnable:
            check_recipe(stage.recipe, stage.ref)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.port_file is None and args.port == 0:
        raise UserError("--port 0 picks a free port: give --port-file FILE to learn which")
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from backends.serve.http import ServeConfig, serve_forever

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    cfg = ServeConfig(host=args.host, port=args.port, port_file=args.port_file, models=tuple(args.model),
                      storage=args.storage, device=args.device, api_key_env=args.api_key_env,
                      sampler_idle_s=args.sampler_idle_s, max_live_samplers=args.max_live_samplers)
    try:
        serve_forever(cfg)
    except KeyboardInterrupt:
        print("runner serve: stopped", file=sys.stderr)
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    path, name = split_ref(args.ref)
    if name is not None:
        name, recipe = load_recipe(args.ref, args.overrides)
        check_chain(recipe, f"{path}#{name}")
        print(f"ok  {path}#{name}")
        return 0
    # Every recipe, each reported on its own line, so one bad recipe does not hide the others.
    failed = 0
    for name, raw in read_tables(path).items():
        where = f"{path}#{name}"
        try:
            recipe = resolve(path, name, raw, args.overrides)
            check_chain(recipe, where)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(f"ok  {where}")
    return 2 if failed else 0


def cmd_show(args: argparse.Namespace) -> int:
    name, recipe = load_recipe(args.ref, args.overrides)
    chain = upstreams(recipe, _where(args.ref, name))
    if chain:
        stages = " -> ".join([*(f"{s.label} ({s.ref})" for s in chain), name])
        sys.stdout.write(f"# chain (init_from): {stages}\n")
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
