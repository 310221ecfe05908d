"""CRC-32 of two pieces joined, from each one's CRC (zlib's ``crc32_combine``, GF(2) matrices).

The zip writer checksums a large record in pieces, in parallel, and joins the pieces' CRCs.
"""

from __future__ import annotations

__all__ = ["crc32_combine"]


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, index = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[index]
        vector >>= 1
        index += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, row) for row in matrix]


_ZERO_OPERATORS: list[list[int]] = []  # operator for 2**k zero bytes, k = 0, 1, ...


def _zeros_operator(power: int) -> list[int]:
    if not _ZERO_OPERATORS:
        one_bit = [0xEDB88320] + [1 << n for n in range(31)]  # the CRC register shifted by one zero bit
        _ZERO_OPERATORS.append(_gf2_square(_gf2_square(_gf2_square(one_bit))))  # 8 bits: one zero byte
    while len(_ZERO_OPERATORS) <= power:
        _ZERO_OPERATORS.append(_gf2_square(_ZERO_OPERATORS[-1]))
    return _ZERO_OPERATORS[power]


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``."""
    power = 0
    while length2:
        if length2 & 1:
            crc1 = _gf2_times(_zeros_operator(power), crc1)
        length2 >>= 1
        power += 1
    return crc1 ^ crc2
