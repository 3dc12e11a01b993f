"""Length rewards: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) on completion token counts.

Standard library only, like the other rule-based rewards; the registry builds it as `type: overlong`.
"""

from __future__ import annotations

from collections.abc import Sequence


def soft_overlong_penalty(lengths: Sequence[int], *, max_length: int, cache: int) -> list[float]:
    """DAPO's soft overlong punishment of completions of `lengths` tokens (Yu et al. 2025, eq. 13):

      R(y) =  0                                   |y| <= L_max - L_cache
              ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
             -1                                   |y| > L_max

    with L_max = `max_length` and L_cache = `cache` (the soft buffer, 1 <= cache <= max_length):
    nothing until the buffer, then a linear fall to -1 at L_max. [N] -> [N] floats.
    """
    if not 1 <= cache <= max_length:
        raise ValueError(f"cache must be in 1..max_length ({max_length}), got {cache}")
    start = max_length - cache
    return [0.0 if n <= start else (start - n) / cache if n <= max_length else -1.0 for n in lengths]
