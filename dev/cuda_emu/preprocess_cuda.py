#!/usr/bin/env python3
"""Rewrites CUDA sources into C++ that the CPU emulator (dev/cuda_emu) compiles.

    preprocess_cuda.py SRC_DIR OUT_DIR

Copies every .cu, .cuh and .h file of SRC_DIR to OUT_DIR (x.cu becomes x.cu.cpp), with a
#line directive so that diagnostics, __FILE__ and sanitizer reports name the original file and
line, and three rewrites (outside comments and string literals), each keeping the line count:

  1. launches:  name<T, 4><<<grid, block, shmem, stream>>>(args)
       -> ::llmtrain_emu::launch("name<T, 4>", __FILE__, __LINE__,
              ::llmtrain_emu::LaunchConfig(grid, block, shmem, stream),
              [&](auto&&... a) { name<T, 4>(a...); }, args)
  2. __shared__ declarations, which need storage per block:
       __shared__ float x[8][32], y[4];   -> static char tag1; auto& x = block_shared<float[8][32]>(&tag1); ...
       extern __shared__ float4 smem[];   -> float4* const smem = dynamic_shared<float4>();
  3. the first statement of every __global__ function's body:
       ::llmtrain_emu::kernel_entry(function_id(&name<template params>), __PRETTY_FUNCTION__,
                                    <first argument of __launch_bounds__, or 0>);

Files are rewritten only when their content changes (so make/ninja rebuild only what changed).
Exits 1, naming the file and line, on a construct it cannot rewrite.
"""

import os
import re
import sys


class RewriteError(Exception):
    pass


def code_mask(text):
    """A bytearray: 1 where text[i] is code, 0 inside comments, string and character literals."""
    mask = bytearray(len(text))
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        m = re.match(r'R"([^()\\ ]{0,16})\(', text[i:i + 20])
        if m and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find(")" + m.group(1) + '"', i)
            i = n if end < 0 else end + len(m.group(1)) + 2
            continue
        if c == '"' or (c == "'" and not is_digit_separator(text, i)):
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
            continue
        mask[i] = 1
        i += 1
    return mask


def is_digit_separator(text, i):
    """True for the ' in 1'000 (a C++14 digit separator), not a character literal."""
    j = i - 1
    while j >= 0 and (text[j].isalnum() or text[j] in "_'."):
        j -= 1
    token = text[j + 1:i]
    return bool(token) and token[0].isdigit()


def line_of(text, pos):
    return text.count("\n", 0, pos) + 1


def match_forward(text, mask, pos, open_c, close_c):
    """Index of the bracket closing the one at pos (text[pos] == open_c)."""
    depth = 0
    for i in range(pos, len(text)):
        if not mask[i]:
            continue
        if text[i] == open_c:
            depth += 1
        elif text[i] == close_c:
            depth -= 1
            if depth == 0:
                return i
    raise RewriteError("unbalanced %s%s" % (open_c, close_c))


def match_backward_angle(text, mask, pos):
    """Index of the '<' opening the template argument list that ends with the '>' at pos."""
    depth = 0
    i = pos
    while i >= 0:
        if mask[i]:
            if text[i] == ">":
                depth += 1
            elif text[i] == "<":
                depth -= 1
                if depth == 0:
                    return i
            elif text[i] in ";{}":
                break
        i -= 1
    raise RewriteError("cannot find the '<' of a kernel's template arguments")


def skip_space_back(text, i):
    while i >= 0 and text[i].isspace():
        i -= 1
    return i


def skip_space(text, i):
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def split_top_level(s, sep=","):
    parts, depth, cur = [], 0, []
    for c in s:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


def pad_lines(original, replacement):
    """replacement followed by the newlines needed to span as many lines as original."""
    missing = original.count("\n") - replacement.count("\n")
    if missing < 0:
        raise RewriteError("internal error: a rewrite added lines")
    return replacement + "\n" * missing


def find_code(text, mask, needle, start=0):
    i = text.find(needle, start)
    while i >= 0 and not all(mask[i:i + len(needle)]):
        i = text.find(needle, i + 1)
    return i


def word_at(text, i, word):
    before = text[i - 1] if i > 0 else " "
    after = text[i + len(word)] if i + len(word) < len(text) else " "
    return text.startswith(word, i) and not (before.isalnum() or before == "_") and not (
        after.isalnum() or after == "_")


def find_word(text, mask, word, start=0):
    i = find_code(text, mask, word, start)
    while i >= 0 and not word_at(text, i, word):
        i = find_code(text, mask, word, i + 1)
    return i


# ---- 1. launches -----------------------------------------------------------------------------------

def rewrite_launches(text, mask, edits):
    pos = 0
    while True:
        p = find_code(text, mask, "<<<", pos)
        if p < 0:
            return
        q = find_code(text, mask, ">>>", p + 3)
        if q < 0:
            raise RewriteError("line %d: '<<<' without '>>>'" % line_of(text, p))
        config = text[p + 3:q]
        # The callee: an identifier (maybe qualified), maybe with template arguments.
        i = skip_space_back(text, p - 1)
        if text[i] == ">":
            i = skip_space_back(text, match_backward_angle(text, mask, i) - 1)
        end_name = i + 1
        while i >= 0 and (text[i].isalnum() or text[i] in "_:"):
            i -= 1
        start = i + 1
        if start == end_name:
            raise RewriteError("line %d: cannot find the kernel name before '<<<'" % line_of(text, p))
        callee = text[start:p]
        a = skip_space(text, q + 3)
        if a >= len(text) or text[a] != "(":
            raise RewriteError("line %d: expected '(' after '>>>'" % line_of(text, p))
        b = match_forward(text, mask, a, "(", ")")
        args = text[a + 1:b]
        name = " ".join(callee.split())
        replacement = (
            '::llmtrain_emu::launch("%s", __FILE__, __LINE__, ::llmtrain_emu::LaunchConfig(%s), '
            "[&](auto&&... llmtrain_emu_args) { %s(llmtrain_emu_args...); }%s)"
            % (name.replace('"', '\\"'), config, callee.strip(), (", " + args) if args.strip() else ""))
        edits.append((start, b + 1, pad_lines(text[start:b + 1], replacement)))
        pos = b + 1


# ---- 2. __shared__ -------------------------------------------------------------------------------

QUALIFIERS = ("extern", "static", "volatile", "const")


def brace_kinds(text, mask):
    """For each '{' in code: 'ns' (namespace or extern "C" body) or 'block'."""
    kinds = {}
    for i, c in enumerate(text):
        if c == "{" and mask[i]:
            head = text[max(0, i - 200):i]
            kinds[i] = "ns" if re.search(r'(\bnamespace\b[\w\s:]*|\bextern\s*"C"\s*)$', head) else "block"
    return kinds


def in_function(text, mask, kinds, pos):
    stack = []
    for i in range(pos):
        if not mask[i]:
            continue
        if text[i] == "{":
            stack.append(kinds[i])
        elif text[i] == "}" and stack:
            stack.pop()
    return "block" in stack


def rewrite_shared(text, mask, edits):
    kinds = None
    counter = 0
    pos = 0
    while True:
        s = find_word(text, mask, "__shared__", pos)
        if s < 0:
            return
        line = line_of(text, s)
        if kinds is None:
            kinds = brace_kinds(text, mask)
        if not in_function(text, mask, kinds, s):
            raise RewriteError("line %d: __shared__ at namespace scope is not supported by the emulator" % line)
        # The declaration: back over qualifiers and alignment specifiers, forward to ';'.
        start = s
        while True:
            j = skip_space_back(text, start - 1)
            m = re.search(r"(\b(?:%s)|\b(?:alignas|__align__)\s*\([^()]*\))$" % "|".join(QUALIFIERS), text[:j + 1])
            if not m:
                break
            start = m.start()
        end = find_code(text, mask, ";", s)
        decl = text[start:end]
        is_extern = re.search(r"\bextern\b", decl) is not None
        volatile = "volatile " if re.search(r"\bvolatile\b", decl) else ""
        body = re.sub(r"\b(?:__shared__|extern|static|volatile)\b|\b(?:alignas|__align__)\s*\([^()]*\)", " ", decl)
        body = " ".join(body.split())
        if "=" in body or "{" in body:
            raise RewriteError("line %d: a __shared__ variable with an initializer" % line)
        declarators = split_top_level(body)
        first = re.match(r"^(.*?)\b([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", declarators[0].strip())
        if not first or not first.group(1).strip():
            raise RewriteError("line %d: cannot parse the __shared__ declaration '%s'" % (line, body))
        base_type = first.group(1).strip()
        pieces = []
        for k, d in enumerate(declarators):
            m = first if k == 0 else re.match(r"^\s*(\**)\s*([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$", d)
            if not m:
                raise RewriteError("line %d: cannot parse the declarator '%s'" % (line, d))
            stars = "" if k == 0 else m.group(1)
            name, dims = m.group(2), "".join(m.group(3).split())
            elem = (volatile + base_type + stars).strip()
            if is_extern:
                if dims != "[]":
                    raise RewriteError("line %d: extern __shared__ must be an unsized array" % line)
                pieces.append("%s* const %s = ::llmtrain_emu::dynamic_shared<%s>();" % (elem, name, elem))
            else:
                counter += 1
                tag = "llmtrain_emu_shared_tag_%d_%s" % (counter, name)
                pieces.append("static char %s; auto& %s = ::llmtrain_emu::block_shared<%s%s>(&%s);"
                              % (tag, name, elem, dims, tag))
        edits.append((start, end + 1, pad_lines(text[start:end + 1], " ".join(pieces))))
        pos = end + 1


# ---- 3. kernel entry -------------------------------------------------------------------------------

def template_params(text, mask, global_pos):
    """The parameter names of the template<...> right before a __global__ function, or None."""
    i = skip_space_back(text, global_pos - 1)
    # Qualifiers between the template head and __global__ (static, inline...).
    while True:
        m = re.search(r"\b(static|inline|__forceinline__|__noinline__)$", text[:i + 1])
        if not m:
            break
        i = skip_space_back(text, m.start() - 1)
    if i < 0 or text[i] != ">":
        return None
    open_angle = match_backward_angle(text, mask, i)
    head = text[:open_angle].rstrip()
    if not head.endswith("template"):
        return None
    names = []
    for param in split_top_level(text[open_angle + 1:i]):
        param = param.split("=")[0].strip()
        if not param:
            continue
        m = re.search(r"([A-Za-z_]\w*)\s*$", param)
        if not m or m.group(1) in ("class", "typename"):
            raise RewriteError("line %d: an unnamed template parameter on a kernel" % line_of(text, open_angle))
        names.append(("%s..." % m.group(1)) if "..." in param else m.group(1))
    return names


def rewrite_kernels(text, mask, edits):
    pos = 0
    while True:
        g = find_word(text, mask, "__global__", pos)
        if g < 0:
            return
        line = line_of(text, g)
        i = g + len("__global__")
        bound = "0"
        name = None
        while True:
            i = skip_space(text, i)
            m = re.match(r"[A-Za-z_]\w*", text[i:])
            if not m:
                raise RewriteError("line %d: cannot parse the __global__ function's declaration" % line)
            word = m.group(0)
            j = skip_space(text, i + len(word))
            if word == "__launch_bounds__":
                close = match_forward(text, mask, j, "(", ")")
                bound = "(%s)" % split_top_level(text[j + 1:close])[0].strip()
                i = close + 1
                continue
            if text[j] == "(":
                name = word
                i = j
                break
            i = j
        close = match_forward(text, mask, i, "(", ")")
        k = skip_space(text, close + 1)
        pos = close + 1
        if text[k] != "{":
            continue  # a declaration
        params = template_params(text, mask, g)
        target = "&%s<%s>" % (name, ", ".join(params)) if params else "&%s" % name
        insert = (" ::llmtrain_emu::kernel_entry(::llmtrain_emu::function_id(%s), __PRETTY_FUNCTION__, %s);"
                  % (target, bound))
        edits.append((k + 1, k + 1, insert))


def rewrite(text):
    mask = code_mask(text)
    edits = []
    rewrite_launches(text, mask, edits)
    rewrite_shared(text, mask, edits)
    rewrite_kernels(text, mask, edits)
    edits.sort()
    for a, b in zip(edits, edits[1:]):
        if a[1] > b[0]:
            raise RewriteError("overlapping rewrites at line %d" % line_of(text, b[0]))
    out, last = [], 0
    for start, end, replacement in edits:
        out.append(text[last:start])
        out.append(replacement)
        last = end
    out.append(text[last:])
    return "".join(out)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src_dir, out_dir = os.path.abspath(sys.argv[1]), sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    failed = False
    for name in sorted(os.listdir(src_dir)):
        if not name.endswith((".cu", ".cuh", ".h")):
            continue
        path = os.path.join(src_dir, name)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            body = rewrite(text)
        except RewriteError as e:
            print("%s: %s" % (path, e), file=sys.stderr)
            failed = True
            continue
        out_name = name + ".cpp" if name.endswith(".cu") else name
        content = '#line 1 "%s"\n%s' % (path, body)
        out_path = os.path.join(out_dir, out_name)
        old = None
        if os.path.exists(out_path):
            with open(out_path, encoding="utf-8") as f:
                old = f.read()
        if old != content:
            with open(out_path, "w", encoding="utf-8") as f:
                f.write(content)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
