"""The engine side of a hand-off, without the engine: what a serving engine's
scheduler tells its workers each step (steps), and the request ledger that decides
it (ledger). Plain values in, plain values out; kvpush.vllm adapts vLLM to them."""
