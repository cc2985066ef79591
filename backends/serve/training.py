"""Training routes: create_model, load_weights (new run, or the legacy load into a run), forward_backward,
optim_step, the saves, and save_weights_and_get_sampling_client (snapshot or inflight samplers). Each
request that names a seq_id becomes an op in its run's FIFO (backends/serve/sessions.py)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import Future
from backends.errors import UserError
from backends.serve import memory, wire
from backends.serve.adapters import FbOp, Stability, fb_reply, loss_op
from backends.serve.limits import Fields, Limits, check_id, to_float
from backends.serve.replies import NOT_LOADED, ApiError, Promises, Reply, deliver, failed
from backends.serve.samplers import SamplerPool, SamplerSession
from backends.serve.sessions import Run, ServedModel, Session, local_sampler
from backends.serve.store import KINDS, Store, iso, now, valid_name
from backends.types import AdamParams, ForwardBackwardOutput, Json, LoraSpec

if TYPE_CHECKING:
    from backends.local.backend import LocalSamplingClient, LocalTrainingClient

log = logging.getLogger("runner.serve")
ADAM_FIELDS = tuple(f.name for f in dataclasses.fields(AdamParams))


class TrainingRoutes:
    store: Store
    models: dict[str, ServedModel]
    limits: Limits
    promises: Promises
    pool: SamplerPool
    stability: Stability
    memory: memory.Memory
    _lock: threading.RLock
    _runs: dict[str, Run]

    def _session(self, sid: str) -> Session: ...

    # ------------------------------------------------------------ models

    def _served(self, name: str) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            raise ApiError(400, f"model {name[:100]!r} is not served here; runner serve offers: {', '.join(self.models)} "
                                f"(serve another with --model {name[:100]}=PATH)")
        return m

    def _capabilities(self, f: Fields) -> Reply:
        return Reply.json({"server_name": "runner-serve", "supported_models": [
            {"model_name": m.name, "trainable": True, "sampleable": True, "max_context_length": self._context(m)}
            for m in self.models.values()]})

    @staticmethod
    def _context(m: ServedModel) -> int | None:
        with contextlib.suppress(Exception):
            from backends.local import model as M

            cfg = json.loads((M.resolve_model_dir(m.path) / "config.json").read_text())
            return int(cfg.get("max_position_embeddings") or 0) or None
        return None

    def tokenizer_id(self, m: ServedModel) -> str | None:
        """A folder AutoTokenizer.from_pretrained loads offline: the model's own, or (tiny) a copy of the
        embedded tokenizer saved under storage/tokenizers/."""
        with m.lock:
            if m.tokenizer_dir is None:
                from backends.local import model as M

                src = M.resolve_model_dir(m.path)
                if (src / "tokenizer_config.json").is_file() and m.path != "tiny":
                    m.tokenizer_dir = src
                else:
                    import transformers

                    dest = self.store.root / "tokenizers" / (hashlib.sha1(m.name.encode()).hexdigest()[:10])
                    if not (dest / "tokenizer_config.json").is_file():
                        transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dest)
                    m.tokenizer_dir = dest
            return str(m.tokenizer_dir)

    def _new_run(self, run_id: str, model: ServedModel, spec: LoraSpec, tc: Future[LocalTrainingClient], session_id: str,
                 user_metadata: Json | None, source: str | None = None) -> Run:
        run = Run(run_id, model, spec, tc, session_id)
        self.store.write_run(run_id, {
            "training_run_id": run_id, "base_model": model.name, "model_owner": "runner-serve", "is_lora": True,
            "corrupted": False, "lora_rank": spec.rank, "last_request_time": iso(now()), "created": iso(now()),
            "user_metadata": user_metadata or None, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed, "seed": spec.seed, "loaded_from": source})
        with self._lock:
            self._runs[run_id] = run
            self._session(session_id).runs.add(run_id)
        return run

    def _shapes(self, model: ServedModel) -> memory.Shapes:
        """The model's sizes; its base counts as held from its first use on."""
        s = memory.shapes(model.path)
        self.memory.hold(f"base:{model.name}", memory.base_bytes(s, model.engine().dtype.itemsize))
        return s

    def _reserve(self, run_id: str, model: ServedModel, spec: LoraSpec) -> None:
        """Count the new run against --max-models and --max-bytes, or refuse it (a 400 naming the cap)."""
        n = memory.lora_bytes(self._shapes(model), spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed)
        self.memory.reserve_run(run_id, n, f"a LoRA rank-{spec.rank} training run of {model.name}")

    def _new_run_id(self, f: Fields) -> tuple[str, str]:
        sid = f.id("session_id")
        run_id = f"{sid}:train:{f.int('model_seq_id', lo=0)}"
        with self._lock:
            if run_id in self._runs or self.store.read_run(run_id) is not None:
                raise ApiError(400, f"training run {run_id} already exists")
        return sid, run_id

    def _create_model(self, f: Fields) -> Reply:
        model = self._served(f.str("base_model"))
        lora = f.sub("lora_config")
        opt = f.sub("optimizer_config").str("type", "adamw")
        if opt != "adamw":
            raise ApiError(400, f"optimizer {opt[:40]!r} is not offered by runner serve (AdamW only)")
        rank = lora.int("rank", 32, lo=1, hi=4096)
        # torch takes seeds in [-2**63, 2**64): a larger one failed the request as the server's error.
        spec = LoraSpec(base_model=model.path, rank=rank, seed=lora.int("seed", None, lo=-2**63, hi=2**64 - 1),
                        train_attn=lora.bool("train_attn", True), train_mlp=lora.bool("train_mlp", True),
                        train_unembed=lora.bool("train_unembed", True))
        if not (spec.train_attn or spec.train_mlp or spec.train_unembed):
            raise ApiError(400, "lora_config trains nothing (train_attn, train_mlp and train_unembed all false)")
        metadata = f.metadata()
        sid, run_id = self._new_run_id(f)
        self._reserve(run_id, model, spec)
        try:
            tc = model.new_trainer(spec)
        except BaseException:
            self.memory.release(f"run:{run_id}")
            raise
        self._new_run(run_id, model, spec, tc, sid, metadata)
        log.info("run %s: %s, LoRA rank %d", run_id, model.name, rank)
        promise, reply = self.promises.new("create_model")
        deliver(promise, tc, lambda _: Reply.json({"model_id": run_id}))
        return reply

    def _run(self, run_id: str) -> Run:
        check_id("model_id", run_id, self.limits)
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            if self.store.read_run(run_id) is None:
                raise ApiError(404, f"unknown training run {run_id}")
            raise ApiError(404, self._not_loaded(run_id), code=NOT_LOADED)
        return run

    def _not_loaded(self, run_id: str) -> str:
        """What a client of a run this server does not hold (it restarted, or the session ended) should do."""
        saved = [m for m in self.store.list_checkpoints(run_id) if m["checkpoint_id"].startswith("weights/")]
        why = f"training run {run_id} is not loaded on this server (runner serve restarted, or its session ended)"
        if not saved:
            return f"{why}, and it saved no state (save_state): create a new training client"
        return (f"{why}: load its last checkpoint, {saved[-1]['tinker_path']}, with "
                f"create_training_client_from_state_with_optimizer and carry on from there")

    def _get_info(self, f: Fields) -> Reply:
        run = self._run(f.id("model_id"))
        return Reply.json({"model_id": run.run_id, "is_lora": True, "lora_rank": run.spec.rank,
                           "model_name": run.model.name,
                           "model_data": {"model_name": run.model.name, "arch": "runner-serve-local",
                                          "tokenizer_id": self.tokenizer_id(run.model)}})

    def _parse_path(self, path: str) -> tuple[str, str, str]:
        """tinker://<run>/<kind>/<name> -> (run, kind, name); 404 when there is no such checkpoint (or it expired)."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if (len(parts) != 3 or parts[1] not in KINDS or not valid_name(parts[0]) or not valid_name(parts[2])
                or len(parts[0]) > 2 * self.limits.max_id_chars or len(parts[2]) > self.limits.max_id_chars):
            raise ApiError(400, f"{path[:200]!r} is not a checkpoint path (tinker://<run_id>/weights/<name>)")
        if self.store.checkpoint_meta(*parts) is None:
            raise ApiError(404, f"no checkpoint at {path} (never saved, deleted, or expired)")
        return parts[0], parts[1], parts[2]

    def _state_source(self, path: str) -> tuple[ServedModel, LoraSpec, Path, Json]:
        src_run, kind, name = self._parse_path(path)
        if kind != "weights":
            raise ApiError(400, f"{path} is a {KINDS[kind]} checkpoint; training state loads from "
                                f"tinker://<run_id>/weights/<name> (save_state)")
        meta = self.store.read_run(src_run)
        if meta is None:
            raise ApiError(404, f"no training run {src_run}")
        model = self._served(meta["base_model"])
        spec = LoraSpec(base_model=model.path, rank=int(meta["lora_rank"]), seed=meta.get("seed"),
                        train_attn=meta["train_attn"], train_mlp=meta["train_mlp"], train_unembed=meta["train_unembed"])
        return model, spec, self.store.checkpoint_dir(src_run, kind, name), meta

    def _load_weights(self, f: Fields) -> Reply:
        if f.req.get("model_id") is not None:  # the legacy TrainingClient.load_state*: into an existing run
            return self._load_into(f)
        path = f.str("path")
        with_opt = f.bool("optimizer", False)
        model, spec, folder, meta = self._state_source(path)
        sid, run_id = self._new_run_id(f)
        self._reserve(run_id, model, spec)
        try:
            tc = model.trainer_from_state(str(folder), spec, with_opt)
        except BaseException:
            self.memory.release(f"run:{run_id}")
            raise
        self._new_run(run_id, model, spec, tc, sid, f.metadata() or meta.get("user_metadata"), path)
        log.info("run %s: loaded %s%s", run_id, path, " with optimizer state" if with_opt else "")
        promise, reply = self.promises.new("load_weights")
        deliver(promise, tc, lambda _: Reply.json({"path": path, "model_id": run_id}))
        return reply

    def _load_into(self, f: Fields) -> Reply:
        """load_state(path) at this point of the run's FIFO: the run trains the loaded weights from then on
        (the previous client stays if the load fails). Later jobs wait for it (Run.drain)."""
        run = self._run(f.id("model_id"))
        seq_id = f.int("seq_id", lo=0)
        path = f.str("path")
        with_opt = f.bool("optimizer", False)
        model, spec, folder, _ = self._state_source(path)
        if model is not run.model:
            raise ApiError(400, f"{path} is a checkpoint of {model.name}, and {run.run_id} trains {run.model.name}")
        promise, reply = self.promises.new("load_weights")

        def op(old_tc: LocalTrainingClient) -> tuple[Future[None], Callable[[None], Reply]]:
            swapped: concurrent.futures.Future[LocalTrainingClient] = concurrent.futures.Future()
            loaded: concurrent.futures.Future[None] = concurrent.futures.Future()
            prev, before = run.tc, run.last
            run.tc = Future(swapped)

            def done(new: Future[LocalTrainingClient]) -> None:
                exc = new.future().exception()
                if exc is None:
                    run.spec = spec
                    self.memory.resize_run(run.run_id, memory.lora_bytes(
                        self._shapes(model), spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed))
                    swapped.set_result(new.result())
                    loaded.set_result(None)
                else:
                    swapped.set_result(prev.result())
                    loaded.set_exception(exc)

            def start(_: object = None) -> None:  # after the run's earlier jobs (a save of this checkpoint, say)
                try:
                    new = model.trainer_from_state(str(folder), spec, with_opt)
                except BaseException as exc:  # noqa: BLE001 - a failed load leaves the run as it was
                    swapped.set_result(prev.result())
                    loaded.set_exception(exc)
                    return
                new.future().add_done_callback(lambda _: done(new))

            if before is None:
                start()
            else:
                before.add_done_callback(start)
            return Future(loaded), lambda _: Reply.json({"path": path, "model_id": run.run_id})

        run.enqueue(seq_id, promise, op)
        log.info("run %s: load_state %s%s", run.run_id, path, " with optimizer state" if with_opt else "")
        return reply

    # ------------------------------------------------------------ FIFO ops

    def _forward_backward(self, headers: dict[str, str], body: bytes) -> Reply:
        try:
            msg = wire.decode_forward_backward(body, headers.get("content-encoding"))
        except Exception as exc:  # protobuf's DecodeError, zstd's error: both the client's
            raise ApiError(400, f"forward_backward: not a ForwardBackwardRequest protobuf ({type(exc).__name__})") from None
        run = self._run(msg.model_id)
        route = "forward" if msg.forward_only else "forward_backward"
        promise, reply = self.promises.new(route)
        op: FbOp | None = None
        try:
            wds = [wire.decode_wire_datum(d) for d in msg.data]
            op = loss_op(msg.loss_fn, wds, wire.loss_config(msg), msg.forward_only, self.stability)
        except (ValueError, KeyError, TypeError, UserError) as exc:
            promise.resolve(failed(str(exc)[:500]))
        # A refused request spends its seq id all the same (later requests must not wait for it): its
        # promise is already resolved, so the op never runs.
        run.enqueue(msg.seq_id, promise, op or (lambda tc: (Future.completed(ForwardBackwardOutput([], {})), fb_reply)))
        return reply

    def _optim_step(self, f: Fields) -> Reply:
        run = self._run(f.id("model_id"))
        seq_id = f.int("seq_id", lo=0)
        p = f.dict("adam_params", None)
        if p is None:
            other = "optimizer_params (Dimuon)" if f.req.get("optimizer_params") is not None else "no adam_params"
            raise ApiError(400, f"runner serve offers AdamW only (adam_params); this request has {other}")
        params = AdamParams(**{k: to_float(f"adam_params.{k}", v, lo=0.0) for k, v in p.items() if k in ADAM_FIELDS})
        promise, reply = self.promises.new("optim_step")
        run.enqueue(seq_id, promise, lambda tc: (tc.optim_step(params), lambda out: Reply.json({"metrics": out.metrics})))
        self._touch_run(run)
        return reply

    def _touch_run(self, run: Run) -> None:
        meta = self.store.read_run(run.run_id)
        if meta is not None:
            meta["last_request_time"] = iso(now())
            self.store.write_run(run.run_id, meta)

    def _save(self, f: Fields, kind: str) -> Reply:
        run = self._run(f.id("model_id"))
        seq_id = f.int("seq_id", lo=0)
        name = f.str("path", None, max_chars=self.limits.max_id_chars)
        if name is None and kind == "sampler_weights":
            return self._ephemeral(run, seq_id, f)
        if name is None or not valid_name(name):
            raise ApiError(400, f"checkpoint name {name!r} must be a plain file name (no '/', not starting with '.')")
        ttl = f.int("ttl_seconds", None, lo=1)
        metadata = f.metadata()
        overwrite = f.bool("overwrite", False)
        raw = f.req.get("age_encryption_recipients") if kind == "external_weights" else None
        recipients: list[str] = []
        if raw:
            if not isinstance(raw, list) or not all(isinstance(r, str) for r in raw):
                raise ApiError(400, "age_encryption_recipients must be a list of strings")
            recipients = [r for r in raw if isinstance(r, str)]
            # Encryption needs pyrage (optional: the cookbook's weights.download asks for it); checked now, so the
            # failure is immediate.
            if importlib.util.find_spec("pyrage") is None:
                raise ApiError(400, "age encryption needs the pyrage package on the server (pip install pyrage)")
        promise, reply = self.promises.new(f"save_{kind}")
        target = f"{run.run_id}/{kind}/{name}"
        path = self.store.checkpoint_dir(run.run_id, kind, name)
        tinker_path = f"tinker://{target}"

        def op(tc: LocalTrainingClient) -> tuple[Future[str], Callable[[str], Reply]]:
            if path.exists():
                if not overwrite:
                    raise UserError(f"checkpoint {tinker_path} already exists (save_state(..., overwrite=True) replaces it)")
                self.store.delete_checkpoint(run.run_id, kind, name)
            fut = tc.save_state(target) if kind == "weights" else tc.save_weights_for_sampler(target)

            def to_reply(_: object) -> Reply:
                if recipients:
                    _encrypt_folder(path, recipients)
                meta = self.store.write_checkpoint_meta(run.run_id, kind, name, ttl, metadata)
                out: Json = {"path": tinker_path}
                if kind == "external_weights":
                    out["size_bytes"] = meta["size_bytes"]
                return Reply.json(out)

            return fut, to_reply

        run.enqueue(seq_id, promise, op)
        return reply

    def _ephemeral(self, run: Run, seq_id: int, f: Fields) -> Reply:
        """save_weights_and_get_sampling_client: a sampler over the weights at this point of the sequence.
        kind="inflight": every inflight sampler of the run follows this save (one shared, mutable target)."""
        sid = f"{run.session_id}:sample:{f.int('sampling_session_seq_id', lo=0)}"
        kind = f.str("kind", "snapshot")
        if kind not in ("snapshot", "inflight"):
            raise ApiError(400, f"kind must be 'snapshot' or 'inflight', not {kind[:40]!r}")
        promise, reply = self.promises.new("save_weights_for_sampler")

        def op(tc: LocalTrainingClient) -> tuple[Future[LocalSamplingClient], Callable[[LocalSamplingClient], Reply]]:
            client = tc.save_weights_and_get_sampling_client().map(local_sampler)
            weights = tc.trained_weights()  # the next job in the same FIFO: the same weights
            sess = SamplerSession(sid, run.model, run.session_id, None, client=client,
                                  run_id=run.run_id if kind == "inflight" else None)
            followers = [sess]
            if kind == "inflight":
                with run.lock:
                    followers += self.pool.find(run.inflight)
                    run.inflight.add(sid)
                for other in followers[1:]:
                    other.adopt(sess)
            step = tc.step

            def keep(_: object) -> None:
                if weights.future().exception() is None:
                    for s in followers:
                        if s.client is client:  # not moved on to a later save meanwhile
                            s.weights = (weights.result(), tc.setup, step)

            weights.future().add_done_callback(keep)
            self.pool.add(sess)
            with self._lock:
                self._session(run.session_id).samplers.add(sid)
            return client, lambda _: Reply.json({"sampling_session_id": sid})

        run.enqueue(seq_id, promise, op)
        return reply


def _encrypt_folder(path: Path, recipients: list[str]) -> None:
    """age-encrypt every file of an export in place (name + '.age'), as the service does for
    save_weights_external(age_encryption_recipients=...)."""
    import importlib

    pyrage = importlib.import_module("pyrage")  # optional; ships no type information (its attributes are untyped)
    keys = []
    for r in recipients:
        keys.append(pyrage.ssh.Recipient.from_str(r) if r.startswith("ssh-") else pyrage.x25519.Recipient.from_str(r))
    for f in [p for p in path.rglob("*") if p.is_file()]:
        f.with_name(f.name + ".age").write_bytes(pyrage.encrypt(f.read_bytes(), keys))
        f.unlink()
