"""Communication a piece posts (stages.overlap): in a pair it runs while the other half computes, and is waited
for just before the piece that consumes it; alone it is waited for at once. Stand-ins with known delays show the
overlap is real (a functional property of the loop, measured with margins that hold on a loaded machine); a block
that posts communication trains as the plain block does; the CUDA side stream's control, on CPU."""
import time

import pytest
import torch
from torch.testing import assert_close

from pipegpt.config import ModelConfig
from pipegpt.model.gpt import GPT
from pipegpt.stages import Stage
from pipegpt.stages.overlap import InThread, OnSideStream, Posted
from pipegpt.stages.stage import PieceRun, interleave

COMPUTE_S = COMM_S = 0.3  # per piece: as long to compute as to communicate, the case where overlap halves the wait


def _timed(fn, *args) -> tuple[float, float]:
    started = time.perf_counter()
    fn(*args)
    return started, time.perf_counter()


def _overlap(first: tuple[float, float], second: tuple[float, float]) -> float:
    return min(first[1], second[1]) - max(first[0], second[0])


def _halves(pieces: int = 2, spans: dict | None = None):
    """Each half yields after computing, and its next step consumes the communication: written as a piece that
    receives what it waited for. spans gets each compute's and each communication's (start, end)."""
    spans = {} if spans is None else spans

    def communicate(label):
        spans[f"{label} comm"] = _timed(time.sleep, COMM_S)
        return label

    def half(name, log):
        received = None
        for k in range(pieces):
            log.append((name, k, "compute", received))
            spans[f"{name}{k} compute"] = _timed(time.sleep, COMPUTE_S)
            received = yield InThread(lambda label=f"{name}{k}": communicate(label))
        return received
    return half


def test_a_pair_hides_each_halfs_communication_under_the_others_compute():
    """Two halves of two pieces, each piece COMPUTE_S of compute then COMM_S of communication. Apart, each half
    waits for its own: 2 x (2 compute + 2 comm) = 2.4 s. As a pair, each half's communication runs while the
    other computes: the compute (1.2 s) plus the last communication (0.3 s) = 1.5 s."""
    apart_spans, paired_spans, log = {}, {}, []
    half = _halves(spans=apart_spans)
    started = time.perf_counter()
    apart = [PieceRun(half(n, log)).finish() for n in "ab"]
    apart_s = time.perf_counter() - started
    half = _halves(spans=paired_spans)
    started = time.perf_counter()
    paired = interleave(PieceRun(half("a", log)), PieceRun(half("b", log)))
    paired_s = time.perf_counter() - started
    assert apart == paired == ["a1", "b1"]  # each half's last communication, handed to it by its wait
    assert apart_s >= 4 * (COMPUTE_S + COMM_S) * 0.98
    # Judged by what ran at the same time, not by wall-clock margins (which a loaded machine stretches): apart,
    # no compute runs during a communication; paired, b's first piece computes during a's first communication and
    # a's second during b's first.
    for comm in ("a0", "a1", "b0", "b1"):
        assert all(_overlap(apart_spans[f"{comm} comm"], span) <= 0
                   for name, span in apart_spans.items() if name.endswith("compute"))
    assert _overlap(paired_spans["a0 comm"], paired_spans["b0 compute"]) > COMPUTE_S / 2
    assert _overlap(paired_spans["b0 comm"], paired_spans["a1 compute"]) > COMPUTE_S / 2
    assert paired_s < apart_s
    # The loop's order: a's piece, b's piece, then a's next (which waited for a's first communication).
    pair_log = log[4:]
    assert [(n, k) for n, k, *_ in pair_log] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert pair_log[2][3] == "a0" and pair_log[3][3] == "b0"


class _Logged:
    """A handle that logs its wait and hands back its name."""

    def __init__(self, name, events):
        self.name, self.events = name, events

    def wait(self):
        self.events.append(f"wait {self.name}")
        return self.name


def test_a_handle_is_waited_for_before_its_consumer_and_not_before():
    """interleave waits a half's handle at that half's next step, after the other half's step has run."""
    events = []

    def half(name):
        events.append(f"{name} piece 0")
        got = yield _Logged(name, events)
        events.append(f"{name} piece 1 got {got}")
        return name

    done = []
    interleave(PieceRun(half("f")), PieceRun(half("b")), done=lambda i, result: done.append((i, result)))
    assert events == ["f piece 0", "b piece 0", "wait f", "f piece 1 got f", "wait b", "b piece 1 got b"]
    assert done == [(0, "f"), (1, "b")]
    events.clear()
    assert PieceRun(half("alone")).finish() == "alone"
    assert events == ["alone piece 0", "wait alone", "alone piece 1 got alone"]


def test_a_half_keeps_the_turn_until_it_posts_communication():
    """A step that posts nothing hides nobody's communication by giving way: its half goes on, and hands the turn
    over at the step that posts (an MoE block's dispatch after its attention, here). The other half's posted
    communication is then waited for after all of that compute, not after its first piece."""
    events = []

    def forward():  # two pieces with nothing posted (a piece boundary), then one that posts
        events.append("f embedding")
        yield
        events.append("f attention")
        yield _Logged("f dispatch", events)
        events.append("f experts")
        return "f"

    def backward():
        events.append("b head")
        yield _Logged("b combine grad", events)
        events.append("b experts")
        yield
        events.append("b attention")
        return "b"

    done = []
    assert interleave(PieceRun(forward()), PieceRun(backward()), done=lambda i, _: done.append(i)) == ["f", "b"]
    assert events == ["f embedding", "f attention", "b head", "wait f dispatch", "f experts",
                      "wait b combine grad", "b experts", "b attention"]
    assert done == [0, 1]

    def dense(name):  # nothing posted at all: each half runs whole, the first handed on first
        for piece in range(3):
            events.append(f"{name} {piece}")
            yield
        return name

    events.clear()
    assert interleave(PieceRun(dense("f")), PieceRun(dense("b")), done=lambda i, _: done.append(i)) == ["f", "b"]
    assert events == ["f 0", "f 1", "f 2", "b 0", "b 1", "b 2"] and done == [0, 1, 0, 1]


def test_an_error_in_the_communication_reaches_the_waiter():
    def broken():
        raise RuntimeError("peer gone")

    with pytest.raises(RuntimeError, match="peer gone"):
        InThread(broken).wait()


def test_a_posted_collective_is_waited_for_and_hands_back_its_tensor():
    class Work:
        waited = False

        def wait(self):
            Work.waited = True

    out = torch.ones(2)
    assert Posted(Work(), out).wait() is out and Work.waited


class _Recorder:
    """A stand-in for CudaStreams that records the calls OnSideStream makes, in order."""

    def __init__(self):
        self.calls = []
        outer = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                outer.calls.append(f"{self.name} waits for stream {other.name}")

            def wait_event(self, event):
                outer.calls.append(f"{self.name} waits for event {event.name}")

            def synchronize(self):
                outer.calls.append("host synchronises")

        class Event:
            name = "e"

            def record(self, stream):
                outer.calls.append(f"event recorded on {stream.name}")

        self.Stream, self.Event = Stream, Event
        self.current_stream, self.side_stream = Stream("current"), Stream("side")
        self.on = "current"

    def current(self, device):
        return self.current_stream

    def side(self, device):
        return self.side_stream

    def using(self, stream):
        recorder = self

        class Using:
            def __enter__(self):
                recorder.calls.append(f"enter {stream.name}")
                recorder.on = stream.name

            def __exit__(self, *exc):
                recorder.calls.append(f"leave {stream.name}")
                recorder.on = "current"
        return Using()

    def event(self):
        return self.Event()


def test_the_side_stream_orders_by_events_and_never_synchronises_the_host():
    streams = _Recorder()
    handle = OnSideStream(lambda: streams.calls.append(f"communicate on {streams.on}") or "result", streams=streams)
    assert streams.calls == ["side waits for stream current", "enter side", "communicate on side", "leave side",
                             "event recorded on side"]
    assert handle.wait() == "result"
    assert streams.calls[-1] == "current waits for event e" and "host synchronises" not in streams.calls


def _stage(cfg, steps_delay=None, recompute="none"):
    stage = Stage(0, 1, GPT(cfg, layers=range(cfg.n_layer), embed=True, head=True, recompute=recompute,
                            init_seed=7), 2)
    if steps_delay is not None:  # each block posts a stand-in communication after its compute
        for block in stage.module.blocks.values():
            def forward_steps(x, documents, block=block):
                out = stage.module.block_forward(block, x, None, documents)
                yield InThread(lambda: time.sleep(steps_delay))
                return out
            block.forward_steps = forward_steps
    return stage


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_block_that_posts_communication_trains_as_the_plain_block(recompute):
    """A pair (forward of microbatch 1, backward of microbatch 0) on a stage whose blocks post communication
    gives the plain stage's losses and parameter gradients."""
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in "01"]
    results = []
    for stage in (_stage(cfg, None, recompute), _stage(cfg, 0.01, recompute)):
        stage.forward(0, *data[0])
        loss1, _ = interleave(stage.forward_pieces(1, *data[1]), stage.backward_pieces(0, None))
        stage.backward(1, None)
        results.append((loss1, {n: p.grad.clone() for n, p in stage.module.named_parameters()}))
    (plain_loss, plain), (loss, grads) = results
    assert_close(loss, plain_loss, rtol=0, atol=0)
    for name in plain:
        assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")


def _cut_stage(cfg, delay, log):
    """Each block's MLP half behind a stand-in all-to-all: the block's input goes out (identity, `delay` late)
    and comes back as the leaf the block computes on; its gradient goes back the same way."""
    from pipegpt.stages.overlap import Cut

    stage = _stage(cfg)
    for layer, block in stage.module.blocks.items():
        def forward_steps(x, documents, block=block, layer=layer):
            def there(t, way):
                log.append(f"{way} {layer}")
                return InThread(lambda: time.sleep(delay) or t.clone())
            received = yield Cut(x * 1.0, lambda t: there(t, "dispatch"), lambda g: there(g, "return"))
            return stage.module.block_forward(block, received, None, documents)
        block.forward_steps = forward_steps
    return stage


@pytest.mark.parametrize("split", [False, True])
def test_a_cut_sends_the_gradient_back_between_the_compute_on_each_side(split):
    """A stand-in all-to-all (identity) in front of each block: forward and backward, paired and alone, split or
    not, give the plain stage's loss and gradients; each backward posts the gradient's way back once per block,
    last block first."""
    cfg = ModelConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, n_embd=32)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in "01"]
    log, results = [], []
    for stage in (_stage(cfg), _cut_stage(cfg, 0.01, log)):
        stage.forward_pieces(0, *data[0]).finish()
        loss1, _ = interleave(stage.forward_pieces(1, *data[1]), stage.backward_pieces(0, None, split=split))
        stage.backward(1, None, split=split)
        if split:
            stage.backward_weight(0)
            stage.backward_weight(1)
        results.append((loss1, {n: p.grad.clone() for n, p in stage.module.named_parameters()}))
    assert log.count("return 1") == log.count("return 0") == 2 and log.count("dispatch 0") == 2
    assert log[-2:] == ["return 1", "return 0"]  # microbatch 1's backward, alone: last block first
    (plain_loss, plain), (loss, grads) = results
    assert_close(loss, plain_loss, rtol=0, atol=0)
    for name in plain:
        assert_close(grads[name], plain[name], rtol=1e-6, atol=1e-8, msg=lambda m: f"{name}: {m}")
