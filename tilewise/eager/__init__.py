"""Op-by-op execution on the simulated device; also the fallback path of the lazy modes."""
from . import executor, factories, kernel_choice, nested_fast_path
from .executor import counters, execute


def install() -> None:
    executor.install()
    factories.install()
    kernel_choice.install()
    nested_fast_path.install()


__all__ = ["counters", "execute", "install"]
