"""Routing traces: a hook-based recorder and a Parquet schema (see ``schema``)."""

from moefleet.traces.profile import profile, tokenize_prompts
from moefleet.traces.recorder import RoutingRecorder
from moefleet.traces.schema import SCHEMA_VERSION, Trace, arrow_schema, read_trace, write_trace

__all__ = [
    "SCHEMA_VERSION",
    "RoutingRecorder",
    "Trace",
    "arrow_schema",
    "profile",
    "read_trace",
    "tokenize_prompts",
    "write_trace",
]
