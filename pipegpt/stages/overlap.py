"""Communication a piece posts and the pair waits for: the handles a composite action's pieces yield.

A piece of a stage (stages.stage.Stage.layer_pieces: the embedding, each block, the head) may return a generator
instead of its output. Each `yield handle` hands communication the piece has just started to whoever runs the
piece; the value of the yield is `handle.wait()`'s, and the generator's return value is the piece's output::

    def piece(x, targets, documents, reduction):
        routed = route(x)
        received = yield all_to_all_start(routed)   # posted; the other half of the pair computes meanwhile
        return combine((yield all_to_all_start(experts(received))))

A handle that moves activations the backward must move back (an all-to-all's dispatch or combine) is a Cut: it
holds the tensor it sent and posts the gradient's communication back (transpose). The Stage ends a seam at what
it sent and starts the next at what it received, so the backward runs the compute on each side apart and posts
the gradient's communication between them, a handle again, waited for before the compute that reads it: in a
pair the other half computes meanwhile, in the backward as in the forward. (The piece's generator receives the
received tensor as a leaf; nothing of the communication is in the autograd graph.)

Run alone (a whole action, Stage.forward), each handle is waited for at once. Run in a pair
(stages.stage.interleave), the handle is waited for just before the piece goes on, after the other half's next
steps have run (up to the one that posts its own communication): that half's compute hides it. A block offers
such a piece by a `forward_steps(x, documents)` method (a generator of handles that returns the block's output);
the Stage then runs it in place of the block's plain forward when it runs pieces.

A handle is anything with wait() -> result (None where there is nothing to hand back):
- Posted(work, result): a torch.distributed collective posted with async_op=True (gloo progresses it on its own
  threads; NCCL's wait() makes the current stream wait, no host synchronisation); wait() returns `result`.
- OnSideStream(fn): CUDA: fn runs on a side stream once the current stream's work so far is done, an event
  marks its end, and wait() makes the current stream wait for that event (no host synchronisation). Its stream
  calls go through a CudaStreams object, so its control is tested on CPU with a stand-in.
- InThread(fn): fn runs on a thread of its own (a blocking call, or a stand-in with a known delay in tests).
- Cut(sent, start, start_back): start(sent) posts sent's communication (a handle whose wait() returns what was
  received); transpose(grad) = start_back(grad) posts the gradient's way back (a handle whose wait() returns the
  gradient of `sent`). For an all-to-all with splits: start_back is the all-to-all with the splits swapped.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

import torch


class Handle(Protocol):
    def wait(self) -> Any:
        """Block until the communication is done (on CUDA: order the current stream after it); its result."""


class Posted:
    """A torch.distributed request (async_op=True) as a handle: wait() waits for it and returns `result`."""

    __slots__ = ("work", "result")

    def __init__(self, work, result=None):
        self.work, self.result = work, result

    def wait(self):
        self.work.wait()
        return self.result


class InThread:
    """fn() on a thread of its own, started now; wait() joins it and returns fn's result (or raises its error)."""

    __slots__ = ("_thread", "_out")

    def __init__(self, fn: Callable[[], Any], name: str = "pipegpt-piece-comm"):
        self._out: list = []

        def run():
            try:
                self._out.append((True, fn()))
            except BaseException as e:  # handed to the waiter
                self._out.append((False, e))

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self):
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


class CudaStreams:
    """The stream calls OnSideStream makes, one side stream per device (a stand-in replaces it in CPU tests)."""

    _side: dict = {}

    def current(self, device):
        return torch.cuda.current_stream(device)

    def side(self, device):
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def using(self, stream):
        return torch.cuda.stream(stream)

    def event(self):
        return torch.cuda.Event()


class OnSideStream:
    """fn() on the device's side stream after what the current stream has queued (its inputs), an event after it;
    wait() orders the current stream after that event and returns fn's result. Nothing synchronises the host.
    Tensors fn reads must stay alive until wait(): the caller keeps them (the piece's locals do)."""

    __slots__ = ("_event", "_result", "_streams", "_device")

    def __init__(self, fn: Callable[[], Any], device=None, streams: CudaStreams | None = None):
        self._streams = streams = streams or CudaStreams()
        self._device = device
        current, side = streams.current(device), streams.side(device)
        side.wait_stream(current)  # fn's inputs were made on the current stream
        with streams.using(side):
            self._result = fn()
        self._event = streams.event()
        self._event.record(side)

    def wait(self):
        self._streams.current(self._device).wait_event(self._event)
        return self._result


class Cut:
    """Communication that splits a piece's autograd graph in two (see the module docstring): wait() is the forward
    handle's, transpose(grad) posts the backward's."""

    __slots__ = ("sent", "_forward", "_start_back")

    def __init__(self, sent: torch.Tensor, start: Callable[[torch.Tensor], Handle],
                 start_back: Callable[[torch.Tensor], Handle]):
        self.sent, self._start_back = sent, start_back
        self._forward = start(sent.detach())

    def wait(self) -> torch.Tensor:
        return self._forward.wait()

    def transpose(self, grad: torch.Tensor) -> Handle:
        return self._start_back(grad)


def start(fn: Callable[[], Any], device) -> Handle:
    """fn's communication started where the device runs it beside compute: a side stream on CUDA, a thread
    elsewhere (a collective that takes async_op=True is better posted so, and wrapped in Posted)."""
    if torch.device(device).type == "cuda":
        return OnSideStream(fn, torch.device(device))
    return InThread(fn)
