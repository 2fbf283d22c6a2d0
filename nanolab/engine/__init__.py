"""The engine: sequences, the scheduler and its block manager, the KV cache and its plans, capture
buckets and CUDA graphs, the model runner, and `Engine`, which drives them a step at a time."""
