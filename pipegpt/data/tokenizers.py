"""Tokenizers: UTF-8 bytes (no download), GPT-2 BPE via tiktoken, and any Hugging Face tokenizer.json via the
tokenizers library (offline: the file is the whole tokenizer); DataError for unusable data."""
from __future__ import annotations

from pathlib import Path

from pipegpt.config import ConfigError, TOKENIZERS, is_tokenizer_file


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


class HuggingFaceTokenizer:
    """A tokenizer.json (Llama, Mistral, Qwen2, SmolLM ...): named by its absolute path, which is what
    checkpoints and prepared data remember. Text is encoded without special tokens (no BOS), as documents are
    joined by prepare; the end-of-text token is the file's </s>, <|endoftext|> or <|end_of_text|> if it has one."""

    END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>")

    def __init__(self, path: str):
        file = Path(path).expanduser()
        if not file.is_file():
            raise DataError(f"tokenizer {path}: no such file (give bytes, gpt2 or the path of a Hugging Face "
                            f"tokenizer.json)")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a tokenizer.json needs the tokenizers library: pip install tokenizers") from None
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 - any unreadable file is one line
            raise DataError(f"tokenizer {path}: not a Hugging Face tokenizer.json ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:100]})") from None
        self.name = str(file.resolve())
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = next((i for i in map(self._tok.token_to_id, self.END_OF_TEXT) if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def tokenizer_size(name: str) -> int:
    """How many token ids a tokenizer gives; gpt2's is known without fetching its BPE files."""
    return 50257 if name == "gpt2" else get_tokenizer(name).vocab_size


def _is_network_error(error: BaseException) -> bool:
    """A failed download (requests' and urllib's errors are OSErrors), as opposed to a bad file."""
    return isinstance(error, OSError) or any(word in type(error).__name__ for word in ("Connection", "Timeout", "HTTP"))


def get_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    if name == "gpt2":
        return TiktokenTokenizer("gpt2")
    if is_tokenizer_file(name):
        return HuggingFaceTokenizer(name)
    raise DataError(f"unknown tokenizer {name!r}: use one of {', '.join(TOKENIZERS)} or the path of a Hugging Face "
                    f"tokenizer.json")
