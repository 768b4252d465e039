"""The daemon's HTTP process: OpenAI-compatible API, admin API, metrics, systemd integration.

app.py (factory + lifespan), openai_api.py and admin.py (routes), openai_schema.py (bodies),
errors.py (OpenAI-shaped errors), worker.py (engine thread + queue), prefix_cache.py
(multi-session KV reuse), metrics.py, notify.py (sd_notify), state.py (tuned settings),
serve.py (`memspec serve`).
"""

from memspec.server.app import create_app

__all__ = ["create_app"]
