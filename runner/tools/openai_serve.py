"""`runner serve`'s OpenAI hooks (backends/serve/openai_api.py OpenAIHooks, docs/openai.md): each model's chat format
(runner/rl/openai_chat.py) and the local checkpoints a request's `model` may name (run dirs).

A request names a local checkpoint only under the folders the operator listed (`runner serve --runs DIR`, none by
default): never an arbitrary path (no `..`, no absolute path outside those folders, no link out of them). What is
read there is read as regular files only (backends/serve/files.py: a FIFO or device is refused at once), and
nothing there is ever written (a torn checkpoints.jsonl is read as it is, not repaired). A run's recipe is read as
plain TOML for its `model` and `renderer`, never loaded as a recipe (which imports code); a renderer that is code
(`renderer = {kind = "python", target = "pkg.mod:NAME"}`, or an older run's `renderer = "pkg.mod:NAME"`) is used only
for runs under a folder the operator also gave as `--trust-code DIR`.
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path

from backends.errors import UserError
from backends.serve.files import is_regular, read_regular
from backends.serve.openai_api import LocalModel, OpenAIHooks
from backends.tokenizer import Tokenizer
from backends.types import Json
from runner.engine.log import parse_jsonl
from runner.rl.openai_chat import RendererChat, chat_format

CONFIG, CHECKPOINTS = "config.toml", "checkpoints.jsonl"  # runner/engine/rundir.py's names


class RunRoots:
    """The folders whose run dirs a request may name (`--runs`), and those whose runs' code may run
    (`--trust-code`, each also a --runs folder)."""

    def __init__(self, runs: Sequence[Path] = (), trust_code: Sequence[Path] = ()):
        self.roots = [Path(os.path.realpath(p)) for p in runs]
        self.trusted = [Path(os.path.realpath(p)) for p in trust_code]
        for t in self.trusted:
            if not any(_within(t, r) for r in self.roots):
                self.roots.append(t)

    def root_of(self, real: Path) -> Path | None:
        return next((r for r in self.roots if _within(real, r)), None)

    def trusts(self, real: Path) -> bool:
        return any(_within(real, t) for t in self.trusted)


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _candidates(spec: str, roots: RunRoots) -> list[tuple[Path, str | None]]:
    """(folder, checkpoint name) readings of `spec`: a path, or `PATH:NAME`; a relative one under each root."""
    if "\x00" in spec:
        raise UserError("model: has a NUL character")
    out: list[tuple[Path, str | None]] = []
    readings: list[tuple[str, str | None]] = [(spec, None)]
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail:
        readings.append((head, tail))
    for text, name in readings:
        p = Path(text).expanduser() if text.startswith("~") else Path(text)
        if ".." in p.parts:
            raise UserError(f"model {spec[:100]!r}: '..' is not allowed in a run's path")
        bases = [p] if p.is_absolute() else [r / p for r in roots.roots]
        out += [(b, name) for b in bases]
    return out


def resolver(roots: RunRoots) -> Callable[[str], LocalModel | None]:
    """The `local_model` hook: a run dir (its last checkpoint), `RUN_DIR:NAME` (its checkpoint NAME) or a checkpoint
    folder, under one of `roots`; None when `spec` names none of these (a 404). The run's config.toml gives the base
    model and the renderer."""

    def local_model(spec: str) -> LocalModel | None:
        if not roots.roots or spec.startswith("tinker://"):
            return None
        for path, name in _candidates(spec, roots):
            try:
                real = Path(os.path.realpath(path))
                if not real.is_dir():
                    continue
            except OSError:  # a name too long, a folder we may not enter: not this reading
                continue
            root = roots.root_of(real)
            if root is None:
                continue  # outside every --runs folder, or a link out of one: names nothing (a 404)
            found = _in_run_dir(real, name, spec, root)
            if found is not None:
                return _with_renderer(found, roots)
        return None

    return local_model


def _in_run_dir(path: Path, name: str | None, spec: str, root: Path) -> tuple[LocalModel, Path | None] | None:
    if is_regular(path / CHECKPOINTS):
        rows = [r for r in _read_rows(path / CHECKPOINTS) if r.get("sampler_path")]
        if not rows:
            raise UserError(f"run dir {spec[:100]} has no checkpoint with sampler weights")
        row = rows[-1] if name is None else next((r for r in rows if r.get("name") == name), None)
        if row is None:
            raise UserError(f"run dir {spec[:100]} has no checkpoint {str(name)[:100]!r}; it has: "
                            f"{', '.join(str(r.get('name'))[:40] for r in rows[-20:])}")
        folder = _sampler_folder(str(row["sampler_path"]), row.get("paths") == "run", path)
        run: Path | None = path
    elif name is None and any(is_regular(path / f) for f in ("state.json", "adapter_config.json")):
        folder = path
        run = path.parent.parent.parent if path.parent.parent.name == "checkpoints" else None
    else:
        return None
    real = Path(os.path.realpath(folder))
    if not _within(real, root) or not real.is_dir():
        raise UserError(f"run dir {spec[:100]}: its checkpoint folder is not a folder under the same --runs folder")
    if run is not None and _within(run, root) and is_regular(run / CONFIG):
        model, renderer = _recipe_model(run / CONFIG)
        return LocalModel(model, real, renderer), run
    base = _base_of(real)
    if base is None:
        raise UserError(f"{spec[:100]}: cannot tell its base model (no run dir config.toml above it)")
    return LocalModel(base, real, None), None


def _with_renderer(found: tuple[LocalModel, Path | None], roots: RunRoots) -> LocalModel:
    from runner.renderers.registry import USER_RENDERER

    local, run = found
    if local.renderer is None or not USER_RENDERER.match(local.renderer):
        return local
    if run is None or not roots.trusts(run):
        raise UserError(f"the run's renderer {local.renderer[:100]!r} is code, and runner serve runs a run's code only "
                        "for runs under a --trust-code folder")
    folder = str(run)
    if folder not in sys.path:  # where `runner run` found it: next to the recipe (runner/recipe/load.py resolve)
        sys.path.append(folder)
    return local


def _read_rows(path: Path) -> list[Json]:
    """checkpoints.jsonl's rows, read-only: a torn last line (a crash mid-write) is skipped, not cut off."""
    parsed = parse_jsonl(read_regular(path).decode("utf-8", errors="replace"))
    if parsed.corrupt is not None:
        raise UserError(f"{path}:{parsed.corrupt}: corrupt line (not JSON)")
    return parsed.rows


def _sampler_folder(p: str, run_relative: bool, run: Path) -> Path:
    """A row's sampler_path as runner/engine/rundir.py resolve_row reads it (run-relative, or an older row's path
    mapped onto this run dir's own checkpoints/)."""
    if run_relative and not Path(p).is_absolute():
        return run / p
    parts = Path(p).parts
    if "checkpoints" in parts:
        i = len(parts) - 1 - parts[::-1].index("checkpoints")
        own = run.joinpath(*parts[i:])
        if own.exists():
            return own
    return Path(p) if Path(p).is_absolute() else run / p


def _recipe_model(config: Path) -> tuple[str, str | None]:
    """The `model` and `renderer` of a run's config.toml, read as TOML (never loaded as a recipe: no code runs)."""
    try:
        data = tomllib.loads(read_regular(config).decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise UserError(f"{config}: not valid TOML ({str(exc)[:100]})") from None
    tables = data.get("recipes")
    if not isinstance(tables, dict) or len(tables) != 1:
        raise UserError(f"{config}: expected exactly one [recipes.<name>] table")
    table = next(iter(tables.values()))
    model = table.get("model", "tiny") if isinstance(table, dict) else None
    renderer = table.get("renderer") if isinstance(table, dict) else None
    if isinstance(renderer, dict) and renderer.get("kind") == "python":  # a user's renderer: its target (code)
        renderer = renderer.get("target")
    if not isinstance(model, str) or (renderer is not None and not isinstance(renderer, str)):
        raise UserError(f"{config}: model and renderer must be strings")
    return model, renderer


def _base_of(folder: Path) -> str | None:
    for name, key in (("state.json", "base_model"), ("adapter_config.json", "base_model_name_or_path")):
        try:
            value = json.loads(read_regular(folder / name)).get(key)
        except (UserError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            return value
    return None


def serve_hooks(renderer: str | None = None, runs: Sequence[Path] = (), trust_code: Sequence[Path] = ()) -> OpenAIHooks:
    """`runner serve`'s OpenAI hooks: each model's renderer is `renderer` when given, else a checkpoint's run's,
    else "auto" (the cookbook's for a model it knows, else the tokenizer's chat template). Local checkpoints: run
    dirs under `runs` (RunRoots)."""

    def chat(model_name: str, tokenizer: Tokenizer, run_renderer: str | None) -> RendererChat:
        return chat_format(model_name, tokenizer, renderer or run_renderer or "auto")

    return OpenAIHooks(chat=chat, local_model=resolver(RunRoots(runs, trust_code)))
