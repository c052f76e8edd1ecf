"""Compiles in a compile process: the parent's side (`background.py`, `remote.py`), the process
(`worker.py`) and what crosses between them (`wire.py`)."""
