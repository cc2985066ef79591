"""The engine: the one training loop (`loop.py`) and what it stands on: the algorithm interface (`spec.py`: what an
algorithm module declares, how a recipe finds it) and contexts (`context.py`), the run dir (`rundir.py`), JSONL and progress (`log.py`), lr schedules (`schedule.py`), trackers
(`track.py`), recipe chains (`chain.py` walks the references, `pipeline.py` runs them in order)."""
