"""`python -m tilewise.compiler`: the compile process of an engine compiling in the background
(worker.py; started by background.py)."""
from .worker import main

main()
