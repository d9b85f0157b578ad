"""The suite's one distribution test: sampled output against the exact distribution of the
(processed) target, with one enumerator, one runner and one pass rule.

Enumerator (:func:`exact_joint`): P(output | prompt) of every output of at most ``n_tokens``
tokens, level by level (one batched forward of transformers' own model per level), with
temperature / top-k / top-p as engine/sampling/probs.py applies them and an optional ``process``
(penalties, a grammar mask) before them; an output ends early at a ``stop`` token.

Pass rule (:func:`fit`): the output tree, node by node. At every prefix h the draws reached at
least ``MIN_AT_PREFIX`` times, the next tokens drawn there are compared with the target's exact
conditional distribution at h (Pearson's chi-square, cells expected under 5 draws pooled); the
statistics and degrees of freedom of all those prefixes add up to one chi-square test at
significance ``ALPHA``. Given how often each prefix was reached, the next tokens drawn at
different prefixes are independent, so the sum is chi-square under the null; and unlike one test
over whole outputs (thousands of cells, most pooled) each conditional keeps its power: a verify
at a temperature 10% off, or a drafter that samples from one q and reports another, moves the
conditionals after the first token, which is where speculation acts. An output the target cannot
produce fails outright. The power against named wrong engines is not assumed: the tests run
them (tests/engine/test_engine_distribution.py) and must reject every one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from engine.sampling.probs import logits_to_probs

ALPHA = 1e-3  # significance of the test: a right engine fails one run in a thousand
MIN_AT_PREFIX = 20  # draws a prefix needs before its next-token counts are tested

# (raw next-token logits [vocab] float32, the output so far) -> processed logits [vocab]
Process = Callable[[torch.Tensor, list[int]], torch.Tensor]


def target_probs(model, ids: list[int], temperature: float, top_k: int = 0, top_p: float = 1.0):
    """The target's processed next-token distribution after ``ids`` (transformers' own forward,
    then temperature / top-k / top-p as engine/sampling/probs.py applies them): [vocab] float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=model.device)).logits[:, -1:].float().cpu()
    probs = logits_to_probs(
        logits,
        torch.tensor([temperature or 1.0]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
    )
    return probs[0, 0].double()


def exact_joint(
    model,
    prompt: list[int],
    n_tokens: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    stop: Iterable[int] = (),
    process: Process | None = None,
) -> dict[tuple[int, ...], float]:
    """P(output | prompt) of every output of at most ``n_tokens`` tokens (module doc)."""
    stop = set(stop)
    joint: dict[tuple[int, ...], float] = {}
    level: list[tuple[list[int], float]] = [([], 1.0)]  # open prefixes and their probability
    for _ in range(n_tokens):
        if not level:
            break
        ids = torch.tensor([prompt + pre for pre, _ in level], device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[:, -1].float().cpu()  # [prefixes, vocab]
        if process is not None:
            logits = torch.stack([process(row, pre) for row, (pre, _) in zip(logits, level)])
        n = len(level)
        probs = logits_to_probs(
            logits[:, None],
            torch.full((n,), temperature or 1.0),
            torch.full((n,), top_k, dtype=torch.long),
            torch.full((n,), top_p),
        )[:, 0].double()
        nxt = []
        for (pre, pr), row in zip(level, probs):
            for t in torch.nonzero(row > 0).flatten().tolist():
                out, p = pre + [t], pr * float(row[t])
                if t in stop:
                    joint[tuple(out)] = joint.get(tuple(out), 0.0) + p
                else:
                    nxt.append((out, p))
        level = nxt
    for pre, pr in level:
        joint[tuple(pre)] = joint.get(tuple(pre), 0.0) + pr
    return joint


# -- the pass rule -------------------------------------------------------------------------------
def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square with ``df`` degrees of freedom."""
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0).double(), torch.tensor(stat / 2.0)))


def chi_square_gof(
    counts: dict, probs: dict, min_expected: float = 5.0
) -> tuple[float, float, int]:
    """Pearson's chi-square test of observed ``counts`` against exact cell probabilities
    ``probs`` (outcomes absent from ``probs`` have probability 0: any such count fails the test).
    Cells expected to hold fewer than ``min_expected`` draws are pooled into one (and that pool,
    if still under ``min_expected``, into the smallest kept cell), so the chi-square
    approximation holds. Returns (statistic, p-value, degrees of freedom)."""
    n = sum(counts.values())
    if any(c and probs.get(o, 0.0) <= 0.0 for o, c in counts.items()):
        return math.inf, 0.0, 0
    cells = sorted(probs, key=lambda o: -probs[o])
    kept = [o for o in cells if probs[o] * n >= min_expected]
    rare = [o for o in cells if probs[o] * n < min_expected]
    obs = [counts.get(o, 0) for o in kept]
    exp = [probs[o] * n for o in kept]
    if rare:
        pool_obs, pool_exp = sum(counts.get(o, 0) for o in rare), sum(probs[o] * n for o in rare)
        if pool_exp >= min_expected or not kept:
            obs.append(pool_obs)
            exp.append(pool_exp)
        else:
            obs[-1] += pool_obs
            exp[-1] += pool_exp
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    df = len(obs) - 1
    return stat, chi2_sf(stat, df), df


@dataclass
class Fit:
    stat: float
    df: int
    p: float
    prefixes: int  # prefixes whose next tokens were tested
    impossible: int  # draws the target cannot produce

    def __str__(self) -> str:
        return (
            f"chi2 = {self.stat:.1f}, df = {self.df}, p = {self.p:.3g} "
            f"({self.prefixes} prefixes, {self.impossible} impossible)"
        )


def fit(outputs: Iterable[Iterable[int]], joint: dict[tuple[int, ...], float]) -> Fit:
    """The pass rule (module doc) of ``outputs`` against ``joint``."""
    counts: dict[tuple[int, ...], int] = {}
    for o in outputs:
        counts[tuple(o)] = counts.get(tuple(o), 0) + 1
    impossible = sum(c for o, c in counts.items() if joint.get(o, 0.0) <= 0.0)
    # next-token mass and counts below each prefix: {prefix: {token: mass or count}}
    mass: dict[tuple[int, ...], dict[int, float]] = {}
    for o, pr in joint.items():
        for d in range(len(o)):
            below = mass.setdefault(o[:d], {})
            below[o[d]] = below.get(o[d], 0.0) + pr
    seen: dict[tuple[int, ...], dict[int, int]] = {}
    for o, c in counts.items():
        for d in range(len(o)):
            below_n = seen.setdefault(o[:d], {})
            below_n[o[d]] = below_n.get(o[d], 0) + c
    stat, df, tested = 0.0, 0, 0
    for h, drawn in seen.items():
        if sum(drawn.values()) < MIN_AT_PREFIX or h not in mass:
            continue
        total = sum(mass[h].values())
        s, _, d = chi_square_gof(drawn, {t: m / total for t, m in mass[h].items()})
        stat, df, tested = stat + s, df + d, tested + 1
    p = 0.0 if impossible or math.isinf(stat) else chi2_sf(stat, df)
    return Fit(stat, df, p, tested, impossible)


def assert_fits(outputs, joint, label: str, min_df: int = 20) -> Fit:
    """The right engine passes: no impossible output, enough cells to mean something, p >= ALPHA."""
    f = fit(outputs, joint)
    print(f"{label}: {f}")
    assert f.impossible == 0, f"{label}: an impossible output was emitted ({f})"
    assert f.df >= min_df, f"{label}: too few cells for the test to mean much ({f})"
    assert f.p >= ALPHA, f"{label}: {f}"
    return f


def assert_rejects(outputs, joint, label: str) -> Fit:
    """A wrong engine fails the same rule."""
    f = fit(outputs, joint)
    print(f"{label} (wrong): {f}")
    assert f.p < ALPHA, f"the test did not see a wrong engine ({label}): {f}"
    return f
