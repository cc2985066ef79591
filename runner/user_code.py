"""The user's own modules: what a recipe names as "pkg.mod:NAME" (envs, data, losses, algorithms, renderers, a
backend) is imported from the working directory, and any failure importing it is the user's to fix.

At the bottom of the package order (tests/test_import_graph.py): it imports nothing of runner/, so the renderers
(below the recipe) and the recipe's targets share it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

from backends.errors import UserError, one_line


def find_user_modules() -> None:
    """Puts the working directory on sys.path: the console script does not (`python -m` does), and user modules live
    next to the recipe, so both entry points must find them."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def import_user_module(module: str, failed: str) -> ModuleType:
    """The module; UserError "{failed}: {why}" when importing it fails in any way. SystemExit too: a module that
    exits as it is imported (a script's sys.exit, argparse at top level) ended `runner check` with its code and no
    word, 0 looking like a pass."""
    find_user_modules()
    try:
        return importlib.import_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure inside user code is the user's to fix
        raise UserError(f"{failed}: {one_line(e)}") from None
