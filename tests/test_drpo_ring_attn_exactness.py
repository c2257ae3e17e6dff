"""DRPO's update under OpenRLHF's ring attention (``--ds.ring_attn_size 2``: sequence
parallelism) equals the one-piece single-process reference: same weights after the rollout's
optimizer steps and the same logged loss, with the ranks of a ring group each forwarding half
of every packed micro-batch. One ring group (SP=2) and two (SP=2 x DP=2, groups dealt over
the data-parallel ranks); scores pass, one pass and penalty pass; ZeRO 2 and 3; chunked
log-probs; dynamic batching. OpenRLHF packs samples whenever ring attention is on, so every
case is packed.

Ring attention is OpenRLHF's (``ring_flash_attn``'s llama3 variant, installed by OpenRLHF's
strategy); only flash-attn's kernels are the plain-torch stand-in of ``tests/cpu_site``
(tested in ``test_ring_attn_stand_in.py``)."""

import pytest
from drpo_actor_harness import Case, assert_matches_reference, result, shared_results
from stand_ins import flash_attn_is_stand_in

if not flash_attn_is_stand_in():  # a GPU environment: its kernels need CUDA tensors
    pytest.skip("ring attention on gloo needs the flash-attn stand-in", allow_module_level=True)

CASES = {
    2: [  # one ring group: SP=2, DP=1
        Case(2, 2, packing=True, ring=2),  # scores pass
        Case(3, 4, packing=True, kl_estimate="microstep", ring=2),  # one pass
        Case(2, 4, packing=True, chunk=5, ring=2),  # penalty pass, chunked log-probs
        Case(2, 1, packing=True, dynamic=True, kl_estimate="microstep", ring=2),
    ],
    4: [  # two ring groups: SP=2 x DP=2
        Case(2, 2, packing=True, kl_estimate="microstep", ring=2),  # groups over both
        Case(3, 1, packing=True, chunk=3, ring=2),  # scores pass
        Case(2, 1, packing=True, dynamic=True, ring=2),
    ],
}
PARAMS = [(w, c) for w, cases in CASES.items() for c in cases]


@pytest.fixture(scope="module")
def drpo_results(request, tmp_path_factory):
    """Shared with the other exactness modules: one spawn per world size for all of them."""
    return shared_results(request, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), PARAMS, ids=str)
def test_ring_attn_drpo_update_matches_one_piece_reference(drpo_results, world, case):
    assert_matches_reference(result(drpo_results, world, case), case, world // case.ring)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "case"), PARAMS, ids=str)
def test_ring_attn_ranks_forward_their_slice_of_each_micro_batch(drpo_results, world, case):
    """The model of each ring rank sees half of the packed tokens (rounded up: OpenRLHF pads
    the packed row to a multiple of the ring size), on every forward."""
    slices = result(drpo_results, world, case)["slices"]
    assert slices
    assert all(local == -(-total // case.ring) for total, local in slices)
