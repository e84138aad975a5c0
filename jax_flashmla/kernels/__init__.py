"""Floor 3: FlashMLA's library and our compiled modules (library), the physical custom calls
each stated once (custom_calls), the builder of the logical ops over them (logical), the dense
decode's logical op (decode_primitive), and the ragged attention cores of the prefill
(ragged_attention: cuDNN's and XLA's)."""
