"""Position-range arithmetic of the dispatchers: equal sizes, equal splits, subtraction.

A range is ``(offset, size)`` of an epoch's permutation positions; lists of ranges keep
their order (the order a rank trains them in)."""

from __future__ import annotations

__all__ = ["equal_sizes", "split_ranges", "subtract_ranges"]


def equal_sizes(n: int, total: int) -> list[int]:
    """``total // n`` each, the first ``total % n`` get one more (§8.2)."""
    if n < 1:
        return []
    per, extra = divmod(total, n)
    return [per + (1 if i < extra else 0) for i in range(n)]


def split_ranges(ranges: list[tuple[int, int]], n: int) -> list[list[tuple[int, int]]]:
    """Split the positions of ``ranges`` (in order) into ``n`` equal consecutive slices."""
    sizes = equal_sizes(n, sum(size for _, size in ranges))
    out: list[list[tuple[int, int]]] = []
    queue = list(ranges)
    for want in sizes:
        mine: list[tuple[int, int]] = []
        while want > 0:
            off, size = queue[0]
            take = min(want, size)
            mine.append((off, take))
            want -= take
            if take == size:
                queue.pop(0)
            else:
                queue[0] = (off + take, size - take)
        out.append(mine)
    return out


def subtract_ranges(ranges: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` (in order) without the positions of ``holes``."""
    out = list(ranges)
    for h_off, h_size in holes:
        h_end = h_off + h_size
        nxt: list[tuple[int, int]] = []
        for off, size in out:
            end = off + size
            if h_end <= off or end <= h_off:
                nxt.append((off, size))
                continue
            if off < h_off:
                nxt.append((off, h_off - off))
            if h_end < end:
                nxt.append((h_end, end - h_end))
        out = nxt
    return out
