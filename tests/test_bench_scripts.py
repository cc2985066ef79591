"""Every bench/*.py imports and answers `--help` (argparse: exit 0, a usage line): a rename or a moved module cannot
break the project's own performance evidence unnoticed (bench/bench_train.py once failed at import for weeks).

They run in this process (runpy, as `python bench/x.py --help` would, with the repo on the path as PYTHONPATH puts
it for a child), so torch, which the test run has imported already, is not imported again by a child (that child
took 8.4 s of its 10.3 s importing bench_attention.py's torch and transformers). What a script may change on its way
to `--help` (the environment, sys.argv, sys.path, the working folder, signal handlers, torch's thread count) is put
back after each."""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def _help(name: str) -> list[object]:
    """[exit code, stdout] of `python bench/<name> --help`; ["raised", traceback] or ["returned without exiting", ...]."""
    import torch

    buf = io.StringIO()
    handlers = {s: signal.getsignal(s) for s in SIGNALS}
    threads, path, cwd = torch.get_num_threads(), list(sys.path), os.getcwd()
    try:
        with mock.patch.dict(os.environ), mock.patch.object(sys, "argv", [f"bench/{name}", "--help"]):
            os.chdir(ROOT)
            if str(ROOT) not in sys.path:
                sys.path.insert(0, str(ROOT))
            with contextlib.redirect_stdout(buf):
                runpy.run_path(str(ROOT / "bench" / name), run_name="__main__")
        return ["returned without exiting", buf.getvalue()[-300:]]
    except SystemExit as e:
        return [e.code, buf.getvalue()]
    except BaseException:  # noqa: BLE001 - reported per script
        return ["raised", traceback.format_exc()[-600:]]
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        torch.set_num_threads(threads)
        for s, h in handlers.items():
            signal.signal(s, h)


def test_every_bench_script_imports_and_answers_help() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS  # the glob found them
    results = {name: _help(name) for name in SCRIPTS}
    bad = {name: r[:1] + [str(r[1])[:300]] for name, r in results.items()
           if r[0] not in (0, None) or "usage:" not in str(r[1])[:300]}
    assert not bad, json.dumps(bad, indent=1)
    assert sorted(results) == SCRIPTS
    # bench_train.py's own options are in its help (it once failed at import and nothing noticed; this was
    # tests/test_bench_gpu.py's test_bench_train_imports, a process of its own for the same check).
    assert "--quick" in str(results["bench_train.py"][1])
