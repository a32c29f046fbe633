"""Evaluation: avg@k pass@1 with the agentic loop, and the metrics behind it."""
