"""benchmarks/long_context_v4.py's tiny run (on CPU through the pure-JAX references): the
prompt prefilled in its fixed-shape chunks through the stack of one layer of each type, then
decode steps, every output finite, and its report."""
import json
import sys

from helpers import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))


def test_the_tiny_run_prefills_and_decodes(tmp_path):
    import long_context_v4

    prefix = tmp_path / "long"
    assert long_context_v4.main(["--tiny", "--out", str(prefix)]) == 0
    result = json.loads(prefix.with_suffix(".json").read_text())
    assert result["complete"]
    assert result["meta"]["layer_types"] == ["heavily_compressed_attention",
                                             "compressed_sparse_attention", "sliding_attention"]
    prefill, decode = result["prefill"], result["decode"]
    assert (prefill["tokens"], prefill["chunks"], prefill["finite"]) == (1024, 4, True)
    assert prefill["tokens_per_s"] > 0
    assert decode["finite"] and decode["us_per_step"] > 0
    assert decode["tokens_cached"] == [1026] * 3
    assert "The whole prompt was prefilled." in prefix.with_suffix(".md").read_text()
