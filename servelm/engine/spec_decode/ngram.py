"""N-gram prompt lookup: propose the tokens that followed the last time the sequence's tail occurred.

No second model: for a task grounded in its input (rewrite, summarize,
extract, edit code) the text being written repeats long stretches of the
prompt, and once the last few tokens match an earlier place, what followed
there is a good guess of what comes next.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_proposal(token_ids: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` tokens proposed to follow ``token_ids``, or none.

    The longest tail of ``max_n`` down to ``min_n`` tokens that also occurs
    earlier wins; of its earlier occurrences the latest (the most recent
    context) is taken, and the proposal is the up to ``k`` tokens after it.
    An occurrence may overlap the tail itself, so a run of one repeated
    token proposes more of it.
    """
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    # Windows that end before the last token, so at least one token follows each.
    head = tokens[:-1]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(head, n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            after = int(hits[-1]) + n
            return [int(t) for t in tokens[after : after + k]]
    return []
