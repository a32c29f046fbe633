"""`HFTokenizer.decode` reads byte-level vocabularies from a table of each token's bytes: it must give
exactly what `tokenizers`' own decode gives (the rollout loop parses tool calls and scores answers
from this text), whatever the ids: every single token, multi-byte characters split across tokens,
invalid UTF-8, special tokens with and without `skip_special_tokens`, ids past the vocabulary,
negative ids, and lists, numpy arrays and TokenArrays alike."""

import json
import random

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from rstar_jax.agent.tokenizer import HFTokenizer  # noqa: E402
from rstar_jax.rollout.tokens import TokenArray  # noqa: E402


def reference(tok: HFTokenizer, ids, skip_special_tokens=False) -> str:
    return tok._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def qwen(qwen3_tokenizer_dir):
    return HFTokenizer(qwen3_tokenizer_dir)


def test_every_single_token_decodes_as_tokenizers_does(qwen):
    assert qwen._byte_level
    for skip in (False, True):
        for i in range(qwen.vocab_size + 2):  # and two ids past the vocabulary (dropped)
            assert qwen.decode([i], skip) == reference(qwen, [i], skip), (i, skip)
    assert qwen._byte_tables[False] is not None  # the table path, not tokenizers, answered


def _byte_ids(tok: HFTokenizer) -> dict[int, int]:
    """byte value -> the id of the token that is that one byte."""
    table = tok._byte_tables.get(False) or tok._byte_table(False)
    return {raw[0]: i for i, raw in enumerate(table) if len(raw) == 1}


def test_multibyte_characters_split_across_tokens_and_invalid_utf8(qwen):
    qwen.decode([0])
    byte_id = _byte_ids(qwen)
    assert len(byte_id) == 256

    def ids_of(raw: bytes) -> list[int]:
        return [byte_id[b] for b in raw]

    cases = [
        "é".encode(), "😀".encode(), "中文".encode(),
        "😀".encode()[:3],  # a character cut short at the end
        "😀".encode()[1:],  # continuation bytes with no lead
        b"\xed\xa0\x80",  # a UTF-16 surrogate written as UTF-8
        b"\xc0\x80", b"\xe0\x80\xaf",  # overlong forms
        b"\xf5\x80\x80\x80", b"\xff", b"\xfe\xfe",  # bytes no UTF-8 has
        b"a\xe2\x82z\xe2\x82\xacb\xf0\x9f",  # a truncated character between valid ones
    ]
    for raw in cases:
        ids = ids_of(raw)
        assert qwen.decode(ids) == reference(qwen, ids), raw
    # Each half of a character in its own BPE token, with ordinary tokens around it.
    word = qwen.encode("the answer is 42")
    for raw in cases:
        ids = word + ids_of(raw) + word
        assert qwen.decode(ids) == reference(qwen, ids), raw


def test_random_sequences_and_every_container(qwen):
    qwen.decode([0])
    singles = list(_byte_ids(qwen).values())
    specials = [qwen.eos_id, qwen.pad_id, qwen.token_to_id("<|im_start|>"), qwen.token_to_id("<tool_call>")]
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.choice(singles) if rng.random() < 0.5 else
               rng.choice(specials) if rng.random() < 0.1 else
               rng.randrange(qwen.vocab_size + 50) for _ in range(rng.randint(0, 16))]
        for skip in (False, True):
            want = reference(qwen, ids, skip)
            for form in (ids, tuple(ids), np.asarray(ids, np.int64), np.asarray(ids, np.int32), TokenArray(ids)):
                assert qwen.decode(form, skip) == want, (ids, skip, type(form))
    text = "Let me compute it.\n<tool_call>\n{\"name\": \"python\"}\n</tool_call><|im_end|>"
    assert qwen.decode(qwen.encode(text)) == text
    assert qwen.decode([]) == qwen.decode(np.zeros(0, np.int32)) == ""


def test_negative_ids_fail_as_tokenizers_does(qwen):
    for ids in ([-1, 5], np.array([5, -1])):
        with pytest.raises(OverflowError):
            qwen.decode(ids)
        with pytest.raises(OverflowError):
            reference(qwen, [-1, 5])


def _byte_level_tokenizer(tmp_path, decoder: dict):
    """A tiny byte-level BPE vocabulary with added tokens: with a space, a CJK character (outside
    GPT-2's byte alphabet: such a token's bytes are its own UTF-8, whatever else it holds), and
    with a non-ASCII character of the alphabet."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["Ġthe"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel() if decoder["type"] == "ByteLevel" else decoders.Metaspace()
    tok.add_tokens([AddedToken(t, special=False) for t in ("a b", "naïve", "中文", "Ġ x")])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer(path)


def test_added_tokens_outside_the_byte_alphabet(tmp_path):
    tok = _byte_level_tokenizer(tmp_path, {"type": "ByteLevel"})
    assert tok._byte_level
    for skip in (False, True):
        for i in range(tok.vocab_size + 1):
            assert tok.decode([i], skip) == reference(tok, [i], skip), i
        ids = list(range(tok.vocab_size)) * 2
        random.Random(1).shuffle(ids)
        assert tok.decode(ids, skip) == reference(tok, ids, skip)
    # "a b" has a space (not in the alphabet): its own UTF-8. "naïve"'s characters are all in it
    # ("ï" stands for byte 0xEF), so tokenizers maps them to bytes, and so must the table.
    pair = [tok.token_to_id("a b"), tok.token_to_id("naïve")]
    assert tok.decode(pair) == reference(tok, pair) == "a bna\ufffdve"
    others = [tok.token_to_id("中文"), tok.token_to_id("Ġ x")]
    assert tok.decode(others) == reference(tok, others) == "中文Ġ x"


def test_other_decoders_are_left_to_tokenizers(tmp_path):
    tok = _byte_level_tokenizer(tmp_path, {"type": "Metaspace"})
    assert not tok._byte_level
    ids = list(range(tok.vocab_size))
    assert tok.decode(ids) == reference(tok, ids)
    assert tok._byte_tables == {}
    assert json.loads((tmp_path / "tokenizer.json").read_text())["decoder"]["type"] == "Metaspace"
