"""The adaptive engine: op-stream tracer, lazy segments, stability analysis, region cache, stats."""
from .engine import RUNTIME, engine, reset_caches, stats, sync

__all__ = ["RUNTIME", "engine", "reset_caches", "stats", "sync"]
