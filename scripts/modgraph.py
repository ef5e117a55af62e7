#!/usr/bin/env python3
"""Finds import circles between the modules (files) of each crate under crates/.

Usage: scripts/modgraph.py [--strict] [-v] [CRATE...]

CRATE is a crate's directory name under crates/ (or a path to a crate directory); without
one, every crate is checked. Each target of a crate (src/lib.rs, src/main.rs, src/bin/*,
examples/*) is its own module tree and is checked on its own; integration tests (tests/) are
test code and are not. -v also prints every edge with one reference for it.

The graph: one node per source file. A file's inline modules (`mod x { ... }`) belong to the
file; its `mod x;` children are nodes of their own. There is an edge A -> B when code in A
names a path into module B:

- `use` declarations (`use crate::b::X`, `use super::b`, `use self::c::Y`, `use c::Y` for a
  child module `c`, every leaf of a `{...}` tree, globs),
- paths in code: `crate::b::x`, `super::b::x`, `self::c::x`, and `c::x` for a child module.

A path goes to the deepest module it names: `crate::X` with `X` an item of lib.rs is an edge
to lib.rs. When the item is a `pub use` re-export of that module, the edge also goes on to the
module the re-export names, so a re-export does not hide whom a file depends on.

Not edges:

- a module's references into its own children and their descendants (a parent that declares
  modules and calls into them is their owner; the arrow that counts is the child's `super::`),
  unless --strict, which counts them too (except re-exports);
- `pub use` re-exports in lib.rs, main.rs, a mod.rs, or an `x.rs` with children in `x/`:
  they publish paths, they depend on nothing (a re-export in any other file is an edge);
- test code: items under `#[cfg(test)]` (such as `mod tests { ... }`), and child modules
  named `tests` (`tests.rs`, `tests/mod.rs`), which may reach anywhere;
- comments (doc links included), string and character literals, `$crate::` in macros.

Prints, for each target, either that it has no circle or every circle (strongly connected
component of more than one file) with the arrows inside it and one reference for each arrow.
Exits 1 if any target has a circle, 2 on a usage error.
"""

import bisect
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# --- Lexing --------------------------------------------------------------------------------


def strip_source(text):
    """`text` with comments, string, byte-string and character literals blanked out (newlines
    kept, so offsets and line numbers stay those of the file)."""
    out = list(text)
    n = len(text)
    i = 0

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c in "rb" and re.match(r"(?:br|r)#*\"", text[i:i + 300]) and not (
            i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            m = re.match(r"(?:br|r)(#*)\"", text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            blank(i, j)
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and not (
            i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")
        )):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            # A character literal ('a', '\n', '\u{1F600}', b'x'), or a lifetime ('a).
            m = re.match(r"'(?:\\(?:u\{[0-9A-Fa-f]+\}|x[0-9A-Fa-f]{2}|.)|[^\\'\n])'", text[i:])
            if m:
                blank(i, i + m.end())
                i += m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


TOKEN = re.compile(r"::|[A-Za-z_][A-Za-z0-9_]*|#!?\[|\S")


def tokens(text):
    """(token, offset) pairs of stripped source; `$crate` stays one token."""
    toks = []
    for m in TOKEN.finditer(text):
        t = m.group(0)
        if t == "crate" and m.start() > 0 and text[m.start() - 1] == "$":
            t = "$crate"
        toks.append((t, m.start()))
    return toks


# --- Parsing one file ----------------------------------------------------------------------


class FileNode:
    """One source file: a node of the graph."""

    def __init__(self, path, modpath, mod_rs):
        self.path = path  # file path
        self.modpath = modpath  # module path of the file's own module
        self.mod_rs = mod_rs  # children live in this file's directory (lib.rs, main.rs, mod.rs)
        self.children = []  # (name, file path or None if missing) of `mod x;`
        self.refs = []  # (scope path, segments, line, is_use, is_reexport)
        self.reexports = {}  # scope path -> {name: (segments, glob)}
        self.inline = set()  # module paths of inline modules in this file

    def rel(self):
        return os.path.relpath(self.path, ROOT)


def attr_is_test(toks):
    """Whether the attribute tokens (inside `#[` ... `]`) are a test-only `cfg`."""
    s = " ".join(toks)
    return bool(re.match(r"cfg \( (?:test|all \( test\b)", s))


def skip_item(toks, i):
    """The index just past the item starting at `toks[i]` (after its attributes): through the
    `;` that ends it, or the `}` that closes its first block (a `use` ends at its `;`)."""
    n = len(toks)
    is_use = False
    j = i
    while j < n and toks[j][0] in ("pub", "(", ")", "crate", "super", "in", "self"):
        j += 1
    if j < n and toks[j][0] == "use":
        is_use = True
    depth = 0
    while i < n:
        t = toks[i][0]
        if t == ";" and depth == 0:
            return i + 1
        if t in ("{", "(", "["):
            if t == "{" and depth == 0 and not is_use:
                return match_brace(toks, i) + 1
            depth += 1
        elif t in ("}", ")", "]"):
            depth -= 1
            if depth < 0:
                return i
        i += 1
    return n


def match_brace(toks, i):
    """The index of the `}` that closes the `{` at `toks[i]`."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j][0] == "{":
            depth += 1
        elif toks[j][0] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(toks) - 1


def parse_use_tree(toks, i, prefix, out):
    """Parses a use tree from `toks[i]`, appending (segments, glob, alias) for every leaf to
    `out`; returns the index after the tree."""
    segs = list(prefix)
    n = len(toks)
    if i < n and toks[i][0] == "::":
        i += 1
    while i < n:
        t = toks[i][0]
        if t == "{":
            i += 1
            while i < n and toks[i][0] != "}":
                i = parse_use_tree(toks, i, segs, out)
                if i < n and toks[i][0] == ",":
                    i += 1
            return i + 1
        if t == "*":
            out.append((segs, True, None))
            return i + 1
        if IDENT.fullmatch(t) or t == "$crate":
            segs = segs + [t]
            i += 1
            if i < n and toks[i][0] == "::":
                i += 1
                continue
            alias = None
            if i + 1 < n and toks[i][0] == "as":
                alias = toks[i + 1][0]
                i += 2
            out.append((segs, False, alias))
            return i
        return i
    return i


def parse_file(node, text):
    """Reads `mod x;` declarations, inline modules, use declarations, re-exports and code
    paths of one file into `node`. Returns False if the whole file is test-only."""
    src = strip_source(text)
    toks = tokens(src)
    starts = [m.end() for m in re.finditer("\n", src)]

    def line_of(off):
        return bisect.bisect_right(starts, off) + 1

    n = len(toks)
    scopes = [(node.modpath, None)]  # (module path, index of the closing brace or None)
    pending_test = False
    pending_path = None
    i = 0
    while i < n:
        t, off = toks[i]
        while scopes[-1][1] is not None and i > scopes[-1][1]:
            scopes.pop()
        scope = scopes[-1][0]
        if t in ("#[", "#!["):
            inner = t == "#!["
            j, depth = i + 1, 1
            while j < n and depth:
                if toks[j][0] == "[":
                    depth += 1
                elif toks[j][0] == "]":
                    depth -= 1
                j += 1
            body = [x[0] for x in toks[i + 1:j - 1]]
            if attr_is_test(body):
                if inner:
                    return False
                pending_test = True
            if body[:2] == ["path", "="]:
                m = re.match(r'\s*#\[\s*path\s*=\s*"([^"]*)"', text[off:])
                pending_path = m.group(1) if m else None
            i = j
            continue
        if pending_test:
            pending_test = False
            pending_path = None
            i = skip_item(toks, i)
            continue
        # Visibility.
        vis = False
        j = i
        if t == "pub":
            vis = True
            j += 1
            if j < n and toks[j][0] == "(":
                while j < n and toks[j][0] != ")":
                    j += 1
                j += 1
        if j < n and toks[j][0] == "mod" and j + 1 < n and IDENT.fullmatch(toks[j + 1][0]):
            name = toks[j + 1][0]
            k = j + 2
            if k < n and toks[k][0] == ";":
                if scope == node.modpath:
                    node.children.append((name, pending_path))
                pending_path = None
                i = k + 1
                continue
            if k < n and toks[k][0] == "{":
                if name == "tests":
                    i = match_brace(toks, k) + 1
                    pending_path = None
                    continue
                node.inline.add(scope + (name,))
                scopes.append((scope + (name,), match_brace(toks, k)))
                pending_path = None
                i = k + 1
                continue
        pending_path = None
        if j < n and toks[j][0] == "use":
            leaves = []
            k = parse_use_tree(toks, j + 1, [], leaves)
            while k < n and toks[k][0] != ";":
                k += 1
            reexport = vis
            for segs, glob, alias in leaves:
                if reexport:
                    name = alias or (segs[-1] if segs and not glob else None)
                    if segs and segs[-1] == "self" and not glob:
                        name = alias or (segs[-2] if len(segs) > 1 else None)
                    key = "*" if glob else name
                    if key:
                        node.reexports.setdefault(scope, {}).setdefault(key, []).append(
                            (segs, glob))
                node.refs.append((scope, segs, line_of(off), True, reexport))
            i = k + 1
            continue
        # `pub(in path)` is a visibility, not a reference.
        if t == "pub" and i + 2 < n and toks[i + 1][0] == "(" and toks[i + 2][0] == "in":
            k = i + 3
            while k < n and toks[k][0] != ")":
                k += 1
            i = k + 1
            continue
        # A path in code: starts at an identifier not preceded by `::` or `.`.
        if (IDENT.fullmatch(t) and i + 1 < n and toks[i + 1][0] == "::"
                and not (i > 0 and toks[i - 1][0] in ("::", "."))):
            segs = [t]
            k = i + 1
            while k + 1 < n and toks[k][0] == "::" and IDENT.fullmatch(toks[k + 1][0]):
                segs.append(toks[k + 1][0])
                k += 2
            node.refs.append((scope, segs, line_of(off), False, False))
            i = k
            continue
        i += 1
    return True


# --- A crate target: its module tree and graph ---------------------------------------------


class Target:
    """One module tree: a crate root file and every file it declares."""

    def __init__(self, crate, kind, root):
        self.crate = crate
        self.kind = kind
        self.files = {}  # module path -> FileNode (file-backed modules)
        self.modules = set()  # every module path, inline ones included
        self.missing = []  # (declaring file, module name)
        self.load(root, (), True)

    def load(self, path, modpath, mod_rs):
        node = FileNode(path, modpath, mod_rs)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not parse_file(node, text):
            return
        self.files[modpath] = node
        self.modules.add(modpath)
        self.modules.update(node.inline)
        here = os.path.dirname(path)
        child_dir = here if mod_rs else os.path.join(here, os.path.splitext(os.path.basename(path))[0])
        for name, attr in node.children:
            if name == "tests":
                continue
            if attr:
                cands = [os.path.join(here, attr)]
            else:
                cands = [os.path.join(child_dir, name + ".rs"),
                         os.path.join(child_dir, name, "mod.rs")]
            found = next((c for c in cands if os.path.isfile(c)), None)
            if found is None:
                self.missing.append((node.rel(), name))
                continue
            # A file named by `#[path]` owns its directory, as a mod.rs does.
            self.load(found, modpath + (name,), bool(attr) or os.path.basename(found) == "mod.rs")

    def file_of(self, modpath):
        """The file that holds module `modpath` (its own, or the one it is inline in)."""
        while modpath not in self.files:
            modpath = modpath[:-1]
        return self.files[modpath]

    def has_children(self, node):
        return any(len(m) == len(node.modpath) + 1 and m[:-1] == node.modpath
                   for m in self.files)

    def resolve(self, scope, segs, seen=None):
        """The module paths a path from `scope` leads to: the deepest module it names, and
        where that module's re-export of the named item leads. Empty for other crates' paths."""
        if not segs:
            return []
        first = segs[0]
        if first == "crate":
            base, rest = (), segs[1:]
        elif first in ("super", "self"):
            base, rest = scope, segs
            while rest and rest[0] in ("super", "self"):
                if rest[0] == "super":
                    if not base:
                        return []
                    base = base[:-1]
                rest = rest[1:]
        elif scope + (first,) in self.modules:
            base, rest = scope + (first,), segs[1:]
        else:
            return []
        cur = base
        while rest and cur + (rest[0],) in self.modules:
            cur = cur + (rest[0],)
            rest = rest[1:]
        out = [cur]
        if rest:
            seen = seen or set()
            key = (cur, rest[0])
            if key not in seen:
                seen.add(key)
                rx = self.files_reexports(cur)
                for r, glob in rx.get(rest[0], []) + rx.get("*", []):
                    if glob:
                        path = list(r) + rest
                    elif r[-1:] == ["self"]:
                        path = list(r[:-1]) + rest[1:]
                    else:
                        path = list(r) + rest[1:]
                    for m in self.resolve(cur, path, seen):
                        if m not in out:
                            out.append(m)
        return out

    def files_reexports(self, modpath):
        return self.file_of(modpath).reexports.get(modpath, {})

    def graph(self, strict):
        """Edges between files: {(from, to): [(line, path text)]}."""
        edges = {}
        for node in self.files.values():
            parent = self.has_children(node)
            for scope, segs, line, is_use, reexport in node.refs:
                if reexport and (parent or node.mod_rs):
                    continue
                for target in self.resolve(scope, segs):
                    dest = self.file_of(target)
                    if dest is node:
                        continue
                    own = dest.modpath[:len(node.modpath)] == node.modpath
                    if own and not strict:
                        continue
                    edges.setdefault((node.modpath, dest.modpath), []).append(
                        (line, "::".join(segs[:-1] if segs[-1:] == ["self"] else segs)))
        return edges


def sccs(nodes, edges):
    """Strongly connected components (Tarjan), each a sorted list of nodes."""
    succ = {v: [] for v in nodes}
    for a, b in edges:
        succ[a].append(b)
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        work = [(v, iter(succ[v]))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            u, it = work[-1]
            nxt = next(it, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[u])
                if low[u] == index[u]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == u:
                            break
                    out.append(sorted(comp))
            elif nxt not in index:
                index[nxt] = low[nxt] = counter[0]
                counter[0] += 1
                stack.append(nxt)
                on.add(nxt)
                work.append((nxt, iter(succ[nxt])))
            elif nxt in on:
                low[u] = min(low[u], index[nxt])

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def targets_of(crate_dir):
    """(kind, root file) of every target of a crate."""
    out = []
    src = os.path.join(crate_dir, "src")
    for kind, name in (("lib", "lib.rs"), ("bin", "main.rs")):
        p = os.path.join(src, name)
        if os.path.isfile(p):
            out.append((kind, p))
    for sub, kind in ((os.path.join(src, "bin"), "bin"), (os.path.join(crate_dir, "examples"), "example")):
        if not os.path.isdir(sub):
            continue
        for e in sorted(os.listdir(sub)):
            p = os.path.join(sub, e)
            if e.endswith(".rs") and os.path.isfile(p):
                out.append((kind, p))
            elif os.path.isfile(os.path.join(p, "main.rs")):
                out.append((kind, os.path.join(p, "main.rs")))
    return out


def check(crate_dir, strict, verbose):
    """Checks every target of a crate; prints what it finds and returns the circle count."""
    crate = os.path.basename(os.path.normpath(crate_dir))
    found = 0
    for kind, root in targets_of(crate_dir):
        t = Target(crate, kind, root)
        label = f"{crate} ({kind} {os.path.relpath(root, crate_dir)})"
        for f, name in t.missing:
            print(f"{label}: warning: {f} declares `mod {name};` but no file holds it")
        edges = t.graph(strict)
        if verbose:
            for (a, b), refs in sorted(edges.items()):
                print(f"{label}: {t.files[a].rel()} -> {t.files[b].rel()}  ({refs[0][1]})")
        comps = [c for c in sccs(list(t.files), edges) if len(c) > 1]
        if not comps:
            print(f"{label}: no circle ({len(t.files)} files)")
            continue
        for comp in comps:
            found += 1
            print(f"{label}: circle of {len(comp)} files:")
            members = set(comp)
            for (a, b), refs in sorted(edges.items()):
                if a in members and b in members:
                    line, path = refs[0]
                    more = f" and {len(refs) - 1} more" if len(refs) > 1 else ""
                    print(f"  {t.files[a].rel()} -> {t.files[b].rel()}"
                          f"  ({path} at line {line}{more})")
    return found


def main(argv):
    strict = "--strict" in argv
    verbose = "-v" in argv
    args = [a for a in argv if a not in ("--strict", "-v")]
    if any(a.startswith("-") for a in args):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    crates_dir = os.path.join(ROOT, "crates")
    if args:
        dirs = []
        for a in args:
            d = a if os.path.isdir(os.path.join(a, "src")) else os.path.join(crates_dir, a)
            if not os.path.isdir(d):
                print(f"no crate {a} (neither a crate directory nor one under crates/)",
                      file=sys.stderr)
                return 2
            dirs.append(d)
    else:
        dirs = sorted(os.path.join(crates_dir, d) for d in os.listdir(crates_dir)
                      if os.path.isfile(os.path.join(crates_dir, d, "Cargo.toml")))
    found = sum(check(d, strict, verbose) for d in dirs)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
