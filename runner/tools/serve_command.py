"""`runner serve`: its flags, each checked before any model loads, then the Tinker-compatible server over the local
backend (backends/serve/http.py) with the OpenAI routes' hooks (runner/tools/openai_serve.py). Split from runner/cli.py
(a composition root, as runner/tools/ is: the only modules that may import a particular backend)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backends.errors import UserError
from runner.threads import prefer_passive_openmp


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`runner serve`'s subcommand and flags."""
    serve = sub.add_parser(
        "serve",
        help="serve the local backend as a Tinker-compatible API, so Tinker programs run offline",
        description="Serve the Tinker API (the routes the tinker SDK and tinker-cookbook use) over the local "
        "torch backend. Point a Tinker program at it with TINKER_BASE_URL=http://HOST:PORT and any "
        "TINKER_API_KEY starting with tml- (or the key in --api-key-env).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  runner serve                                  # tiny, on 127.0.0.1:8000\n"
        "  runner serve --model Qwen/Qwen3-0.6B=/models/qwen3-0.6b --storage ~/.runner-serve\n"
        "  runner serve --port 0 --port-file /tmp/port  # a free port, written to the file once listening\n"
        "  runner serve --runs ~/runs                    # /v1 requests may name run dirs under ~/runs\n",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000,
                       help="port (0: a free one, logged as `runner serve: http://HOST:PORT`; see --port-file)")
    serve.add_argument("--port-file", type=Path, help="write the bound port to this file once listening")
    serve.add_argument("--model", action="append", default=[], metavar="NAME=PATH",
                       help="serve the model at PATH (a Hugging Face folder, a cached hub id, or tiny) under NAME; "
                       "repeatable; default: tiny")
    serve.add_argument("--storage", type=Path, default=Path("serve-storage"),
                       help="folder for training runs and checkpoints (kept across restarts; default ./serve-storage)")
    serve.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="auto: cuda for a model of 50M parameters or more where CUDA exists, else cpu")
    serve.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                       help="of the base weights and activations (adapters stay float32); auto: bfloat16 on cuda, "
                       "float32 on cpu")
    serve.add_argument("--sampler-weights", choices=["auto", "merged", "lora"], default="auto",
                       help="sampling clients hold merged weights (fastest) or share the base and apply their LoRA "
                       "unmerged (an extra client costs its adapters); auto: merged on the CPU in float32 under 1 GiB")
    serve.add_argument("--api-key-env", metavar="VAR", help="require the API key held in environment variable VAR")
    serve.add_argument("--sampler-idle-s", type=float, default=None,
                       help="free a sampling session's model after this many idle seconds (default 30)")
    serve.add_argument("--max-live-samplers", type=int, default=None,
                       help="sampling sessions that may hold a loaded model at once (default 4)")
    serve.add_argument("--renderer", default=None,
                       help="renderer of /v1/chat/completions (default: a checkpoint's run's, else auto; docs/openai.md)")
    serve.add_argument("--max-models", type=int, default=None, metavar="N",
                       help="live training runs held at once (default 32); one more is refused with a 400")
    serve.add_argument("--max-bytes", default=None, metavar="SIZE",
                       help="memory live sessions may hold: base models, training runs' adapters + gradients + "
                            "optimizer state, in-flight sampling (e.g. 24G; default: half the machine's memory, or 90%% "
                            "of the GPU's when a served model is placed on cuda)")
    serve.add_argument("--runs", action="append", type=Path, default=[], metavar="DIR",
                       help="a /v1 request's `model` may name a run dir (or checkpoint) under DIR; repeatable; default: "
                       "none (only served models and this server's own tinker:// checkpoints)")
    serve.add_argument("--trust-code", action="append", type=Path, default=[], metavar="DIR",
                       help="runs under DIR may have their recipe's own renderer code (renderer = 'pkg.mod:NAME') "
                       "imported; repeatable; default: none (such a run's chat requests are refused)")
    serve.add_argument("-v", "--verbose", action="store_true", help="log every request")
    serve.set_defaults(command=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import signal

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    prefer_passive_openmp()  # before torch loads (runner/threads.py)
    from backends.serve.http import ServeConfig, serve_forever
    from runner.renderers import names as renderer_names
    from runner.tools.openai_serve import serve_hooks

    if args.renderer is not None and args.renderer not in renderer_names():
        from runner.renderers.registry import USER_RENDERER, user_factory

        if not USER_RENDERER.match(args.renderer):
            raise UserError(f"--renderer {args.renderer!r} is unknown; choose one of: {', '.join(renderer_names())}, "
                            "or your own as 'pkg.mod:NAME'")
        try:  # your own, as a recipe's `renderer` may be: imported now, not at the first chat request
            user_factory(args.renderer)
        except UserError as e:
            raise UserError(f"--renderer: {e}") from None
    from backends.serve.limits import Limits
    from backends.serve.memory import parse_bytes

    # Each flag is checked here, before any model loads: a port out of range was an OverflowError at bind, a storage
    # path through a file a NotADirectoryError, and 0 live samplers or a negative idle time were taken as given.
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port}: expected 0 (a free port) to 65535")
    if args.max_live_samplers is not None and args.max_live_samplers < 1:
        raise UserError(f"--max-live-samplers {args.max_live_samplers}: must be at least 1")
    if args.sampler_idle_s is not None and not args.sampler_idle_s >= 0:  # `not >=`: NaN too
        raise UserError(f"--sampler-idle-s {args.sampler_idle_s}: must be a number of seconds >= 0")
    on_the_way = next((p for p in (args.storage, *args.storage.parents) if p.exists() and not p.is_dir()), None)
    if on_the_way is not None:
        raise UserError(f"--storage {args.storage}: {on_the_way} is a file, not a folder")
    for flag, dirs in (("--runs", args.runs), ("--trust-code", args.trust_code)):
        if bad := next((d for d in dirs if not d.is_dir()), None):
            raise UserError(f"{flag} {bad}: not a folder")
    caps: dict[str, int] = {}
    if args.max_models is not None:
        if args.max_models < 1:
            raise UserError(f"--max-models {args.max_models}: must be at least 1")
        caps["max_models"] = args.max_models
    if args.max_bytes is not None:
        try:
            caps["max_bytes"] = parse_bytes(args.max_bytes)
        except ValueError as exc:
            raise UserError(f"--max-bytes {exc}") from None

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    cfg = ServeConfig(host=args.host, port=args.port, port_file=args.port_file, models=tuple(args.model),
                      storage=args.storage, device=args.device, dtype=args.dtype,
                      sampler_weights=args.sampler_weights,
                      api_key_env=args.api_key_env,
                      sampler_idle_s=args.sampler_idle_s, max_live_samplers=args.max_live_samplers,
                      limits=Limits(**caps), openai=serve_hooks(args.renderer, args.runs, args.trust_code))
    try:
        serve_forever(cfg)
    except KeyboardInterrupt:
        print("runner serve: stopped", file=sys.stderr)
    return 0

