"""The benchmarks' shared parts: what the machine is (machine, gpu), servers and their clients
(serving, compare; the servers start through scripts/peers/launch.py), workloads and what they are
cut from (texts, serving, kv_quality, checkpoint, weights_engine, weights_auto), and reports (report,
docs, vllm_report).

A script under scripts/ imports these, never another script; nothing here imports a script
(tests/unit/test_import_layers.py)."""
