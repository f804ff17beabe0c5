"""Worker processes: each owns one vLLM engine and consumes its model's queue."""
