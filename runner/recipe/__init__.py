"""Recipes: the schema (`schema.py`, only the schema), reading files and overrides (`load.py`), msgspec errors as one
line (`explain.py`), references to other recipes and runs (`refs.py`), and the one importer of `pkg.mod:fn`
(`targets.py`). Nothing here imports torch, transformers or a backend's SDK."""
