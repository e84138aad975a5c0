"""tests/bad_value_cases.py's cases in this process, on the CPU's implementations (the pure-JAX
references and mla_prefill's blockwise attention): every case but those that check what a
Hopper GPU's default lowers to. On a GPU they run in processes of their own
(tests/test_gpu_bad_values.py), where a crash takes no other case down."""
import jax
import pytest

from bad_value_cases import GROUPS


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{group}/{c.name}")
                                  for group, cases in GROUPS.items() for c in cases])
def test_bad_value_case(case):
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the cases run in processes of their own (test_gpu_bad_values.py)")
    if case.needs is not None:
        pytest.skip(case.needs)
    case.run()
