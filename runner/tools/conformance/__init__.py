"""`runner conformance --base-url URL`: a battery of real `tinker` SDK calls against any Tinker-compatible server,
reported as a pass/fail/skip table (docs/conformance.md).

Each check is a function registered with `@check(group, name, timeout_s)` in one of the group modules
(sessions.py, ordering.py, loss_values.py: group "losses", sampling.py, checkpoints.py, errors.py). It raises
`Fail(reason)` or `Skip(reason)`, or returns a short detail line on success. Each runs in its own daemon thread with a
timeout: a hang is reported as a failure and the suite goes on. `KNOWN_GAPS` maps a server name to the
checks known to fail there, with the reason; those are reported as "known gap" and do not fail the run.
"""

# The group modules register their checks on import; core never imports them (no circle).
from runner.tools.conformance import checkpoints, errors, loss_values, ordering, sampling, sessions  # noqa: F401
from runner.tools.conformance.core import (
    CHECKS,
    KNOWN_GAPS,
    Check,
    Ctx,
    Fail,
    Result,
    Skip,
    check,
    format_table,
    run_suite,
)

__all__ = ["CHECKS", "KNOWN_GAPS", "Check", "Ctx", "Fail", "Result", "Skip", "check", "format_table", "run_suite"]
