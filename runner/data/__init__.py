"""Training data: conversations from any data source (`conversations.py`) and preference comparisons
(`comparisons.py`), read through the recipe's data formats (runner/recipe/formats.py)."""
