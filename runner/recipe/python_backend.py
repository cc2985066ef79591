"""A user's own backend from a recipe: `backend = {kind = "python", target = "pkg.mod:fn", args = {...}}`.

fn(model=..., tokenizer=..., storage_dir=..., seed=..., **args) returns a backends.base.Backend (the protocol: a
training client, sampling clients, a tokenizer). It is called when the run starts, where a built-in backend's
`make` is; `runner check` imports it and binds its args first (runner/recipe/load.py check_recipe: a `Target`
field, with TARGET_KEYWORDS), so a bad target or a misspelt arg is one line before any model loads. The variant is a
BackendConfig subclass like the built-in ones (backends/backend_config.py): the schema's `Backend` union takes it
the same way. What it returns is held to the protocol at every call (runner/recipe/backend_guard.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from backends.backend_config import BackendConfig
from backends.errors import UserError, one_line
from runner.recipe.common import Json, Target
from runner.recipe.targets import import_target

if TYPE_CHECKING:
    from backends.base import Backend


class PythonBackend(BackendConfig, tag="python"):  # pyright: ignore[reportGeneralTypeIssues] (see ConfigStruct)
    """Your own backend: `target` names fn(model=, tokenizer=, storage_dir=, seed=, **args) -> a Backend."""

    target: Target
    args: Json = {}
    # What runner passes fn besides the args (the recipe's model and tokenizer override, the run dir's
    # checkpoints/ folder, the seed): `runner check` binds these with the args; the args may not set them.
    TARGET_KEYWORDS: ClassVar[tuple[str, ...]] = ("model", "tokenizer", "storage_dir", "seed")

    def __post_init__(self) -> None:
        if clash := sorted(set(self.args) & set(self.TARGET_KEYWORDS)):
            raise ValueError(f"args may not set {', '.join(clash)}: runner passes them (from the recipe and run dir)")

    def make(self, model: str, tokenizer: str | None, storage_dir: Path, seed: int) -> Backend:
        from backends.base import Backend

        where = f"backend target {self.target!r}"
        fn = import_target(self.target)
        try:
            out = fn(model=model, tokenizer=tokenizer, storage_dir=storage_dir, seed=seed, **self.args)
        except UserError:
            raise
        # SystemExit too: user code that exits (an argparse inside it, a sys.exit) would end the run with its code
        # and no word of why.
        except (Exception, SystemExit) as e:  # noqa: BLE001 - user code: one line naming it, not a traceback
            raise UserError(f"{where}: calling it with args {sorted(self.args)} raised {one_line(e)}") from None
        # Backend is a runtime-checkable Protocol: a class (not an instance of it) has the same attributes and passes
        # isinstance, then fails at its first unbound call; so a type is refused here by name.
        if isinstance(out, type) or not isinstance(out, Backend):
            got = f"the class {out.__name__} (call it)" if isinstance(out, type) else type(out).__name__
            raise UserError(f"{where} returned {got}, not a backends.base.Backend (get_tokenizer, "
                            "create_training_client, create_sampling_client, ...: backends/base.py)")
        from runner.recipe.backend_guard import CheckedBackend

        # Held to the protocol at every call: a violation is one line naming the target (runner/recipe/backend_guard.py).
        return CheckedBackend(out, where)  # pyright: ignore[reportReturnType] - a Backend by its methods
