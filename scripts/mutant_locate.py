"""Where a mutant goes: its ``old`` text, found robustly, and the text with ``new`` in its place.

A mutant names the code it changes by content, not by position, and survives refactors
that keep behaviour:

- **indentation is ignored** where the text is not found as written: each line of ``old``
  is then matched with its leading whitespace stripped, so code moved into or out of a
  block, a helper or a class still matches, and ``new`` is shifted by as many columns as
  the match moved;
- **``function`` scopes the search** (optional): ``"place"`` or ``"Job.record"`` limits it
  to that function's (or class's) source, so a pattern common in a file, such as
  ``if False:``-able conditions, need only be unique inside one function.

The match must be unique in its scope; ``count`` says how often it occurs.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Scope:
    start: int
    """Offset of the scope's first character in the file's text."""
    text: str


def scope(source: str, function: str = "") -> Scope:
    """The whole file, or the source of ``function`` (``name`` or ``Class.name``, unique in
    the file); ValueError when there is no such function, or more than one."""
    if not function:
        return Scope(0, source)
    found = [node for path, node in _definitions(ast.parse(source)) if _named(path, function)]
    if len(found) != 1:
        raise ValueError(f"function {function!r} is defined {len(found)} times (must be once)")
    node = found[0]
    first = (node.decorator_list[0] if node.decorator_list else node).lineno
    lines = source.splitlines(keepends=True)
    start = sum(len(line) for line in lines[:first - 1])
    return Scope(start, "".join(lines[first - 1:node.end_lineno]))


def _definitions(tree: ast.AST, prefix: tuple[str, ...] = ()):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            path = (*prefix, node.name)
            yield path, node
            yield from _definitions(node, path)
        else:
            yield from _definitions(node, prefix)


def _named(path: tuple[str, ...], function: str) -> bool:
    wanted = tuple(function.split("."))
    return path[-len(wanted):] == wanted


def _normalize(text: str) -> tuple[str, list[int]]:
    """``text`` with every line's leading blanks removed, and each kept character's offset
    in ``text``."""
    kept: list[str] = []
    where: list[int] = []
    at_line_start = True
    for i, ch in enumerate(text):
        if at_line_start and ch in " \t":
            continue
        at_line_start = ch == "\n"
        kept.append(ch)
        where.append(i)
    return "".join(kept), where


def _occurrences(haystack: str, needle: str) -> list[int]:
    found, at = [], haystack.find(needle)
    while at >= 0 and needle:
        found.append(at)
        at = haystack.find(needle, at + 1)
    return found


def count(source: str, old: str, function: str = "") -> int:
    """How many times ``old`` occurs in the scope: as written, or else indentation ignored."""
    where = scope(source, function)
    exact = where.text.count(old)
    return exact if exact else len(_occurrences(_normalize(where.text)[0], _normalize(old)[0]))


def apply(source: str, old: str, new: str, function: str = "") -> str:
    """``source`` with the one occurrence of ``old`` replaced by ``new``. Text found as
    written is replaced as written; text found only with its indentation ignored gets
    ``new`` shifted by as much as the match sits deeper (or shallower) than ``old``."""
    where = scope(source, function)
    if where.text.count(old) == 1:
        text = where.text.replace(old, new, 1)
        return source[:where.start] + text + source[where.start + len(where.text):]
    norm, offsets = _normalize(where.text)
    needle = _normalize(old)[0]
    hits = _occurrences(norm, needle)
    if len(hits) != 1:
        raise ValueError(f"'old' occurs {len(hits)} times (must be exactly once)")
    begin = offsets[hits[0]]
    end = offsets[hits[0] + len(needle) - 1] + 1
    line_start = where.text.rfind("\n", 0, begin) + 1
    lead = where.text[line_start:begin]
    shift = _indent(lead) - _indent(old.split("\n")[0])
    starts_line = not lead.strip(" \t")
    if starts_line:  # the match starts its line: its indent is replaced too
        begin = line_start
    text = where.text[:begin] + _shift(new, shift, first_too=starts_line) + where.text[end:]
    return source[:where.start] + text + source[where.start + len(where.text):]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _shift(new: str, by: int, first_too: bool) -> str:
    """``new`` with each line's indentation changed by ``by`` columns; ``first_too`` False:
    the first line continues a line already indented, so it is left as it is."""
    lines = new.split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip() or (i == 0 and not first_too):
            out.append(line if i == 0 else line.strip(" "))
        else:
            out.append(" " * max(0, _indent(line) + by) + line.lstrip(" "))
    return "\n".join(out)
