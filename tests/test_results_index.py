"""loadtest/results/README.md is an index of findings: every results file and folder it lists is
there, and every one that is there is listed (with the command that reproduces it)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"


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
    run = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", str(RESULTS)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    rel = [Path(f).relative_to("loadtest/results").parts[0] for f in run.stdout.split()]
    return {name for name in rel if name != "README.md" and (RESULTS / name).exists()}


def test_the_index_lists_what_is_there():
    listed = indexed()
    present = kept()
    assert len(listed) > 20  # the table was read
    assert listed - present == set(), "listed, not there"
    assert present - listed == set(), "there, not listed"
