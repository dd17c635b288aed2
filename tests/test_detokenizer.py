"""Streaming text from token ids: never a split character, never a partial stop string, and
the same text however the ids arrive (one at a time, in chunks, or after a resume)."""

import random

import pytest

from tokstream.text.detokenizer import IncrementalDetokenizer
from tokstream.model.presets import dummy_config
from tokstream.model.source import ModelSource, embedded_gguf_path
from tokstream.text.tokenizer import dummy_tokenizer, load_tokenizer

FFFD = "\ufffd"
TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "naïve café résumé — Ünïcödé Ångström façade",
    "emoji 😀🎉👍🏽 and 🏳️‍🌈, CJK 你好世界，日本語のテキスト、한국어 텍스트",
    "def f(x):\n    return x ** 2  # 12345\n\n\tprint('done')",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
    "<|im_start|>assistant\nSure!<|im_end|>",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSource("gguf", embedded_gguf_path(), dummy_config("smollm2-135m")))


def stream(detok, ids, chunks=None):
    """Feed `ids` (in the given chunk sizes, else one at a time); the deltas, stop and tail."""
    deltas, stop, i = [], None, 0
    while i < len(ids):
        n = chunks.randint(1, 4) if chunks else 1
        step = detok.step(ids[i:i + n])
        deltas.append(step.text)
        stop = stop or step.stop
        i += n
    return deltas, stop, detok.finish()


def test_multibyte_characters_are_never_split(tok):
    split_somewhere = False
    for text in TEXTS[1:3]:
        ids = tok.encode(text)
        split_somewhere |= any(FFFD in tok.decode([i]) for i in ids)
        deltas, stop, tail = stream(IncrementalDetokenizer(tok), ids)
        assert not any(FFFD in d for d in deltas)
        assert "".join(deltas) + tail == tok.decode(ids) == text
        assert stop is None
    assert split_somewhere  # the texts really do cut characters across tokens


def test_window_stays_small(tok):
    ids = tok.encode(" ".join(TEXTS) * 3)
    detok = IncrementalDetokenizer(tok)
    for i in ids:
        detok.step([i])
        assert len(detok.ids) - detok.prefix_offset <= 8


def test_stop_string_spanning_tokens(tok):
    ids = tok.encode(TEXTS[0])
    assert tok.decode(ids[2:3]) == " of" and tok.decode(ids[3:4]) == " France"
    deltas, stop, tail = stream(IncrementalDetokenizer(tok, stop=["of Fr"]), ids)
    assert "".join(deltas) == "The capital " and stop == "of Fr" and tail == ""
    assert not any("of" in d for d in deltas)


def test_partial_stop_is_held_then_released(tok):
    ids = tok.encode("The capital of France")
    deltas, stop, tail = stream(IncrementalDetokenizer(tok, stop=["capital idea"]), ids)
    assert deltas == ["The", " ", "capital of", " France"]
    assert stop is None and tail == ""


def test_held_text_is_flushed_at_finish(tok):
    ids = tok.encode("The capital")
    deltas, stop, tail = stream(IncrementalDetokenizer(tok, stop=["capital idea"]), ids)
    assert deltas == ["The", " "] and tail == "capital" and stop is None


def test_multiple_stop_strings_first_completed_wins(tok):
    ids = tok.encode(TEXTS[0])
    deltas, stop, _ = stream(IncrementalDetokenizer(tok, stop=["France", "capital"]), ids)
    assert "".join(deltas) == "The " and stop == "capital"
    # "pital of" completes before "The capital of France" does, whatever the chunking.
    stops = ["The capital of France", "pital of"]
    for chunks in (None, random.Random(1), random.Random(2)):
        deltas, stop, _ = stream(IncrementalDetokenizer(tok, stop=stops), ids, chunks)
        assert "".join(deltas) == "The ca" and stop == "pital of"


def test_stop_at_the_very_first_token(tok):
    detok = IncrementalDetokenizer(tok, stop=["The"])
    first = detok.step(tok.encode("The"))
    assert first.text == "" and first.stop == "The"
    assert detok.step(tok.encode(" capital")).text == ""
    assert detok.finish() == ""


def test_stop_string_made_of_split_characters(tok):
    text = TEXTS[2]
    deltas, stop, tail = stream(IncrementalDetokenizer(tok, stop=["世界"]), tok.encode(text))
    assert "".join(deltas) == text[:text.index("世界")] and stop == "世界" and tail == ""
    assert not any(FFFD in d for d in deltas)


def test_special_tokens_shown_only_when_asked(tok):
    ids = tok.encode(TEXTS[5])
    hidden, _, tail = stream(IncrementalDetokenizer(tok), ids)
    assert "".join(hidden) + tail == "assistant\nSure!"
    shown, _, tail = stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids)
    assert "".join(shown) + tail == TEXTS[5]
    _, stop, _ = stream(IncrementalDetokenizer(tok, stop=["<|im_end|>"],
                                               skip_special_tokens=False), ids)
    assert stop == "<|im_end|>"


def test_prompt_is_context_only(tok):
    prompt = tok.encode("Answer: 你")
    ids = tok.encode("好世界 and more")
    deltas, _, tail = stream(IncrementalDetokenizer(tok, prompt_ids=prompt), ids)
    assert "".join(deltas) + tail == tok.decode(ids)


@pytest.mark.parametrize("stops", [[], ["Paris", "好世"], ["Tower.", "\n\n\t", "résumé"],
                                   [TEXTS[2][-25:] + "!"]])  # a long stop held, then released
def test_resume_continues_exactly(tok, stops):
    ids = tok.encode(" ".join(TEXTS))
    for k in range(0, len(ids), 3):
        original = IncrementalDetokenizer(tok, stop=stops)
        for i in ids[:k]:
            original.step([i])
        if original.finished:
            break
        resumed = IncrementalDetokenizer(tok, stop=stops, delivered_ids=ids[:k])
        for i in ids[k:]:
            a, b = original.step([i]), resumed.step([i])
            assert a == b, (k, i)
        assert original.finish() == resumed.finish()


def test_resume_holds_a_partial_stop(tok):
    ids = tok.encode("The capital of France")
    resumed = IncrementalDetokenizer(tok, stop=["capital idea"], delivered_ids=ids[:2])
    assert resumed.step(ids[2:3]).text == "capital of"


def check_stream(tok, ids, stops, rng):
    """Against the whole-text answer: the first-completed stop, and every delta so far a
    prefix of the final text (nothing streamed is ever taken back)."""
    full = tok.decode(ids)
    hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
    expected = full[:min(hits)[1]] if hits else full
    detok = IncrementalDetokenizer(tok, stop=stops)
    shown, i, stop = "", 0, None
    while i < len(ids) and stop is None:
        n = rng.randint(1, 3)
        step = detok.step(ids[i:i + n])
        shown += step.text
        stop = step.stop
        assert expected.startswith(shown)
        i += n
    shown += detok.finish()
    assert shown == expected
    assert stop == (min(hits)[2] if hits else None)
    if FFFD not in full:
        assert FFFD not in shown


def test_random_sequences(tok):
    rng = random.Random(0)
    pieces = [tok.encode(t) for t in TEXTS]
    for _ in range(150):
        ids = []
        for _ in range(rng.randint(1, 4)):
            piece = rng.choice(pieces)
            a = rng.randrange(len(piece))
            ids += piece[a:a + rng.randint(1, 20)]
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(max(len(full), 1))
            stops.append(full[a:a + rng.randint(1, 6)] if rng.random() < 0.7 else "zq!")
        # A stop ending in U+FFFD could only match the unfinished tail, which no stream shows.
        check_stream(tok, ids, [s for s in stops if s and FFFD not in s], rng)


def test_random_ids_decode_like_the_whole(tok):
    rng = random.Random(3)
    for vocab_tok in (tok, dummy_tokenizer(512, 1, (2,))):
        for _ in range(20):
            ids = [rng.randrange(vocab_tok.vocab_size) for _ in range(rng.randint(1, 40))]
            deltas, _, tail = stream(IncrementalDetokenizer(vocab_tok), ids, random.Random(4))
            assert "".join(deltas) + tail == vocab_tok.decode(ids)


def test_invalid_bytes_do_not_hold_text_forever(tok):
    dummy = dummy_tokenizer(512, 1, (2,))
    lone = dummy.encode("é")[1]  # a lone continuation byte: invalid UTF-8 on its own
    ids = dummy.encode("ok ") + [lone] * 12 + dummy.encode(" end")
    detok = IncrementalDetokenizer(dummy)
    deltas = [detok.step([i]).text for i in ids]
    assert "".join(deltas[:6]).startswith("ok " + FFFD)  # released despite the garbage
    assert "".join(deltas) + detok.finish() == dummy.decode(ids)


def test_random_resumes(tok):
    rng = random.Random(5)
    pieces = [tok.encode(t) for t in TEXTS]
    for _ in range(60):
        ids = []
        for _ in range(rng.randint(1, 4)):
            piece = rng.choice(pieces)
            a = rng.randrange(len(piece))
            ids += piece[a:a + rng.randint(1, 25)]
        full = tok.decode(ids)
        a = rng.randrange(max(len(full), 1))
        stops = [s for s in (full[a:a + rng.randint(1, 30)] + rng.choice(["", "!"]),)
                 if s and FFFD not in s]
        k = rng.randrange(len(ids) + 1)
        original = IncrementalDetokenizer(tok, stop=stops)
        for i in ids[:k]:
            original.step([i])
        if original.finished:
            continue
        resumed = IncrementalDetokenizer(tok, stop=stops, delivered_ids=ids[:k])
        for i in ids[k:]:
            assert original.step([i]) == resumed.step([i])
        assert original.finish() == resumed.finish()


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode(TEXTS[0])  # "The capital of France is Paris. It is ..."
    assert tok.decode(ids[:1]) == "The"
    deltas, stop, _ = stream(IncrementalDetokenizer(tok, stop=[" is"]), ids)
    assert "".join(deltas) == "The capital of France" and stop == " is"
    # " is" completes at token 5: with 5 tokens unchecked the second " is" ends the text
    deltas, stop, _ = stream(IncrementalDetokenizer(tok, stop=[" is"], min_tokens=5), ids)
    assert "".join(deltas) == "The capital of France is Paris. It" and stop == " is"


@pytest.mark.parametrize("min_tokens", [1, 4, 9])
def test_resume_with_min_tokens_continues_exactly(tok, min_tokens):
    ids = tok.encode(" ".join(TEXTS))
    stops = ["France", "is P", "Tower."]
    for k in range(0, 30):
        original = IncrementalDetokenizer(tok, stop=stops, min_tokens=min_tokens)
        for i in ids[:k]:
            original.step([i])
        if original.finished:
            break
        resumed = IncrementalDetokenizer(tok, stop=stops, delivered_ids=ids[:k],
                                         min_tokens=min_tokens)
        for i in ids[k:]:
            assert original.step([i]) == resumed.step([i]), (k, i)
        assert original.finish() == resumed.finish()
