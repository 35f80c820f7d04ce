"""Per-rank random streams (pipegpt.state.rng): seeded per (pipeline rank, replica), the same on tp ranks, and
kept in a checkpoint: the CPU state, and on a GPU the device generator's (a stand-in plays torch.cuda here)."""
from __future__ import annotations

import itertools

import pytest
import torch

from pipegpt.state import rng


def test_streams_differ_across_pipeline_ranks_and_replicas():
    seeds = {rng.rank_seed(1337, pp, dp) for pp, dp in itertools.product(range(8), range(16))}
    assert len(seeds) == 8 * 16
    assert rng.rank_seed(1337, 1, 2) == rng.rank_seed(1337, 1, 2) != rng.rank_seed(1338, 1, 2)


def test_seeding_gives_the_same_dropout_mask_on_a_rank_and_another_on_the_next():
    def mask(pp, dp):
        rng.seed_rank(7, pp, dp, torch.device("cpu"))
        return torch.nn.functional.dropout(torch.ones(64), 0.5)

    assert torch.equal(mask(0, 0), mask(0, 0))
    assert not torch.equal(mask(0, 0), mask(1, 0)) and not torch.equal(mask(0, 0), mask(0, 1))


class FakeCuda:
    """torch.cuda's generator calls, over a CPU generator standing in for the device's."""

    def __init__(self):
        self.generator, self.seeded = torch.Generator(), []

    def manual_seed(self, seed):
        self.seeded.append(seed)
        self.generator.manual_seed(seed)

    def get_rng_state(self, device):
        assert device.type == "cuda"
        return self.generator.get_state()

    def set_rng_state(self, state, device):
        assert device.type == "cuda"
        self.generator.set_state(state)


def test_the_device_generator_is_seeded_saved_and_restored_per_rank():
    cuda, gpu = FakeCuda(), torch.device("cuda", 0)
    rng.seed_rank(5, 2, 1, gpu, cuda=cuda)
    assert cuda.seeded == [rng.rank_seed(5, 2, 1)]
    torch.rand(3, generator=cuda.generator)
    saved = rng.rng_state(3, gpu, cuda=cuda)
    assert set(saved) == {"rng/3", "cuda_rng/3"} and all(rng.is_rng_key(k) for k in saved)
    expected_cpu, expected_gpu = torch.rand(4), torch.rand(4, generator=cuda.generator)

    rng.seed_rank(5, 2, 1, gpu, cuda=cuda)  # a fresh worker: seeded, then the checkpoint's states
    rng.restore_rng(saved, 3, gpu, cuda=cuda)
    assert torch.equal(torch.rand(4), expected_cpu)
    assert torch.equal(torch.rand(4, generator=cuda.generator), expected_gpu)


def test_a_cpu_rank_saves_no_device_state_and_a_cpu_checkpoint_leaves_the_device_generator_as_seeded():
    assert set(rng.rng_state(0, torch.device("cpu"))) == {"rng/0"}
    cuda = FakeCuda()
    rng.seed_rank(5, 0, 0, torch.device("cuda", 0), cuda=cuda)
    before = cuda.generator.get_state()
    rng.restore_rng({"rng/0": torch.get_rng_state()}, 0, torch.device("cuda", 0), cuda=cuda)
    assert torch.equal(cuda.generator.get_state(), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_device_stream_resumes_exactly():
    gpu = torch.device("cuda", torch.cuda.current_device())
    rng.seed_rank(3, 1, 0, gpu)
    torch.nn.functional.dropout(torch.ones(1000, device=gpu), 0.1)
    saved = rng.rng_state(0, gpu)
    expected = torch.nn.functional.dropout(torch.ones(1000, device=gpu), 0.1)
    rng.seed_rank(3, 1, 0, gpu)
    rng.restore_rng(saved, 0, gpu)
    assert torch.equal(torch.nn.functional.dropout(torch.ones(1000, device=gpu), 0.1), expected)


def manifest(dp, pp, tp, cp=None, step=6):
    parallel = {"dp": dp, "stages": pp, "tp": tp, **({"cp": cp} if cp is not None else {})}
    return {"step": step, "world_size": dp * pp * tp * (cp or 1), "config": {"parallel": parallel}}


def resumed(saved_manifest, dims, saved_states):
    """What a resuming rank's CPU stream draws next, and whether the checkpoint's state was taken."""
    restored = rng.resume_streams(saved_manifest, dims, lambda: saved_states, rank=1, pp_index=0, dp_index=0,
                                  seed=7, device=torch.device("cpu"))
    return torch.rand(8), restored


def test_a_resume_continues_the_saved_streams_only_under_the_same_grid():
    from pipegpt.dims import ParallelDims

    rng.seed_rank(7, 1, 0, torch.device("cpu"))
    torch.rand(5)
    saved = rng.rng_state(1, torch.device("cpu"))
    continued = torch.rand(8)
    # pp 4 x tp 2 written, pp 4 x tp 2 resumed: rank 1 holds the same position, its stream goes on
    draws, restored = resumed(manifest(1, 4, 2, cp=1), ParallelDims(pp=4, tp=2), saved)
    assert restored and torch.equal(draws, continued)
    # a manifest written before context parallelism (no cp) is the grid with cp 1
    draws, restored = resumed(manifest(1, 4, 2), ParallelDims(pp=4, tp=2, cp=1), saved)
    assert restored and torch.equal(draws, continued)
    # pp 4 x tp 2 resumed as pp 2 x tp 4: the same world size, another position for rank 1: fresh streams,
    # the same on the tp ranks of a pipeline rank, and not a replay of the run's first masks
    draws, restored = resumed(manifest(1, 4, 2), ParallelDims(pp=2, tp=4), saved)
    assert not restored and not torch.equal(draws, continued)
    rng.seed_rank(7, 0, 0, torch.device("cpu"), step=6)
    assert torch.equal(draws, torch.rand(8))
    rng.seed_rank(7, 0, 0, torch.device("cpu"))
    assert not torch.equal(draws, torch.rand(8))
    assert rng.rank_seed(7, 0, 0, step=0) == rng.rank_seed(7, 0, 0)  # the streams of a run that never resumed


def test_the_driver_says_when_dropout_streams_start_afresh():
    from pipegpt.dims import ParallelDims

    assert rng.grid_change_line(manifest(1, 4, 2), ParallelDims(pp=4, tp=2), dropout=0.1) is None
    assert rng.grid_change_line(manifest(1, 4, 2), ParallelDims(pp=2, tp=4), dropout=0.0) is None  # nothing drawn
    assert rng.grid_change_line(manifest(1, 4, 2), ParallelDims(pp=2, tp=4), dropout=0.1) == (
        "pipegpt: the checkpoint was written under dp x pp x cp x tp = 1 x 4 x 1 x 2, this run is 1 x 2 x 1 x 4: "
        "dropout's random streams start afresh (seeded for the resume after step 6), not continued")
