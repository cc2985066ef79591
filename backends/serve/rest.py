"""REST routes (docs/serve.md): training runs, checkpoints (list, get, delete, ttl, download URLs),
weights_info and copy_weights. Runs and checkpoints are read from the store, so they outlive the server."""

from __future__ import annotations

import shutil
import urllib.parse
from typing import TYPE_CHECKING

from backends.serve.downloads import Downloads
from backends.serve.limits import Fields, Limits, check_id, to_int
from backends.serve.replies import ApiError, Reply
from backends.serve.store import KINDS, Store, iso, now

if TYPE_CHECKING:
    from backends.types import Json


class RestRoutes:
    store: Store
    limits: Limits
    downloads: Downloads

    def _parse_path(self, path: str) -> tuple[str, str, str]: ...

    def _run_view(self, meta: Json) -> Json:
        cps = self.store.list_checkpoints(meta["training_run_id"])
        last = {t: next((c for c in reversed(cps) if c["checkpoint_type"] == t), None) for t in ("training", "sampler")}
        keys = ("training_run_id", "base_model", "model_owner", "is_lora", "corrupted", "lora_rank",
                "last_request_time", "user_metadata")
        return {**{k: meta.get(k) for k in keys}, "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"]}

    def _all_checkpoints(self) -> Reply:
        cps = [c for r in self.store.list_runs() for c in self.store.list_checkpoints(r["training_run_id"])]
        cps.sort(key=lambda c: c["time"], reverse=True)
        return Reply.json({"checkpoints": cps, "cursor": {"offset": 0, "limit": len(cps), "total_count": len(cps)}})

    def _training_runs(self, method: str, parts: list[str], path: str, base_url: str, f: Fields) -> Reply:
        if not parts:
            if method != "GET":
                raise ApiError(405, f"training_runs takes GET, not {method}")
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
            limit = _query_int(query, "limit", 20)
            offset = _query_int(query, "offset", 0)
            runs = self.store.list_runs()
            page = [self._run_view(r) for r in runs[offset:offset + limit]]
            return Reply.json({"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}})
        run_id = parts[0]
        check_id("training run id", run_id, self.limits)
        meta = self.store.read_run(run_id)
        if meta is None:
            raise ApiError(404, f"unknown training run {run_id}")
        if len(parts) == 1 and method == "GET":
            return Reply.json(self._run_view(meta))
        if len(parts) < 2 or parts[1] != "checkpoints":
            raise ApiError(404, f"no route {method} training_runs/{'/'.join(parts)[:200]}")
        if len(parts) == 2 and method == "GET":
            return Reply.json({"checkpoints": self.store.list_checkpoints(run_id)})
        if len(parts) < 4 or parts[2] not in KINDS:
            raise ApiError(404, f"no checkpoint {'/'.join(parts[2:])[:200]} in {run_id}")
        kind, name, action = parts[2], parts[3], "/".join(parts[4:])
        if self.store.checkpoint_meta(run_id, kind, name) is None:
            raise ApiError(404, f"no checkpoint tinker://{run_id}/{kind}/{name[:100]}")
        if action == "" and method == "DELETE":
            self.store.delete_checkpoint(run_id, kind, name)
            return Reply.json({})
        if action == "" and method == "GET":
            return Reply.json(self.store.checkpoint_meta(run_id, kind, name))
        if action == "ttl" and method == "PUT":
            ttl = f.int("ttl_seconds", None, lo=1)
            self.store.set_ttl(run_id, kind, name, ttl)
            return Reply.json({})
        if action == "external_weights_urls" and method == "GET":
            if kind != "external_weights":
                raise ApiError(400, "download URLs exist for external_weights checkpoints only")
            return self.downloads.urls(run_id, kind, name, base_url)
        if action == "publish":
            raise ApiError(400, "runner serve has no public checkpoints")
        raise ApiError(404, f"no route {method} training_runs/{'/'.join(parts)[:200]}")

    def _weights_info(self, f: Fields) -> Reply:
        run_id, _, _ = self._parse_path(f.str("tinker_path"))
        meta = self.store.read_run(run_id)
        if meta is None:
            raise ApiError(404, f"no training run {run_id}")
        return Reply.json({"base_model": meta["base_model"], "is_lora": True, "lora_rank": meta["lora_rank"],
                           "train_unembed": meta["train_unembed"], "train_mlp": meta["train_mlp"],
                           "train_attn": meta["train_attn"]})

    def _copy_weights(self, f: Fields) -> Reply:
        src_run, kind, name = self._parse_path(f.str("source_path"))
        if f.req.get("session_id") is None or f.req.get("model_seq_id") is None:
            raise ApiError(400, "runner serve has no projects: copy_weights needs session_id and model_seq_id")
        meta = self.store.read_run(src_run)
        if meta is None:
            raise ApiError(404, f"no training run {src_run}")
        run_id = f"{f.id('session_id')}:train:{f.int('model_seq_id', lo=0)}"
        ttl = f.int("ttl_seconds", None, lo=1)
        if self.store.read_run(run_id) is None:
            self.store.write_run(run_id, {**meta, "training_run_id": run_id, "created": iso(now()),
                                          "last_request_time": iso(now()), "loaded_from": f.req["source_path"]})
        dest = self.store.checkpoint_dir(run_id, kind, name)
        if dest.exists():
            raise ApiError(400, f"tinker://{run_id}/{kind}/{name} already exists")
        shutil.copytree(self.store.checkpoint_dir(src_run, kind, name), dest)
        self.store.write_checkpoint_meta(run_id, kind, name, ttl, None)
        return Reply.json({"tinker_path": f"tinker://{run_id}/{kind}/{name}"})


def _query_int(query: dict[str, list[str]], key: str, default: int) -> int:
    raw = query.get(key, [str(default)])[0]
    try:
        v = int(raw)
    except ValueError:
        raise ApiError(400, f"query parameter {key} must be an integer, not {raw[:40]!r}") from None
    return to_int(key, v, lo=0, hi=10_000)
