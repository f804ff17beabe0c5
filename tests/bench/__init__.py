"""Benchmarks (not part of ``make test``): ``python -m tests.bench`` compares llmq with vLLM's own
OpenAI server and the engine in-process; ``tests.bench.pickup`` and ``tests.bench.relay`` measure
queue pickup and relay capacity. ``make bench`` runs all three."""
