"""Serving runtime shared by the prefill and decode workers: the engine on its own thread
(:class:`AsyncEngine`), settings, metrics and the gRPC server plumbing."""

from engine.serving.async_engine import AsyncEngine, EngineError, EngineStats, EngineStoppedError
from engine.serving.settings import WorkerSettings

__all__ = ["AsyncEngine", "EngineError", "EngineStats", "EngineStoppedError", "WorkerSettings"]
