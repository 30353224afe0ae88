"""OpenAI-compatible serving of one engine, with Prometheus metrics and billed cost.

    create_app(engine, model_name=...)  -> FastAPI app (engine on its own thread)
    serve/metrics.py                    the metric names, defined once
"""

from moefleet.serve.app import create_app
from moefleet.serve.metrics import ServeMetrics

__all__ = ["ServeMetrics", "create_app"]
