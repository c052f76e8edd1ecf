"""The adaptive engine: op-stream tracer, lazy segments, stability analysis, region cache, stats."""
from .engine import RUNTIME, engine, explain, prepare_background_compiles, reset_caches, stats, sync, wait_for_compiles

__all__ = ["RUNTIME", "engine", "explain", "prepare_background_compiles", "reset_caches", "stats", "sync",
           "wait_for_compiles"]
