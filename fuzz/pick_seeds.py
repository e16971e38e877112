#!/usr/bin/env python3
"""Picks at most LIMIT seed files from a grown corpus by greedy set cover of coverage edges.

    ./fuzz/target/x86_64-unknown-linux-gnu/release/<target> -merge=1 \
        -merge_control_file=/tmp/ctl /tmp/empty <dir with seeds + grown corpus>
    python3 fuzz/pick_seeds.py /tmp/ctl fuzz/corpus/<target> /tmp/picked 200

Files already in the seed directory are kept first; then, while under LIMIT, the file adding
the most edges not yet covered (smallest first on ties). libFuzzer's own -set_cover_merge has
no size cap, and a target over Arrow and Parquet keeps hundreds of files that each add an edge.
"""
import os
import shutil
import sys


def main():
    ctl, seeds_dir, out_dir, limit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    lines = open(ctl).read().split("\n")
    n = int(lines[0])
    files = lines[2:2 + n]
    cov = {}
    for line in lines[2 + n:]:
        parts = line.split()
        if parts and parts[0] == "COV":
            cov[int(parts[1])] = set(map(int, parts[2:]))
    seeds = set(os.listdir(seeds_dir))
    covered, chosen = set(), []
    for i, f in enumerate(files):
        if os.path.basename(f) in seeds:
            chosen.append(i)
            covered |= cov.get(i, set())
    total = set().union(*cov.values()) if cov else set()
    while len(chosen) < limit:
        rest = [i for i in cov if i not in chosen]
        if not rest:
            break
        best = max(rest, key=lambda i: (len(cov[i] - covered), -os.path.getsize(files[i])))
        if not cov[best] - covered:
            break
        chosen.append(best)
        covered |= cov[best]
    os.makedirs(out_dir, exist_ok=True)
    for i in chosen:
        shutil.copy(files[i], out_dir)
    print(f"{len(chosen)} files, {len(covered)}/{len(total)} edges")


if __name__ == "__main__":
    main()
