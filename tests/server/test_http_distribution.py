"""Sampled requests (T > 0) that speculate over HTTP, against plain decoding in distribution.

A seeded sampled request runs at K = 0 unless it sends ``speculation.k``
(engine/kcontrol/controller.py ``pinned_k``), so every sampled request below sends one (the
speculative arm) or turns speculation off (the plain arm). Many short requests (a few tokens, a
small top-k: a small output space), a distinct seed per choice, both arms interleaved and in flight
together so that the engine batches them; each choice's output is its tokens (``logprobs``), then an
end mark where it stopped. Then:

  * the two arms are one distribution, by two chi-square homogeneity tests at ``ALPHA``: over
    whole outputs (a 2 x C table, rare outputs pooled), and node by node over the output tree
    (at every prefix both arms reached often enough, the next tokens drawn in each arm; the
    statistics and degrees of freedom summed over prefixes: the pass rule of
    tests/distribution.py with the second arm in place of the exact distribution, which keeps
    the power of the conditionals after the first token, where speculation acts);
  * on the fp32 server the target's exact distribution is known (transformers' forward,
    ``tests.distribution.exact_joint``): each arm fits it by that module's own rule;
  * speculation ran in the speculative arm and the drafter was wrong sometimes
    (0 < accepted < drafted), so the rejection rule's residual path produced output too;
  * a seeded speculative request reproduces (same seed, same K: the same choices).

The default config's server drafts with the EAGLE-3 head (a chat turn) and with n-gram copies
(a text that repeats). The power is measured, not assumed: see ``HEAD`` / ``COPY``."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from tests.conftest import MODEL
from tests.distribution import ALPHA, MIN_AT_PREFIX, assert_fits, chi2_sf, exact_joint
from tests.helpers import assert_speculated

pytestmark = pytest.mark.real_model

SPEC, PLAIN = {"k": 3}, {"enabled": False}
SAMPLING = {"temperature": 1.0, "top_k": 4}
END = "<end>"  # an output that stopped (EOS) ends with this mark


def _cells(a: dict, b: dict, min_expected: float) -> list[tuple[int, int]]:
    """The 2 x C table of outcome counts ``a`` and ``b``: outcomes expected under
    ``min_expected`` in the smaller sample pooled into one cell (and that pool, if still under
    it, into the smallest kept cell)."""
    na, nb = sum(a.values()), sum(b.values())
    share = min(na, nb) / (na + nb)  # the smaller sample's expected count = a cell's total x it
    totals = {o: a.get(o, 0) + b.get(o, 0) for o in set(a) | set(b)}
    kept = sorted((o for o in totals if totals[o] * share >= min_expected), key=totals.__getitem__)
    rare = [o for o in totals if totals[o] * share < min_expected]
    cells = [(a.get(o, 0), b.get(o, 0)) for o in kept[::-1]]
    if rare:
        pool = (sum(a.get(o, 0) for o in rare), sum(b.get(o, 0) for o in rare))
        if sum(pool) * share >= min_expected or not cells:
            cells.append(pool)
        else:
            last = cells.pop()
            cells.append((last[0] + pool[0], last[1] + pool[1]))
    return cells


def homogeneity(a: dict, b: dict, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's chi-square statistic and degrees of freedom of the homogeneity of two samples'
    outcome counts ``a`` and ``b`` (rare outcomes pooled: :func:`_cells`)."""
    cells = _cells(a, b, min_expected)
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for ca, cb in cells:
        for observed, row in ((ca, na), (cb, nb)):
            expected = row * (ca + cb) / (na + nb)
            stat += (observed - expected) ** 2 / expected
    return stat, len(cells) - 1


def whole_outputs(a: list[tuple], b: list[tuple]) -> tuple[float, int, float]:
    """The homogeneity test over whole outputs: (statistic, df, p)."""
    stat, df = homogeneity(counts(a), counts(b))
    return stat, df, chi2_sf(stat, df)


def output_tree(a: list[tuple], b: list[tuple]) -> tuple[float, int, float, int]:
    """The homogeneity test node by node: at every prefix each sample reached at least
    ``MIN_AT_PREFIX / 2`` times, the next tokens of the two samples; statistics and degrees of
    freedom summed over those prefixes. Returns (statistic, df, p, prefixes tested)."""
    below: list[dict] = [{}, {}]  # per sample: {prefix: {next token: count}}
    for side, outputs in zip(below, (a, b)):
        for o in outputs:
            for d in range(len(o)):
                nxt = side.setdefault(o[:d], {})
                nxt[o[d]] = nxt.get(o[d], 0) + 1
    stat, df, tested = 0.0, 0, 0
    for h, na in below[0].items():
        nb = below[1].get(h, {})
        if min(sum(na.values()), sum(nb.values())) < MIN_AT_PREFIX / 2:
            continue
        s, d = homogeneity(na, nb)
        stat, df, tested = stat + s, df + d, tested + (d > 0)
    return stat, df, chi2_sf(stat, df), tested


def counts(outputs: list) -> dict:
    hist: dict = {}
    for o in outputs:
        hist[o] = hist.get(o, 0) + 1
    return hist


def test_homogeneity_tests_tell_apart_what_differs():
    same = whole_outputs(
        [("x",)] * 60 + [("y",)] * 30 + [("z",)] * 10, [("x",)] * 58 + [("y",)] * 33 + [("z",)] * 9
    )
    assert same[2] > 0.5 and same[1] == 2
    differ = whole_outputs(
        [("x",)] * 60 + [("y",)] * 30 + [("z",)] * 10, [("x",)] * 30 + [("y",)] * 60 + [("z",)] * 10
    )
    assert differ[2] < 1e-4
    # outcomes seen a few times only are pooled: one cell of 2 + 3 never makes its own df
    pooled = whole_outputs(
        [("x",)] * 50 + [("y",)] * 48 + [("r",)] * 2, [("x",)] * 49 + [("y",)] * 48 + [("s",)] * 3
    )
    assert pooled[1] == 1 and pooled[2] > 0.5
    # the tree: the first token alike (a node with no difference: df 1, statistic 0), the
    # second token differs after "x"
    a = [("x", "1")] * 40 + [("x", "2")] * 40 + [("y", "1")] * 20
    b = [("x", "1")] * 65 + [("x", "2")] * 15 + [("y", "1")] * 20
    _, df, p, tested = output_tree(a, b)
    assert tested == 2 and df == 2 and p < ALPHA
    assert output_tree(a, a)[2] == 1.0


def run_arms(server, prompt: str, max_tokens: int, requests: int, n: int, slots: int):
    """``requests`` requests of ``n`` choices per arm, interleaved, ``slots`` choices in flight
    at once (so the engine batches both arms together). Choice i of the request with seed s
    samples with seed s + i: every choice has a seed of its own. Returns {arm: ([output of every
    choice: its tokens, then END if it stopped], [(drafted, accepted) of every request])}."""
    base = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": n, "logprobs": 0}
    base |= SAMPLING
    jobs = [
        (arm, {**base, "seed": 1000 + n * (2 * j + (arm == "plain")), "speculation": spec})
        for j in range(requests)
        for arm, spec in (("spec", SPEC), ("plain", PLAIN))
    ]

    async def main():
        limit = asyncio.Semaphore(max(1, slots // n))
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as c:

            async def one(body):
                async with limit:
                    r = await c.post("/completions", json=body)
                    assert r.status_code == 200, r.text
                    return r.json()

            return await asyncio.gather(*(one(body) for _, body in jobs))

    out: dict = {"spec": ([], []), "plain": ([], [])}
    for (arm, _), r in zip(jobs, asyncio.run(main())):
        outputs, usage = out[arm]
        for c in sorted(r["choices"], key=lambda c: c["index"]):
            tokens = tuple(c["logprobs"]["tokens"])
            outputs.append(tokens + ((END,) if c["finish_reason"] == "stop" else ()))
        s = r["usage"]["speculation"]
        usage.append((s["drafted_tokens"], s["accepted_tokens"]))
    return out


def check_homogeneous(arms) -> None:
    spec, plain = arms["spec"][0], arms["plain"][0]
    stat, df, p = whole_outputs(spec, plain)
    assert df >= 2 and p >= ALPHA, (stat, df, p, counts(spec), counts(plain))
    stat, df, p, tested = output_tree(spec, plain)
    assert tested >= 2 and p >= ALPHA, (stat, df, p, tested)


def check_reproduces(server) -> None:
    """The same seeded speculative request (4 choices of 16 tokens) twice, alone: the same
    choices, and it drafted. (Sixteen sampled tokens: output that did not follow the seed would
    differ.)"""
    body = {"model": MODEL, "prompt": HEAD[0], "max_tokens": 16, "n": 4, **SAMPLING}
    body |= {"seed": 7, "speculation": SPEC}
    with httpx.Client(base_url=server.base_url, timeout=600) as c:
        runs = [c.post("/completions", json=body).json() for _ in range(2)]
    texts = [[x["text"] for x in sorted(r["choices"], key=lambda x: x["index"])] for r in runs]
    assert texts[0] == texts[1]
    assert len(set(texts[0])) == 4  # the choices sampled, each with a seed of its own
    assert runs[0]["usage"]["speculation"]["drafted_tokens"] > 0


# (prompt, max_tokens): a chat turn (the EAGLE-3 head drafts on the default server: about a
# quarter of its drafts accepted) and a text that repeats (n-gram copies, the fp32 server's only
# drafter: about three quarters accepted). Measured on the default server, 16 requests of 8
# choices an arm (whole outputs / tree): the exact rule p = 0.54 / 0.45 (head), 0.47 / 0.77
# (copies); a rule that keeps every draft 1e-20 / 4e-34 (head), 8e-5 / 3e-4 (copies); one that
# recovers a rejected copy from p instead of the residual 8e-5 / 1e-3 (copies). Not seen at this
# size: that residual error on the head's drafts (they mostly lie outside the target's top-k,
# where the residual is p) or an acceptance that ignores q (p >= 0.2): tests/engine's
# distribution tests draw many more samples in process.
HEAD = ("<|im_start|>user\nName a primary color.<|im_end|>\n<|im_start|>assistant\n", 4)
COPY = ("1 2 3 4 1 2 3 4 1 2 3 4 1 2", 4)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,max_tokens", [HEAD, COPY], ids=["head", "copy"])
def test_default_sampled_speculation_matches_plain_in_distribution(
    live_default, prompt, max_tokens
):
    arms = run_arms(live_default, prompt, max_tokens, requests=16, n=8, slots=16)
    assert_speculated(arms["spec"][1], can_reject=True)
    assert sum(d for d, _ in arms["plain"][1]) == 0
    check_homogeneous(arms)
    if prompt == HEAD[0]:
        check_reproduces(live_default)


@pytest.mark.slow
def test_fp32_sampled_speculation_matches_the_exact_target_distribution(live):
    """On the fp32 server the target's exact distribution is known (transformers' forward):
    both arms fit it (tests/distribution.py's rule), and fit each other."""
    prompt, max_tokens = COPY
    arms = run_arms(live, prompt, max_tokens, requests=12, n=8, slots=8)
    tok = live.tokenizer
    ids = tok(prompt)["input_ids"]
    stop = {tok.eos_token_id}
    joint = exact_joint(
        live.model, ids, max_tokens, SAMPLING["temperature"], SAMPLING["top_k"], stop=stop
    )
    by_tokens: dict = {}  # the outputs as the server shows them: each token decoded alone
    for out, pr in joint.items():  # (the EOS that stops one among its logprobs tokens)
        key = tuple(tok.decode([t]) for t in out) + ((END,) if out[-1] in stop else ())
        by_tokens[key] = by_tokens.get(key, 0.0) + pr
    assert math.isclose(sum(by_tokens.values()), 1.0, abs_tol=1e-6)
    assert_speculated(arms["spec"][1], can_reject=True)
    for arm in ("spec", "plain"):
        assert_fits(arms[arm][0], by_tokens, f"fp32 {arm}", min_df=3)
    check_homogeneous(arms)
    check_reproduces(live)
