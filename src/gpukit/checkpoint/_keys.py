"""Shortening long lists of state-dict keys for people to read.

``layers.0.attn.weight`` ... ``layers.11.attn.bias`` become ``layers.{0..11}.attn.{weight,bias}
(24 keys)``: numbered segments are folded into ranges, then sibling leaves into one brace.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpukit._util.units import whole_number

__all__ = ["group_keys", "format_indices"]


def format_indices(indices: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"{0..3,7}"``; one index stays bare."""
    values = sorted(set(indices))
    if len(values) == 1:
        return str(values[0])
    runs: list[str] = []
    start = prev = values[0]
    for value in values[1:] + [None]:  # type: ignore[list-item]
        if value is not None and value == prev + 1:
            prev = value
            continue
        runs.append(str(start) if start == prev else f"{start}..{prev}" if prev > start + 1 else f"{start},{prev}")
        if value is not None:
            start = prev = value
    if len(runs) > 6:
        runs = runs[:3] + ["..."] + runs[-2:]
    return "{" + ",".join(runs) + "}"


def _fold_numbers(keys: list[str]) -> list[tuple[str, int]]:
    """Fold numbered segments: returns (pattern, key count) in first-seen order."""
    groups: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    for key in keys:
        parts = key.split(".")
        parsed = [whole_number(part) if part.isascii() else None for part in parts]  # not '²', not 5000 digits
        shape = tuple("#" if n is not None else part for part, n in zip(parts, parsed))
        numbers = tuple(n for n in parsed if n is not None)
        groups.setdefault(shape, []).append(numbers)
    folded: list[tuple[str, int]] = []
    for shape, numbers in groups.items():
        columns = list(zip(*numbers)) if numbers and numbers[0] else []
        column_iter = iter(columns)
        parts = [format_indices(next(column_iter)) if part == "#" else part for part in shape]
        folded.append((".".join(parts), len(numbers)))
    return folded


def group_keys(keys: Iterable[str], max_lines: int = 8) -> list[str]:
    """Readable, grouped lines for a list of state-dict keys.

    Args:
        keys: the keys, in model order.
        max_lines: lines to return at most; the rest are counted in a last "... and N more" line.

    Returns:
        Lines such as ``"layers.{0..11}.attn.{weight,bias}  (24 keys)"``.
    """
    key_list = list(keys)
    by_parent: dict[str, list[tuple[str, int]]] = {}
    for pattern, count in _fold_numbers(key_list):
        parent, _, leaf = pattern.rpartition(".")
        by_parent.setdefault(parent, []).append((leaf, count))
    lines: list[tuple[str, int]] = []
    for parent, leaves in by_parent.items():
        names = [leaf for leaf, _ in leaves]
        total = sum(count for _, count in leaves)
        joined = names[0] if len(names) == 1 else "{" + ",".join(names) + "}"
        lines.append((f"{parent}.{joined}" if parent else joined, total))
    shown = [f"{text}  ({count} keys)" if count > 1 else text for text, count in lines[:max_lines]]
    hidden = sum(count for _, count in lines[max_lines:])
    if hidden:
        shown.append(f"... and {hidden} more key(s)")
    return shown
