from collections import Counter

import pytest

from drpo_openrlhf.update.layout import (
    ONE_PASS,
    SCORES_PASS,
    UNTRAINED,
    Layout,
    LayoutError,
    assign_group_steps,
    deal_rollout,
    pack_group_microsteps,
    plan_dynamic_steps,
    plan_from_slots,
    plan_optimizer_steps,
)


def paper_layout(**overrides) -> Layout:
    """The released runs: 128 prompts x 8 responses, mini-batch 32 prompts, 8 GPUs."""
    values = dict(
        world_size=8,
        n_samples_per_prompt=8,
        rollout_batch_size=128,
        train_batch_size=256,
        micro_batch_size=4,
    )
    return Layout(**{**values, **overrides})


def test_paper_layout_is_accepted():
    layout = paper_layout()
    layout.check()
    assert layout.samples_per_step == 32 and layout.micro_steps == 8


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(n_samples_per_prompt=1), "n_samples_per_prompt >= 2"),
        (dict(train_batch_size=252), "multiple of n_samples_per_prompt \\(8\\)"),
        (dict(train_batch_size=384), "must divide the rollout's 1024 responses"),
        (dict(world_size=48), "multiple of the 48 actor ranks"),
        (dict(micro_batch_size=3), "must divide the 32 responses"),
    ],
)
def test_layouts_that_would_break_groups_are_rejected(overrides, message):
    with pytest.raises(LayoutError, match=message):
        paper_layout(**overrides).check()


def test_plan_keeps_groups_whole_per_step_and_orders_by_group():
    layout = Layout(1, 2, 3, 4, 2)  # 3 prompts x 2, steps of 4 responses, micro 2
    group_ids = [7, 7, 3, 3, 5, 5]
    with pytest.raises(LayoutError, match="do not fill whole optimizer steps of 4"):
        plan_optimizer_steps(group_ids, 2, layout)
    layout = Layout(1, 2, 4, 4, 2)
    plan = plan_optimizer_steps([7, 3, 7, 3, 5, 9, 5, 9], 2, layout)
    assert plan == [[[1, 3], [4, 6]], [[0, 2], [5, 7]]]


def test_plan_rejects_groups_split_across_ranks():
    with pytest.raises(LayoutError, match="prompt group 4 has 1 responses"):
        plan_optimizer_steps([3, 3, 4], 2, Layout(1, 2, 2, 4, 2))


def test_a_short_rollout_leaves_out_incomplete_groups_and_steps_only_when_allowed():
    layout = Layout(1, 2, 4, 4, 2)
    ids = [1, 1, 2, 2, 3, 3, 4]  # group 4 lost a response, group 3 would start a third step
    with pytest.raises(LayoutError, match="prompt group 4 has 1 responses"):
        plan_optimizer_steps(ids, 2, layout)
    assert plan_optimizer_steps(ids, 2, layout, allow_partial=True) == [[[0, 1], [2, 3]]]


def test_dynamic_steps_take_whole_groups_in_id_order_across_ranks():
    everyone = [9, 2, 5, 2, 7, 9, 5, 7]  # four groups of 2 spread over ranks
    assert assign_group_steps(everyone, 2, 2) == {2: 0, 5: 0, 7: 1, 9: 1}
    with pytest.raises(LayoutError, match="do not fill whole optimizer steps of 6"):
        assign_group_steps(everyone, 2, 3)
    assert assign_group_steps([*everyone, 11], 2, 2, allow_partial=True) == {2: 0, 5: 0, 7: 1, 9: 1}


def test_dynamic_layout_needs_only_whole_groups_per_step():
    paper_layout(world_size=64, micro_batch_size=3, dynamic_batching=True).check()
    with pytest.raises(LayoutError, match="multiple of n_samples_per_prompt"):
        paper_layout(train_batch_size=252, dynamic_batching=True).check()


def test_given_lengths_each_step_is_cut_longest_first():
    layout = Layout(1, 2, 4, 4, 2)
    ids = [1, 1, 2, 2, 3, 3, 4, 4]
    lengths = [5, 50, 7, 40, 9, 9, 30, 1]
    plan = plan_optimizer_steps(ids, 2, layout, lengths=lengths)
    assert plan == [[[1, 3], [2, 0]], [[6, 4], [5, 7]]]  # groups per step unchanged


def test_whole_group_micro_batches_are_sorted_by_longest_member():
    layout = Layout(1, 2, 6, 6, 2)
    ids = [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    lengths = [5, 50, 7, 60, 9, 9, 30, 1, 2, 3, 4, 80]
    plan = plan_optimizer_steps(ids, 2, layout, lengths=lengths, whole_groups_per_micro_batch=True)
    assert plan == [[[2, 3], [0, 1], [4, 5]], [[10, 11], [6, 7], [8, 9]]]
    assert layout.groups_fit_micro_batches


@pytest.mark.parametrize(
    "layout",
    [Layout(1, 4, 4, 8, 2), Layout(1, 4, 4, 8, 6), Layout(2, 4, 4, 8, 4, dynamic_batching=True)],
    ids=["smaller", "not-a-multiple", "dynamic"],
)
def test_micro_batches_that_cannot_hold_whole_groups_are_refused(layout):
    assert not layout.groups_fit_micro_batches
    with pytest.raises(LayoutError, match="cannot hold whole groups"):
        plan_optimizer_steps([0] * 4, 4, layout, whole_groups_per_micro_batch=True)


def test_group_microsteps_respect_every_ranks_budget():
    shares = {0: [10, 30], 1: [25, 5], 2: [20, 20], 3: [5, 6], 4: [12, 3]}
    steps = pack_group_microsteps(shares, 40)
    assert steps == [[0, 1], [2, 4, 3]]  # first fit, largest per-rank share first
    assert sorted(g for s in steps for g in s) == sorted(shares)
    for groups in steps:
        for rank in range(2):
            assert 0 < sum(shares[g][rank] for g in groups) <= 40


@pytest.mark.parametrize(
    "shares",
    [{0: [10, 41], 1: [3, 3]}, {0: [30, 0], 1: [30, 0], 2: [0, 5]}],
    ids=["over-budget", "empty-rank"],
)
def test_group_microsteps_impossible_layouts_give_none(shares):
    assert pack_group_microsteps(shares, 40) is None


@pytest.mark.parametrize(("world", "micro"), [(8, 4), (16, 2), (32, 1), (64, 4), (64, 1)])
def test_paper_batch_runs_in_one_pass_on_any_rank_count_dividing_it(world, micro):
    """256 responses per step on up to 64 ranks (groups split over ranks beyond 32): every
    global micro-step can hold whole groups."""
    layout = paper_layout(world_size=world, micro_batch_size=micro)
    layout.check()
    assert layout.groups_fit_micro_steps


def test_micro_steps_that_cannot_hold_a_group_still_train_whole_groups_per_step():
    layout = Layout(3, 4, 6, 12, 1)  # 3 rows per global micro-step, groups of 4
    layout.check()
    assert not layout.groups_fit_micro_steps


def whole_groups(positions: list[int], group_ids: list[int], n: int) -> bool:
    return set(Counter(group_ids[i] for i in positions).values()) == {n}


@pytest.mark.parametrize(
    ("world", "n", "prompts", "step", "micro"),
    [
        (8, 8, 8, 32, 4),  # the released layout, fewer prompts: W = n
        (2, 4, 8, 16, 1),  # W | n; 2 rows per micro-step cannot hold a group
        (2, 4, 8, 16, 2),  # W | n, one group per micro-step
        (8, 4, 4, 16, 1),  # n | W: a group spans 4 ranks
        (16, 8, 4, 32, 2),  # n | W, 4 groups per micro-step
        (3, 4, 6, 12, 2),  # neither; 6 rows per micro-step cannot hold whole groups
        (3, 4, 6, 12, 4),  # neither; 12 rows = 3 whole groups per micro-step
    ],
)
def test_dealt_rollout_keeps_groups_whole_per_step_and_per_micro_step_when_they_fit(
    world, n, prompts, step, micro
):
    layout = Layout(world, n, prompts, step, micro)
    layout.check()
    group_ids = [i // n for i in range(prompts * n)]
    dealt = deal_rollout(group_ids, layout)
    positions = [[i for i, _ in pairs] for pairs in dealt]
    assert sorted(i for p in positions for i in p) == list(range(prompts * n))
    plans = [plan_from_slots([s for _, s in pairs], layout) for pairs in dealt]
    for k in range(prompts * n // step):
        in_step = [positions[r][i] for r in range(world) for mb in plans[r][k] for i in mb]
        assert len(in_step) == step and whole_groups(in_step, group_ids, n)
        for j in range(layout.micro_steps):
            assert all(len(plan[k][j]) == micro for plan in plans)
            micro_step = [positions[r][i] for r in range(world) for i in plans[r][k][j]]
            assert whole_groups(micro_step, group_ids, n) == layout.groups_fit_micro_steps
    if world == n:  # the released code's layout: rank r holds response r of every prompt
        assert all(i % n == r for r in range(world) for i in positions[r])


def test_a_short_rollout_deals_its_whole_steps_and_leaves_the_rest_untrained():
    layout = Layout(2, 2, 4, 4, 1)
    ids = [0, 0, 1, 1, 2, 2, 3]  # group 3 lost a response: one whole step of groups 0-1
    with pytest.raises(LayoutError, match="prompt group 3 has 1 responses"):
        deal_rollout(ids, layout)
    dealt = deal_rollout(ids, layout, allow_partial=True)
    assert dealt == [
        [(0, 0), (2, 1), (4, UNTRAINED), (6, UNTRAINED)],
        [(1, 0), (3, 1), (5, UNTRAINED)],
    ]
    assert plan_from_slots([s for _, s in dealt[1]], layout) == [[[0], [1]]]


def test_slots_that_do_not_fill_the_micro_batches_are_refused():
    layout = Layout(1, 2, 2, 4, 2)
    with pytest.raises(LayoutError, match="do not fill micro-batches of 2"):
        plan_from_slots([0, 0, 1], layout)
    with pytest.raises(LayoutError, match="do not fill micro-batches of 2"):
        plan_from_slots([0, 0, 1, 1, 2, 2], layout)  # half an optimizer step


def test_given_lengths_each_ranks_share_of_a_step_is_cut_longest_first():
    layout = Layout(2, 2, 4, 8, 2)  # one step of 4 groups; 4 responses per rank, micro 2
    ids = [0, 0, 1, 1, 2, 2, 3, 3]
    lengths = [5, 50, 7, 40, 9, 9, 30, 1]
    plain = deal_rollout(ids, layout)
    dealt = deal_rollout(ids, layout, lengths=lengths)
    # each rank keeps its responses (the round-robin), only their micro-batches change
    assert [sorted(i for i, _ in pairs) for pairs in dealt] == [
        sorted(i for i, _ in pairs) for pairs in plain
    ]
    assert dealt == [[(6, 0), (4, 0), (2, 1), (0, 1)], [(1, 0), (3, 0), (5, 1), (7, 1)]]
    assert plan_from_slots([s for _, s in dealt[0]], layout) == [[[0, 1], [2, 3]]]


def _first_fit_count(tokens: list[int], budget: int) -> int:
    """Micro-batches first fit needs (what OpenRLHF's ``get_minimum_num_micro_batch_size``
    computes), for the dynamic planner's tests."""
    loads: list[int] = []
    for t in tokens:
        for j, load in enumerate(loads):
            if load + t <= budget:
                loads[j] += t
                break
        else:
            loads.append(t)
    return len(loads)


def _round_robin(tokens: list[int], count: int) -> list[list[int]]:
    return [list(range(j, len(tokens), count)) for j in range(count)]


def _dynamic(everyone, rank, layout, *, max_tokens, microstep=False, partial=False):
    return plan_dynamic_steps(
        everyone,
        rank,
        layout,
        max_tokens=max_tokens,
        pack_microsteps=microstep,
        allow_partial=partial,
        micro_batches_needed=_first_fit_count,
        balanced_parts=_round_robin,
    )


# two ranks, groups of 2, 2 groups per optimizer step: OpenRLHF's dynamic batching spreads a
# group's responses over the ranks
DYNAMIC = Layout(
    world_size=2, n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=4,
    micro_batch_size=1, dynamic_batching=True,
)  # fmt: skip
EVERYONE = [
    [(0, 30), (1, 10), (2, 20), (3, 5)],  # rank 0: (group, tokens) per response
    [(0, 20), (1, 25), (3, 30), (2, 6)],
]


def test_dynamic_plan_packs_whole_groups_into_one_pass_micro_steps_where_they_fit():
    plans = [_dynamic(EVERYONE, r, DYNAMIC, max_tokens=40, microstep=True) for r in range(2)]
    assert [modes for _, modes in plans] == [[ONE_PASS, ONE_PASS]] * 2
    # every global micro-step (micro-batch j of both ranks) holds whole groups in budget
    for k in range(2):
        assert len(plans[0][0][k]) == len(plans[1][0][k])
        for j in range(len(plans[0][0][k])):
            held = [EVERYONE[r][i] for r in range(2) for i in plans[r][0][k][j]]
            assert all(n == 2 for n in Counter(g for g, _ in held).values()), held
            for r in range(2):
                assert sum(EVERYONE[r][i][1] for i in plans[r][0][k][j]) <= 40
    # steps take groups in id order: 0 and 1, then 2 and 3
    assert sorted(EVERYONE[0][i][0] for mb in plans[0][0][0] for i in mb) == [0, 1]
    assert sorted(EVERYONE[0][i][0] for mb in plans[0][0][1] for i in mb) == [2, 3]


def test_dynamic_plan_gives_every_rank_the_busiest_ranks_micro_batch_count():
    """Under the mini-batch KL each rank cuts its share of a step into as many micro-batches
    as the rank that needs most: step 0's rank 1 holds 20 + 25 tokens under a budget of 40
    (two), though rank 0's 30 + 10 fit in one; step 1 fits in one on both."""
    plans = [_dynamic(EVERYONE, r, DYNAMIC, max_tokens=40) for r in range(2)]
    for plan, modes in plans:
        assert modes == [SCORES_PASS, SCORES_PASS]
        assert [len(step) for step in plan] == [2, 1]
    assert plans[0][0][0] == [[0], [1]]
    assert sorted(i for step in plans[1][0] for mb in step for i in mb) == [0, 1, 2, 3]


def test_a_group_over_the_budget_falls_back_to_the_scores_pass():
    """Under the per-micro-step KL, a group no micro-step can hold (rank 1's 45 tokens of
    group 1 over a budget of 40) cannot run in one pass: the step runs a scores pass."""
    everyone = [[(0, 10), (1, 10)], [(0, 10), (1, 45)]]
    layout = Layout(
        world_size=2, n_samples_per_prompt=2, rollout_batch_size=2, train_batch_size=4,
        micro_batch_size=1, dynamic_batching=True,
    )  # fmt: skip
    plan, modes = _dynamic(everyone, 0, layout, max_tokens=40, microstep=True)
    assert modes == [SCORES_PASS] and [len(step) for step in plan] == [2]


def test_a_dynamic_step_a_rank_cannot_fill_raises_on_every_rank():
    """Rank 1 holds one response of step 0 but rank 0 needs two micro-batches for its three:
    both ranks raise (neither goes on to a forward the other never runs)."""
    layout = Layout(
        world_size=2, n_samples_per_prompt=4, rollout_batch_size=1, train_batch_size=4,
        micro_batch_size=1, dynamic_batching=True,
    )  # fmt: skip
    everyone = [[(0, 30), (0, 30), (0, 30)], [(0, 5)]]
    for rank in range(2):
        with pytest.raises(LayoutError, match=r"rank\(s\) \[1\] fewer responses than the 2"):
            _dynamic(everyone, rank, layout, max_tokens=64)


def test_a_short_dynamic_rollout_plans_only_its_whole_steps():
    everyone = [[(0, 3), (1, 3), (2, 3)], [(0, 3), (1, 3)]]  # group 2 lost a response
    layout = Layout(
        world_size=2, n_samples_per_prompt=2, rollout_batch_size=4, train_batch_size=4,
        micro_batch_size=1, dynamic_batching=True,
    )  # fmt: skip
    with pytest.raises(LayoutError):
        _dynamic(everyone, 0, layout, max_tokens=64)
    plan, modes = _dynamic(everyone, 0, layout, max_tokens=64, partial=True)
    assert modes == [SCORES_PASS] and sorted(i for mb in plan[0] for i in mb) == [0, 1]
