"""bf16 training (`model.to(torch.bfloat16)` with LayerNorm), autocast-to-bf16 training and
autocast-to-float16 training with a GradScaler on `neuron` against the same on the CPU. Each case
runs in a child process (see lowp.py): an abort there is a failed test, not the end of the suite."""
import pytest

from .helpers import assert_isolated_passes, xfail_modes


def _program(name: str, mode: str) -> str:
    return f"""
        import sys
        sys.path.insert(0, "tests")
        from models.lowp import PROGRAMS
        PROGRAMS[{name!r}]({mode!r})
    """


# Each child process costs ~10 s on 2 cores: CI keeps bf16 in eager and adaptive mode (the one seen
# to abort) and autocast in eager mode.
@pytest.mark.parametrize("mode", xfail_modes({}, slow=("compiled",)))
def test_bf16_model_with_layer_norm_trains_like_cpu(mode):
    """Bitwise equal to CPU: compiled regions ran CPU's in-place bf16 `_foreach_mul_` (momentum) as
    a functional mul, which rounds 0.9 differently (compiler/decompose.py rounded_foreach_scalars)."""
    assert_isolated_passes(_program("bf16", mode))


@pytest.mark.parametrize("mode", xfail_modes({}, slow=("adaptive", "compiled")))
def test_autocast_bf16_training_matches_cpu(mode):
    assert_isolated_passes(_program("autocast", mode))


@pytest.mark.parametrize("mode", xfail_modes({}, slow=("adaptive", "compiled")))
def test_float16_autocast_with_grad_scaler_trains_like_cpu(mode):
    assert_isolated_passes(_program("float16_grad_scaler", mode))
