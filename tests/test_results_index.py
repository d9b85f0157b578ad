"""loadtest/results/README.md is an index of findings: every results file and folder it lists is
there, and every one that is there is listed (with the command that reproduces it)."""

import re
from pathlib import Path

from tests.helpers import repo_files

RESULTS = Path(__file__).resolve().parents[1] / "loadtest" / "results"


def indexed() -> set[str]:
    """The files and folders the index's table names in its first column."""
    names: set[str] = set()
    for line in (RESULTS / "README.md").read_text().splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            names.update(n.rstrip("/") for n in re.findall(r"`([^`]+)`", first))
    return names


def kept() -> set[str]:
    """The results files and folders git keeps (a benchmark's ignored outputs, e.g. its JSON
    beside the .txt, are not findings)."""
    rel = [Path(f).relative_to("loadtest/results").parts[0] for f in repo_files(str(RESULTS))]
    return {name for name in rel if name != "README.md"}


def test_the_index_lists_what_is_there():
    listed = indexed()
    present = kept()
    assert len(listed) > 20  # the table was read
    assert listed - present == set(), "listed, not there"
    assert present - listed == set(), "there, not listed"
