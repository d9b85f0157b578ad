"""Every bug in tests/mutants still applies to the code as it is: a patch that no longer applies
is a mutant the suite is no longer shown to catch (tests/mutants/run.sh reports it, but is run by
hand)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "tests" / "mutants").glob("*.patch"))


@pytest.mark.skipif(shutil.which("patch") is None, reason="no patch(1)")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_the_mutant_still_applies(patch):
    run = subprocess.run(
        ["patch", "--dry-run", "-s", "-f", "-p1", "-i", str(patch)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_there_are_mutants():
    assert len(PATCHES) >= 10
