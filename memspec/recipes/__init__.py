"""Draft build recipes: how the drafts a runtime serves are made from a target GGUF.

`memspec drafts build` runs them (build: quantize, layers, datastore, distill, head; family:
a non-testbed target's manifests), over a corpus of the target's own answers (corpus) with a
shared torch harness (training). They import the runtime drafts, engine and backends they
build for; nothing the daemon serves from (memspec.drafts, engine, scheduler, runtime)
imports them (tests/test_layering.py).
"""
