"""A grammar's constraint across speculative rows (worker/grammar.py, issue 34 item 2), with
the real llguidance matcher and the dummy byte-level tokenizer, no model: the mask of every
drafted row equals the mask a fresh matcher gives after the same tokens; a refused draft
leaves the matcher able to go on; the next step rolls back to what the request kept; and only
a refused token of the real output gives up the grammar."""

import logging

import pytest
import torch

from tokstream.structured import StructuredOutput
from tokstream.text.tokenizer import dummy_tokenizer
from tokstream.worker.grammar import Grammars

VOCAB, BOS, EOS = 300, 0, (1,)
GRAMMAR = StructuredOutput("grammar", 'start: WORD (" " WORD)*\nWORD: "abc" | "abd"').grammar()


@pytest.fixture(scope="module")
def tokenizer():
    return dummy_tokenizer(VOCAB, BOS, EOS)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer.to_json, VOCAB, EOS)


def reference(grammars, tokens: list[int]) -> torch.Tensor:
    """The mask a matcher that has only ever seen `tokens` gives."""
    fresh = grammars.constraint(GRAMMAR)
    mask = fresh.allowed(tokens)
    assert mask is not None
    return mask


def test_each_drafted_row_is_masked_as_plain_decoding_masks_it(grammars, tokenizer):
    output = tokenizer.encode("abc a")
    drafts = tokenizer.encode("bd ab")
    constraint = grammars.constraint(GRAMMAR)
    constraint.allowed(output)
    for i in range(len(drafts) + 1):  # the rows of one verification chunk, in order
        row = output + drafts[:i]
        assert torch.equal(constraint.allowed(row, num_drafts=i), reference(grammars, row)), i
    # The next step: two drafts were accepted, then another token sampled.
    kept = output + drafts[:2] + tokenizer.encode(" ")
    assert torch.equal(constraint.allowed(kept), reference(grammars, kept))
    assert constraint.seen == kept


def test_a_refused_draft_masks_nothing_and_loses_no_state(grammars, tokenizer, caplog):
    output = tokenizer.encode("abc")
    constraint = grammars.constraint(GRAMMAR)
    constraint.allowed(output)
    refused = tokenizer.encode("!")  # never allowed: the row after it is discarded
    with caplog.at_level(logging.WARNING, logger="tokstream.worker"):
        assert constraint.allowed(output + refused, num_drafts=1) is None
        assert constraint.allowed(output + refused + tokenizer.encode(" "), num_drafts=2) is None
    assert caplog.records == [] and not constraint.lost
    kept = output + tokenizer.encode(" ")
    assert torch.equal(constraint.allowed(kept), reference(grammars, kept))


def test_a_shorter_or_different_output_replays_from_what_was_kept(grammars, tokenizer):
    constraint = grammars.constraint(GRAMMAR)
    constraint.allowed(tokenizer.encode("abc abd ab"))
    for text in ("abc", "abd abc", ""):  # a preempted request recomputed; another path
        tokens = tokenizer.encode(text)
        assert torch.equal(constraint.allowed(tokens), reference(grammars, tokens)), text
        assert constraint.seen == tokens


def test_a_refused_token_of_the_real_output_gives_up_the_grammar(grammars, tokenizer, caplog):
    constraint = grammars.constraint(GRAMMAR)
    with caplog.at_level(logging.WARNING, logger="tokstream.worker"):
        assert constraint.allowed(tokenizer.encode("abc!")) is None
    assert constraint.lost and "grammar state lost" in caplog.text
    assert constraint.allowed(tokenizer.encode("abc")) is None  # for good, as before
