"""Scheduling: policies (what to draft with, what to keep resident) and the working set."""
