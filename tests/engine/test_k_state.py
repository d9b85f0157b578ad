"""A request's acceptance record (KState) on synthetic rounds."""

from engine.k_state import KState


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
    st.update(0, 0, 0, decay=0.9)  # K = 0: nothing observed
    assert st.alpha < 0.05
    for _ in range(50):
        st.update(4, 0, 0, decay=0.9)  # asked, nothing drafted (n-gram without a match)
    assert st.match < 0.1 and st.alpha < 0.05
