"""The passes in pipeline order (`driver.PASSES`): decompose, partition, lower (with the memory fit),
schedule, emit, cost; `ops.py` is what they know about an aten op."""
