"""Engines for tests, through the composition root (``compose.presets``)."""

from moefleet.compose.presets import build_engine, opened_engine

__all__ = ["build_engine", "opened_engine"]
