"""Tokenizers: UTF-8 bytes (no download) and GPT-2 BPE via tiktoken; DataError for unusable data."""
from __future__ import annotations

from pipegpt.config import ConfigError, TOKENIZERS


class DataError(ConfigError):
    """Data or a tokenizer cannot be loaded (one-line, user-facing message).

    A ConfigError (the --data or --tokenizer value is unusable), so the CLI, which catches ConfigError
    without importing this module, prints it as one `Error:` line with exit status 2.
    """


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no download, no unknown tokens."""

    name = "bytes"
    vocab_size = 256
    eot_token = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """GPT-2 BPE via tiktoken (vocabulary 50257; end of text is token 50256)."""

    def __init__(self, name: str = "gpt2"):
        try:
            import tiktoken

            self._enc = tiktoken.get_encoding(name)
        except Exception as e:  # tiktoken downloads its BPE file on first use
            first = (str(e).splitlines() or [type(e).__name__])[0][:200]
            raise DataError(
                f"cannot load the tiktoken {name!r} tokenizer: {type(e).__name__}: {first}; tiktoken needs the "
                f"network once to fetch its BPE files: offline, set TIKTOKEN_CACHE_DIR to a directory holding "
                f"tiktoken's cache from a machine that fetched them (by default <tmp>/data-gym-cache), "
                f"or use --tokenizer bytes"
            ) from None
        self.name = name
        self.vocab_size = self._enc.n_vocab
        self.eot_token = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer("gpt2")
    raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)}")
