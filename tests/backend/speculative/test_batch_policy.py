"""The batch's speculation policy without a model: the pass-cost curve it reads and the γ a batched stream runs."""

from specchat.backend.api import PolicyState
from specchat.backend.speculative.batch_policy import BatchPolicy, Offer, PassCost, allocate


def test_one_slow_pass_does_not_make_fewer_rows_dearer_than_more():
    cost = PassCost()
    for _ in range(9):
        for rows, seconds in ((4, 0.030), (8, 0.048), (9, 0.050), (12, 0.058), (16, 0.067)):
            cost.observe(rows, seconds)
    cost.observe(1, 0.170)  # calibration passes while another program held the cores
    cost.observe(2, 0.092)
    cost.observe(8, 0.190)  # one slow pass at 8 rows: the median holds
    curve = cost.monotone()
    assert list(curve.values()) == sorted(curve.values())  # never cheaper with more rows
    assert cost.time(1) <= cost.time(4) <= cost.time(8) <= cost.time(9)
    assert abs(cost.time(8) - 0.048) < 0.001  # nine samples a row count outweigh the stale pair pooled with them
    # With the curve measured, drafts that nearly always land are worth a row in a pass of eight:
    good = Offer([1.0, 1.9, 2.7, 3.4], draft_s=0.0)
    assert all(g > 0 for g in allocate([good] * 2 + [Offer([1.0, 1.1], 0.0)] * 6, 8, cost)[:2])


def test_the_noisy_curve_before_the_fix_would_have_refused_them():
    """The raw medians of the test above, non-monotone: T(4) below T(2). allocate reads the monotone curve, so the
    first two rows do not look dearer than four (a stale calibration pair is pooled with what follows)."""
    cost = PassCost()
    cost.observe(2, 0.092)
    for _ in range(9):
        cost.observe(4, 0.030)
    assert cost.curve()[2] > cost.curve()[4]
    assert cost.monotone()[2] <= cost.monotone()[4]
    assert cost.time(3) <= cost.time(4)


def test_a_batched_stream_runs_the_allocations_gamma():
    policy = BatchPolicy(max_gamma=8)
    cost = PassCost()
    for rows in (1, 2, 4, 8):
        cost.observe(rows, 1.0 + 0.05 * rows)  # memory-bound passes: a lone stream's drafts pay
    policy.learn_costs(cost)
    for _ in range(12):  # a stream whose drafts land: its own choice is some γ > 0
        policy.observe(gamma=2, proposed=2, accepted=2, draft_s=0.0, verify_s=0.0)
    policy.cap = 5
    assert policy.choose() == 5  # the batch's choice, not the lone-stream S(γ) bounded by it
    policy.cap = 0
    assert policy.choose() == 0
    policy.cap = None
    assert policy.choose() > 0  # alone again: its own choice


def test_a_paused_stream_in_a_batch_drafts_nothing_but_still_comes_back_to_probe():
    policy = BatchPolicy(max_gamma=8)
    for _ in range(policy.warmup_steps + 1):
        policy.observe(gamma=3, proposed=3, accepted=0, draft_s=0.0, verify_s=0.0)
    assert policy.state is PolicyState.PAUSED
    policy.cap = 0
    offered = policy.offer(8, 1.0)
    assert len(offered.expected) == 1  # paused: offers no drafts
    states = []
    for _ in range(policy.probe_after + 2):
        states.append(policy.choose())
        policy.observe(gamma=0, proposed=0, accepted=0, draft_s=0.0, verify_s=0.0)
    assert set(states) == {0}
    assert policy.state is PolicyState.SPECULATING  # its probe started: the next allocation may give it drafts
