"""The engine worker's states, and the one error each gives a request that cannot be served.

STARTING -> LOADING -> READY, or FAILED (the models did not load), or WAITING_FOR_DEVICE (an
RPC worker the target is split over does not answer; retried until it does). READY ->
RELOADING (a tune of n_ctx or parallel) -> READY; READY -> DEVICE_LOST (a worker went away
mid-run) -> READY once it is back; at the end STOPPING -> STOPPED. The values are what
/admin/status and /health report.
"""

from __future__ import annotations

from memspec.compat import StrEnum
from memspec.errors import DeviceUnavailable, MemSpecError
from memspec.server.errors import NotReady


class EngineState(StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    RELOADING = "reloading"
    WAITING_FOR_DEVICE = "waiting_for_device"
    DEVICE_LOST = "device_lost"
    FAILED = "failed"
    STOPPING = "stopping"
    STOPPED = "stopped"


# The states in which the engine thread beats and a restart would not help (healthy).
LIVE = frozenset(
    {
        EngineState.READY,
        EngineState.RELOADING,
        EngineState.WAITING_FOR_DEVICE,
        EngineState.DEVICE_LOST,
    }
)


def state_error(state: EngineState, error: str | None) -> MemSpecError | None:
    """Why a request cannot be served in `state` (None: it can be, or can wait its turn)."""
    if state in (EngineState.STARTING, EngineState.LOADING):
        return NotReady("models are loading; retry shortly", code="model_loading")
    if state is EngineState.FAILED:
        return NotReady(f"models failed to load: {error}", code="model_load_failed")
    if state is EngineState.WAITING_FOR_DEVICE:
        return DeviceUnavailable(f"the target cannot load: {error}")
    if state is EngineState.DEVICE_LOST:
        return DeviceUnavailable(f"the target cannot run: {error}")
    return None
