"""SLURM's host-list grammar (``SLURM_JOB_NODELIST``): ``n[1-3,7],gpu-[01-02]`` -> host names.

The grammar, as ``scontrol show hostnames`` of SLURM 22.05 (Debian 12's slurm-client) expands it,
checked against it by tests/cluster/test_nodelist.py on generated lists:

* host expressions separated by commas, spaces or tabs (several in a row count as one);
  separators inside ``[...]`` belong to the brackets;
* an expression is text with bracket groups, each a comma-separated list of numbers and
  ``lo-hi`` ranges; ``a[1-2]-b[3-4]`` is ``a1-b3, a1-b4, a2-b3, a2-b4``;
* with three or more groups SLURM's order is its own: the last group varies fastest, then the
  first, the second, ... and the last-but-one slowest (``a[1-2]b[3-4]c[5-6]`` is ``a1b3c5,
  a1b3c6, a2b3c5, a2b3c6, a1b4c5, ...``);
* a number keeps the width of its range's low end, spaces and a ``+`` sign included:
  ``gpu[08-10]`` is ``gpu08, gpu09, gpu10`` and ``n[ 1-2]`` is ``n01, n02``;
* a range of more than 65,536 hosts is an error (SLURM's ``MAX_RANGE``), and so is a group
  before the last that spans more than 65,536 numbers (SLURM's ``MAX_PREFIX_CNT``).

Differences, on purpose: text after the last ``]`` (``rack[1-2]n[001-002].cluster``) is an
error in SLURM 22.05 and a suffix from 23.02; gpukit accepts it as a suffix. These are errors
here where scontrol 22.05 prints something (or crashes): a list of more than :data:`MAX_HOSTS`
hosts, an unclosed ``[``, a stray ``]``, junk after a range's low number (``[1abc-2]``), control
characters (a newline), numbers beyond 2**64 - 2, and a bad group before the last-but-one (which
makes SLURM drop the whole expression without a word). Counts are computed before anything is
expanded, so no list can exhaust memory.
Order is kept (the first host is the job's first node, where rank 0 runs).
"""

from __future__ import annotations

import itertools
import math
import re

from gpukit.errors import ConfigurationError

__all__ = ["parse_nodelist", "count_nodelist", "MAX_HOSTS", "MAX_RANGE_HOSTS"]

#: hosts one ``lo-hi`` range may hold (SLURM's ``MAX_RANGE``, and its ``MAX_PREFIX_CNT``)
MAX_RANGE_HOSTS = 65_536
#: hosts a whole list may expand to (gpukit's cap; larger than any SLURM job's node count)
MAX_HOSTS = 262_144
#: longest node-list text read (the kernel caps one environment variable at 128 KiB)
MAX_TEXT_CHARS = 1 << 20
_MAX_NUMBER = 2**64 - 2  # strtoul's ULONG_MAX, less the one value SLURM's loop cannot end on
_SEPARATORS = ", \t"
_SPACE = " \t\n\r\f\v"  # what C's strtoul skips before a number
_LO = re.compile(rf"^[{_SPACE}]*\+?(\d+)([{_SPACE}]*)$")
_HI = re.compile(rf"^[{_SPACE}]*\+?(\d+)$")

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # a tab separates; a newline does not (scontrol)

_GRAMMAR = (
    "host names separated by commas or spaces, each with optional [..] groups of numbers and lo-hi "
    "ranges, e.g. 'node[1-3,7],gpu-[01-02]'"
)

Group = list[tuple[int, int, int]]  # (lo, hi, width) per item


def _error(text: str, why: str) -> ConfigurationError:
    shown = text if len(text) <= 200 else text[:200] + "..."
    return ConfigurationError(
        f"Cannot read the SLURM node list {shown!r}: {why}. Expected {_GRAMMAR} "
        "(`scontrol show hostnames` expands it the same way)."
    )


def _tokens(text: str) -> list[str]:
    """Split at separators outside brackets (empty entries dropped, as SLURM does)."""
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
        elif char in _SEPARATORS and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise _error(text, "a '[' is never closed")
    parts.append(text[start:])
    return [p for p in parts if p]


def _parse_item(item: str, text: str) -> tuple[int, int, int]:
    """``"08-10"`` -> ``(8, 10, 2)``; the width is the low end's text length, as in SLURM."""
    lo_text, dash, hi_text = item.partition("-")
    lo_match = _LO.match(lo_text)
    if lo_match is None or (not dash or not hi_text) and lo_match.group(2):
        raise _error(text, f"{item!r} in a [..] group is neither a number nor a lo-hi range")
    lo = int(lo_match.group(1))
    hi = lo
    if hi_text:
        hi_match = _HI.match(hi_text)
        if hi_match is None:
            raise _error(text, f"{item!r} in a [..] group is neither a number nor a lo-hi range")
        hi = int(hi_match.group(1))
    if hi > _MAX_NUMBER:
        raise _error(text, f"{item!r} holds a number above {_MAX_NUMBER}")
    if hi < lo:
        raise _error(text, f"the range {item!r} runs backwards")
    if hi - lo + 1 > MAX_RANGE_HOSTS:
        raise _error(text, f"the range {item!r} holds {hi - lo + 1:,} hosts; SLURM allows at most "
                           f"{MAX_RANGE_HOSTS:,} in one range")
    return lo, hi, len(lo_text)


def _parse_group(group: str, text: str, *, prefix: bool) -> Group:
    items = [_parse_item(item, text) for item in group.split(",")]
    if prefix and sum(hi - lo + 1 for lo, hi, _ in items) > MAX_RANGE_HOSTS:
        raise _error(text, f"the group [{group[:40]}] before the last spans more than {MAX_RANGE_HOSTS:,} "
                           "numbers (SLURM refuses it too)")
    return items


def _expression(expr: str, text: str) -> tuple[list[str], list[Group]]:
    """``"a[1-2]b[3]c"`` -> texts ``["a", "b", "c"]`` and the groups between them."""
    texts: list[str] = []
    bodies: list[str] = []
    rest = expr
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        texts.append(head)
        bodies.append(body)
    texts.append(rest)
    # every group but the last is a "prefix" group in SLURM's terms, with its own size limit
    return texts, [_parse_group(body, text, prefix=i < len(bodies) - 1) for i, body in enumerate(bodies)]


def _group_size(group: Group) -> int:
    return sum(hi - lo + 1 for lo, hi, _ in group)


def _numbers(group: Group) -> list[str]:
    return [str(n).zfill(width) for lo, hi, width in group for n in range(lo, hi + 1)]


def _expand(texts: list[str], groups: list[Group]) -> list[str]:
    if not groups:
        return [texts[0]]
    values = [_numbers(g) for g in groups]
    # SLURM's order: the last-but-one group slowest, down to the first, then the last fastest
    order = [*range(len(groups) - 2, -1, -1), len(groups) - 1]
    out = []
    for combo in itertools.product(*(values[i] for i in order)):
        chosen = dict(zip(order, combo))
        out.append("".join(t + (chosen[i] if i < len(groups) else "") for i, t in enumerate(texts)))
    return out


def _parse(text: object) -> tuple[str, list[tuple[list[str], list[Group]]]]:
    if not isinstance(text, str):
        raise _error(str(text), f"it is a {type(text).__name__}, not text")
    if len(text) > MAX_TEXT_CHARS:
        raise _error(text, f"it is {len(text):,} characters long (at most {MAX_TEXT_CHARS:,} are read)")
    bad = _CONTROL.search(text)
    if bad is not None:
        raise _error(text, f"it holds the control character {bad.group()!r} at position {bad.start()}")
    expressions = [_expression(token, text) for token in _tokens(text)]
    if not expressions:
        raise _error(text, "it names no host")
    return text, expressions


def _total(expressions: list[tuple[list[str], list[Group]]]) -> int:
    return sum(math.prod(_group_size(g) for g in groups) for _, groups in expressions)


def count_nodelist(text: str) -> int:
    """How many hosts ``text`` expands to, without expanding it.

    Raises:
        ConfigurationError: as :func:`parse_nodelist` for a malformed list (not for its size).
    """
    return _total(_parse(text)[1])


def parse_nodelist(text: str) -> list[str]:
    """Expand a SLURM host list into host names, in SLURM's order.

    Args:
        text: e.g. ``"n[1-3,7],gpu-[01-02]"`` or ``"a[1-2]-b[3-4]"``.

    Returns:
        The host names, e.g. ``["n1", "n2", "n3", "n7", "gpu-01", "gpu-02"]``; duplicates
        are kept as SLURM keeps them.

    Raises:
        ConfigurationError: a list naming no host, unbalanced or nested brackets, a bracket
            group that is not numbers and ascending ``lo-hi`` ranges, a range of more than
            65,536 hosts, or a list of more than :data:`MAX_HOSTS` hosts (counted before
            anything is expanded).
    """
    text, expressions = _parse(text)
    total = _total(expressions)
    if total > MAX_HOSTS:
        raise _error(text, f"it expands to {total:,} hosts; gpukit reads at most {MAX_HOSTS:,}")
    hosts: list[str] = []
    for texts, groups in expressions:
        hosts.extend(_expand(texts, groups))
    return hosts
