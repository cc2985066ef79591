"""Tests run torch the way `runner run` does: OpenMP threads wait passively (runner/threads.py), which also
keeps the suite from crawling when the machine's cores are shared."""

from runner.threads import prefer_passive_openmp

prefer_passive_openmp()
