"""Traces, the trace-driven simulator, and offline training of the acceptance predictor."""
