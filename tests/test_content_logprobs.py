"""Chat logprobs entries against the text they stand for, without a server: fed in any split
(the text may lag its tokens, as the detokeniser holds back a cut character or a possible stop
string), the entries' bytes concatenate to the text; special tokens, ids the vocabulary lacks
and a stop string's tokens are not listed; a token a stop string cuts keeps its shown part."""

import pytest

from tokstream.engine.messages.worker import TokenLogprobs
from tokstream.server.api.content_logprobs import ContentLogprobs
from tokstream.text.tokenizer import dummy_tokenizer

TOKENIZER = dummy_tokenizer(512, bos_token_id=1, eos_token_ids=(2,))
EOS, BOS = 2, 1


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def logprobs(n: int) -> list[TokenLogprobs]:
    return [TokenLogprobs(logprob=-0.5 - i, top_token_ids=[EOS], top_logprobs=[-0.1])
            for i in range(n)]


def feed_in_steps(tokens: list[int], texts: list[str], step: int) -> list[dict]:
    """tokens fed `step` at a time; texts[i] is released with the i-th feed (the rest after)."""
    content = ContentLogprobs(TOKENIZER)
    lps = logprobs(len(tokens))
    entries = []
    feeds = range(0, len(tokens), step)
    for n, at in enumerate(feeds):
        entries += content.feed(tokens[at:at + step], lps[at:at + step],
                                texts[n] if n < len(texts) else "")
    for text in texts[len(feeds):]:
        entries += content.feed([], [], text)
    return entries + content.finish()


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_entries_add_up_to_text_that_lags_its_tokens(step):
    text = "Paris é 😀 done"
    tokens = [BOS, *ids(text)[:4], 511, *ids(text)[4:], EOS]  # 511: a word, shown below
    shown = TOKENIZER.decode(tokens)
    # The text comes late and in other pieces than the tokens (a character or stop string
    # held back), the last of it with the end.
    texts = ["", shown[:3], "", shown[3:9], shown[9:]]
    entries = feed_in_steps(tokens, texts, step)
    assert b"".join(bytes(e["bytes"]) for e in entries) == shown.encode()
    assert len(entries) == len(tokens) - 2  # no <|bos|>, no <|eos|>
    assert [e["logprob"] for e in entries] == [-0.5 - i for i in range(1, len(tokens) - 1)]
    assert entries[0]["top_logprobs"] == [{"token": "<|eos|>", "logprob": -0.1,
                                           "bytes": list(b"<|eos|>")}]


def test_a_stop_string_ends_the_entries_where_it_cuts_the_text():
    # " w300" is one token; the stop string "0" cuts it to " w3" and drops the tokens after
    tokens = [*ids("ab"), 300, *ids("cd")]
    entries = feed_in_steps(tokens, ["a", "b w3"], 1)
    assert [e["token"] for e in entries] == ["a", "b", " w3"]
    assert entries[2]["logprob"] == -2.5  # the cut token's own value


def test_nothing_released_lists_nothing():
    assert feed_in_steps([*ids("abc"), EOS], [], 2) == []


def test_a_tokenizer_whose_pieces_are_not_the_text_lists_every_token_as_it_comes():
    # As sentencepiece's "▁" shows as a space: the first mismatch ends the alignment, and no
    # token is held back or dropped after it (only special tokens are left out).
    entries = feed_in_steps([*ids("_ab"), EOS, *ids("cd")], [" ab", "", "", "", ""], 1)
    assert [e["token"] for e in entries] == ["_", "a", "b", "c", "d"]


def test_a_stray_byte_shown_as_a_replacement_character_keeps_the_alignment():
    tokens = [*ids("a"), TOKENIZER.encode("é")[0], *ids("bc")]  # a lone first byte of "é"
    entries = feed_in_steps(tokens, ["a\ufffdb"], 100)  # "c" held back by a stop string
    assert [e["token"] for e in entries] == ["a", "\ufffd", "b"]
