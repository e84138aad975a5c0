"""benchmarks/bench_v4.py: its tiny configuration (on CPU through the pure-JAX references) and
its report; the torch side's window writer stores the bytes jax_flashmla's writer stores."""
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import BENCHMARKS, run_tiny_benchmark
from jax_flashmla.caches.v4 import V4KVCache
from jax_flashmla.sparse import write_sparse_kv

sys.path.insert(0, str(BENCHMARKS))


def test_the_tiny_run_writes_its_report(tmp_path):
    prefix = tmp_path / "v4"
    result = run_tiny_benchmark("bench_v4.py", prefix, "--parts", "step", "decode")
    assert [r["label"] for r in result["step"]] == ["step/b2"]
    assert [r["label"] for r in result["decode"]] == ["decode/b2"]
    assert result["prefill"] == result["heads"] == result["not_run"] == []
    assert result["meta"]["layer_types"] == {"heavily_compressed_attention": 3,
                                             "compressed_sparse_attention": 1}
    for record in result["step"] + result["decode"]:
        assert record["layers"] == 4 and record["jax_out_finite"]
        assert record["jax_us"] > 0 and record["jax_queued_us"] > 0
        assert "ratio" not in record  # no torch here
    markdown = prefix.with_suffix(".md").read_text()
    assert "## The decodes alone (no window writes)" in markdown
    assert prefix.with_suffix(".png").stat().st_size > 0


def test_the_torch_writer_stores_jax_flashmlas_bytes():
    """TorchV4.write (torch ops, captured in the torch step's graph) against write_sparse_kv:
    the same token rows and scale rows, byte for byte, rows of small, large and zero tiles."""
    torch = pytest.importorskip("torch")
    import bench_v4

    rng = np.random.default_rng(0)
    rows = rng.normal(0, 1, (6, 512)) * rng.choice([1e-6, 1.0, 300.0], (6, 1))
    rows[0, :64] = 0  # a tile of zeros: its scale is the floor's
    rows = jnp.asarray(rows, jnp.bfloat16)
    slots = jnp.asarray([0, 63, 64, 100, 190, 255], jnp.int32)
    expected = write_sparse_kv(V4KVCache.create(4), slots, rows).data
    window = torch.zeros((4, 65, 576), dtype=torch.uint8)
    writer = types.SimpleNamespace(torch=torch)
    bench_v4.TorchV4.write(writer, window, torch.from_numpy(np.array(slots)).long(),
                           torch.from_numpy(np.array(rows.astype(jnp.float32))).bfloat16())
    np.testing.assert_array_equal(window.numpy(), np.asarray(expected))
