#!/usr/bin/env python3
"""Keeps the README and docs/ true to the tree and to the command line:
  - README.md is at most 12,500 bytes (it teaches; the details live in docs/);
  - every relative link in README.md, docs/*.md and bench/**/*.md resolves to a file
    (and its #anchor, where it names one, to a heading of that file);
  - every page of docs/ is reachable from README.md by links;
  - every tpsim command in a code block of README.md or docs/*.md names a subcommand that
    exists and only flags that the subcommand's --help lists.

Usage: scripts/check_docs.py TPSIM_BINARY [REPO_ROOT]
Exit 0: all hold; 1: something broke (each printed); 2: usage.
"""
import os
import re
import shlex
import subprocess
import sys

README_LIMIT = 12_500
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def anchor(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(path):
    with open(path, encoding="utf-8") as fh:
        body = FENCE.sub("", fh.read())
    return {anchor(m) for m in re.findall(r"^#+\s+(.*)$", body, re.M)}


def links_of(path):
    with open(path, encoding="utf-8") as fh:
        text = FENCE.sub("", fh.read())
    return [a or b for a, b in LINK.findall(text)]


def commands_of(path):
    """(line, argv) for each tpsim command in the file's code blocks, continuations joined,
    comments and shell operators cut."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    out = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            for cut in ("|", ">", "2>", "&&", ";", "||", ">>", "<"):
                if cut in words:
                    words = words[:words.index(cut)]
            words = [w for w in words if not re.match(r"^\d?>", w)]
            if words and os.path.basename(words[0]) == "tpsim":
                out.append((line, words[1:]))
    return out


def subcommands(binary):
    """The names under "Subcommands:" in `tpsim --help` (a subcommand's own --help exits 0
    for any word, so existence must be read from the top-level list)."""
    p = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    text = p.stdout.split("Subcommands:", 1)[1] if "Subcommands:" in p.stdout else ""
    return set(re.findall(r"^  (\w[\w-]*)\s", text, re.M))


def help_flags(binary, sub, cache):
    if "" not in cache:
        cache[""] = subcommands(binary)
    if sub not in cache[""]:
        return None
    if sub not in cache:
        p = subprocess.run([binary, sub, "--help"], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            cache[sub] = None
        else:
            cache[sub] = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", p.stdout))
    return cache[sub]


# Counts that prose states and the binary knows: "the 48 bugs it knows how to plant",
# "the 17 built-in faults". Each must equal `tpsim verify --list-faults`'s line count.
FAULT_COUNT = re.compile(r"\b(\d+) (?:built-in |planted )?(?:bugs it knows|faults)\b|"
                         r"--list-faults` names all (\d+)\b")


def count_errors(binary, root, pages):
    p = subprocess.run([binary, "verify", "--list-faults"], capture_output=True, text=True,
                       timeout=60)
    if p.returncode != 0:
        return [f"`tpsim verify --list-faults` exited {p.returncode}"]
    faults = len([l for l in p.stdout.splitlines() if l.strip()])
    errors = []
    for page in pages:
        rel = os.path.relpath(page, root)
        if rel.startswith("bench/"):
            continue  # dated results: their counts were true on their day
        with open(page, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for m in FAULT_COUNT.finditer(line):
                    if int(m.group(1) or m.group(2)) != faults:
                        errors.append(f"{rel}:{n}: says {m.group(0)!r}, but `verify "
                                      f"--list-faults` lists {faults}")
    return errors


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip().splitlines()[-2])
        return 2
    binary = sys.argv[1]
    root = sys.argv[2] if len(sys.argv) > 2 else os.path.join(os.path.dirname(__file__), "..")
    root = os.path.abspath(root)
    errors = []
    readme = os.path.join(root, "README.md")
    size = os.path.getsize(readme)
    if size > README_LIMIT:
        errors.append(f"README.md is {size} bytes, over {README_LIMIT}")

    pages = [readme]
    for sub in ("docs", "bench"):
        for d, _, files in os.walk(os.path.join(root, sub)):
            pages += [os.path.join(d, f) for f in sorted(files) if f.endswith(".md")]

    graph = {}
    for page in pages:
        graph[page] = []
        for link in links_of(page):
            if re.match(r"^[a-z]+:", link):
                continue  # http:, https:, mailto:
            target, _, frag = link.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
            rel = os.path.relpath(page, root)
            if not os.path.exists(full):
                errors.append(f"{rel}: broken link {link}")
                continue
            if frag and full.endswith(".md") and frag not in anchors_of(full):
                errors.append(f"{rel}: link {link}: no heading with anchor #{frag}")
            graph[page].append(full)

    seen, todo = {readme}, [readme]
    while todo:
        for nxt in graph.get(todo.pop(), []):
            if nxt in graph and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    for page in pages:
        if os.path.relpath(page, root).startswith("docs/") and page not in seen:
            errors.append(f"{os.path.relpath(page, root)}: not reachable from README.md")

    cache, checked = {}, 0
    for page in [readme] + [p for p in pages if os.path.relpath(p, root).startswith("docs/")]:
        rel = os.path.relpath(page, root)
        for line, argv in commands_of(page):
            checked += 1
            if not argv or argv[0].startswith("-"):
                continue  # `tpsim --help` and the like
            flags = help_flags(binary, argv[0], cache)
            if flags is None:
                errors.append(f"{rel}: `{line}`: no subcommand {argv[0]}")
                continue
            for w in argv[1:]:
                flag = w.split("=", 1)[0]
                if flag.startswith("-") and flag != "-" and flag not in flags:
                    errors.append(f"{rel}: `{line}`: {argv[0]} has no flag {flag}")

    errors += count_errors(binary, root, [readme] + pages)

    for e in errors:
        print("check_docs: " + e)
    print(f"check_docs: README {size} bytes, {len(pages)} pages, {checked} commands, "
          f"{len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
