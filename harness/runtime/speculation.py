"""Prompt-lookup speculation: draft tokens from the request's own text, and which to keep.

No draft model: the drafts are the tokens that followed the most recent earlier occurrence
of the request's last ``n`` tokens (``n`` from ``MAX_NGRAM`` down to 1) in its prompt and
output so far. Code edits and summaries quote their context, so such runs repeat; chat
rarely does. The engine verifies ``[pending] + drafts`` in one forward and keeps the
longest run of drafts the model's greedy choice agrees with, plus the model's own token
after it (``accepted_tokens``). Both functions are pure; neither touches the pool.
"""

from collections.abc import Sequence

MAX_NGRAM = 3


def propose_drafts(token_ids: Sequence[int], max_drafts: int) -> list[int]:
    """Up to ``max_drafts`` tokens that followed the latest earlier match of the longest
    suffix of ``token_ids`` (``MAX_NGRAM`` tokens down to 1); ``[]`` when nothing matches.

    A match may overlap the suffix itself (``a b a b a`` proposes ``b a ...``): only its
    start must lie before the suffix's.
    """
    length = len(token_ids)
    if max_drafts < 1:
        return []
    for ngram in range(min(MAX_NGRAM, length - 1), 0, -1):
        suffix = list(token_ids[length - ngram :])
        for start in range(length - ngram - 1, -1, -1):
            if list(token_ids[start : start + ngram]) == suffix:
                follow = start + ngram
                return list(token_ids[follow : follow + max_drafts])
    return []


def accepted_tokens(drafts: Sequence[int], greedy: Sequence[int]) -> list[int]:
    """The tokens a verify forward emits: the drafts the model agrees with, then its own.

    ``greedy[i]`` is the model's argmax after ``[pending] + drafts[:i]``
    (``len(greedy) == len(drafts) + 1``). Drafts are taken while ``drafts[i] == greedy[i]``;
    the first disagreement (or the last row) gives the bonus token ``greedy[accepted]``.
    So the result is exactly what greedy decoding would emit next, one to
    ``len(drafts) + 1`` tokens.
    """
    assert len(greedy) == len(drafts) + 1, "one greedy token per verified position"
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    return list(greedy[: accepted + 1])
