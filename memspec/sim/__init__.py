"""Traces and the trace-driven simulator: replay measured acceptance under a device profile."""
