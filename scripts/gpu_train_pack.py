"""Pack what a GPU fit of the EAGLE-3 head needs into calls of the device tool.

The lent GPU machine has no network and takes at most 64 MiB a call (the working tree with what a
call carries), so the target's weights (the served Q4_1 GGUF, ~97 MB: exact, the features the
head learns are the served model's) and the training rows travel in parts over consecutive calls:

  .gpu/train/call1 .. callN   each within the budget left beside the working tree; the last
                              holds manifest.json (the parts, in order, with the whole GGUF's
                              sha256) and is the one whose call runs scripts/gpu_train.sh
  .gpu/whl                    the wheels the machine lacks (gguf: transformers' GGUF loader)

Every call but the last stages its part (``STAGE=1 bash scripts/gpu_train.sh``: a copy into
/tmp/stage, kept while the machine stays warm, 30 s after a call); the last call joins the parts,
checks the sha256 and fits (docs/gpu.md, "Training the head"). Data, by the split rules
(prompts/sharegpt.py): training rows from the training buckets only (``python -m train original
--whole``), evaluation rows from the ``e`` bucket (``python -m train distill --split eval``).

  python scripts/gpu_train_pack.py [--rows .cache/distill/train-conversations.npz]
      [--eval .cache/distill/eval.jsonl] [--out .gpu/train]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool's limit on what one call sends


def travelling_bytes(root: Path, skip: tuple[str, ...]) -> int:
    """Bytes of the working tree that every call sends: tracked files and untracked ones git does
    not ignore, less the folders under ``skip`` (this script's own output, counted per call)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in out.decode().split("\0"):
        p = root / name
        if name and not name.startswith(skip) and p.is_file():
            total += p.stat().st_size
    return total


def split_file(src: Path, sizes: list[int], names: list[Path]) -> None:
    """``src`` cut into consecutive parts of ``sizes`` bytes, written to ``names``."""
    with open(src, "rb") as f:
        for size, name in zip(sizes, names):
            name.write_bytes(f.read(size))


def plan_parts(weights: int, data: int, budget: int) -> list[int]:
    """Bytes of the weights each call carries, in the fewest calls of at most ``budget`` bytes:
    the last call carries ``data`` (rows, eval rows, manifest) and fills up with weights, the
    calls before it share the rest evenly."""
    if data > budget:
        raise ValueError("the rows alone are over one call's budget: pack fewer")
    calls = max(1, -(-(weights + data) // budget))
    last = min(weights, budget - data)
    if calls == 1:
        return [weights]
    q, r = divmod(weights - last, calls - 1)
    return [q + 1] * r + [q] * (calls - 1 - r) + [last]


def main(argv: list[str] | None = None) -> int:
    from engine.config import DEFAULT_TARGET
    from engine.model.loader import resolve_source

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=".cache/distill/train-conversations.npz")
    ap.add_argument("--eval", default=".cache/distill/eval.jsonl")
    ap.add_argument("--out", default=".gpu/train")
    ap.add_argument("--wheels", default=".gpu/whl")
    ap.add_argument("--margin-mib", type=float, default=2.0, help="left free in every call")
    a = ap.parse_args(argv)

    root = Path(__file__).resolve().parents[1]
    gguf = Path(resolve_source(DEFAULT_TARGET).location)
    out = root / a.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rows, ev = root / a.rows, root / a.eval  # (absolute paths stay as given)
    if not rows.name.startswith("train"):  # the split's rule: only training rows are fitted on
        raise SystemExit(f"{rows.name}: the rows must be a training split's (train-*)")
    if not ev.name.startswith("eval"):
        raise SystemExit(f"{ev.name}: the evaluation rows must be the e bucket's (eval*)")
    data_dir = out / "data"
    data_dir.mkdir()
    shutil.copyfile(rows, data_dir / rows.name)
    ev_gz = data_dir / (ev.name + ".gz" if ev.suffix != ".gz" else ev.name)
    with open(ev, "rb") as f, gzip.open(ev_gz, "wb") as g:
        shutil.copyfileobj(f, g)
    data = sum(p.stat().st_size for p in data_dir.iterdir()) + 4096  # + the manifest

    wheels = root / a.wheels
    wheel_bytes = sum(p.stat().st_size for p in wheels.glob("*.whl")) if wheels.exists() else 0
    if not wheel_bytes:
        print(f"warning: no wheels in {a.wheels}: the GPU machine has no gguf package (see docs)")
    tree = travelling_bytes(root, (a.out.rstrip("/") + "/", a.wheels.rstrip("/") + "/"))
    budget = CALL_LIMIT - tree - wheel_bytes - int(a.margin_mib * MIB)
    weights = gguf.stat().st_size
    parts = plan_parts(weights, data, budget)
    calls = [out / f"call{i + 1}" for i in range(len(parts))]
    for c in calls:
        c.mkdir()
    names = [c / f"weights.{i:02d}" for i, c in enumerate(calls)]
    split_file(gguf, parts, names)
    for p in data_dir.iterdir():
        p.rename(calls[-1] / p.name)
    data_dir.rmdir()
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    manifest = {
        "gguf": gguf.name,
        "sha256": sha,
        "parts": [n.name for n in names],
        "rows": rows.name,
        "eval": ev_gz.name,
    }
    (calls[-1] / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"working tree {tree / MIB:.1f} MiB, wheels {wheel_bytes / MIB:.1f} MiB")
    print(f"budget a call {budget / MIB:.1f} MiB; weights {weights / MIB:.1f} MiB, rows and eval")
    print(f"{data / MIB:.1f} MiB")
    for c in calls:
        files = sorted(c.iterdir())
        size = sum(p.stat().st_size for p in files)
        names = ", ".join(p.name for p in files)
        print(f"  {c.relative_to(root)}: {size / MIB:.1f} MiB ({names})")
    print("calls, in one batch of tool calls (the machine stays warm 30 s after each):")
    for i, c in enumerate(calls):
        rel = c.relative_to(root)
        stage = "STAGE=1 " if i < len(calls) - 1 else ""
        carry = [str(rel)] + ([a.wheels] if i == len(calls) - 1 and wheel_bytes else [])
        print(f"  run carry={carry} command='{stage}CALL={rel} bash scripts/gpu_train.sh'")
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
