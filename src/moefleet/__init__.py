"""moefleet: plan, deploy, serve and scale Mixture-of-Experts models on serverless platforms."""

__version__ = "0.1.0"
