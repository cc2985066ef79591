"""Build tooling kept out of the installed package (pyproject.toml packages only runner and backends)."""
