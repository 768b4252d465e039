"""MemSpec's laboratory: what measures and studies the product, kept out of it.

- `bench/`: `memspec bench ...`, each benchmark writing JSON (and a PNG plot); its workloads
  (`bench/data/*.jsonl`);
- `sim/`: traces, the trace-driven simulator, its device profiles (`sim/profiles/*.toml`) and
  the predictor's training from traces;
- `testbed.py`: `memspec testbed fetch`, the models and data the tests and benchmarks use;
- `relay.py`, `rpc_local.py`: a TCP relay adding link latency, and local RPC workers behind it;
- `stub_backend.py`: a target that costs nothing per step;
- `cli.py`: the lab's commands, which `memspec` lists and hands here (memspec/cli/lab.py).

The lab imports memspec; memspec never imports the lab but in memspec/cli/lab.py, when one of
its commands runs (tests/test_layering.py holds both).
"""
