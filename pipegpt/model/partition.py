"""Which layers go to which stage."""
from __future__ import annotations

from pipegpt.config import ConfigError


def partition_layers(n_layer: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[range]:
    """Split n_layer blocks into num_stages contiguous ranges.

    Evenly by default. The first stage also carries the embedding and the last
    the head and the loss (the heaviest single piece with a large vocabulary),
    so remainder layers go to the middle stages first, then to the first stage.
    """
    if layers_per_stage is None:
        if n_layer < num_stages:
            raise ConfigError(f"n_layer={n_layer} is fewer than the {num_stages} pipeline stages it must fill: "
                              f"use at most {n_layer} stage{'s' * (n_layer > 1)} or at least {num_stages} layers")
        base, extra = divmod(n_layer, num_stages)
        preference = list(range(1, num_stages - 1)) + [0, num_stages - 1]
        counts = [base] * num_stages
        for s in preference[:extra]:
            counts[s] += 1
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages:
            raise ConfigError(f"layers-per-stage {','.join(map(str, counts))} has {len(counts)} entries "
                              f"but there are {num_stages} stages")
        if sum(counts) != n_layer:
            even = ",".join(str(len(r)) for r in partition_layers(n_layer, num_stages)) if n_layer >= num_stages else ""
            raise ConfigError(f"layers-per-stage {','.join(map(str, counts))} sums to {sum(counts)} "
                              f"but the model has n_layer={n_layer}" + (f": e.g. {even}" if even else ""))
        for s, c in enumerate(counts):
            ends = s in (0, num_stages - 1)
            if c < 0 or (c == 0 and not ends):
                raise ConfigError(f"layers-per-stage entry {s} is {c}: stages other than the first and last "
                                  f"need at least one layer")
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges
