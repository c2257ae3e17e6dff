"""DRPO's update under DeepSpeed tensor parallelism (AutoTP, ``--ds.tensor_parallel_size 2``)
equals the one-piece single-process reference: same weights after the rollout's optimizer
steps and the same logged loss, the layers really split over the TP ranks. One TP group
(TP=2) and two (TP=2 x DP=2, groups dealt over the data-parallel ranks); scores pass, one
pass and penalty pass; padded and packed; dynamic batching; ZeRO-0 and 2, and ZeRO-3 on one
data-parallel rank. Log-probs unchunked
(``--drpo.logprob_chunk_tokens 0``, which tensor parallelism requires).

Substitution: OpenRLHF hands AutoTP ``dtype=torch.bfloat16`` whatever the run's dtype; the
model is kept in fp32 here (``drpo_openrlhf.testing.fp32_tensor_parallel``) so that the
comparison is exact."""

import pytest
from drpo_actor_harness import Case, assert_matches_reference, result, shared_results, tiny_model

CASES = {
    2: [  # one tensor-parallel group: TP=2, DP=1
        Case(2, 2, tp=2),  # scores pass
        Case(3, 4, tp=2),  # penalty pass; ZeRO-3 over one data-parallel rank
        Case(0, 4, packing=True, kl_estimate="microstep", tp=2),  # one pass
        Case(2, 1, packing=True, dynamic=True, tp=2),
    ],
    4: [  # two tensor-parallel groups: TP=2 x DP=2
        Case(2, 2, kl_estimate="microstep", tp=2),  # one pass, groups over both
        Case(2, 1, packing=True, tp=2),  # scores pass
    ],
}
PARAMS = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.fixture(scope="module")
def drpo_results(request, tmp_path_factory):
    """Shared with the other exactness modules: one spawn per world size for all of them."""
    return shared_results(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), PARAMS, ids=str)
def test_tensor_parallel_drpo_update_matches_one_piece_reference(drpo_results, world, case):
    shared = case.ring * case.tp
    assert_matches_reference(result(drpo_results, world, case), case, world // shared)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), PARAMS, ids=str)
def test_tensor_parallel_ranks_hold_a_share_of_the_layers(drpo_results, world, case):
    full = sum(p.numel() for p in tiny_model().parameters())
    assert result(drpo_results, world, case)["local_numel"] < 0.75 * full
