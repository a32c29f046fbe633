"""Helpers shared by tests: top-level (picklable) functions for code run in spawned worker
processes, and a small ChatML tokenizer file."""

import pathlib
import time


def slow_score(text: str, gold: str) -> float:
    if "hang" in text:
        time.sleep(60)
    return 1.0 if gold in text else 0.0


def write_chatml_tokenizer(directory: pathlib.Path) -> dict[str, int]:
    """A character-level `tokenizer.json` with the ChatML specials (<|endoftext|>, <|im_start|>,
    <|im_end|>) in `directory`; returns the specials' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz <>/\n")}
    tok = Tokenizer(models.WordLevel(vocab={**vocab, "[UNK]": len(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))
    return {name: tok.token_to_id(name) for name in specials}
