"""Every bench/*.py imports and answers `--help` (argparse: exit 0, a usage line): a rename or a moved module cannot
break the project's own performance evidence unnoticed (bench/bench_train.py once failed at import for weeks).

One child process runs them all (runpy, as `python bench/x.py --help` would), so torch is imported once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")

CHILD = r"""
import contextlib, io, json, runpy, sys, traceback
out = {}
for name in sys.argv[1:]:
    sys.argv = [f"bench/{name}", "--help"]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(f"bench/{name}", run_name="__main__")
        out[name] = ["returned without exiting", buf.getvalue()[-300:]]
    except SystemExit as e:
        out[name] = [e.code, buf.getvalue()]
    except BaseException:
        out[name] = ["raised", traceback.format_exc()[-600:]]
print(json.dumps(out))
"""


def test_every_bench_script_imports_and_answers_help() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS  # the glob found them
    proc = subprocess.run([sys.executable, "-c", CHILD, *SCRIPTS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {name: r[:1] + [r[1][:300]] for name, r in results.items() if r[0] not in (0, None) or "usage:" not in r[1][:300]}
    assert not bad, json.dumps(bad, indent=1)
    assert sorted(results) == SCRIPTS
    # bench_train.py's own options are in its help (it once failed at import and nothing noticed; this was
    # tests/test_bench_gpu.py's test_bench_train_imports, a process of its own for the same check).
    assert "--quick" in results["bench_train.py"][1]
