"""Floor 2: the pure-JAX semantics of the ops, the path off the GPU and the tests' oracle: the
dense decode (dense), the sparse decode and prefill (sparse), and merging partial attention
results (merge)."""
