"""Worker endpoints (HOST:PORT), whether they answer, and how a target's layers split over them."""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

from memspec.errors import DeviceUnavailable, InvalidRequest

DEFAULT_PORT = 50052  # ggml's rpc-server default


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); InvalidRequest when malformed."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"rpc endpoint {text!r} is not HOST:PORT", param="rpc")
    if ":" in host:  # ggml splits an endpoint at its first colon: it would abort on this
        raise InvalidRequest(
            f"rpc endpoint {text!r}: ggml RPC takes IPv4 addresses or host names, not IPv6",
            param="rpc",
        )
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ggml RPC's handshake (ggml-rpc.cpp): command HELLO (14), the client's 24 bytes of transport
# capabilities; the answer is the server's protocol version (major, minor, patch, pad) and its
# capabilities. Major 7 is the protocol of the llama.cpp the pinned llama-cpp-python vendors.
RPC_CMD_HELLO = 14
RPC_CAPS_SIZE = 24
RPC_PROTO_MAJOR = 7


def check_reachable(endpoint: str, timeout_s: float = 3.0) -> None:
    """DeviceUnavailable unless a ggml RPC worker of our protocol answers the handshake at
    `endpoint` within `timeout_s`. Asked before ggml connects, since ggml aborts the process
    when it cannot (or when the versions differ)."""
    host, port = parse_endpoint(endpoint)
    hello = bytes([RPC_CMD_HELLO]) + struct.pack("<Q", RPC_CAPS_SIZE) + bytes(RPC_CAPS_SIZE)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(hello)
            size = struct.unpack("<Q", _recv_exactly(sock, 8))[0]
            version = _recv_exactly(sock, min(size, 4 + RPC_CAPS_SIZE))
    except OSError as e:
        reason = e.strerror or str(e) or type(e).__name__
        raise DeviceUnavailable(f"rpc worker {endpoint} unreachable: {reason}") from e
    if version[0] != RPC_PROTO_MAJOR:
        raise DeviceUnavailable(
            f"rpc worker {endpoint} speaks ggml RPC protocol {version[0]}.{version[1]}, this "
            f"daemon {RPC_PROTO_MAJOR}: run the same memspec version (scripts/setup.sh) on both"
        )


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection closed during the handshake")
        data += chunk
    return data


@dataclass(frozen=True)
class LayerSplit:
    """Which device holds how many of the target's repeating layers. `remote[i]` is the
    number on endpoint i; the rest (and the input embeddings) stay local."""

    endpoints: tuple[str, ...]
    remote: tuple[int, ...]
    local: int

    @property
    def n_remote(self) -> int:
        return sum(self.remote)

    def shares(self) -> list[tuple[str, int]]:
        """(device, layers), local first."""
        return [("local", self.local), *zip(self.endpoints, self.remote, strict=True)]


def layer_split(n_layers: int, endpoints: list[str], tensor_split: list[float]) -> LayerSplit:
    """Split `n_layers` over the endpoints and this device in proportion to `tensor_split`: one
    weight per endpoint, then optionally one for this device (default: the endpoints share
    equally and nothing stays local but the embeddings). Rounded so the counts sum up."""
    if not endpoints:
        return LayerSplit((), (), n_layers)
    weights = list(tensor_split) or [1.0] * len(endpoints)
    if len(weights) == len(endpoints):
        weights.append(0.0)
    if len(weights) != len(endpoints) + 1 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise InvalidRequest(
            f"tensor_split {tensor_split} needs {len(endpoints)} non-negative weights (one per "
            f"rpc endpoint) or {len(endpoints) + 1} (the last for this device)",
            param="tensor_split",
        )
    total = sum(weights)
    counts, assigned, acc = [], 0, 0.0
    for w in weights:  # cumulative rounding: the counts always sum to n_layers
        acc += w
        upto = round(n_layers * acc / total)
        counts.append(upto - assigned)
        assigned = upto
    return LayerSplit(tuple(endpoints), tuple(counts[:-1]), counts[-1])
