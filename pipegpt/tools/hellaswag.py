"""`pipegpt hellaswag`: HellaSwag accuracy of a checkpoint, in one process or on workers in a layout (the format and
the scoring rule are in pipegpt.data.hellaswag, whose score_on_engine the workers run, as the training loop's do at
evaluation steps)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipegpt.config import ConfigError
from pipegpt.data.hellaswag import read_examples, render_all, score
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


def evaluate(path, file, limit: int | None = None, tokenizer: str | None = None, device: str = "cpu",
             layout=None, timeout_s: float = 60.0) -> Result:
    """HellaSwag acc and acc_norm of a checkpoint (or of a run directory's latest) on a jsonl file: in one process,
    or on workers in `layout` (pipegpt.infer.job.Layout) holding a slice of the model each."""
    examples = read_examples(file, limit)  # a bad file is refused before the checkpoint is read
    if layout is not None:
        return _on_workers(path, file, examples, tokenizer, device, layout, timeout_s)
    dev = pick_device(device)
    model, manifest, found = load_model(path, dev)
    name = tokenizer or manifest.get("tokenizer") or "bytes"
    _check_seq_len(model.config.seq_len, found)
    correct, correct_norm = score(model, examples, name, file)
    return Result(len(examples), correct, correct_norm, found, name, Path(file))


def _on_workers(path, file, examples, tokenizer, device, layout, timeout_s) -> Result:
    from pipegpt.infer.job import InferenceJob

    job = InferenceJob(path, layout, device, timeout_s)  # refuses a bad layout before any worker starts
    name = tokenizer or job.manifest.get("tokenizer") or "bytes"
    _check_seq_len(job.model.seq_len, job.found)
    rendered = render_all(examples, name, job.model.seq_len, job.model.vocab_size, file)
    with job:
        job.start()
        correct, correct_norm = job.hellaswag(examples, rendered)
    return Result(len(examples), correct, correct_norm, job.found, name, Path(file))


def _check_seq_len(seq_len: int, found: Path) -> None:
    if seq_len < 2:
        raise ConfigError(f"{found}: seq_len={seq_len}: a model must see at least 2 tokens to score an ending")
