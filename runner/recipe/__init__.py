"""Recipes: the schema (`schema.py`, only the schema), reading files and overrides (`load.py`), msgspec errors as one
line (`explain.py`), references to other recipes and runs (`refs.py`), and the one importer of `pkg.mod:fn`
(`targets.py`), the data formats a source names (`formats.py`, pure: the schema validates against it). Nothing here imports torch, transformers or a backend's SDK."""
