"""SLURM's host-list grammar (``SLURM_JOB_NODELIST``): ``n[1-3,7],gpu-[01-02]`` -> host names.

The grammar, as ``scontrol show hostnames`` expands it:

* a comma-separated list of host expressions; commas inside ``[...]`` belong to the brackets;
* an expression is text with any number of bracket groups, each a comma-separated list of
  numbers and ``lo-hi`` ranges: ``a[1-2]-b[3-4]`` is the product ``a1-b3, a1-b4, a2-b3, a2-b4``;
* numbers keep their zero padding: ``gpu[08-10]`` is ``gpu08, gpu09, gpu10`` (the width of
  ``lo`` is the width of every number of the range).

Order is kept (the first host is the job's first node, where rank 0 runs).
"""

from __future__ import annotations

import itertools

from gpukit.errors import ConfigurationError

__all__ = ["parse_nodelist"]

_GRAMMAR = (
    "host names separated by commas, each with optional [..] groups of numbers and lo-hi "
    "ranges, e.g. 'node[1-3,7],gpu-[01-02]'"
)


def _error(text: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"Cannot read the SLURM node list {text!r}: {why}. Expected {_GRAMMAR} "
        "(`scontrol show hostnames` expands it the same way)."
    )


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets; refuse unbalanced brackets."""
    parts: list[str] = []
    depth = 0
    start = 0
    for i, char in enumerate(text):
        if char == "[":
            if depth:
                raise _error(text, f"nested '[' at position {i}")
            depth = 1
        elif char == "]":
            if not depth:
                raise _error(text, f"']' without '[' at position {i}")
            depth = 0
        elif char == "," and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise _error(text, "a '[' is never closed")
    parts.append(text[start:])
    return parts


def _expand_group(group: str, text: str) -> list[str]:
    """``"1-3,07"`` -> ``["1", "2", "3", "07"]`` (padding from each range's low end)."""
    out: list[str] = []
    for item in group.split(","):
        item = item.strip()
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise _error(text, f"[{group}] holds {item!r}, which is neither a number nor a lo-hi range")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise _error(text, f"the range {item!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_expression(expr: str, text: str) -> list[str]:
    pieces: list[list[str]] = []
    rest = expr
    while "[" in rest:
        head, _, tail = rest.partition("[")
        group, _, rest = tail.partition("]")
        if not group.strip():
            raise _error(text, f"{expr!r} has an empty '[]'")
        pieces.append([head])
        pieces.append(_expand_group(group, text))
    pieces.append([rest])
    return ["".join(combo) for combo in itertools.product(*pieces)]


def parse_nodelist(text: str) -> list[str]:
    """Expand a SLURM host list into host names, in order.

    Args:
        text: e.g. ``"n[1-3,7],gpu-[01-02]"`` or ``"a[1-2]-b[3-4]"``.

    Returns:
        The host names, e.g. ``["n1", "n2", "n3", "n7", "gpu-01", "gpu-02"]``; duplicates
        are kept as SLURM keeps them.

    Raises:
        ConfigurationError: an empty list, unbalanced or nested brackets, or a bracket
            group that is not numbers and ascending ``lo-hi`` ranges.
    """
    if not isinstance(text, str) or not text.strip():
        raise _error(str(text), "it is empty")
    hosts: list[str] = []
    for expr in _split_top_level(text.strip()):
        expr = expr.strip()
        if not expr:
            raise _error(text, "it has an empty entry between commas")
        hosts.extend(_expand_expression(expr, text))
    return hosts
