"""What reads and drives runs from outside the loop: sweeps (`sweep.py`), tables (`compare.py`), plots
(`plot.py`), sampling, chat and evals of a checkpoint (`talk.py`), a recipe's data as the trainer sees it
(`render.py`)."""
