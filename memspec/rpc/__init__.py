"""A target split over devices on ggml's RPC backend: workers and endpoints (the latency relay
and local workers for tests and benchmarks are the lab's: memspec_lab.relay, .rpc_local)."""
