"""A request's acceptance record (KState) on synthetic rounds."""

import itertools

from engine.records.kstate import KState


def test_kstate_estimates_alpha_and_forgets():
    st = KState()
    for _ in range(50):
        st.update(4, 4, 4, decay=0.9)  # all accepted
    assert st.alpha > 0.95 and st.match > 0.9
    for _ in range(50):
        st.update(4, 4, 0, decay=0.9)  # first token rejected: ~3 rounds of memory at K = 4
    assert st.alpha < 0.15
    for _ in range(50):
        st.update(1, 1, 0, decay=0.9)  # ~10 rounds of memory at K = 1
    assert st.alpha < 0.05
    before = st.alpha
    st.update(0, 0, 0, decay=0.9)  # K = 0: nothing observed; the evidence ages a little
    assert before < st.alpha < 0.1
    for _ in range(50):
        st.update(4, 0, 0, decay=0.9)  # asked, nothing drafted (n-gram without a match)
    assert st.match < 0.1 and st.alpha < 0.1


def test_rounds_at_k_zero_age_the_evidence_towards_the_prior():
    """A row that stopped drafting because its estimate dipped keeps that estimate no longer than
    its evidence lasts: each round at K = 0 ages it by IDLE_DECAY, so the estimate returns
    towards the prior (0.5) and the controller drafts again (the row's gain is measured again
    instead of frozen at its worst moment)."""
    st = KState()
    for _ in range(30):
        st.update(1, 1, 0, decay=0.95)
    low = st.alpha
    ages = []
    for _ in range(40):
        st.update(0, 0, 0, decay=0.95)
        ages.append(st.alpha)
    assert low < ages[0] and all(a < b for a, b in itertools.pairwise(ages))
    assert abs(ages[-1] - 0.5) < 0.05
    assert st.match > 0.9  # the match rate is not aged
