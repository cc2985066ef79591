"""Hub models on first use: a hub id that is not in the Hugging Face cache is downloaded there, as transformers,
TRL and vLLM do (the local backend's models and tokenizers: backends/local/model.py; any tokenizer by hub id:
backends/tokenizer.py).

- The cache is looked at first, without a network call; a cached id never touches the hub.
- HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) and the local backend's `local_files_only = true` keep to the cache.
- The hub (HF_ENDPOINT) gets a quick connection check first: offline, the hub client would retry for most of a
  minute; instead the run stops at once with one line saying how to get the files.
- Progress: one line naming the id, the endpoint and the cache folder, then huggingface_hub's progress bars, all on
  stderr (HF_HUB_DISABLE_PROGRESS_BARS=1 silences the bars). Only what loading needs is fetched: configs,
  safetensors weights, tokenizer files (not .bin/.pt/.gguf copies of the same weights).
- Bounded (docs/backends.md, "Hub downloads"): the hub client runs in a child process that this one watches. The
  download stops with one line when it takes longer than RUNNER_HUB_TIMEOUT_S in all, or when the repo's bytes in
  the cache reach no new high for RUNNER_HUB_STALL_S (a hub that never answers, one that stalls, one that drops
  the file and sends it again from the start); a failed try is tried again, resuming the partial files where the
  hub serves ranges, at most RUNNER_HUB_RETRIES more times. Ctrl-C kills the child at once.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from backends.errors import UserError

# What loading a model or tokenizer reads (transformers' from_pretrained with safetensors weights).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
# What loading a tokenizer alone reads: no weights.
TOKENIZER_PATTERNS = [p for p in ALLOW_PATTERNS if p != "*.safetensors"]
HUB_CHECK_TIMEOUT_S = 3.0
# The download's bounds, each overridden by its environment variable (module doc; docs/backends.md).
DEFAULT_TIMEOUT_S = 6 * 3600.0
DEFAULT_STALL_S = 60.0
DEFAULT_RETRIES = 3
POLL_S = 0.1


def hub_endpoint() -> str:
    """The Hugging Face endpoint: $HF_ENDPOINT, else the public hub."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hugging Face endpoint opens within `timeout`."""
    url = urlparse(hub_endpoint())
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def env_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE as set in the environment now."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))  # fmt: skip


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, as set now or as huggingface_hub read it when it was imported."""
    import huggingface_hub.constants

    return env_offline() or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def cached_snapshot(repo_id: str) -> Path | None:
    """The repo's folder when it is wholly in the Hugging Face cache (no network call), else None."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not (fully) in the cache, or a name the hub client refuses
        return None


def looks_like_hub_id(name: str) -> bool:
    """`org/name` that is not a folder here (what backends/local/model.py downloads; "tiny" is built in)."""
    if name == "tiny" or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return False
    return not Path(name).expanduser().exists()


def cache_miss(name: str, what: str, local_files_only: bool = False) -> str | None:
    """For `runner check`: the line a run would stop with because hub id `name` is not in the Hugging Face cache
    and downloads are off (HF_HUB_OFFLINE=1 or local_files_only); None otherwise. Never a network call; with
    downloads on, nothing is looked up (the run downloads it). The environment as it is now decides (a fresh run
    reads the same), not what huggingface_hub read when this process imported it."""
    if not looks_like_hub_id(name) or not (local_files_only or env_offline()):
        return None
    if cached_snapshot(name) is not None:
        return None
    why = "local_files_only = true" if local_files_only else "HF_HUB_OFFLINE=1"
    return (f"{what} {name!r} is not in the Hugging Face cache and downloads are off ({why}); download it first "
            f"(hf download {name}) or name a local folder")


def snapshot(repo_id: str, what: str = "model", local_files_only: bool = False,
             patterns: list[str] | None = None) -> Path:  # fmt: skip
    """The folder of hub repo `repo_id` in the Hugging Face cache, downloaded on first use (module doc).
    UserError (one line) when it is not cached and cannot be downloaded."""
    import huggingface_hub.constants

    cached = cached_snapshot(repo_id)
    if cached is not None:
        return cached
    fix = f"download it first (hf download {repo_id}) or name a local folder"
    if local_files_only or offline():
        why = "local_files_only = true" if local_files_only else "HF_HUB_OFFLINE=1"
        raise UserError(f"{what} {repo_id!r} is not in the Hugging Face cache and downloads are off ({why}); {fix}")
    endpoint = hub_endpoint()
    if not hub_reachable():
        raise UserError(f"{what} {repo_id!r} is not in the Hugging Face cache and the hub ({endpoint}) cannot be "
                        f"reached; {fix}")
    cache = Path(huggingface_hub.constants.HF_HUB_CACHE)
    print(f"{what} {repo_id}: not in the Hugging Face cache, downloading it from {endpoint} into {cache}",
          file=sys.stderr, flush=True)
    try:
        return download(repo_id, patterns or ALLOW_PATTERNS, cache)
    except DownloadError as e:
        raise UserError(f"cannot download {what} {repo_id!r} from {endpoint} ({e}); {fix}") from None


@dataclass(frozen=True)
class Bounds:
    timeout_s: float = DEFAULT_TIMEOUT_S
    stall_s: float = DEFAULT_STALL_S
    retries: int = DEFAULT_RETRIES

    @staticmethod
    def from_env() -> Bounds:
        def read(name: str, default: float, kind: type) -> float:
            text = os.environ.get(name, "").strip()
            if not text:
                return default
            try:
                value = kind(text)
            except ValueError:
                value = -1
            if not (value >= 0 and value < float("inf")) or (kind is float and value == 0):
                least = "a number of seconds > 0" if kind is float else "a whole number >= 0"
                raise UserError(f"{name} must be {least}, got {text!r}")
            return value

        return Bounds(read("RUNNER_HUB_TIMEOUT_S", DEFAULT_TIMEOUT_S, float),
                      read("RUNNER_HUB_STALL_S", DEFAULT_STALL_S, float),
                      int(read("RUNNER_HUB_RETRIES", DEFAULT_RETRIES, int)))  # fmt: skip


class DownloadError(Exception):
    """Why a download stopped, one line (snapshot() adds the repo, the endpoint and the fix)."""


# The child: the hub client's snapshot_download, its answer as one JSON line on stdout. It exits when its parent
# goes away (a parent killed by a signal cannot kill it first).
_CHILD = r"""
import json, os, sys, threading, time
parent = os.getppid()
def orphaned():
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(3)
threading.Thread(target=orphaned, daemon=True).start()
repo, patterns = sys.argv[1], json.loads(sys.argv[2])
try:
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors
    path = snapshot_download(repo, allow_patterns=patterns)
    answer = {"path": str(path)}
except Exception as e:
    final = (errors.RepositoryNotFoundError, errors.GatedRepoError, errors.RevisionNotFoundError,
             errors.EntryNotFoundError, errors.DisabledRepoError) if "errors" in globals() else ()
    answer = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0], "final": isinstance(e, final)}
sys.stdout.write(json.dumps(answer) + "\n")
sys.stdout.flush()
os._exit(0)
"""


def download(repo_id: str, patterns: list[str], cache: Path, bounds: Bounds | None = None) -> Path:
    """snapshot_download in a watched child process (module doc); DownloadError when it cannot finish."""
    bounds = bounds or Bounds.from_env()
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    deadline = time.monotonic() + bounds.timeout_s
    why = ""
    for attempt in range(bounds.retries + 1):
        answer, why = _one_try(repo_id, patterns, folder, bounds, deadline)
        if answer is not None:
            if "path" in answer:
                return Path(str(answer["path"]))
            why = str(answer.get("error") or "the hub client failed")
            if answer.get("final"):
                raise DownloadError(why)
        if time.monotonic() >= deadline:
            raise DownloadError(f"not done after {bounds.timeout_s:g} s, RUNNER_HUB_TIMEOUT_S")
        if attempt < bounds.retries:
            print(f"hub download of {repo_id}: {why}; trying again ({attempt + 1} of {bounds.retries})",
                  file=sys.stderr, flush=True)
    tries = bounds.retries + 1
    raise DownloadError(f"{why}; gave up after {tries} tr{'y' if tries == 1 else 'ies'}, RUNNER_HUB_RETRIES")


def _one_try(repo_id: str, patterns: list[str], folder: Path, bounds: Bounds,
             deadline: float) -> tuple[dict[str, object] | None, str]:  # fmt: skip
    """One child: its answer, or None and why it was stopped (no progress, out of time)."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, repo_id, json.dumps(patterns)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        high, last_progress = _bytes(folder), time.monotonic()
        while proc.poll() is None:
            time.sleep(POLL_S)
            now = time.monotonic()
            size = _bytes(folder)
            if size > high:
                high, last_progress = size, now
            if now >= deadline:
                return None, f"not done after {bounds.timeout_s:g} s, RUNNER_HUB_TIMEOUT_S"
            if now - last_progress >= bounds.stall_s:
                return None, f"no progress for {bounds.stall_s:g} s, RUNNER_HUB_STALL_S"
        out = proc.stdout.read() if proc.stdout else ""
        try:
            answer = json.loads(out.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return None, f"the hub client exited with code {proc.returncode} without an answer"
        return (answer if isinstance(answer, dict) else None), "the hub client answered nonsense"
    finally:
        _kill(proc)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        pass
    if proc.stdout:
        proc.stdout.close()


def _bytes(folder: Path) -> int:
    """Bytes of the repo's blobs in the cache, partial (.incomplete) ones included: the download's progress."""
    total = 0
    try:
        with os.scandir(folder / "blobs") as it:
            for entry in it:
                try:
                    total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
    except OSError:
        pass
    return total
