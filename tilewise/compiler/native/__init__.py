"""The host executables: tile programs as C, built and loaded (`build.py`, `codegen_c.py` and the
`c_*` modules, `vml.py`), the recorded graph through PyTorch's bindings (`bindings.py`), and the tiers
that pick between them (`tiers.py`)."""
