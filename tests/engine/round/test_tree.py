"""The draft tree's acceptance rule (engine/round/tree.py) on synthetic distributions: greedy
walks the target's argmax; a chain is the chain rule (rejection.py) draw for draw; and sampled
trees (two candidates a node, two levels, drawn from q without replacement) generate text
distributed exactly as the target's -- the suite's distribution test (tests/distribution.py),
which rejects the same rule fed the deterministic top-2 candidates instead of a sample."""

import pytest
import torch

from engine.round.rejection import rejection_sample
from engine.round.tree import ancestors, depths, tree_accept
from tests.distribution import assert_fits, assert_rejects

V = 4  # vocabulary of the synthetic target and draft
M = 3  # tokens generated per draw
N = 20000  # draws
PARENTS = [-1, -1, 0, 0, 1, 1]  # two candidates at the root, two below each


def tables(seed: int, scale: float) -> torch.Tensor:
    """A next-token distribution for each context (the last two tokens): [V * V, V]."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(scale * torch.randn(V * V, V, generator=g, dtype=torch.float64), -1)


P_TABLE, Q_TABLE = tables(1, 1.5), tables(2, 1.0)  # the draft is a different, flatter model


def key(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * V + b


def exact_joint() -> dict[tuple[int, ...], float]:
    out = {}
    for n in range(V**M):
        toks = [(n // V**i) % V for i in range(M)]
        ctx, pr = [0, 1], 1.0
        for t in toks:
            pr *= float(P_TABLE[ctx[-2] * V + ctx[-1], t])
            ctx.append(t)
        out[tuple(toks)] = pr
    return out


def draw_tree(ctx: torch.Tensor, gen: torch.Generator, sample: bool):
    """Per row (context ``ctx`` [B, 2]): 2 root candidates, 2 below each, drawn from q without
    replacement (Gumbel top-2; ``sample=False``: q's top 2, the wrong way). Returns tokens
    [B, 6], target and draft probabilities [B, 7, V]."""
    b = ctx.shape[0]

    def top2(k: torch.Tensor) -> torch.Tensor:
        logq = Q_TABLE[k].log()
        if sample:
            u = torch.rand(b, V, generator=gen, dtype=torch.float64).clamp_min(1e-12)
            logq = logq - (-u.log()).log()  # + Gumbel noise
        return logq.topk(2, -1).indices

    root = key(ctx[:, 0], ctx[:, 1])
    first = top2(root)  # [B, 2]
    keys1 = [key(ctx[:, 1], first[:, j]) for j in range(2)]
    second = [top2(k) for k in keys1]  # [B, 2] each
    tokens = torch.stack([first[:, 0], first[:, 1], *second[0].T, *second[1].T], -1)
    node_keys = [root, *keys1] + [
        key(first[:, j], second[j][:, c]) for j in range(2) for c in range(2)
    ]
    k = torch.stack(node_keys, -1)  # [B, 7]
    return tokens, P_TABLE[k].float(), Q_TABLE[k].float()


def generate(sample: bool, seed: int = 0) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.tensor([[0, 1]]).repeat(N, 1)
    out = [[] for _ in range(N)]
    parents = torch.tensor(PARENTS).repeat(N, 1)
    while min(len(o) for o in out) < M:
        tokens, p, q = draw_tree(seqs[:, -2:], gen, sample)
        u = torch.rand(N, len(PARENTS), generator=gen)
        noise = torch.empty(N, V).exponential_(generator=gen)
        path, acc, nxt = tree_accept(
            p,
            tokens,
            parents,
            torch.ones(N, 6, dtype=torch.bool),
            q,
            torch.zeros(N, dtype=torch.bool),
            u,
            noise,
            depth=2,
            width=2,
        )
        emitted = []
        for b in range(N):
            row = [int(tokens[b, i]) for i in path[b, : acc[b]]] + [int(nxt[b])]
            out[b] += row
            emitted.append(row[-2:] if len(row) >= 2 else [int(seqs[b, -1]), row[0]])
        seqs = torch.tensor(emitted)
    return [tuple(o[:M]) for o in out]


@pytest.mark.slow
def test_sampled_trees_generate_the_targets_distribution():
    joint = exact_joint()
    assert_fits(generate(sample=True), joint, "trees of sampled candidates")
    assert_rejects(generate(sample=False), joint, "trees of q's top-2 candidates")


def test_greedy_walks_the_targets_argmax():
    """Root's argmax is node 1's token, node 1's argmax is node 5's, node 5 is a leaf: the path
    is 1, 5 and the next token node 5's argmax; a row whose root argmax is no child stops."""
    tokens = torch.tensor([[0, 1, 2, 3, 2, 3], [0, 1, 2, 3, 2, 3]])
    parents = torch.tensor([PARENTS, PARENTS])
    p = torch.zeros(2, 7, V)
    p[0, 0, 1] = p[0, 2, 3] = p[0, 6, 2] = 1.0  # root -> 1 (node 1) -> 3 (node 5) -> 2
    p[1, 0, 3] = 1.0  # root -> 3: not a candidate
    p[:, :, 0] += 0.1  # argmax elsewhere only where set
    path, acc, nxt = tree_accept(
        p, tokens, parents, torch.ones(2, 6, dtype=torch.bool), None,
        torch.ones(2, dtype=torch.bool), torch.zeros(2, 6), None, depth=2, width=2,
    )  # fmt: skip
    assert acc.tolist() == [2, 0] and path[0].tolist() == [1, 5] and nxt.tolist() == [2, 3]


def test_a_chain_is_the_chain_rule_draw_for_draw():
    """One candidate a node, K = 4 deep: the same acceptances and next token as
    rejection_sample's with the same uniforms and noise, greedy and sampled rows mixed."""
    g = torch.Generator().manual_seed(5)
    b, k, v = 64, 4, 6
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    q = torch.softmax(torch.randn(b, k + 1, v, generator=g), -1)
    tokens = torch.multinomial(q[:, :k].reshape(-1, v), 1, generator=g).view(b, k)
    nd = torch.randint(0, k + 1, (b,), generator=g)
    greedy = torch.rand(b, generator=g) < 0.3
    u = torch.rand(b, k, generator=g)
    noise = torch.empty(b, v).exponential_(generator=g)
    parents = torch.arange(-1, k - 1).repeat(b, 1)
    valid = torch.arange(k)[None, :] < nd[:, None]
    path, acc, nxt = tree_accept(p, tokens, parents, valid, q, greedy, u, noise, depth=k, width=1)
    want_acc, want_next = rejection_sample(p, tokens, nd, q[:, :k], greedy, u, noise)
    assert acc.tolist() == want_acc.tolist() and nxt.tolist() == want_next.tolist()
    assert 0 < int(acc.sum()) < int(nd.sum())  # accepted and rejected both
    for r in range(b):
        assert path[r, : acc[r]].tolist() == list(range(int(acc[r])))


def test_depths_and_ancestors():
    parents = torch.tensor([PARENTS])
    assert depths(parents).tolist() == [[1, 1, 2, 2, 2, 2]]
    anc = ancestors(parents)[0]
    assert anc[4].nonzero().flatten().tolist() == [1, 4]  # node 4 sees node 1 and itself
    assert anc[1].nonzero().flatten().tolist() == [1]
    assert not anc[2, 1] and anc[2, 0]


def random_trees(g: torch.Generator, b: int, n: int, v: int):
    """``b`` random trees of up to ``n`` nodes over ``v`` tokens (siblings may repeat a token),
    parents before children, padding (invalid) nodes anywhere after a row's own."""
    parents = torch.stack([torch.randint(-1, max(i, 0), (b,), generator=g) for i in range(n)], 1)
    parents[:, 0] = -1
    size = torch.randint(1, n + 1, (b,), generator=g)
    valid = torch.arange(n)[None, :] < size[:, None]
    tokens = torch.randint(0, v, (b, n), generator=g)
    return tokens, parents, valid


def test_the_greedy_walk_is_the_rule_walked_node_by_node():
    """The closed form (every row greedy) against the rule's own walk, one node and one
    candidate at a time (the loop sampled batches take, here with every row greedy): the same
    path, accepted count and next token on random trees where siblings may share a token (the
    first in id order is taken), over a tiny vocabulary so that deep paths are accepted."""
    g = torch.Generator().manual_seed(3)
    b, n, v = 512, 9, 3
    tokens, parents, valid = random_trees(g, b, n, v)
    p = torch.softmax(3 * torch.randn(b, n + 1, v, generator=g), -1)
    greedy = torch.ones(b, dtype=torch.bool)
    u, noise = torch.rand(b, n, generator=g), torch.ones(b, v)
    depth = int(depths(parents.masked_fill(~valid, -1)).max())
    want = tree_accept(p, tokens, parents, valid, None, greedy, u, noise, depth=depth, width=n)
    got = tree_accept(p, tokens, parents, valid, None, greedy, u, None, depth=depth, width=n)
    for w, x in zip(want, got):
        assert w.tolist() == x.tolist()
    assert int(want[1].max()) >= 3 and int((want[1] == 0).sum()) > 0  # deep and empty paths


def test_point_mass_trees_in_closed_form_are_the_rule_draw_for_draw():
    """Rows that try every candidate as a point mass (an expanded tree: drafters/eagle/expand.py)
    beside greedy rows: the closed form (``every_point``) takes the same paths, counts and next
    tokens as the rule's walk node by node with the same uniforms and noise, on random trees
    where siblings may repeat a token; accepted and rejected candidates both, deep paths, and
    rows that end by sampling the residual after rejecting every child."""
    g = torch.Generator().manual_seed(6)
    b, n, v = 1024, 9, 4
    tokens, parents, valid = random_trees(g, b, n, v)
    p = torch.softmax(2 * torch.randn(b, n + 1, v, generator=g), -1)
    q = torch.softmax(torch.randn(b, n + 1, v, generator=g), -1)  # (a point row's q is unread)
    greedy = torch.rand(b, generator=g) < 0.25
    point = ~greedy
    u = torch.rand(b, n, generator=g)
    noise = torch.empty(b, v).exponential_(generator=g)
    depth = int(depths(parents.masked_fill(~valid, -1)).max())
    args = (p, tokens, parents, valid, q, greedy, u, noise)
    kw = {"depth": depth, "width": n, "point": point}
    want = tree_accept(*args, **kw)  # the loop
    got = tree_accept(*args, **kw, every_point=True)
    for w, x in zip(want, got):
        assert w.tolist() == x.tolist()
    acc = want[1][point]
    assert int(acc.max()) >= 3 and int((acc == 0).sum()) > 50  # deep paths, all rejected


def test_a_walk_stopped_by_its_depth_samples_the_whole_distribution():
    """A point row whose path reaches the walk's ``depth`` never tries the last node's children:
    it emits from that node's whole p (the closed form as the loop: the children stay in p)."""
    tokens, parents = torch.tensor([[1, 0]]), torch.tensor([[-1, 0]])
    p = torch.tensor([[[0.0, 1.0], [0.9, 0.1], [0.5, 0.5]]])
    u, noise = torch.tensor([[0.5, 0.99]]), torch.ones(1, 2)
    greedy, point, valid = torch.tensor([False]), torch.tensor([True]), torch.ones(1, 2).bool()
    args = (p, tokens, parents, valid, None, greedy, u, noise)
    kw = {"depth": 1, "width": 1, "point": point}
    want, got = tree_accept(*args, **kw), tree_accept(*args, **kw, every_point=True)
    assert want[1].tolist() == got[1].tolist() == [1]  # node 0 taken, the walk stops there
    assert want[2].tolist() == got[2].tolist() == [0]  # argmax of p / noise: token 0 (0.9)


def test_ancestors_follow_every_line_up_to_the_root():
    g = torch.Generator().manual_seed(4)
    _, parents, _ = random_trees(g, 64, 17, 2)
    anc = ancestors(parents)
    for r in range(64):
        for i in range(17):
            line, j = {i}, int(parents[r, i])
            while j >= 0:
                line.add(j)
                j = int(parents[r, j])
            assert set(anc[r, i].nonzero().flatten().tolist()) == line
    assert depths(parents).tolist() == anc.sum(-1).tolist()
