"""Bounded caches: plain dicts that keep at most ``capacity`` entries, the oldest inserted
leaving first. Plans, templates, conversions and prepared launches are cached this way
throughout the library: a long-running process that keeps making new shapes or mods keeps
a fixed number of them, while a steady call pattern always hits."""

from __future__ import annotations


def keep_bounded(table: dict, key, value, capacity: int):
    """``table[key] = value``, the oldest entry leaving at ``capacity``; returns ``value``."""
    if key not in table and len(table) >= capacity:
        table.pop(next(iter(table)))
    table[key] = value
    return value
