"""The adaptive controller's choice of draft-tree leaves (round/draft_tree.py) on synthetic
machines: leaves where the verify's extra queries are cheap beside what they add, none where
they are dear or where the batch is large; the leaf rate β learned from the rounds."""

import numpy as np

from engine.kcontrol.controller import AdaptiveK, FixedK
from engine.kcontrol.cost import RoundCost
from engine.records.kstate import LEAF_PRIOR, KState, leaf_reach
from engine.records.params import SamplingParams, SpecParams
from engine.records.sequence import RoundStats, Sequence

GREEDY = SamplingParams(temperature=0, max_tokens=10**6)


def seq(i=0, params=GREEDY):
    return Sequence(f"r{i}", [1, 2, 3], params, SpecParams())


def machine(per_token: float, buckets=(1, 4, 8)):
    """A verify of w + 1 tokens padded to a q bucket: 10 ms + ``per_token`` per padded token and
    row; no draft cost."""

    def padded(batch, q):
        return batch, next(b for b in buckets if b >= q)

    def true_cost(batch, width):
        return 0.010 + batch * per_token * padded(batch, width + 1)[1]

    cost = RoundCost(shape=padded)
    for batch in (1, 8):
        for w in (0, 3, 7):
            cost.add_calibration(batch, w, true_cost(batch, w))
    return cost, true_cost


def run(
    ctrl, true_cost, batch=1, rounds=80, alpha=0.45, beta=0.5, seed=0, row_step=0.0, tree_s=0.0
):
    """Rounds where a draft is accepted with chance α given the ones before, and a round whose
    chain was cut short ends at a leaf with chance β·leaf_reach(L); returns (K, L) per round.
    A draft step costs ``row_step`` a head row (a tree row's expansion adds
    ``ctrl.expand_rows`` rows to each step but its first); a round with trees ``tree_s`` more
    (their own host work: growing them, the tree rule)."""
    rng = np.random.default_rng(seed)
    seqs = [seq(i) for i in range(batch)]
    out = []
    for _ in range(rounds):
        ks = [ctrl.k_for(s, 7) for s in seqs]
        ls = [ctrl.leaves_for(s, k, 7 - k) for s, k in zip(seqs, ks)]
        width = max(k + n for k, n in zip(ks, ls))
        for s, k, n in zip(seqs, ks, ls):
            acc = 0
            while acc < k and rng.random() < alpha:
                acc += 1
            hit = int(n > 0 and acc < k and rng.random() < beta * leaf_reach(n))
            stats = RoundStats(k, k, acc + hit, acc + hit + 1, 0.0, 0.0, width)
            stats.leaves, stats.leaf_hit = n, hit
            ctrl.observe(s, k, stats, 7)
        extra = getattr(ctrl, "expand_rows", 0) * sum(k - 1 for k, n in zip(ks, ls) if n)
        draft_s = row_step * (max(ks) * batch + extra)
        tree = any(ls)
        rest = true_cost(batch, width) + tree_s * tree
        ctrl.end_round(batch, width, max(ks), rest, draft_s, 0, extra, tree)
        out.append((max(ks), max(ls)))
    return out


def test_leaves_fill_a_verify_shape_where_its_queries_are_cheap():
    """A verify of 8 queries costs little more than one of 4: the chain of 3 gets leaves up to
    the shape's 8 queries (K + L = 7); with leaves turned off, the same machine drafts chains."""
    cost, true_cost = machine(0.0002)
    rounds = run(AdaptiveK(7, cost=cost, max_leaves=4), true_cost)
    late = rounds[20:]
    assert np.mean([n > 0 for _, n in late]) > 0.8
    assert all(k + n <= 7 for k, n in late)
    cost, true_cost = machine(0.0002)
    assert all(n == 0 for _, n in run(AdaptiveK(7, cost=cost), true_cost))


def test_leaves_never_widen_the_verify_where_its_queries_are_dear_or_the_batch_is_large():
    """Each padded query costs 2 ms a row (a CPU's verify): leaves worth ~0.3 tokens a round
    (β = 0.2) never buy the 8-query shape at batch 1, nor where queries are cheap at batch 8;
    within the chain's own 4-query shape a leaf may take the third draft's place (at α = 0.45 it
    is worth more), so the verify is never wider than the chains' alone."""
    for per_token, batch in ((0.002, 1), (0.0002, 8)):
        cost, true_cost = machine(per_token)
        chains = run(AdaptiveK(7, cost=cost), true_cost, batch=batch, beta=0.2)
        cost, true_cost = machine(per_token)
        trees = run(AdaptiveK(7, cost=cost, max_leaves=4), true_cost, batch=batch, beta=0.2)
        assert max(k for k, _ in chains[10:]) <= 3
        assert all(k + n <= 3 for k, n in trees[10:]), trees
        assert any(n > 0 for _, n in trees[10:])


def test_leaf_rate_is_learned_from_cut_short_rounds():
    st = KState()
    assert st.leaf_rate == LEAF_PRIOR
    for _ in range(40):
        st.update_leaves(2, cut_short=True, hit=True, decay=0.95)
    high = st.leaf_rate
    assert high > 0.6  # every cut-short round ended at a leaf: β·reach(2) -> 1, β -> 1/1.5
    for _ in range(40):
        st.update_leaves(2, cut_short=False, hit=False, decay=0.95)  # nothing to learn
    assert st.leaf_rate == high
    for _ in range(60):
        st.update_leaves(2, cut_short=True, hit=False, decay=0.95)
    assert st.leaf_rate < 0.1


def test_rows_that_may_not_grow_a_tree_get_none():
    """A seeded or penalized row is verified as a chain (draft_tree.may_grow): the adaptive
    controller weighs its leaves at β = 0; a pinned K gets none from it either."""
    cost, true_cost = machine(0.0002)
    ctrl = AdaptiveK(7, cost=cost, max_leaves=4)
    run(ctrl, true_cost, rounds=30)
    free, pinned = seq(0), Sequence("p", [1, 2], GREEDY, SpecParams(k=3))
    assert ctrl.leaves_for(free, 3, 4) > 0 and ctrl.leaves_for(pinned, 3, 4) == 0
    assert ctrl.leaves_for(free, 0, 4) == 0  # no chain, no leaves
    assert FixedK(3, 2).leaves_for(pinned, 3, 1) == 1  # within the cap


def test_an_expansions_head_rows_are_priced():
    """Where a verify's queries are cheap, leaves pay; where each head row of a draft step costs
    more than the deeper nodes add, a tree that expands (its B - 1 extras fed at every step after
    the first: drafters/eagle/expand.py) does not, and the controller, fitting the draft
    phase's row-steps with the extras counted, grows trees only at K = 1 (the root's candidates:
    no step to expand); runners-up alone (no extra head rows) hang on deeper chains."""
    step = 0.001  # a head row of a draft step
    cost, true_cost = machine(0.0002)
    cost.add_step_calibration(1, step)
    leaves = run(AdaptiveK(7, cost=cost, max_leaves=4), true_cost, row_step=step)
    assert np.mean([n > 0 and k > 1 for k, n in leaves[20:]]) > 0.8, leaves
    cost, true_cost = machine(0.0002)
    cost.add_step_calibration(1, step)
    expanded = AdaptiveK(7, cost=cost, max_leaves=4, expand_rows=3)
    rounds = run(expanded, true_cost, row_step=step)
    assert all(k == 1 for k, n in rounds[20:] if n > 0), rounds


def test_a_tree_rounds_own_work_is_learned_and_priced():
    """Leaves that pay for their queries (the first test's machine) stop paying where a round
    with trees costs 6 ms more of its own (growing them, the tree rule, the paths laid out as
    chains: a CPU's few hundred small ops): the controller learns that from the tree rounds it
    tried and drafts chains after them; at 0.5 ms it keeps its trees. A tree round widens the
    verify at the same time, so the cost is told apart from the slope of its queries only by
    the rounds' own record of which had trees."""
    cost, true_cost = machine(0.0002)
    rounds = run(AdaptiveK(7, cost=cost, max_leaves=4), true_cost, tree_s=0.0005)
    assert np.mean([n > 0 for _, n in rounds[20:]]) > 0.8, rounds
    cost, true_cost = machine(0.0002)
    rounds = run(AdaptiveK(7, cost=cost, max_leaves=4), true_cost, tree_s=0.006)
    assert any(n > 0 for _, n in rounds[:20])  # tried
    assert all(n == 0 for _, n in rounds[20:]), rounds
    assert cost.predict(1, 3, 3, tree=True) - cost.predict(1, 3, 3) > 0.004  # learned
