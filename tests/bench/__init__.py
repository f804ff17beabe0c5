"""Benchmarks (not part of ``make test``): ``python -m tests.bench`` compares llmq with vLLM's own
OpenAI server and the engine in-process; ``tests.bench.pickup``, ``tests.bench.relay`` and
``tests.bench.fairness`` measure queue pickup, relay capacity and the fair-share pick's cost with
many tenants; the other modules are described in docs/benchmarks.md. ``make bench`` runs them all."""
