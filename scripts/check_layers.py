#!/usr/bin/env python3
"""The include graph's rules (docs/architecture.md), checked on every project header and
source: a folder includes only folders of lower layers (or its own), the reference model
never sees the sharded model or the backends, and no file includes itself through others.

Usage: scripts/check_layers.py [REPO_ROOT]   exit 0: clean; 1: a rule broken (each printed)
"""
import os
import re
import sys

# Lower number = lower layer. A folder may include its own and any lower layer's headers;
# folders of one layer never include each other. Tests, bench, fuzz and examples sit on top.
LAYERS = {
    "src/core": 0,
    "src/init": 1,
    "src/model": 2,
    "src/io": 3, "src/backend": 3,
    "src/comm": 4,
    "src/profile": 5, "src/runtime": 5,
    "reference": 6, "sharded": 6,
    "verify/setup": 7,
    "verify/dump": 8, "verify/engine": 8,
    "verify/report": 9,
    "verify/commands": 10,
    "verify/cli": 11,
}
# The reference is independent of the sharded code: a bug both shared would be invisible.
ONLY = {"reference": {"src/core", "src/init", "src/model", "src/io"}}
SOURCE = (".h", ".cpp", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def component(path):
    """The layer folder a repository path (or an include written against src/ or the
    root) belongs to, or None for files outside the layers."""
    parts = path.split("/")
    if parts[0] == "src" and len(parts) > 2:
        return "src/" + parts[1]
    if parts[0] == "verify" and len(parts) > 2:
        return "verify/" + parts[1]
    return parts[0] if parts[0] in LAYERS else None


def resolve(include, root):
    """An include as written ("core/tensor.h", "verify/engine/compare.h") to its path in
    the repository, or None for a header that is not the project's."""
    for candidate in (include, "src/" + include):
        if os.path.isfile(os.path.join(root, candidate)):
            return candidate
    return None


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
    graph = {}
    for top in ("src", "reference", "sharded", "verify"):
        for d, _, files in os.walk(os.path.join(root, top)):
            for f in files:
                if f.endswith(SOURCE):
                    path = os.path.relpath(os.path.join(d, f), root)
                    with open(os.path.join(root, path), errors="replace") as fh:
                        text = fh.read()
                    graph[path] = [p for p in (resolve(i, root) for i in INCLUDE.findall(text)) if p]
    errors = []
    for path, includes in sorted(graph.items()):
        me = component(path)
        if path.startswith("verify/") and path.count("/") == 1 and not path.endswith(".h"):
            errors.append(f"{path}: a source file at verify/'s top level (each belongs in a role's folder)")
        if me is None:
            continue
        for inc in includes:
            them = component(inc)
            if them is None or them == me:
                continue
            if them not in LAYERS:
                continue
            if me in ONLY and them not in ONLY[me]:
                errors.append(f"{path}: includes {inc}, but {me} may include only {sorted(ONLY[me])}")
            elif LAYERS[them] >= LAYERS[me]:
                errors.append(f"{path}: includes {inc} ({them}, layer {LAYERS[them]}) from {me} "
                              f"(layer {LAYERS[me]}): an arrow upward or sideways")
    # Cycles among files: depth-first search, grey = on the current path.
    state = {}

    def visit(node, stack):
        state[node] = "grey"
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == "grey":
                errors.append("include cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "black"

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    for e in errors:
        print("check_layers: " + e)
    print(f"check_layers: {len(graph)} files, {sum(map(len, graph.values()))} includes, "
          f"{len(errors)} broken rule(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
