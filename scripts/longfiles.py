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

from longfns import rust_files


def header(lines):
    """The file's leading `//!` block, without the markers."""
    out = []
    for line in lines:
        if not line.startswith('//!'):
            break
        out.append(line[3:].strip())
    return out


def main():
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 700
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'crates')
    found = []
    for path, lines in rust_files(root):
        n = len(lines) - (lines[-1] == '')
        reasons = [l for l in header(lines) if l.startswith('One file') and ':' in l]
        if n > limit and not reasons:
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
