"""Compute profiles (time per token vs threads and batch size) and model sizes."""

from moefleet.profiles.model import (
    PROFILE_VERSION,
    BatchLaw,
    ComputeProfile,
    FunctionProfile,
    ThreadLaw,
)

__all__ = ["PROFILE_VERSION", "BatchLaw", "ComputeProfile", "FunctionProfile", "ThreadLaw"]
