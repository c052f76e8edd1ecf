import os

import pytest

# The suite keeps compiled regions in memory, as each test expects to compile its own (the disk
# cache, on by default for users, has tests of its own that name their directories); set here, not
# in a fixture, so the programs tests start in subprocesses inherit it.
os.environ.setdefault("TILEWISE_CACHE_DIR", "off")
# Every compile the suite makes is checked against the IR's spec after each pass (IRError names the pass).
os.environ.setdefault("TILEWISE_VERIFY_IR", "on")

import tilewise  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def private_cache_key(tmp_path_factory):
    """Tests that use a disk cache authenticate it with a key of their own, never the user's."""
    with tilewise.config.patch(cache_key_file=str(tmp_path_factory.mktemp("key") / "cache.key")):
        yield


@pytest.fixture(autouse=True)
def fresh_engine():
    """Each test starts with no compiled regions and zeroed statistics, so it sees its own compiles."""
    tilewise.reset_caches()
    tilewise.stats().reset()
    yield
