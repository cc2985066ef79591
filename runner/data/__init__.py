"""Training data: conversations from any data source (`conversations.py`) and preference comparisons
(`comparisons.py`)."""
