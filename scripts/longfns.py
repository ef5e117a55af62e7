#!/usr/bin/env python3
"""Lists the functions in crates/ longer than LIMIT lines (default 150), longest first, and
exits 1 if there is one.

    scripts/longfns.py [LIMIT]

A function runs from its `fn` line to the brace that closes its body, found by counting
braces outside string and character literals and line comments (a text scan, not a parser:
good enough for rustfmt's layout). Test code counts too.
"""
import os
import re
import sys

FN = re.compile(r'\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"C"\s+)?fn\s+(\w+)')


def code(line):
    """The line without string and character literals and a trailing comment."""
    line = re.sub(r'"([^"\\]|\\.)*"', '""', line)
    line = re.sub(r"'([^'\\]|\\.)'", "''", line)
    return line.split('//')[0]


def rust_files(root):
    """Every `.rs` file below `root`, as (path, its lines)."""
    for top, _, files in os.walk(root):
        for name in files:
            if name.endswith('.rs'):
                path = os.path.join(top, name)
                with open(path, errors='replace') as f:
                    yield path, f.read().split('\n')


def long_functions(root, limit):
    found = []
    for path, lines in rust_files(root):
        for i, line in enumerate(lines):
            m = FN.match(line)
            if not m:
                continue
            depth, opened, j = 0, False, i
            while j < len(lines):
                c = code(lines[j])
                if not opened and ';' in c and '{' not in c:
                    break  # a declaration without a body
                depth += c.count('{') - c.count('}')
                opened = opened or '{' in c
                if opened and depth <= 0:
                    break
                j += 1
            if j - i + 1 > limit:
                found.append((j - i + 1, path, i + 1, m.group(7)))
    return sorted(found, reverse=True)


def main():
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 150
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'crates')
    found = long_functions(os.path.normpath(root), limit)
    for n, path, line, name in found:
        print(f'{n:5} lines  {os.path.relpath(path)}:{line} {name}')
    if not found:
        print(f'no function over {limit} lines in crates/')
    return 1 if found else 0


if __name__ == '__main__':
    sys.exit(main())
