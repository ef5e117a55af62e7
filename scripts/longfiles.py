#!/usr/bin/env python3
"""Lists the Rust files in crates/ longer than LIMIT lines (default 700) whose header does not
say why they are one file, and exits 1 if there is one.

    scripts/longfiles.py [LIMIT]

The header is the file's leading `//!` block; the reason is a line of it that begins
`One file` and says, after a colon, what is read together there (not how long it is):

    //! One file: the writer and the reader of the format, so that a change is made to both.
"""
import os
import sys


def header(path):
    lines = []
    with open(path, encoding='utf-8') as f:
        for line in f:
            if not line.startswith('//!'):
                break
            lines.append(line[3:].strip())
    return lines


def main():
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 700
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'crates')
    found = []
    for top, _, files in os.walk(root):
        for name in files:
            if not name.endswith('.rs'):
                continue
            path = os.path.join(top, name)
            with open(path, encoding='utf-8') as f:
                n = sum(1 for _ in f)
            if n <= limit:
                continue
            reasons = [l for l in header(path) if l.startswith('One file') and ':' in l]
            if not reasons:
                found.append((n, os.path.relpath(path, os.path.join(root, '..'))))
    for n, path in sorted(found, reverse=True):
        print(f'  {n:4} lines  {path}: no `//! One file: ...` line in its header says why')
    if found:
        print(f'{len(found)} file(s) over {limit} lines without a reason')
        return 1
    print(f'every file over {limit} lines in crates/ says why it is one')
    return 0


if __name__ == '__main__':
    sys.exit(main())
