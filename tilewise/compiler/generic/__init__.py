"""Shape-generic regions (`symbolic.py`) and their parametric tile programs (`parametric.py`)."""
