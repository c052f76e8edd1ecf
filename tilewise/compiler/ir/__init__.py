"""The IR every pass reads and writes: the region (`region.py`), its tile programs (`tile_ir.py`,
sizes that may be symbolic in `sizes.py`) and their reference semantics, the tile interpreter."""
