"""The compile cache: the signed directory on disk (`disk.py`), a compiled region as JSON
(`serialize.py`), and compiled regions cached in memory and on disk (`regions.py`)."""
