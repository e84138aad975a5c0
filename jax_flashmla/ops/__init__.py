"""Floor 4: the public ops: the dense decode (decode), prefill and extend (prefill),
DeepSeek-V3.2's sparse decode and prefill (sparse) and indexer (indexer), and the decode over a
cache split across devices (context_parallel)."""
