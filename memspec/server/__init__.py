"""The daemon's HTTP process: OpenAI-compatible API, admin API, metrics, systemd integration.

app.py (factory + lifespan), openai_api.py and admin.py (routes), openai_schema.py (bodies),
errors.py (OpenAI-shaped errors), worker.py (engine thread + queue), engine_state.py (its
states and the error each gives), tuning.py (live tuning: tune, reset), state.py (the tuned
file), metrics.py, notify.py (sd_notify), serve.py (`memspec serve`); the prefix cache (multi-
session KV reuse) is memspec.engine.prefix_cache.
"""

from memspec.server.app import create_app

__all__ = ["create_app"]
