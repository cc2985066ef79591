"""The `runner conformance` subcommand: argument parsing and the report (the checks live beside it)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from backends.errors import UserError


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "conformance",
        help="check a Tinker-compatible server against the SDK's documented behaviour (pass/fail table)",
        description="A battery of real tinker SDK calls against the server at --base-url: sessions, ordering, "
        "every loss against its documented formula, sampling options, checkpoints and REST routes, errors that "
        "must be user errors. Exit 1 on any failure; a check known to fail on the named server is a 'known gap' "
        "(docs/conformance.md).")
    p.add_argument("--base-url", required=True, metavar="URL", help="e.g. http://127.0.0.1:8000 (runner serve)")
    p.add_argument("--api-key-env", default="TINKER_API_KEY", metavar="VAR",
                   help="the environment variable holding the API key (default TINKER_API_KEY; unset: tml-local)")
    p.add_argument("--model", metavar="NAME", help="the base model to test (default: the first trainable one listed)")
    p.add_argument("--server-name", metavar="NAME",
                   help="the name known gaps are looked up under (default: the server_name the server reports)")
    p.add_argument("--only", nargs="+", default=[], metavar="GROUP",
                   help="groups (sessions ordering losses sampling checkpoints errors) or check names")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="at most S seconds per check (default: each check's own, 60-150 s); a check past it fails")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    p.add_argument("--rtol", type=float, default=2e-3, help="relative tolerance of numeric checks (default 2e-3)")
    p.add_argument("--atol", type=float, default=2e-3, help="absolute tolerance of numeric checks (default 2e-3)")
    p.set_defaults(command=cmd_conformance)


def cmd_conformance(args: argparse.Namespace) -> int:
    from importlib.metadata import version

    from runner.tools.conformance.core import Ctx, failed, format_table, run_suite, select, to_json

    select(args.only)  # a bad --only is a UserError before anything connects
    if not args.base_url.startswith(("http://", "https://")):
        raise UserError(f"--base-url {args.base_url!r}: expected http://HOST:PORT or https://...")
    key = os.environ.get(args.api_key_env, "").strip() or "tml-local"
    if not key.startswith("tml-"):
        raise UserError(f"${args.api_key_env}: the tinker SDK only sends keys that start with 'tml-'")
    _reachable(args.base_url)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    logging.getLogger("tinker").setLevel(logging.CRITICAL)  # the refusals the error checks provoke are expected
    ctx = Ctx(args.base_url, key, args.model, rtol=args.rtol, atol=args.atol)

    def progress(r: object) -> None:
        if not args.json:
            print(f"  {r.result:<9} {r.check}", file=sys.stderr, flush=True)  # type: ignore[attr-defined]

    try:
        server, results = run_suite(ctx, args.only, server_name=args.server_name, progress=progress,
                                    max_timeout_s=args.timeout)
    finally:
        ctx.close()
    print(to_json(results, server, version("tinker")) if args.json else format_table(results, server))
    return 1 if failed(results) else 0


def _reachable(base_url: str) -> None:
    """Any HTTP answer will do; nothing listening is a UserError now, not 41 checks each failing by its timeout
    (the SDK retries a refused connection for 5 minutes, holding a process-wide lock while it does)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(f"{base_url.rstrip('/')}/api/v1/healthz", timeout=15).close()
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"--base-url {base_url}: nothing answers there ({reason})") from None
