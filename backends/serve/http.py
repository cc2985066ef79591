"""`runner serve`: its configuration, the service it builds (backends/serve/service.py), and the server that runs it
(backends/serve/aio.py: aiohttp.web, the service's work on worker threads).

Logging: one INFO line per session, run, checkpoint event; requests at DEBUG. The API key is never logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backends.errors import UserError
from backends.serve.aio import Site, running
from backends.serve.limits import Limits
from backends.serve.memory import default_max_bytes, fmt_bytes, shapes
from backends.serve.openai_api import OpenAIHooks
from backends.serve.service import Service
from backends.serve.sessions import ServedModel
from backends.serve.store import Store

if TYPE_CHECKING:
    import torch

log = logging.getLogger("runner.serve")
__all__ = ["ServeConfig", "build_service", "parse_models", "running", "serve_forever"]


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    models: tuple[str, ...] = ()  # "NAME=PATH" or "PATH" (served under its own name)
    storage: Path = Path("serve-storage")
    device: str = "auto"
    dtype: str = "auto"  # backends/local/local_config.py Local.dtype
    sampler_weights: str = "auto"  # backends/local/local_config.py Local.sampler_weights
    api_key_env: str | None = None
    sampler_idle_s: float | None = None
    max_live_samplers: int | None = None
    limits: Limits = field(default_factory=Limits)  # caps (backends/serve/limits.py)
    openai: OpenAIHooks | None = None  # chat formats for /v1/chat/completions (runner/rl/openai_chat.py)


def parse_models(specs: tuple[str, ...]) -> dict[str, str]:
    """NAME=PATH pairs; a bare PATH serves under its own name; nothing given serves `tiny`."""
    out: dict[str, str] = {}
    for spec in specs or ("tiny",):
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = spec, spec
        if not name or not path:
            raise UserError(f"--model {spec!r}: expected NAME=PATH (e.g. Qwen/Qwen3-0.6B=/models/qwen3-0.6b) or a PATH")
        if name in out:
            raise UserError(f"--model {name!r} is given twice")
        out[name] = path
    return out


def serve_device(devices: list[torch.device]) -> torch.device | None:
    """The device whose memory --max-bytes defaults to: cuda when any served model is placed there (its memory is
    what the big models fill; the ledger cannot tell the devices apart), else the CPU (every model small, or no
    CUDA): half the machine's memory, not 90% of a GPU that holds nothing."""
    return next((d for d in devices if getattr(d, "type", None) == "cuda"), None)


def build_service(cfg: ServeConfig) -> Service:
    from backends.local import model as M
    from backends.local.backend import LocalBackend, _user_error
    from backends.local.device import place
    from backends.local.local_config import Local

    api_key = None
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env, "").strip()
        if not api_key:
            raise UserError(f"--api-key-env {cfg.api_key_env}: that environment variable is empty or unset")
    served = parse_models(cfg.models)
    model_dirs = [M.resolve_model_dir(path) for path in served.values()]  # a missing folder fails now
    local = Local(device=cfg.device, dtype=cfg.dtype, sampler_weights=cfg.sampler_weights)  # type: ignore[arg-type]
    try:
        # Where each served model's runs and samplers will live: the placement LocalBackend itself takes (with
        # --device auto, `tiny` stays on the CPU of a GPU box). --device cuda without CUDA fails here.
        devices = [place(local, d).device for d in model_dirs]
    except UserError:
        raise UserError(f"--device {cfg.device}: torch sees no CUDA device; use --device auto or cpu") from None
    limits = cfg.limits
    if limits.max_bytes is None:  # what the device holds (backends/serve/memory.py)
        limits = dataclasses.replace(limits, max_bytes=default_max_bytes(serve_device(devices)))
    store = Store(cfg.storage)

    class ServeBackend(LocalBackend):
        """Checkpoints go where the store keeps them: the service names them <run_id>/<kind>/<name>."""

        def new_checkpoint_dir(self, kind: str, name: str) -> Path:
            run_id, real_kind, ckpt = name.split("/")
            path = store.checkpoint_dir(run_id, real_kind, ckpt)
            if path.exists():
                raise _user_error(f"checkpoint tinker://{name} already exists")
            return path

    models = {}
    for name, path in served.items():
        log.info("model %s: %s", name, local.describe(path))
        models[name] = ServedModel(name, path, lambda p=path: ServeBackend(local, p, None, store.root / "runs"))
    kwargs = {}
    if cfg.sampler_idle_s is not None:
        kwargs["sampler_idle_s"] = cfg.sampler_idle_s
    if cfg.max_live_samplers is not None:
        kwargs["max_live_samplers"] = cfg.max_live_samplers
    service = Service(store, models, api_key=api_key, limits=limits, **kwargs)
    service.openai.hooks = cfg.openai
    return service


def warm_shapes(name: str, path: str) -> None:
    """Read a served model's shapes at start-up, before the port is reported ready (serve_forever; in-process
    servers, as tests build them, read them on first use): every request that reserves memory needs them
    (backends/serve/memory.py `shapes`, cached), and the first read imports transformers' modeling code for the
    model, which took the first /v1 request to 7.6-14.2 s with `tiny` on 2 busy CPU cores (0.35-0.78 s now:
    bench/bench_serve_first_request.py, docs/serve.md). A model whose shapes cannot be read fails as it did, on the
    request that needs them."""
    try:
        shapes(path)
    except Exception as exc:  # noqa: BLE001 - reported by the request that needs them
        log.warning("model %s: its shapes could not be read at start-up (%s); requests will say why", name,
                    str(exc)[:200])


def serve_forever(cfg: ServeConfig) -> None:
    service = build_service(cfg)
    try:
        for model in service.models.values():
            warm_shapes(model.name, model.path)
        asyncio.run(_serve(cfg, service))
    finally:
        service.close()


async def _serve(cfg: ServeConfig, service: Service) -> None:
    site = Site(service)
    try:
        listening = await site.start(cfg.host, cfg.port)
    except OSError as exc:
        raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
    try:
        host, port = listening.server_address
        url = f"http://{host}:{port}"
        if cfg.port_file is not None:  # written once the socket listens, atomically: a reader never sees half
            cfg.port_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{cfg.port_file.name}.", dir=cfg.port_file.parent)
            with os.fdopen(fd, "w") as f:
                f.write(f"{port}\n")
            os.replace(tmp, cfg.port_file)
        if host not in ("127.0.0.1", "localhost", "::1") and service.api_key is None:
            log.warning("listening on %s without --api-key-env: anyone who can reach this address can use it", host)
        models = ", ".join(f"{m.name}={m.path}" if m.name != m.path else m.name for m in service.models.values())
        log.info("runner serve: %s (models: %s; storage: %s)", url, models, service.store.root)
        log.info("caps: %d live training runs (--max-models), %s held (--max-bytes)", service.memory.max_models,
                 fmt_bytes(service.memory.max_bytes))
        log.info("use it: TINKER_BASE_URL=%s TINKER_API_KEY=%s python your_script.py", url,
                 f"${cfg.api_key_env}" if cfg.api_key_env else "tml-local")
        await asyncio.Event().wait()  # until KeyboardInterrupt (Ctrl-C, or SIGTERM: runner/cli.py)
    finally:
        await site.stop()
