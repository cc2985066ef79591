"""`python -m runner ...` is `runner ...`."""

from runner.cli import main

raise SystemExit(main())
