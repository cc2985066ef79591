"""Every algorithm, two files each: NAME_config.py, its recipe struct (a variant of the schema's `Algo` union, found by
its file name: backends/configs.py `found`), and NAME.py, which declares `SPEC = AlgoSpec(...)` (runner/engine/spec.py:
how to build it from a recipe, its headline metrics, how `runner render` shows its data). The engine imports the module
beside a recipe's struct, as it imports a user's `algo = {kind = "python", target = "pkg.mod:SPEC"}`; nothing but the
tools and the CLI imports an algorithm's code (tests/test_import_graph.py; its config modules sit at the recipe's
layer), and nothing lists algorithms.
"""
