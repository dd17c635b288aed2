"""The tokenizer built from the embedded GGUF must tokenise exactly as SmolLM2's own tokenizer;
transformers' GGUF path is the reference (where it is right, see the digit test)."""

import os
import random

import gguf
import pytest

from tokstream.errors import UserInputError
from tokstream.model.presets import PRESETS, dummy_config
from tokstream.model.source import ModelSource, embedded_gguf_path
from tokstream.text.chat_template import PLAIN_CHAT_TEMPLATE, TEMPLATE_NAMES
from tokstream.text.tokenizer import Tokenizer, dummy_tokenizer, load_tokenizer

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CHATML_FRANCE = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
EMOJI_CJK = "emoji 😀🎉👍🏽 and CJK 你好世界 日本語のテキスト 한국어"
VARIED = [
    "Hello world", "The capital of France is", "12345", "a 12345 b", "3.14159 and 1,000,000",
    "def f(x):\n    return x**2  # square\n", "for (int i = 0; i < n; ++i) { s += a[i]; }",
    "a   b\t\tc\n\n\nd", " leading space", "trailing spaces  ", "   ", "\n", "",
    EMOJI_CJK, "naïve café résumé Ünïcödé Ångström",
    "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|><repo_name>x<file_sep>y",
    "don't I'll we've THEY'RE", "mixed\r\nline\rendings", "🏳️‍🌈 family 👨‍👩‍👧",
]


@pytest.fixture(scope="module")
def smollm2():
    source = ModelSource("gguf", embedded_gguf_path(), dummy_config("smollm2-135m"))
    return load_tokenizer(source)


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    path = embedded_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path))


def test_raw_text_has_no_bos(smollm2):
    assert smollm2.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


def test_special_tokens(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.bos_token_id == 1 and smollm2.eos_token_ids == (2,)
    assert smollm2.encode("<|im_start|>") == [1]
    assert smollm2.encode("<|im_end|>") == [2]
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert smollm2.decode(ids) == "user\nhi"
    assert smollm2.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


@pytest.mark.startup
def test_same_ids_as_transformers(smollm2, reference):
    for text in VARIED:
        assert smollm2.encode(text) == reference(text, add_special_tokens=False).input_ids, text


@pytest.mark.parametrize("text", ["x  1", "\n\n1", "  42", "ℕ  ² ½"])
def test_digits_are_split_before_the_gpt2_regex(smollm2, text):
    # SmolLM2's tokenizer.json runs Digits(individual_digits) before ByteLevel, and llama.cpp's
    # "smollm" pre-tokenizer splits \p{N} first; transformers' GGUF conversion uses the plain
    # GPT-2 split, so only here it cuts a whitespace run before a digit differently.
    words = [w for w, _ in smollm2.backend.pre_tokenizer.pre_tokenize_str(text)]
    decoded = [bytes(smollm2.backend.decoder.decode([w]), "utf-8") for w in words]
    assert b"".join(decoded).decode() == text
    assert all(len(w.decode()) == 1 for w in decoded if any(c.isnumeric() for c in w.decode()))
    assert smollm2.decode(smollm2.encode(text)) == text
    assert smollm2.encode("x  1") == [104, 256, 33]  # "x", "  ", "1"


def test_round_trip(smollm2):
    for text in VARIED:
        assert smollm2.decode(smollm2.encode(text), skip_special_tokens=False) == text


@pytest.mark.startup
def test_chatml_matches_reference(smollm2, reference):
    assert smollm2.apply_chat_template(FRANCE) == CHATML_FRANCE
    ids = smollm2.encode_chat(FRANCE)
    assert len(ids) == 37 and ids[0] == 1
    assert ids[-4:] == [1, *smollm2.encode("assistant\n")]
    expected = reference.apply_chat_template(FRANCE, tokenize=True, add_generation_prompt=True)
    assert ids == list(getattr(expected, "input_ids", expected))


def test_chat_template_keeps_a_given_system_prompt(smollm2):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = smollm2.apply_chat_template(messages, add_generation_prompt=False)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello<|im_end|>\n")


def test_messages_the_template_cannot_render_are_user_errors(smollm2):
    with pytest.raises(UserInputError, match="chat template"):
        smollm2.apply_chat_template([{"role": "user", "content": [{"type": "text"}]}])
    with pytest.raises(UserInputError, match="chat template"):
        smollm2.apply_chat_template([{"content": "no role"}])


def test_template_errors_and_fallback():
    tok = dummy_tokenizer(512, 1, (2,))
    assert tok.chat_template is None
    assert tok.apply_chat_template(FRANCE) == "User: What is the capital of France?\n\nAssistant:"
    assert tok.decode(tok.encode_chat(FRANCE)) == tok.apply_chat_template(FRANCE)
    strict = Tokenizer(tok.backend, chat_template=(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"))
    assert strict.apply_chat_template(FRANCE) == "ok"
    with pytest.raises(UserInputError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert "User:" in Tokenizer(tok.backend, chat_template=PLAIN_CHAT_TEMPLATE).apply_chat_template(
        [{"role": "user", "content": ""}])


def test_template_kwargs_reach_the_template_and_cannot_replace_its_own_names():
    tok = dummy_tokenizer(512, 1, (2,))
    thinking = Tokenizer(tok.backend, chat_template=(
        "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"))
    assert thinking.apply_chat_template(FRANCE) == "What is the capital of France?|"
    off = thinking.encode_chat(FRANCE, template_kwargs={"enable_thinking": False})
    assert tok.decode(off) == "What is the capital of France?|<no-think>"
    # with special-token text in a message the render takes the other path: the same kwargs
    special = [{"role": "user", "content": "<|eos|>"}]
    assert tok.decode(thinking.encode_chat(special, template_kwargs={"enable_thinking": False}),
                      skip_special_tokens=False) == "<|eos|>|<no-think>"
    assert {"messages", "add_generation_prompt", "tools", "bos_token"} <= TEMPLATE_NAMES


def test_saved_folder_loads_back_everywhere(smollm2, tmp_path):
    smollm2.save(tmp_path)
    again = load_tokenizer(ModelSource("hf", str(tmp_path), dummy_config("smollm2-135m")))
    assert again.chat_template == smollm2.chat_template
    assert again.bos_token_id == 1 and again.eos_token_ids == (2,)
    for text in VARIED:
        assert again.encode(text) == smollm2.encode(text)
    assert again.encode_chat(FRANCE) == smollm2.encode_chat(FRANCE)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    # Saved with our pre-tokenizer, so transformers now splits digits as SmolLM2 does too.
    assert theirs("x  1 " + EMOJI_CJK, add_special_tokens=False).input_ids == \
        smollm2.encode("x  1 " + EMOJI_CJK)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dummy_tokenizer_covers_the_vocab(name):
    config = dummy_config(name)
    tok = load_tokenizer(ModelSource("dummy", None, config))
    assert tok.vocab_size == config.vocab_size
    assert tok.bos_token_id == config.bos_token_id and tok.eos_token_ids == config.eos_token_ids
    assert tok.to_json() == dummy_tokenizer(config.vocab_size, config.bos_token_id,
                                            config.eos_token_ids).to_json()
    for text in VARIED:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode(tok.decode([config.eos_token_ids[0]], skip_special_tokens=False)) == \
        [config.eos_token_ids[0]]
    # A random-weight model emits any id below vocab_size; each must decode quietly.
    rng = random.Random(0)
    ids = rng.sample(range(config.vocab_size), 300) + [config.vocab_size - 1, 0]
    assert isinstance(tok.decode(ids), str)
    assert all(isinstance(tok.decode([i]), str) for i in ids)


def test_dummy_tokenizer_needs_room_for_bytes():
    with pytest.raises(UserInputError, match="vocab_size"):
        dummy_tokenizer(200, 1, (2,))


def write_gguf(path, model="gpt2", pre="smollm"):
    """A GGUF holding only tokenizer metadata: 256 bytes, one merge, a control and a
    user-defined token."""
    from tokstream.text.tokenizer import _bytes_to_unicode

    alphabet = list(_bytes_to_unicode().values())
    tokens = ["<|ctl|>", "<think>", *alphabet, "ab"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3, 4] + [1] * (len(tokens) - 2))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_control_and_user_defined_tokens(tmp_path):
    tok = load_tokenizer(ModelSource("gguf", write_gguf(tmp_path / "t.gguf"), dummy_config("tiny")))
    ab = len(tok.backend.get_vocab()) - 1
    assert tok.encode("ab<|ctl|>x<think>") == [ab, 0, tok.encode("x")[0], 1]
    assert tok.decode(tok.encode("ab<|ctl|>x<think>")) == "abx<think>"
    assert tok.chat_template is None and tok.eos_token_ids == (0, 2)  # file's, then config's


@pytest.mark.parametrize("model, pre, named", [("llama", "default", "'llama'"),
                                               ("bert", "default", "'bert'"),
                                               ("gpt2", "mystery", "'mystery'")])
def test_unsupported_gguf_tokenizer_is_named(tmp_path, model, pre, named):
    path = write_gguf(tmp_path / "t.gguf", model, pre)
    with pytest.raises(UserInputError, match=named):
        load_tokenizer(ModelSource("gguf", path, dummy_config("tiny")))
