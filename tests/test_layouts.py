"""The sizes and byte layouts that C++ and CUDA state once (ffi/layouts.h, ffi/host_queue.h,
which the CPU and CUDA modules are compiled with) equal those the Python package states once."""
from jax_flashmla import _cpu
from jax_flashmla.base import validation
from jax_flashmla.caches import index_keys, v4
from jax_flashmla.serving import host_queue


def test_compiled_layouts_equal_pythons():
    assert _cpu.layouts() == {
        "page_tokens": validation.PAGE_SIZE,
        "metadata_fields": validation.METADATA_FIELDS,
        "index_key_dim": index_keys.INDEX_HEAD_DIM,
        "index_key_scale_bytes": index_keys.SCALE_BYTES,
        "index_page_values_bytes": index_keys.VALUES_BYTES,
        "index_page_bytes": index_keys.PAGE_BYTES,
        "v4_row_bytes": v4.ROW_BYTES,
        "v4_scale_bytes": v4.SCALE_BYTES,
        "v4_page_rows": v4.PAGE_ROWS,
        "v4_kernel_token_bytes": v4.KERNEL_TOKEN_BYTES,
        "host_queue_header_bytes": host_queue.HEADER_BYTES,
        "host_queue_writing": host_queue.WRITING,
    }
