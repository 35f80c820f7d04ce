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
        except ImportError:
            raise DataError(f"the {name} tokenizer needs tiktoken: pip install tiktoken, or use --tokenizer bytes") \
                from None
        try:
            self._enc = tiktoken.get_encoding(name)
        except Exception as e:  # tiktoken downloads its BPE files on first use
            # The error's own text (a URL, a retry count, a resolver message) says no more than its type.
            cause = "no network?" if _is_network_error(e) else "a damaged cache?"
            raise DataError(f"cannot load the {name} tokenizer: tiktoken could not fetch its BPE files "
                            f"({type(e).__name__}: {cause}): set TIKTOKEN_CACHE_DIR to a cache copied from a "
                            f"machine online, or use --tokenizer bytes") from None
        self.name = name
        self.vocab_size = self._enc.n_vocab
        self.eot_token = self._enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])


def _is_network_error(error: BaseException) -> bool:
    """A failed download (requests' and urllib's errors are OSErrors), as opposed to a bad file."""
    return isinstance(error, OSError) or any(word in type(error).__name__ for word in ("Connection", "Timeout", "HTTP"))


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer("gpt2")
    raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)}")
