"""`runner run | check | show | list | export | sweep | compare | plot | serve`: the command line over runner/recipe/schema.py
and runner/engine/loop.py (sweeps, comparison and plots: runner/tools/sweep.py, runner/tools/compare.py, runner/tools/plot.py; the
Tinker-compatible server: runner/tools/serve_command.py over backends/serve/; sample, chat and eval:
runner/tools/talk_command.py).

Exit codes: 0 ok, 2 a user error (one line on stderr, no traceback), 3 budget reached (checkpointed), 130 interrupted, 1 a bug
(with its traceback). `check`, `show` and `list` never import torch: the loop, and with it the
backends, is imported inside `run` only (and the local backend's export inside `export`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from backends.errors import UserError
from runner.engine.chain import check_all, check_session, upstreams
from runner.recipe.load import (
    DEFAULT_FILE,
    dump_recipe,
    explain_recipe,
    load_recipe,
    read_tables,
    recipe_names,
    resolve,
    split_ref,
)
from runner.renderers.auto import auto_note as renderer_note
from runner.threads import prefer_passive_openmp
from runner.tools.serve_command import add_parser as add_serve
from runner.tools.smoke import check_smoke
from runner.tools.sweep import check_line, refuse_sweep, show_sweep
from runner.tools.talk_command import add_parsers as add_talk
from runner.tools.talk_command import at_least_one

SMOKE_HELP = ("run it end to end offline in seconds: local backend, a stand-in model, the recipe's smoke table "
              "(data, env, model, steps), 2 steps, run dir <name>-smoke; every stage of a chain (docs/smoke.md)")

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
  runner render {DEFAULT_FILE}#sl_basic --n 2 renderer=qwen3   # tokens and weights the trainer sees
  runner smoke examples/cookbook.toml            # every recipe, offline, seconds each
  runner export runs/sl_basic out/sl_basic-merged --merged
  runner sweep {DEFAULT_FILE}#sl_basic 'lr=[1e-3,4e-3]' max_steps=20
  runner compare runs/sl_basic
  runner plot runs/sl_basic --metric train_mean_nll -o nll.png
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
        description="Declarative LLM post-training (SFT, DPO, reward_model, RL, distill, generate and python: your own, "
        "examples/custom_algo.py) from TOML recipes, on a local torch backend or Tinker.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_Version, help="print the installed version and exit")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    run = sub.add_parser("run", help="train one recipe", description="Validate, check and run one recipe.")
    _ref_and_overrides(run)
    run.add_argument("--dry-run", action="store_true", help="print the plan (data, steps, schedule, calls) and stop")
    run.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    run.add_argument("--force", action="store_true",
                     help="resume even though the data files (or pkg.mod:fn sources) changed since the run dir trained")
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
    show.add_argument("--smoke", action="store_true", help="print the recipe --smoke runs (and its smoked stages)")
    show.add_argument("--explain", action="store_true",
                      help="one `key = value  # source` line per value: default, [defaults], an extends base, "
                      "the recipe, or an override (docs/recipes.md)")
    show.set_defaults(command=cmd_show)

    render = sub.add_parser(
        "render",
        help="print the first rows of a recipe's data as the trainer sees them (tokens, weights)",
        description="The first N rows of the recipe's data rendered with its renderer: tokens colored by weight "
        "(green = trained) on a terminal, else (or with --json) one {\"tokens\", \"weights\"} object per line. "
        "DPO and the reward model: each side of a comparison; RL: the env's first prompts. docs/renderers.md says "
        "which renderer to pick.",
    )
    _ref_and_overrides(render)
    render.add_argument("--n", type=int, default=3, help="rows to show (default 3)")
    render.add_argument("--json", action="store_true", help="one JSON object per line, also on a terminal")
    render.set_defaults(command=cmd_render)

    smoke = sub.add_parser(
        "smoke",
        help="run every recipe of a file (or those named) offline in seconds; a table of results",
        description="Each recipe as `runner run FILE#name --smoke` runs it (local backend, a stand-in model, "
        "its smoke table's data, 2 steps, run dir <name>-smoke), then one row per recipe: stages, steps, wall "
        "seconds, ok or FAILED. Exit 1 if any failed. docs/smoke.md says how to smoke your own recipe.",
    )
    smoke.add_argument("file", metavar="FILE", help="a recipe file")
    smoke.add_argument("names", nargs="*", metavar="NAME", help="recipes to smoke (default: all)")
    smoke.set_defaults(command=cmd_smoke)

    add_serve(sub)

    ls = sub.add_parser("list", help="one line per recipe: name, algorithm, model, backend")
    ls.add_argument("file", nargs="?", default=DEFAULT_FILE, metavar="FILE", help=f"default: {DEFAULT_FILE}")
    ls.set_defaults(command=cmd_list)

    export = sub.add_parser(
        "export",
        help="write a run's checkpoint as a PEFT adapter or a merged model folder",
        description="Write a local-backend checkpoint of RUN_DIR to the new folder OUT, with the tokenizer: a "
        "PEFT adapter that PeftModel.from_pretrained loads and merge_and_unload merges exactly, or with "
        "--merged a plain Hugging Face model folder. A full fine-tune's checkpoint is a model folder either way.",
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds config.toml, checkpoints.jsonl)")
    export.add_argument("out", metavar="OUT", help="the folder to write; must not exist, or be empty")
    export.add_argument("--checkpoint", metavar="NAME",
                        help="a checkpoint by name (checkpoints.jsonl); default: the last one with sampler weights")
    export.add_argument("--merged", action="store_true", help="merge the adapter into the weights")
    export.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the dtype the base is loaded, merged and saved in (auto: the base's own, bfloat16 for "
                             "most chat models, where merging rounds the update; float32 keeps it exact)")
    export.set_defaults(command=cmd_export)
    _science_commands(sub)
    add_talk(sub)
    _numerics_command(sub)
    return parser


def _numerics_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`runner numerics` (runner/tools/numerics.py)."""
    num = sub.add_parser(
        "numerics", help="check that the sampler and the trainer agree on sampled tokens' logprobs",
        description="Sample N prompts (the recipe's env or prompt sets, else generic ones) at temperature 1 with the "
        "recipe's model and backend, recompute the sampled tokens' logprobs with compute_logprobs and a training "
        "forward, and print the per-token differences (KL, mean/max |Δ|, by position, worst tokens). Exit 1 when "
        "over the recipe's numerics limits (else the defaults). docs/numerics.md.")
    _ref_and_overrides(num)
    num.add_argument("--n", type=int, default=8, help="prompts (default 8)")
    num.add_argument("--json", action="store_true", help="the report as one JSON object")
    num.set_defaults(command=cmd_numerics)


def cmd_numerics(args: argparse.Namespace) -> int:
    from runner.tools.numerics import check

    at_least_one(args.n, "--n")
    prefer_passive_openmp()
    return check(args.ref, args.overrides, args.n, args.json, sys.stdout)


def _science_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """sweep, compare, plot (runner/tools/sweep.py, runner/tools/compare.py, runner/tools/plot.py)."""
    sweep = sub.add_parser(
        "sweep",
        help="run a grid of one recipe's values, each point a run dir",
        description="One run per value of each KEY=[v1, v2, ...] (the product of them; --zip pairs them), and of\n"
        "the recipe's [recipes.<name>.sweep] table; plain KEY=VALUE applies to every point. Each point runs in\n"
        "<log_dir>/<key=value,...>/ (default log_dir: runs/<name>); finished points are not run again, killed\n"
        "ones resume. A key that takes an array is swept by an array of arrays:\n"
        "algo.env.prompts='[[\"a\"], [\"b\", \"c\"]]'. Every point is checked before any starts.",
        epilog=f"examples:\n  runner sweep {DEFAULT_FILE}#sl_basic 'lr=[1e-3,4e-3]' 'lora.rank=[8,16]' max_steps=20\n"
        f"  runner sweep {DEFAULT_FILE}#sl_basic 'lr=[1e-3,2e-3,4e-3]' 'seed=[0,1,2]' --zip --dry-run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _ref_and_overrides(sweep)
    sweep.add_argument("--parallel", type=_positive, metavar="N",
                       help="points running at once (default: local CPU half the cores, at least 2; local GPU 1; "
                       "Tinker 8)")
    sweep.add_argument("--zip", action="store_true", help="pair the swept values instead of taking their product")
    sweep.add_argument("--dry-run", action="store_true", help="list the points, their run dirs and status; run nothing")
    sweep.set_defaults(command=cmd_sweep)

    compare = sub.add_parser(
        "compare",
        help="one table of runs: the keys that differ, final and best metrics",
        description="A row per run (run dirs, sweep dirs, globs): the recipe keys that differ between the runs, the "
        "steps trained, and the final and best value of each metric (default: the algorithm's main metrics), "
        "best run first.",
    )
    compare.add_argument("dirs", nargs="+", metavar="DIR", help="run dirs, or dirs holding run dirs (a sweep)")
    compare.add_argument("--metric", action="append", default=[], metavar="NAME",
                         help="a metrics.jsonl key (repeatable); NAME:min or NAME:max says which way is better")
    compare.add_argument("--format", choices=("table", "csv", "markdown", "json", "html"), default="table")
    compare.set_defaults(command=cmd_compare)

    plot = sub.add_parser(
        "plot",
        help="learning curves of runs as a PNG",
        description="One line per run, step on x, labelled by the keys that differ; one panel per metric. With one "
        "DIR and no -o, writes DIR/index.html (the compare table and the plots, plot-<metric>.png next to it).",
    )
    plot.add_argument("dirs", nargs="+", metavar="DIR", help="run dirs, or dirs holding run dirs (a sweep)")
    plot.add_argument("--metric", action="append", default=[], metavar="NAME", help="a metrics.jsonl key (repeatable)")
    plot.add_argument("-o", "--output", metavar="PNG", help="the image to write (default: see above, or plot.png)")
    plot.add_argument("--smooth", type=_positive, default=1, metavar="K",
                      help="moving average over K points, bold over the faint raw curve (default 1: raw)")
    plot.set_defaults(command=cmd_plot)

    from runner.tools.conformance.command import add_parser as add_conformance  # docs/conformance.md

    add_conformance(sub)


class _Version(argparse.Action):
    """`runner --version`: the installed package's version (its metadata), looked up only when asked."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=str(kwargs.get("help")))

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("runner")
        except PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
            text = "unknown (not installed: pip install -e .)"
        print(f"runner {text}")
        parser.exit()


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


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
    if args.smoke:
        return _run_smoke(args)
    name, recipe = load_recipe(args.ref, args.overrides)
    refuse_sweep(args.ref)
    where = _where(args.ref, name)
    check_all(recipe, where, keep_rows=not args.dry_run, name=name)
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from runner.engine.cost import BudgetReached
    from runner.engine.loop import Interrupted  # torch and the backends load here, and only here
    from runner.engine.pipeline import naming, run_chain

    try:
        with naming(where):  # a dry run's errors name the recipe as the run's do
            run_chain(recipe, name, where, dry_run=args.dry_run, force=args.force)
    except Interrupted:  # Ctrl-C: the loop saved a checkpoint and said so
        return 130
    except BudgetReached:  # the recipe's budget: the loop saved a checkpoint and said why (docs/cost.md)
        return 3
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    with check_session():  # each recipe a chain reaches is loaded and checked once (runner/engine/chain.py)
        return _check(args)


def _check(args: argparse.Namespace) -> int:
    path, name = split_ref(args.ref)
    if name is not None:
        print(check_line(args.ref, args.overrides))  # a sweep: every point
        check_smoke(path, name, args.overrides)
        return 0
    # Every recipe, each reported on its own line, so one bad recipe does not hide the others.
    failed = 0
    for name in recipe_names(path):
        try:
            line = check_line(f"{path}#{name}", args.overrides)
            check_smoke(path, name, args.overrides)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
            continue
        print(line)
    return 2 if failed else 0


def _run_smoke(args: argparse.Namespace) -> int:
    from runner.tools.smoke import split

    path, name = split(args.ref)
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from runner.engine.loop import Interrupted
    from runner.tools.smoke import run_smoke

    try:
        run_smoke(path, [name], args.overrides, dry_run=args.dry_run, keep_going=False)
    except Interrupted:
        return 130
    return 0


def cmd_smoke(args: argparse.Namespace) -> int:
    from runner.tools.smoke import all_names, table

    names = args.names or all_names(args.file)
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from runner.tools.smoke import run_smoke

    results = run_smoke(args.file, names)
    sys.stdout.write(table(results))
    return 0 if all(r.ok for r in results) else 1


def cmd_show(args: argparse.Namespace) -> int:
    if args.smoke:
        from runner.tools.smoke import show, split

        sys.stdout.write(show(*split(args.ref), args.overrides))
        return 0
    swept = show_sweep(args.ref, args.overrides)  # a sweep: with its table (runner/tools/sweep.py)
    if swept is not None:
        sys.stdout.write(swept)
        return 0
    name, recipe = load_recipe(args.ref, args.overrides)
    chain = upstreams(recipe, _where(args.ref, name))
    if chain:
        stages = " -> ".join([*(f"{s.label} ({s.ref})" for s in chain), name])
        sys.stdout.write(f"# chain (init_from): {stages}\n")
    sys.stdout.write(_lr_note(args.ref, args.overrides))
    sys.stdout.write(renderer_note(recipe.renderer, recipe.model))
    if args.explain:
        sys.stdout.write(explain_recipe(split_ref(args.ref)[0], name, recipe, args.overrides))
        return 0
    sys.stdout.write(dump_recipe(name, recipe))
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from runner.tools.render import render_command

    render_command(args.ref, args.overrides, args.n, args.json, sys.stdout)
    return 0

def _lr_note(ref: str, overrides: Sequence[str]) -> str:
    """'# lr = 0.000619: auto: ...' when the recipe's lr is "auto" (runner/recipe/lr.py), else ''."""
    from runner.recipe.load import apply_overrides, pick
    from runner.recipe.lr import auto_note

    path, name, raw = pick(ref)
    return auto_note(apply_overrides(raw, overrides, f"{path}#{name}")) or ""


def cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for name, raw in read_tables(args.file).items():
        recipe = resolve(args.file, name, raw)
        rows.append((name, _kind(recipe.algo), recipe.model, _kind(recipe.backend)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0


def _check_writable_parent(out: Path) -> None:
    """UserError unless OUT's folder is one export can create its temporary sibling in: checked before torch loads
    and the base is merged, not found out after (a file on the way, or a folder this user cannot write)."""
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{out}: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{out}: cannot write in {ancestor}")


def cmd_export(args: argparse.Namespace) -> int:
    from runner.engine.checkpoints import CHECKPOINTS, checkpoints_of
    from runner.engine.rundir import CONFIG, load_config

    run_dir, out = Path(args.run_dir), Path(args.out)
    if not (run_dir / CONFIG).is_file():
        raise UserError(f"{run_dir} is not a run dir (no {CONFIG})")
    if out.is_symlink():  # the write is a rename onto OUT, which a link (even to an empty folder) refuses
        raise UserError(f"{out} is a symbolic link; export writes a new folder: name the folder itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; export never overwrites")
    _check_writable_parent(out)
    recipe = load_config(run_dir / CONFIG)
    rows = checkpoints_of(run_dir)
    if args.checkpoint is None:
        with_weights = [r for r in rows if r.sampler_path]
        if not with_weights:
            raise UserError(f"{run_dir} has no checkpoint with sampler weights yet ({CHECKPOINTS})")
        row = with_weights[-1]
    else:
        named = [r for r in rows if r.name == args.checkpoint]
        if not named:
            have = ", ".join(r.name for r in rows) or "none"
            raise UserError(f"{run_dir} has no checkpoint named {args.checkpoint!r} (have: {have})")
        row = named[-1]
        if not row.sampler_path:
            raise UserError(f"checkpoint {args.checkpoint!r} in {run_dir} has no sampler weights")
    sampler = str(row.sampler_path)
    if "://" in sampler:
        raise UserError(f"checkpoint {row.name!r} is a Tinker checkpoint ({sampler}): exporting it needs a "
                        "download, which runner export does not support yet (local-backend runs only)")
    sampler_dir = Path(sampler)
    if not sampler_dir.is_dir():  # a run dir that was moved: the same checkpoint under its new location
        moved = run_dir / "checkpoints" / "sampler_weights" / sampler_dir.name
        if not moved.is_dir():
            raise UserError(f"checkpoint {row.name!r}: its sampler weights {sampler_dir} are missing")
        sampler_dir = moved
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from backends.local.export import export  # torch loads here

    print(export(sampler_dir, out, recipe.model, recipe.tokenizer, merged=args.merged, dtype=args.dtype))
    return 0


def _kind(struct: object) -> str:
    return str(type(struct).__struct_config__.tag)  # type: ignore[attr-defined]


def _where(ref: str, name: str) -> str:
    return f"{split_ref(ref)[0]}#{name}"


def cmd_sweep(args: argparse.Namespace) -> int:
    from runner.tools.compare import find_runs
    from runner.tools.plot import write_report
    from runner.tools.sweep import plan, print_dry_run, run_sweep

    sweep = plan(args.ref, args.overrides, args.zip)  # every point checked before anything starts
    if args.dry_run:
        print_dry_run(sweep, args.parallel)
        return 0
    code = run_sweep(sweep, args.parallel)
    try:
        page = write_report(sweep.dir, find_runs([str(sweep.dir)]))
        print(f"report: {page}")
    except UserError as e:  # no point got as far as a metrics row
        print(f"no report: {e}", file=sys.stderr)
    return code


def cmd_compare(args: argparse.Namespace) -> int:
    from runner.tools.compare import choose_metrics, find_runs, render

    runs = find_runs(args.dirs)
    sys.stdout.write(render(runs, choose_metrics(runs, args.metric), args.format))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from runner.tools.compare import choose_metrics, find_runs
    from runner.tools.plot import MISSING, have_matplotlib, plot, write_report

    if not have_matplotlib():
        raise UserError(f"runner plot: {MISSING}")
    runs = find_runs(args.dirs)
    if args.output is None and len(args.dirs) == 1 and Path(args.dirs[0]).is_dir():
        page = write_report(Path(args.dirs[0]), runs, args.metric, args.smooth)
        print(f"wrote {page} and its plots")
        return 0
    out = plot(runs, choose_metrics(runs, args.metric), Path(args.output or "plot.png"), args.smooth)
    print(f"wrote {out} ({len(runs)} runs)")
    return 0
