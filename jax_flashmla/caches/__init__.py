"""Floor 1: the caches' byte layouts, writes and quantization: the paged bf16/FP8 cache (paged,
fp8), DeepSeek-V3.2's sparse token cache (sparse) and index-key cache (index_keys)."""
