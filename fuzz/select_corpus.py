#!/usr/bin/env python3
"""Picks the inputs to commit for one target from a libFuzzer merge control file (fuzz/README.md).

A greedy set cover of coverage edges: the seeds first (every file in SEEDS), then, one at a time,
the input adding the most edges not yet covered per (bytes + 20000) (small inputs win ties), until
FILES inputs or BYTES bytes, or no input adds an edge. Copies them to OUT (emptied first).
The control file lists, per input, only the edges no input merged before it reached, so the edge
count printed is a lower bound: `fuzz_T -runs=0 FOLDER` prints a folder's true coverage ("cov:").

  build/fuzz/fuzz/fuzz_T -merge=1 -merge_control_file=/tmp/T.control /tmp/empty fuzz/corpus/T NEW...
  fuzz/select_corpus.py /tmp/T.control fuzz/corpus/T /tmp/T.chosen 100 950000
  rm -r fuzz/corpus/T && mv /tmp/T.chosen fuzz/corpus/T
"""
import os
import shutil
import sys


def main():
    control, seeds_dir, out, max_files, max_bytes = sys.argv[1:6]
    max_files, max_bytes = int(max_files), int(max_bytes)
    lines = open(control).read().split("\n")
    n = int(lines[0])
    paths = lines[2:2 + n]
    edges = {}
    for line in lines[2 + n:]:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "COV":
            edges[int(fields[1])] = set(map(int, fields[2:]))
    size = {i: os.path.getsize(paths[i]) for i in range(n)}
    seeds_dir = os.path.abspath(seeds_dir)
    chosen = [i for i in range(n) if os.path.dirname(os.path.abspath(paths[i])) == seeds_dir]
    covered = set().union(*(edges.get(i, set()) for i in chosen))
    total = sum(size[i] for i in chosen)
    while len(chosen) < max_files:
        best, best_score = None, 0.0
        for i, e in edges.items():
            if i in chosen or total + size[i] > max_bytes:
                continue
            score = len(e - covered) / (size[i] + 20000)
            if score > best_score:
                best, best_score = i, score
        if best is None:
            break
        chosen.append(best)
        covered |= edges[best]
        total += size[best]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    for i in chosen:
        shutil.copy(paths[i], os.path.join(out, os.path.basename(paths[i])))
    all_edges = set().union(*edges.values()) if edges else set()
    print(f"{len(chosen)} inputs, {total} bytes, at least {len(covered)} of {len(all_edges)} coverage edges")


if __name__ == "__main__":
    main()
