"""Tokenizers with one interface: Hugging Face `tokenizer.json` for real models, bytes for tiny ones.

The byte tokenizer maps bytes to ids 0..255 and the ChatML specials to the ids after them, so a
tiny model can learn the exact rStar2 protocol strings without a trained vocabulary. Special
tokens are recognised as whole strings when encoding.
"""

from __future__ import annotations

import functools
import json
import logging
import operator
import os
import pathlib
import re
from typing import Protocol, Sequence

import numpy as np

log = logging.getLogger(__name__)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHATML_SPECIALS = (ENDOFTEXT, IM_START, IM_END)


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int  # <|im_end|>: ends an assistant turn
    im_end_id: int  # the same id as eos_id
    pad_id: int
    # Ids that end a generation: `<|im_end|>` first, then the rest of the model's EOS set (its
    # generation config's eos_token_id), as SGLang and transformers stop on the whole set.
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and each token's (start, end) character span in `text`."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_to_id(self, token: str) -> int: ...


class ByteTokenizer:
    """Bytes 0..255, then the ChatML specials; vocab padded to a multiple of 64 (320).

    The padding keeps embedding and logit shapes friendly to sharding and matmul tiling; padded ids
    decode as `<|unused_N|>`. `allowed_specials` limits which specials are recognised when encoding
    (the others are encoded as their bytes), e.g. to keep a user's literal `<|im_end|>` harmless.
    """

    def __init__(self, specials: Sequence[str] = CHATML_SPECIALS, pad_to_multiple: int = 64,
                 allowed_specials: Sequence[str] | None = None):
        self.specials = tuple(specials)
        allowed = self.specials if allowed_specials is None else tuple(allowed_specials)
        unknown = [s for s in allowed if s not in self.specials]
        if unknown:
            raise ValueError(f"ByteTokenizer.allowed_specials: {unknown} are not among the specials {self.specials}")
        self._special_ids = {s: 256 + i for i, s in enumerate(self.specials)}
        self._id_to_special = {i: s for s, i in self._special_ids.items()}
        raw = 256 + len(self.specials)
        self.vocab_size = -(-raw // pad_to_multiple) * pad_to_multiple
        self._split = (re.compile("(" + "|".join(re.escape(s) for s in allowed) + ")") if allowed else None)
        self.eos_id = self.im_end_id = self._special_ids[IM_END]
        self.pad_id = self._special_ids[ENDOFTEXT]
        self.stop_ids = tuple(self._special_ids[s] for s in (IM_END, ENDOFTEXT) if s in self._special_ids)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        if self._split is None:
            return list(text.encode("utf-8"))
        for piece in self._split.split(text):
            if not piece:
                continue
            if piece in self._special_ids:
                ids.append(self._special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        pieces = self._split.split(text) if self._split is not None else [text]
        position = 0
        for piece in pieces:
            if piece in self._special_ids and self._split is not None:
                ids.append(self._special_ids[piece])
                offsets.append((position, position + len(piece)))
            else:
                for i, char in enumerate(piece):
                    raw = char.encode("utf-8")
                    ids.extend(raw)
                    offsets.extend([(position + i, position + i + 1)] * len(raw))
            position += len(piece)
        return ids, offsets

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if i in self._id_to_special:
                if not skip_special_tokens:
                    out.append(self._id_to_special[i])
            elif not skip_special_tokens:
                out.append(f"<|unused_{i}|>")  # padding ids the model may still sample
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_to_id(self, token: str) -> int:
        if token in self._special_ids:
            return self._special_ids[token]
        raw = token.encode("utf-8")
        if len(raw) == 1:
            return raw[0]
        raise KeyError(f"{token!r} is not a single token of the byte tokenizer")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` library (no transformers needed).

    generation_config: the model's `generation_config.json` (or its directory); its `eos_token_id`
    (an id or a list) joins `<|im_end|>` and `<|endoftext|>` in `stop_ids`. None: the one beside the
    tokenizer, if any.
    """

    def __init__(self, path: str | os.PathLike, generation_config: str | os.PathLike | None = None):
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as e:  # an optional extra: the base install is the library without it
            raise ImportError(f"HFTokenizer needs the `tokenizers` package ({e}): "
                              "pip install 'rstar-jax[train]' (or [serve])") from e

        path = pathlib.Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise FileNotFoundError(f"tokenizer file {file} does not exist")
        self._tok = _Tokenizer.from_file(str(file))
        for special in (IM_START, IM_END):
            if self._tok.token_to_id(special) is None:
                raise ValueError(f"{file}: the tokenizer has no {special!r} token (a ChatML vocabulary is required)")
        self.eos_id = self.im_end_id = self._tok.token_to_id(IM_END)
        pad = self._tok.token_to_id(ENDOFTEXT)
        self.pad_id = pad if pad is not None else self.eos_id
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # decode() reads each token's bytes from a table (built on first use) where the decoder is
        # tokenizers' plain ByteLevel one; else it asks tokenizers.
        self._byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
        self._byte_tables: dict[bool, list[bytes]] = {}
        source = file.parent if generation_config is None else pathlib.Path(generation_config)
        eos = _generation_eos(source, required=generation_config is not None) or []
        # An eos id no token of this vocabulary has (a transformers-made tiny model keeps Qwen's
        # default 151643) is never a token the model's text can end with: left out, and said.
        unknown = [i for i in eos if i >= self.vocab_size]
        if unknown:
            log.warning("%s: eos_token_id %s outside the tokenizer's %d tokens; stopping on the others",
                        source, unknown, self.vocab_size)
        self.stop_ids = tuple(dict.fromkeys([self.eos_id, *(i for i in eos if i < self.vocab_size),
                                             *([pad] if pad is not None else [])]))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(span) for span in encoding.offsets]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """`tokenizers`' decode of `ids`. Where the vocabulary's decoder is byte-level (Qwen's, GPT-2's),
        the same string is read from a table of each token's bytes (built on first use), without
        tokenizers' per-token work: about a sixth of its time for a 1,200-token turn."""
        table = self._byte_tables.get(skip_special_tokens)
        if table is None and self._byte_level:
            table = self._byte_tables[skip_special_tokens] = self._byte_table(skip_special_tokens)
        if getattr(getattr(ids, "dtype", None), "kind", "") in ("i", "u"):
            # An integer array (numpy, rstar_jax.rollout.tokens.TokenArray) converts in one call.
            array = np.asarray(ids)
            as_list = array.tolist()
            tabled = table is not None and array.ndim == 1 and (
                not array.size or (int(array.min()) >= 0 and int(array.max()) < len(table)))
        else:
            as_list = [int(i) for i in ids]
            tabled = table is not None and (not as_list or (min(as_list) >= 0 and max(as_list) < len(table)))
        if tabled:
            if len(as_list) > 1:
                raw = b"".join(operator.itemgetter(*as_list)(table))
            else:
                raw = table[as_list[0]] if as_list else b""
            return raw.decode("utf-8", "replace")
        # Not byte-level, or an id outside the vocabulary (tokenizers drops one past it, refuses a
        # negative one): tokenizers itself.
        return self._tok.decode(as_list, skip_special_tokens=skip_special_tokens)

    def _byte_table(self, skip_special_tokens: bool) -> list[bytes]:
        """Each id's bytes as `tokenizers`' ByteLevel decoder gives them: the token's characters
        mapped back through GPT-2's byte-to-character table, or, when one of them is not in it (an
        added token with a space, say), the token's own UTF-8; b"" for an id with no token and, when
        `skip_special_tokens`, for the special tokens. The decoder joins every token's bytes and
        decodes them once, invalid sequences replaced (Rust's `from_utf8_lossy`, which replaces as
        Python's "replace" handler does: one U+FFFD per maximal invalid subsequence)."""
        byte_of, outside = _byte_level_chars()
        specials = set()
        if skip_special_tokens:
            specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        table = []
        for i in range(self._tok.get_vocab_size(with_added_tokens=True)):
            token = self._tok.id_to_token(i)
            if token is None or token in specials:
                table.append(b"")
                continue
            # A character outside the alphabet: the decoder takes the token's own UTF-8.
            table.append(token.encode() if token.translate(outside) else token.translate(byte_of).encode("latin-1"))
        return table

    def token_to_id(self, token: str) -> int:
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"{token!r} is not in the tokenizer's vocabulary")
        return tid


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> tuple[dict[int, int], dict[int, None]]:
    """GPT-2's byte-level alphabet as two `str.translate` tables: each of its characters to its byte
    (a code point below 256, so that the translated text's latin-1 encoding is the token's bytes),
    as `tokenizers`' ByteLevel decoder reads a token back; and each of its characters deleted (what
    is left of a token is what the alphabet lacks)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shifted
            shifted += 1
    return {char: byte for byte, char in chars.items()}, dict.fromkeys(chars.values())


def _generation_eos(path: pathlib.Path, *, required: bool) -> list[int] | None:
    """`eos_token_id` of a generation config (a file or its directory) as a list; None when there is
    no such file (and it is not `required`) or it names no eos."""
    file = path / "generation_config.json" if path.is_dir() else path
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"generation config {file} does not exist")
        return None
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{file}: not a JSON object ({e})") from None
    eos = [eos] if isinstance(eos, int) else eos
    if eos is None:
        return None
    # Not bounded by the tokenizer's size: a model's embedding may be larger (Qwen3: 151,936 rows for
    # 151,669 tokens), and an id no token has is simply never sampled.
    if not (isinstance(eos, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos)):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of token ids, got {eos!r}")
    return eos


def load_tokenizer(kind: str, path: str | os.PathLike | None = None,
                   generation_config: str | os.PathLike | None = None) -> Tokenizer:
    """generation_config (hf only): where the model's EOS set is read (see `HFTokenizer`)."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        if not path:
            raise ValueError("an hf tokenizer needs a path (tokenizer.json or its directory)")
        return HFTokenizer(path, generation_config)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'byte' or 'hf'")
