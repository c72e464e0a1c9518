#!/bin/bash
# Unpack another revision's `mla/` and `benchmarks/` into DIR, for a before/after timing:
#   bash benchmarks/tree_at.sh REV DIR      (here, where git is; DIR inside the tree so that it
#                                             travels to the GPU machine, e.g. .gpu/before)
#   cd DIR && python -m benchmarks.topk_routes --out "$OUT/before"      (on the GPU machine)
# Run the command from inside DIR: `python -m` puts the working directory first on sys.path,
# ahead of PYTHONPATH, so `PYTHONPATH=DIR python -m ...` from the repository root would import
# the root's code, not REV's. DIR/REV names the revision; the command below prints which `mla`
# a run imports.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: bash benchmarks/tree_at.sh REV DIR" >&2; exit 2; }
rev=$(git rev-parse --verify "$1^{commit}")
dir=$2
rm -rf "$dir" && mkdir -p "$dir"
git archive "$rev" mla benchmarks | tar -x -C "$dir"
echo "$rev" > "$dir/REV"
(cd "$dir" && python3 -c "import importlib.util as u; print('mla here:', u.find_spec('mla').origin)")
