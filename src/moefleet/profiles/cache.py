"""Cached compute profiles: measure once per model and machine, then read the JSON.

Where a profile lives:
- zoo models: ``<zoo model dir>/compute_profile.json``, next to the weights, so a
  rebuild (new recipe hash, or ``--force``) drops the stale profile with the old weights;
- anything else (checkpoint directory, hub id): ``<cache>/profiles/<slug>-<hash>.json``,
  the hash taken over the resolved reference.

A cached file that no longer loads (truncated, NaN, old version) is measured again rather
than reported: the cache is ours to regenerate. Writes are atomic, so two processes that
race only measure twice.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from moefleet.errors import DataError
from moefleet.paths import cache_dir
from moefleet.profiles.model import ComputeProfile

PROFILE_FILE = "compute_profile.json"


def profile_path(model_name: str, dtype: str | None = None) -> Path:
    """Where :func:`profile_for` keeps the profile of ``model_name`` (in ``dtype``, a
    concrete dtype name; None: the checkpoint's, the file without a suffix)."""
    from moefleet.models import zoo

    suffix = "" if dtype is None else f"-{dtype}"
    if zoo.has_entry(model_name):
        return zoo.model_dir(model_name) / PROFILE_FILE.replace(".json", f"{suffix}.json")
    path = Path(model_name).expanduser()
    ref = str(path.resolve()) if path.exists() else model_name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(ref).name or ref)[:60]
    digest = hashlib.sha256(ref.encode()).hexdigest()[:10]
    return cache_dir() / "profiles" / f"{slug}-{digest}{suffix}.json"


def profile_for(
    model_name: str, *, refresh: bool = False, dtype: str | None = None,
    **measure_kwargs: Any
) -> ComputeProfile:
    """The compute profile of ``model_name`` (zoo name, directory or hub id) with its
    weights in ``dtype`` (``auto|bfloat16|float16|float32``; None: the checkpoint's).

    Measured with :func:`~moefleet.profiles.measure.measure_profile` (defaults, or
    ``measure_kwargs``) the first time or when ``refresh``; later calls read the cached
    JSON in milliseconds (one file per dtype). Builds a zoo model first if it is not built
    yet. A cached profile without the memory fields (footprint, intermediate bytes) gets
    them measured and saved (a few seconds), its time laws unchanged.
    """
    from moefleet.models import load_adapter
    from moefleet.models.dtypes import concrete_cpu_dtype

    dtype = concrete_cpu_dtype(dtype)
    target = profile_path(model_name, dtype)

    if target.is_file() and not refresh:
        try:
            cached = ComputeProfile.load(target)
        except DataError:
            cached = None  # unreadable cache: fall through and measure again
        if cached is not None and cached.has_memory:
            return cached
        if cached is not None:  # saved before memory was measured: add it, keep the times
            from moefleet.profiles.measure import add_memory

            add_memory(cached, load_adapter(model_name, dtype=dtype)).save(target)
            return cached
    from moefleet.profiles.measure import measure_profile

    adapter = load_adapter(model_name, dtype=dtype)
    profile = measure_profile(adapter, **measure_kwargs)
    # A zoo build may have (re)created the model directory: compute the path again.
    target = profile_path(model_name, dtype)
    profile.save(target)
    return profile
