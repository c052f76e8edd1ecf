"""docs/guide/kernels.md stays true: its Python blocks run, in order, as one program (their asserts
check what the page claims)."""
import pathlib
import re

import torch

GUIDE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "guide" / "kernels.md"


def test_the_guides_examples_run(capsys):
    blocks = re.findall(r"^```python\n(.*?)^```", GUIDE.read_text(), re.S | re.M)
    assert len(blocks) == 6
    namespace = {}
    for block in blocks:
        exec(compile(block, str(GUIDE), "exec"), namespace)
    printed = capsys.readouterr().out
    assert "kernel add_kernel:" in printed and "partition dim <= 128" in printed
    assert isinstance(namespace["report"].dma_bytes, int) and torch.is_tensor(namespace["o"])
