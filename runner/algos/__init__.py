"""Every algorithm, one module each (sft, dpo, reward_model, generate, distill, rl).

An algorithm is its recipe struct (runner/recipe/schema.py: a variant of `Algo`, whose `implementation` names the
module here) plus that module, which declares `SPEC = AlgoSpec(...)` (runner/engine/spec.py: how to build it from a
recipe, its headline metrics, how `runner render` shows its data). The engine finds a module by that name, exactly as
it finds a user's `algo = {kind = "custom", target = "pkg.mod:SPEC"}`; nothing imports this package but the tools and
the CLI (tests/test_import_graph.py), and nothing lists algorithms.
"""
