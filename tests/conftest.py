import pytest

import tilewise


@pytest.fixture(autouse=True)
def fresh_engine():
    """Each test starts with no compiled regions and zeroed statistics, so it sees its own compiles."""
    tilewise.reset_caches()
    tilewise.stats().reset()
    yield
