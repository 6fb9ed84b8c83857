"""What the engine did (types.py holds it until it moves here)."""

from batchrun.engine.types import EngineStats, SpeculationStats  # noqa: F401
