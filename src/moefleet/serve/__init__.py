"""OpenAI-compatible serving of one engine, with Prometheus metrics and billed cost.

    create_app(engine, model_name=...)  -> FastAPI app (engine on its own thread)
    serve/metrics.py                    Prometheus metrics (names: moefleet/metric_names.py)
    serve/cost.py                       billing: in-process estimate, or invocation records
    serve/deployed.py                   serve --plan: experts in a deployment's functions
"""

from moefleet.serve.app import create_app
from moefleet.serve.metrics import ServeMetrics

__all__ = ["ServeMetrics", "create_app"]
