"""A target split over devices on ggml's RPC backend: workers, endpoints, a latency relay."""
