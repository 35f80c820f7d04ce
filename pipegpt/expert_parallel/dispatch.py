"""Tokens to their experts' ranks and back: a MoE layer's dispatch and combine over its ep group.

Rank i of an ep group of n holds experts [i E/n, (i+1) E/n) of a layer's E (local_experts). A rank routes its
own tokens over all E experts and sorts the assignments by expert: they are then grouped by owning rank too.

    route = start_dispatch(x_sorted, counts, ep)     # counts [E] per expert; the counts exchanged, tokens posted
    received = route.tokens.wait()                   # [sum(route.received), C], by source rank, then local expert
    y = expert_outputs(received[route.by_expert], route.expert_counts, ...)   # grouped by local expert
    back = start_combine(y[route.by_source], route)  # to the ranks that sent them, in the order they sent
    out = back.wait()                                # rows as x_sorted's

Both exchanges are pipegpt.expert_parallel.all_to_all's Pending (start now, wait later: another microbatch's
compute may run between), in autograd: the backward of each is the other's exchange.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipegpt.expert_parallel.all_to_all import (CarriedExchange, Pending, exchange_counts, post_counts,
                                                start_all_to_all)


@dataclass(frozen=True)
class ExpertGroup:
    """A rank's place in an ep group: its process group (None: one rank), size, index, and the wait bound."""

    group: object
    size: int
    index: int
    timeout_s: float = 60.0

    def local_experts(self, n_experts: int) -> slice:
        per = n_experts // self.size
        return slice(self.index * per, (self.index + 1) * per)

    def run(self, x_sorted: torch.Tensor, counts: torch.Tensor, compute) -> torch.Tensor:
        """Dispatch, compute(rows grouped by local expert, rows per local expert) on this rank, combine: the
        outputs of x_sorted's rows (sorted by expert, counts[e] for expert e of all E), in their order. What a
        MoE layer calls (pipegpt.model.moe holds this object and imports nothing of this package)."""
        route = start_dispatch(x_sorted, counts, self)
        received = route.tokens.wait()
        y = compute(received[route.by_expert], route.expert_counts)
        return start_combine(y[route.by_source], route).wait()

    def post_counts(self, counts: torch.Tensor) -> Pending:
        """The exchange of counts [E] (per expert) that sizes a dispatch, posted: wait() gives post_dispatch's
        `received`."""
        return post_counts(counts.view(self.size, -1), self.group, self.timeout_s)

    def post_dispatch(self, carried: list[torch.Tensor], x_sorted: torch.Tensor, counts: torch.Tensor,
                      received: torch.Tensor):
        """run()'s dispatch as a cut (all_to_all.CarriedExchange, carrying `carried` past it), the counts exchanged
        already (post_counts' result: `received`). Returns the cut and its Route (what post_combine sends back
        by)."""
        route = plan_dispatch(counts, self, x_sorted.device, received)
        cut = CarriedExchange(carried, x_sorted, [sum(r) for r in route.sent], [sum(r) for r in route.received],
                              self.group, self.timeout_s, "dispatch")
        return cut, route

    def post_combine(self, carried: list[torch.Tensor], y: torch.Tensor, route: "Route") -> CarriedExchange:
        """run()'s combine as a cut: y (rows in the received order) back to the ranks that sent them."""
        return CarriedExchange(carried, y, [sum(r) for r in route.received], [sum(r) for r in route.sent],
                               self.group, self.timeout_s, "combine")


@dataclass
class Route:
    """What one dispatch sent and received: sent [ep, E/ep] (assignments this rank sent each rank's local experts),
    received [ep, E/ep] (what each rank sent this one's); the received rows' order by local expert (by_expert)
    and back (by_source)."""

    ep: ExpertGroup
    sent: list[list[int]]
    received: list[list[int]]
    tokens: Pending | None = None
    by_expert: torch.Tensor = field(default=None)
    by_source: torch.Tensor = field(default=None)

    @property
    def expert_counts(self) -> list[int]:
        """Rows each local expert received, from every rank together."""
        return [sum(col) for col in zip(*self.received)]


def plan_dispatch(counts: torch.Tensor, ep: ExpertGroup, device, received: torch.Tensor | None = None) -> Route:
    """counts[e] rows for expert e of all E; received [ep, E/ep] what each rank sends this one's experts, or None
    to exchange the counts now (waited for: they size the exchange). A Route whose tokens are not posted yet."""
    per = counts.numel() // ep.size
    if received is None:
        received = exchange_counts(counts.view(ep.size, per), ep.group, ep.timeout_s)
    route = Route(ep, counts.view(ep.size, per).tolist(), received.tolist())
    # the received rows' local expert, source by source; sorted stably: grouped by expert, sources in rank order
    experts = torch.arange(per, device=device).repeat(ep.size)
    row_expert = experts.repeat_interleave(torch.tensor(route.received, device=device).reshape(-1))
    route.by_expert = row_expert.argsort(stable=True)
    route.by_source = route.by_expert.argsort()
    return route


def start_dispatch(x_sorted: torch.Tensor, counts: torch.Tensor, ep: ExpertGroup) -> Route:
    """plan_dispatch, then post the tokens; x_sorted's rows sorted by expert, counts[e] of them for expert e."""
    route = plan_dispatch(counts, ep, x_sorted.device)
    route.tokens = start_all_to_all(x_sorted, [sum(r) for r in route.sent], [sum(r) for r in route.received],
                                    ep.group, ep.timeout_s, "dispatch")
    return route


def start_combine(y: torch.Tensor, route: Route) -> Pending:
    """Post the experts' outputs (rows in the received order) back to the ranks that sent them: the Pending's
    wait() gives this rank's rows in the order it dispatched them."""
    ep = route.ep
    return start_all_to_all(y, [sum(r) for r in route.received], [sum(r) for r in route.sent], ep.group,
                            ep.timeout_s, "combine")
