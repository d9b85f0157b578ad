#!/usr/bin/env bash
# Bugs injected on purpose: each *.patch here applies one to a copy of the project, and the test
# suite (the README's selection, -m "not full") must fail on it. A patch's first lines say the bug
# ("# ...") and the tests that should catch it first ("# first: <paths>"): they run first and the
# run stops at the first failure (-x), so a caught mutant costs seconds to minutes, not a suite.
#
#   tests/mutants/run.sh                 every patch
#   tests/mutants/run.sh 03 07           the patches whose names start so
#
# Prints one line a mutant (caught by which test, or SURVIVED) and exits non-zero if any survived.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="$root/.venv/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
survived=0
patches=()
if [ $# -eq 0 ]; then
  patches=("$here"/*.patch)
else
  for p in "$@"; do patches+=("$here/$p"*.patch); done
fi
for patch in "${patches[@]}"; do
  name="$(basename "$patch" .patch)"
  copy="$work/$name"
  mkdir -p "$copy"
  # the project as it is now (tracked and untracked files), without the venv, git or caches
  (cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$copy")
  if ! patch -s -d "$copy" -p1 < "$patch"; then
    echo "$name: the patch no longer applies"; survived=1; continue
  fi
  first="$(sed -n 's/^# first: //p' "$patch")"
  start=$(date +%s)
  # the copy's packages come first on sys.path (python -m runs from the copy); the named tests
  # first, then (only if they all passed) the whole selection
  run() { (cd "$copy" && timeout 3600 "$py" -m pytest -x -q -p no:randomly -m "not full" \
      -p no:cacheprovider "$@" >> "$work/$name.log" 2>&1); }
  run $first
  rc=$?
  if [ $rc -eq 0 ]; then run tests; rc=$?; fi
  took=$(( $(date +%s) - start ))
  if [ $rc -eq 0 ]; then
    echo "$name: SURVIVED (the suite passed in ${took} s)"; survived=1
  else
    caught="$(grep -m1 -E '^(FAILED|ERROR) tests/' "$work/$name.log" | cut -c1-160)"
    echo "$name: caught in ${took} s by ${caught:-exit code $rc}"
  fi
  rm -rf "$copy"
done
exit $survived
