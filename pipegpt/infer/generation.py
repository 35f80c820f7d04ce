"""Generation's decode loop on one rank, walking its actions of a decode plan (pipegpt.schedule.generators).

The prompts are cut into groups (of similar lengths, left-padded to the longest of the group). Every stage keeps a
KVCache per group: keys and values of its own blocks only, with the model's kv heads (grouped-query attention
caches n_kv_head heads, not n_head; under tp a rank its own heads). F(s, step x G + g) runs group g's step on stage
s: step 0 the prefill of its prompts, each later step one token per prompt. The last stage chooses the next tokens
(pipegpt.infer.sampling, each prompt from its own generator) and sends them to the first stage, where the group's
next step begins; meanwhile the stages work on the other groups, so with G >= stages none waits in the steady state.

With one stage (the whole model, one process or one rank) the same loop runs with no messages: that is the
batched one-process sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipegpt.comm.p2p import Message, PointToPoint
from pipegpt.infer.sampling import SamplingSettings, next_tokens, prompt_generators
from pipegpt.model.gpt import GPT, KVCache
from pipegpt.schedule import Plan
from pipegpt.schedule.generators import decode_position
from pipegpt.tensor_parallel.collectives import gather_from_sequence


@dataclass
class Group:
    """Prompts that travel together: their indices, and their tokens left-padded to the longest [n, length]."""

    indices: list[int]
    tokens: torch.Tensor
    pads: list[int]


def make_groups(prompts: list[tuple[int, list[int]]], count: int) -> list[Group]:
    """(index, tokens) prompts in `count` groups of consecutive lengths (little padding), as even as they divide."""
    ordered = sorted(prompts, key=lambda p: len(p[1]))
    size, extra = divmod(len(ordered), count)
    groups, start = [], 0
    for g in range(count):
        part = ordered[start:start + size + (g < extra)]
        start += len(part)
        longest = max(len(tokens) for _, tokens in part)
        pads = [longest - len(tokens) for _, tokens in part]
        rows = torch.tensor([[0] * pad + tokens for pad, (_, tokens) in zip(pads, part)], dtype=torch.long)
        groups.append(Group([i for i, _ in part], rows, pads))
    return groups


class PipelineLink:
    """A rank's messages of the decode loop: activations to the next stage, tokens from the last to the first.
    Receives are waited for at once; sends go when posted and are waited for once done, or at the end.

    Every channel carries its messages in the plan's order at both ends, so order matching (NCCL) pairs them as
    tag matching (gloo) does. On a GPU each direction of each pair of neighbours has its own communicator
    (comm/mesh.py pair_groups): the tokens, going back to the first rank, never queue behind the activations
    (with 2 stages, the same two ranks the other way)."""

    def __init__(self, p2p: PointToPoint, pipeline_ranks: list[int], message_dtype: torch.dtype, device):
        self.p2p, self.ranks, self.message_dtype, self.device = p2p, pipeline_ranks, message_dtype, device
        self.sending: list[Message] = []

    def send(self, stage: int, tensor: torch.Tensor, microbatch: int, tokens: bool) -> None:
        """Stage's output for microbatch (activations to the next stage; tokens from the last to the first)."""
        peer = self.ranks[0 if tokens else stage + 1]
        message = Message(tensor if tokens else tensor.to(self.message_dtype), peer, _tag(microbatch, tokens),
                          f"send {'tokens' if tokens else 'activations'} of {stage}F{microbatch}")
        self.p2p.post([message], [])
        self.sending.append(message)
        for sent in [m for m in self.sending if self.p2p.done(m)]:
            self.p2p.wait(sent)
            self.sending.remove(sent)

    def receive(self, stage: int, shape: tuple[int, ...], microbatch: int, tokens: bool) -> torch.Tensor:
        peer = self.ranks[-1 if tokens else stage - 1]
        buffer = torch.empty(shape, dtype=torch.long if tokens else self.message_dtype, device=self.device)
        message = Message(buffer, peer, _tag(microbatch, tokens),
                          f"receive {'tokens' if tokens else 'activations'} for {stage}F{microbatch}")
        self.p2p.post([], [message])
        self.p2p.wait(message)
        return buffer

    def finish(self) -> None:
        for message in self.sending:
            self.p2p.wait(message)
        self.sending.clear()
        self.p2p.settle()


def _tag(microbatch: int, tokens: bool) -> int:
    return 2 * microbatch + int(tokens)


@torch.no_grad()
def decode(plan: Plan, rank: int, module: GPT, groups: list[Group], settings: SamplingSettings,
           link: PipelineLink | None = None, tp_group=None) -> dict[int, list[int]]:
    """Run this rank's actions of the decode plan (one stage per rank); returns, on the last stage, each prompt's
    new tokens by its index (empty elsewhere)."""
    (stage,) = plan.stages_of(rank)
    first, last = stage == 0, stage == plan.num_stages - 1
    device = next(module.parameters()).device
    dtype = next(module.parameters()).dtype
    caches = [KVCache(g.pads) for g in groups]
    steps = plan.meta["decode_steps"]
    new: dict[int, list[int]] = {i: [] for g in groups for i in g.indices} if last else {}
    generators = [prompt_generators(g.indices, settings, device) for g in groups] if last else []
    next_input: dict[int, torch.Tensor] = {}  # one stage holding both ends: tokens chosen, waiting for their step
    for action in plan.ranks[rank]:
        step, g = decode_position(plan, action.microbatch)
        group = groups[g]
        rows, length = group.tokens.shape
        if first and step == 0:
            x = group.tokens.to(device)
        elif first:
            x = next_input.pop(g) if last else link.receive(stage, (rows, 1), action.microbatch, tokens=True)
        else:
            shape = (rows, length if step == 0 else 1, module.config.n_embd)
            x = link.receive(stage, shape, action.microbatch, tokens=False).to(dtype)
        h = module.hidden(x, cache=caches[g])
        if not last:
            link.send(stage, h, action.microbatch, tokens=False)
            continue
        chosen = next_tokens(last_logits(module, h, tp_group), settings, generators[g])
        for i, token in zip(group.indices, chosen):
            new[i].append(token)
        if step + 1 < steps:
            tokens = torch.tensor(chosen, dtype=torch.long, device=device)[:, None]
            if first:
                next_input[g] = tokens
            else:
                link.send(stage, tokens, action.microbatch + len(groups), tokens=True)
    if link is not None:
        link.finish()
    return new


def last_logits(module: GPT, h: torch.Tensor, tp_group=None) -> torch.Tensor:
    """The float logits [rows, vocab] of each row's last position (under tp, the ranks' vocabulary shards
    gathered: a row of the vocabulary per prompt, never the sequence's)."""
    logits = module.lm_head(module.ln_f(h[:, -1]))
    if tp_group is not None:
        logits = gather_from_sequence(logits, tp_group, -1)
    return logits[:, :module.config.vocab_size].float()


def generate_in_process(model: GPT, prompts: list[list[int]], settings: SamplingSettings,
                        first: int = 0) -> list[list[int]]:
    """The batched one-process sampler: every prompt in one group through the whole model (a decode plan of one
    stage), each prompt's new tokens as the pipeline would choose them; the prompts' indices start at `first`."""
    from pipegpt.schedule.generators import decode_plan

    if settings.max_new_tokens == 0 or not prompts:
        return [[] for _ in prompts]
    groups = make_groups(list(enumerate(prompts, first)), 1)
    new = decode(decode_plan(1, 1, settings.max_new_tokens), 0, model, groups, settings)
    return [new[first + k] for k in range(len(prompts))]
