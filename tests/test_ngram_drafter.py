"""The prompt-lookup drafter against a brute-force search of the same rule, on random
histories over small alphabets (where matches abound), plus the cases that motivate it."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokstream.engine.ngram_drafter import NgramConfig, NgramDrafter


def brute_force(tokens: list[int], k: int, config: NgramConfig) -> list[int]:
    """The longest suffix (max_n down to min_n) found earlier; the latest such occurrence;
    what followed it, read on through the draft itself where it reaches the present."""
    last = len(tokens) - 1
    for n in range(min(config.max_n, len(tokens)), config.min_n - 1, -1):
        suffix = tokens[last - n + 1:]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[end + 1 + i])
                return extended[len(tokens):]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), k=st.integers(0, 6),
       n=st.tuples(st.integers(1, 3), st.integers(0, 3)))
def test_drafts_are_the_brute_force_search(tokens, k, n):
    config = NgramConfig(min_n=n[0], max_n=n[0] + n[1])
    drafter = NgramDrafter(config=config)
    for i, token in enumerate(tokens):
        drafter.append(token)
        # after every token, not only at the end: the index is built incrementally
        assert drafter.draft(k) == brute_force(tokens[:i + 1], k, config)


def test_a_quoted_paragraph_is_predicted_after_its_first_tokens():
    paragraph = list(range(100, 160))
    drafter = NgramDrafter([1, 2, 3, *paragraph, 4, 5])  # the prompt holds the paragraph
    predicted = 0
    for token in paragraph:  # the answer repeats it
        predicted += drafter.draft(1) == [token]
        drafter.append(token)
    assert predicted >= len(paragraph) - 2  # all but the first tokens, before a match exists
    assert NgramDrafter(paragraph).draft(4) == []  # no repetition, no draft


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    drafter = NgramDrafter([7, 8, 9, 1, 0, 8, 9, 2, 7, 8, 9], NgramConfig(min_n=2, max_n=3))
    assert drafter.draft(2) == [1, 0]  # "7 8 9" -> 1, though "8 9" -> 2 is more recent


def test_a_loop_is_drafted_as_far_as_k():
    """A model repeating itself: the latest match is one period back, and the draft goes on
    round the loop rather than stopping at the present."""
    assert NgramDrafter([9, 42, 42, 42]).draft(4) == [42, 42, 42, 42]
    assert NgramDrafter([1, 5, 6, 7, 5, 6, 7, 5, 6]).draft(5) == [7, 5, 6, 7, 5]


def test_truncate_forgets_what_came_after():
    drafter = NgramDrafter([5, 6, 7, 5, 6])
    assert drafter.draft(1) == [7]
    drafter.truncate(2)
    assert drafter.tokens == [5, 6] and drafter.draft(3) == []
    with pytest.raises(ValueError):
        drafter.truncate(3)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramConfig(min_n=0)
    with pytest.raises(ValueError, match="max_n"):
        NgramConfig(min_n=3, max_n=2)


def test_the_drafter_imports_no_torch():
    code = ("import sys, tokstream.engine.ngram_drafter; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
