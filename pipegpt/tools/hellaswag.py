"""`pipegpt hellaswag`: HellaSwag accuracy of a checkpoint, in one process (the format and the scoring
rule are in pipegpt.data.hellaswag, which the training loop also runs at evaluation steps)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipegpt.config import ConfigError
from pipegpt.data.hellaswag import read_examples, score
from pipegpt.tools.sample import load_model, pick_device


@dataclass
class Result:
    examples: int
    correct: int           # argmin of the summed ending loss is the label
    correct_norm: int      # argmin of the mean ending loss per token is the label
    checkpoint: Path
    tokenizer: str
    file: Path

    @property
    def acc(self) -> float:
        return self.correct / self.examples

    @property
    def acc_norm(self) -> float:
        return self.correct_norm / self.examples

    def as_dict(self) -> dict:
        return {"examples": self.examples, "acc": self.acc, "acc_norm": self.acc_norm, "correct": self.correct,
                "correct_norm": self.correct_norm, "checkpoint": str(self.checkpoint), "tokenizer": self.tokenizer,
                "file": str(self.file)}


def evaluate(path, file, limit: int | None = None, tokenizer: str | None = None, device: str = "cpu") -> Result:
    """HellaSwag acc and acc_norm of a checkpoint (or of a run directory's latest) on a jsonl file."""
    examples = read_examples(file, limit)  # a bad file is refused before the checkpoint is read
    dev = pick_device(device)
    model, manifest, found = load_model(path, dev)
    name = tokenizer or manifest.get("tokenizer") or "bytes"
    if model.config.seq_len < 2:
        raise ConfigError(f"{found}: seq_len={model.config.seq_len}: a model must see at least 2 tokens to score "
                          f"an ending")
    correct, correct_norm = score(model, examples, name, file)
    return Result(len(examples), correct, correct_norm, found, name, Path(file))
