"""What `runner serve` keeps on disk under --storage, so a restarted server lists, loads and resumes it.

    runs/<run_id>/run.json                       a training run (TrainingRun's fields, plus the LoRA spec)
    runs/<run_id>/<kind>/<name>/                 a checkpoint: kind = weights (local state folder: weights,
                                                 optimizer, step), sampler_weights or external_weights
                                                 (PEFT adapter folders)
    runs/<run_id>/<kind>/<name>.json             its metadata: time, size, expiry, user metadata
    sessions.jsonl                               every session id ever handed out (ids never repeat)
    tokenizers/<model>/                          a served model's tokenizer, for get_info's tokenizer_id
    ephemeral/<sampler id>/                      a freed sampler's weights, until its session ends

Files are written to a temporary name and renamed, so a crash leaves either the old file or the new one.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from backends.types import Json

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def read_json(path: Path) -> Json:
    """A metadata file (run.json, a checkpoint's .json): a JSON object, else ValueError (as for a torn file)."""
    obj = json.loads(path.read_text())
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds {type(obj).__name__}, not a JSON object")
    return obj


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def valid_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and not name.startswith(".")


class Store:
    def __init__(self, root: Path):
        self.root = Path(root).resolve()
        self.runs_dir = self.root / "runs"
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        self.ephemeral_dir = self.root / "ephemeral"
        # A previous process's sessions are gone, and with them their freed samplers.
        shutil.rmtree(self.ephemeral_dir, ignore_errors=True)
        self.ephemeral_dir.mkdir(parents=True)
        self._lock = threading.Lock()
        self._sessions_file = self.root / "sessions.jsonl"
        self._session_ids: set[str] = set()
        if self._sessions_file.exists():
            for line in self._sessions_file.read_text().splitlines():
                if line.strip():
                    self._session_ids.add(json.loads(line)["session_id"])

    # ---------------------------------------------------------------- sessions

    def new_session_id(self, make: Callable[[], str]) -> str:
        """A session id never handed out before by any server on this storage (they prefix run ids)."""
        with self._lock:
            while True:
                sid = make()
                if sid not in self._session_ids and not any(self.runs_dir.glob(f"{sid}:*")):
                    break
            self._session_ids.add(sid)
            with self._sessions_file.open("a") as f:
                f.write(json.dumps({"session_id": sid, "time": iso(now())}) + "\n")
        return sid

    # ---------------------------------------------------------------- runs

    def run_dir(self, run_id: str) -> Path:
        if not valid_name(run_id):
            raise KeyError(run_id)
        return self.runs_dir / run_id

    def write_run(self, run_id: str, meta: Json) -> None:
        write_json(self.run_dir(run_id) / "run.json", meta)

    def read_run(self, run_id: str) -> Json | None:
        try:
            return read_json(self.run_dir(run_id) / "run.json")
        except (KeyError, OSError, ValueError):
            return None

    def list_runs(self) -> list[Json]:
        out = []
        for p in self.runs_dir.glob("*/run.json"):
            try:
                out.append(read_json(p))
            except (OSError, ValueError):
                continue
        out.sort(key=lambda r: r.get("created", ""), reverse=True)
        return out

    # ---------------------------------------------------------------- checkpoints

    def checkpoint_dir(self, run_id: str, kind: str, name: str) -> Path:
        if kind not in KINDS or not valid_name(name):
            raise KeyError(f"{kind}/{name}")
        return self.run_dir(run_id) / kind / name

    def write_checkpoint_meta(self, run_id: str, kind: str, name: str, ttl_seconds: int | None,
                              user_metadata: dict[str, str] | None) -> Json:
        path = self.checkpoint_dir(run_id, kind, name)
        t = now()
        meta = {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind], "time": iso(t),
                "tinker_path": f"tinker://{run_id}/{kind}/{name}", "size_bytes": dir_size(path), "public": False,
                "user_metadata": user_metadata or None,
                "expires_at": iso(t + dt.timedelta(seconds=ttl_seconds)) if ttl_seconds else None}
        write_json(path.with_name(name + ".json"), meta)
        return meta

    def checkpoint_meta(self, run_id: str, kind: str, name: str) -> Json | None:
        try:
            path = self.checkpoint_dir(run_id, kind, name)
            if not path.is_dir():
                return None
            meta = read_json(path.with_name(name + ".json"))
        except (KeyError, OSError, ValueError):
            return None
        if expired(meta):  # enforced on access, not only by the housekeeping sweep
            self.delete_checkpoint(run_id, kind, name)
            return None
        return meta

    def set_ttl(self, run_id: str, kind: str, name: str, ttl_seconds: int | None) -> bool:
        meta = self.checkpoint_meta(run_id, kind, name)
        if meta is None:
            return False
        meta["expires_at"] = iso(now() + dt.timedelta(seconds=ttl_seconds)) if ttl_seconds else None
        write_json(self.checkpoint_dir(run_id, kind, name).with_name(name + ".json"), meta)
        return True

    def list_checkpoints(self, run_id: str) -> list[Json]:
        out = []
        for kind in KINDS:
            base = self.run_dir(run_id) / kind
            for p in sorted(base.glob("*.json")) if base.is_dir() else []:
                meta = self.checkpoint_meta(run_id, kind, p.stem)
                if meta is not None:
                    out.append(meta)
        out.sort(key=lambda m: m["time"])
        return out

    def delete_checkpoint(self, run_id: str, kind: str, name: str) -> bool:
        path = self.checkpoint_dir(run_id, kind, name)
        if not path.is_dir():
            return False
        # Rename first: a reader never sees a half-deleted folder.
        trash = Path(tempfile.mkdtemp(prefix=f".deleted-{name}.", dir=path.parent))
        try:
            path.rename(trash / name)
        except FileNotFoundError:  # deleted by another request meanwhile
            trash.rmdir()
            return False
        path.with_name(name + ".json").unlink(missing_ok=True)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def expire(self) -> list[str]:
        """Delete every checkpoint past its expiry; returns their tinker paths."""
        gone = []
        for meta_file in self.runs_dir.glob("*/*/*.json"):
            try:
                meta = read_json(meta_file)
            except (OSError, ValueError):
                continue
            if expired(meta):
                run_id, kind = meta_file.parent.parent.name, meta_file.parent.name
                if kind in KINDS and self.delete_checkpoint(run_id, kind, meta_file.stem):
                    gone.append(meta["tinker_path"])
        return gone


def expired(meta: Json) -> bool:
    exp = meta.get("expires_at")
    return exp is not None and dt.datetime.fromisoformat(exp) <= now()
