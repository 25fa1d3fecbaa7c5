#!/usr/bin/env python3
"""The include graph of src/ and kernels/ keeps the design's layers (docs/ARCHITECTURE.md).

Fails, naming the files, when
  - a file under kernels/ includes anything from src/ (the kernel library is a leaf);
  - a file under src/ includes one from a folder above its own in the layer order
    core; config, data; device; kernels, ops; model; dist; optim; parallel; checkpoint; eval, plan;
    train; cli;
  - two files under src/ share a base name (train/plan.cpp beside cli/plan.cpp: a reader finds
    a file by its name);
  - files include each other in a circle. A unit is a header with its sources (foo.h, foo.cpp,
    foo.cu): unit A depends on unit B when any file of A includes a file of B, so foo.cpp
    including bar.h while bar.cpp includes foo.h is a circle, even though no header includes the
    other.
Only quoted includes ("...") are read; system headers and generated ones (build_info.h) are not
files of the tree and are left out.

Usage: layering_test.py [REPO_ROOT]   (default: the folder above this script's)
"""
import os
import re
import sys

LAYERS = [["core"], ["config", "data"], ["device"], ["kernels", "ops"], ["model"], ["dist"], ["optim"],
          ["parallel"], ["checkpoint"], ["eval", "plan"], ["train"], ["cli"]]
LAYER_OF = {folder: level for level, folders in enumerate(LAYERS) for folder in folders}
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cu", ".cuh", ".def")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_files(root):
    for top in ("src", "kernels"):
        for folder, _, names in os.walk(os.path.join(root, top)):
            for name in sorted(names):
                if name.endswith(SOURCE_SUFFIXES):
                    yield os.path.relpath(os.path.join(folder, name), root)


def resolve(root, including, target):
    """The tree file an include names (as the build's include paths find it), or None."""
    candidates = [os.path.join(os.path.dirname(including), target), os.path.join("src", target),
                  os.path.join("kernels", "include", target), os.path.join("kernels", target)]
    for candidate in candidates:
        candidate = os.path.normpath(candidate)
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def folder_of(path):
    """The layer folder of a file: kernels for everything under kernels/, else src/FOLDER."""
    parts = path.split(os.sep)
    return "kernels" if parts[0] == "kernels" else parts[1]


def unit_of(path):
    return os.path.splitext(path)[0]


def circles(edges):
    """Strongly connected components with more than one unit (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop(); on_stack.discard(member); component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems, edges, why = [], {}, {}
    files = list(source_files(root))
    if not files:
        print(f"layering: no sources under {root}/src or {root}/kernels")
        return 1
    for path in files:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            text = f.read()
        here = folder_of(path)
        if here not in LAYER_OF:
            problems.append(f"{path}: folder src/{here} has no place in the layer order; add it to LAYERS and docs/ARCHITECTURE.md")
            continue
        for target in INCLUDE.findall(text):
            found = resolve(root, path, target)
            if found is None:
                continue
            there = folder_of(found)
            if path.startswith("kernels") and found.startswith("src"):
                problems.append(f'{path}: includes "{target}" from src/; the kernel library includes nothing above it')
            elif LAYER_OF.get(there, -1) > LAYER_OF[here]:
                problems.append(f'{path}: includes "{target}" ({there}/ is above {here}/ in the layer order)')
            a, b = unit_of(path), unit_of(found)
            if a != b:
                edges.setdefault(a, set()).add(b)
                why.setdefault((a, b), f"{path} includes {found}")
    by_base = {}
    for path in files:
        if path.startswith("src"):
            by_base.setdefault(os.path.splitext(os.path.basename(path))[0], set()).add(os.path.dirname(path))
    for base, folders in sorted(by_base.items()):
        if len(folders) > 1:
            problems.append(f"base name {base} in " + ", ".join(sorted(folders)) + ": give each file a name of its own")
    for component in circles(edges):
        members = set(component)
        links = [why[(a, b)] for a in component for b in sorted(edges.get(a, ())) if b in members]
        problems.append("circle between " + ", ".join(component) + ": " + "; ".join(links))
    for problem in problems:
        print("layering: " + problem)
    print(f"layering: {len(files)} files, {sum(len(v) for v in edges.values())} unit dependencies, "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
