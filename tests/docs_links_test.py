#!/usr/bin/env python3
"""The documentation's relative links lead somewhere, and the README stays a short front page.

Reads README.md, every docs/*.md and the other folders' README.md files (configs/, dev/...), and
fails, naming the file and line, when
  - a relative link [text](path) or [text](path#anchor) names a file or folder that does not exist;
  - a link's #anchor (also a same-page [text](#anchor)) matches no heading of the page it points
    at, by the anchors a Git forge makes of headings: the heading's text without its markup, in
    lower case, without punctuation other than '-' and '_', spaces turned into '-', and '-1', '-2'
    ... after repeated headings;
  - README.md is over MAX_README_LINES lines, or does not link every page of docs/.
Links inside code (fenced blocks and `inline code`) are not links and are left out; so are
absolute URLs (http:, https:, mailto:).

Usage: docs_links_test.py [REPO_ROOT]   (default: the folder above this script's)
"""
import glob
import os
import re
import sys

MAX_README_LINES = 300
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
IMAGE_OR_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")


def pages(root):
    found = [os.path.join(root, "README.md")]
    found += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    for pattern in ("*/README.md", "*/*/README.md"):
        for path in sorted(glob.glob(os.path.join(root, pattern))):
            top = os.path.relpath(path, root).split(os.sep)[0]
            if top not in ("docs", "third_party") and not top.startswith(("build", ".")):
                found.append(path)
    return [path for path in found if os.path.isfile(path)]


def prose_lines(text):
    """(line number, line) of every line outside fenced code blocks."""
    inside = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield number, line


def anchor_of(heading):
    """The anchor a Git forge gives a heading's text."""
    text = IMAGE_OR_LINK.sub(r"\1", heading)           # a link in a heading keeps its text
    text = INLINE_CODE.sub(r"\2", text)                 # code keeps its characters
    text = re.sub(r"[*~]|<[^>]*>", "", text).lower()    # emphasis and HTML tags go
    text = re.sub(r"[^\w\- ]", "", text)                # punctuation goes ('_' and '-' stay)
    return text.replace(" ", "-")


def anchors(path, cache={}):
    """Every anchor of a markdown file's headings, repeats numbered as a forge numbers them."""
    if path not in cache:
        seen, result = {}, set()
        with open(path, encoding="utf-8") as f:
            for _, line in prose_lines(f.read()):
                match = HEADING.match(line)
                if not match:
                    continue
                base = anchor_of(match.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                result.add(base if count == 0 else f"{base}-{count}")
        cache[path] = result
    return cache[path]


def links(text):
    """(line number, target) of every link outside code; a link's text may run over lines."""
    lines = text.split("\n")
    prose = set(number for number, _ in prose_lines(text))
    kept = "\n".join(line if number in prose else "" for number, line in enumerate(lines, 1))
    kept = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), kept)
    for match in LINK.finditer(kept):
        yield kept.count("\n", 0, match.start()) + 1, match.group(2)


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    problems, checked = [], 0
    files = pages(root)
    readme = os.path.join(root, "README.md")
    if readme not in files:
        print(f"docs links: no README.md under {root}")
        return 1
    linked = set()
    for path in files:
        name = os.path.relpath(path, root)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for number, target in links(text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue                                # http:, https:, mailto:
            checked += 1
            file_part, _, anchor = target.partition("#")
            where = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(where):
                problems.append(f"{name}:{number}: link to {target}: {os.path.relpath(where, root)} does not exist")
                continue
            if path == readme:
                linked.add(where)
            if anchor and where.endswith(".md") and os.path.isfile(where) and anchor not in anchors(where):
                problems.append(f"{name}:{number}: link to {target}: no heading of {os.path.relpath(where, root)} "
                                f"has the anchor #{anchor}")
    with open(readme, encoding="utf-8") as f:
        readme_lines = f.read().count("\n")
    if readme_lines > MAX_README_LINES:
        problems.append(f"README.md: {readme_lines} lines, over {MAX_README_LINES}: move the topic to its page in docs/")
    for page in sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
        if page not in linked:
            problems.append(f"README.md: links no {os.path.relpath(page, root)}")
    for problem in problems:
        print("docs links: " + problem)
    print(f"docs links: {len(files)} files, {checked} relative links, README.md {readme_lines} lines, "
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
