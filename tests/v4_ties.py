"""The tie rule by which the V4 tests compare jax_flashmla's indexer selections with HF's.

HF's DeepseekV4Indexer scores unquantized queries and entries; jax_flashmla's scores them
rotated and FP8 (jax_flashmla/ops/v4_indexer.py), a few percent of a row's largest score off.
So a selection is HF's up to ties: with k = min(topk, visible) and s_k the k-th largest exact
score (HF's), every entry scoring above s_k + slack is selected and none below s_k - slack,
slack twice the row's largest |FP8 score - exact score| plus FLOAT32_SHARE of the call's
largest score. HF's own selections pass the same rule with FLOAT32_SHARE alone. Ties are real:
a score is exactly 0 where every head's relu is.
"""
import numpy as np

FLOAT32_SHARE = 1e-6  # torch's and XLA's float32 sums, of the call's largest |score|


def assert_top_up_to_ties(selected, exact, k, slack):
    """selected (entries, -1 padding) holds k distinct entries that are exact's (a row's
    float64 scores, -inf where not visible) top k but for ties within slack (module doc)."""
    chosen = selected[selected >= 0]
    assert len(chosen) == len(set(chosen.tolist())) == k, (selected, k)
    assert np.isfinite(exact[chosen]).all(), (chosen, exact)
    if k:
        kth = np.sort(exact)[::-1][k - 1]
        missed = set(np.flatnonzero(exact > kth + slack).tolist()) - set(chosen.tolist())
        assert not missed, (missed, chosen, exact, kth, slack)
        assert (exact[chosen] >= kth - slack).all(), (chosen, exact, kth, slack)


def assert_selections_up_to_ties(ours, theirs, exact, fp8, topk):
    """A call's rows: ours and theirs (HF's) (S, >= k) entries, -1 padding; exact (S, T) HF's
    float64 scores and fp8 (S, T) ours, -inf where not visible. Both selections must pass the
    rule (module doc). Returns how many rows select other entries than HF's."""
    finite = np.isfinite(exact)
    assert (np.isfinite(fp8) == finite).all(), "our scores see other entries than HF's"
    peak = np.abs(exact[finite]).max(initial=1.0)
    error = np.where(finite, np.abs(fp8 - np.where(finite, exact, 0)), 0).max(-1, initial=0)
    differing = 0
    for t in range(exact.shape[0]):
        k = min(topk, int(finite[t].sum()))
        assert_top_up_to_ties(ours[t], exact[t], k, 2 * error[t] + FLOAT32_SHARE * peak)
        assert_top_up_to_ties(theirs[t], exact[t], k, FLOAT32_SHARE * peak)
        differing += set(ours[t][ours[t] >= 0].tolist()) != set(theirs[t][theirs[t] >= 0].tolist())
    return differing
