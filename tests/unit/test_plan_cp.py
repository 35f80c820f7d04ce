"""The planner with context parallelism: what a cp rank holds and spends (pipegpt.costs, against sums done by
hand), and what the search makes of it (pipegpt.planner: cp explored, --cp and --cp-comm, the JSON, the node)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from helpers import assert_one_line_error, invoke
from pipegpt.config import MODEL_PRESETS, TrainConfig
from pipegpt.costs import memory as memory_model
from pipegpt.costs.cost import AnalyticalCosts, Shape, cp_bytes_per_layer
from pipegpt.costs.devices import make_cluster
from pipegpt.dims import ParallelDims, Sharding
from pipegpt.planner.candidates import Layout, Request
from pipegpt.planner.search import Search, search
from pipegpt.schedule import build_plan

LLAMA = replace(MODEL_PRESETS["tiny-llama"], seq_len=256)  # 4 layers, width 128, 4 heads (2 kv) of 32, MLP 352
FP32 = 4


def _act(sharding, precision="fp32", **where):
    return memory_model.activation_bytes(LLAMA, where.pop("layers", 0), microbatch_size=2, sharding=sharding,
                                         precision=precision, **where)


# ---------------------------------------------------------------------------------------------------------
# memory


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_a_cp_rank_keeps_the_activations_of_its_tokens(tp, sp):
    """Every per-token term halves at cp 2; what does not depend on the sequence stays: the loss's scalars
    (3 fp32 at tp 1; an int64 and 2 fp32 at tp 2) and, under bf16, each block's bf16 weight casts. At cp 2 each
    block keeps the peer's K/V besides: 2 sequences x 128 tokens x (k, v) x the rank's kv heads (2, or 1 at
    tp 2) x 32. Its attention Function keeps its own k and v that wide too, where cp 1's SDPA keeps them repeated
    to the rank's query heads (4, or 2 at tp 2); and rotary's cos and sin for q and k (128 x 32 each) are indexed
    at the rank's positions per call, where in fp32 cp 1 keeps views of the cached table (in bf16 both keep casts)."""
    one, two = Sharding(tp=tp, sequence_parallel=sp), Sharding(tp=tp, cp=2, sequence_parallel=sp)
    peer_kv = lambda size: 2 * 128 * 2 * (2 // tp) * 32 * size  # noqa: E731
    repeated = lambda size: 2 * 128 * 2 * (4 // tp) * 32 * size  # noqa: E731
    rotary = 4 * 128 * 32 * FP32
    for where in ({"layers": 3}, {"embed": True}, {"layers": 2, "embed": True}):
        kept = where.get("layers", 0) * (2 * peer_kv(FP32) - repeated(FP32) + rotary)
        assert _act(one, **where) == 2 * (_act(two, **where) - kept) > 0
    scalars = 3 * FP32 if tp == 1 else 8 + 2 * FP32
    assert _act(one, head=True) == 2 * _act(two, head=True) - scalars
    # bf16: q 128x128, k and v 64x128 (two kv heads of 32), proj 128x128, gate and up 352x128, proj 128x352, / tp
    casts = (128 * 128 + 2 * 64 * 128 + 128 * 128 + 3 * 352 * 128) // tp * 2
    if tp == 2:  # one kv head per rank: k and v are 32 x 128 there, not 64 / 2 rows of the whole
        casts = (64 * 128 + 2 * 32 * 128 + 128 * 64 + 3 * 176 * 128) * 2
    kept = 3 * (2 * peer_kv(2) - repeated(2))
    assert _act(one, "bf16", layers=3) == 2 * (_act(two, "bf16", layers=3) - kept) - 3 * casts
    deferred = lambda sh: memory_model.deferred_bytes(LLAMA, 3, microbatch_size=2, sharding=sh)  # noqa: E731
    assert deferred(one) == 2 * deferred(two)


def test_cp_four_holds_a_quarter_of_a_layers_activations_by_hand():
    """One block, fp32, tp 1, one sequence of 256 at cp 4: L = 64 tokens, N = 64 x 128 elements."""
    N = 64 * 128
    expected = (2 * N * FP32  # ln1, ln2 inputs
                + 2 * 64 * FP32  # their rstd (CUDA's fused RMSNorm)
                + 2 * N * FP32  # the two norm outputs the linears read
                + N * FP32  # q, as cp's attention Function keeps it
                + 2 * 64 * 2 * 32 * FP32  # k and v, kept by it as the 2 kv heads give them (not repeated)
                + 4 * 64 * 32 * FP32  # rotary's cos and sin for q and k, indexed at the rank's 64 positions
                + N * FP32  # attention output
                + 4 * 64 * 352 * FP32  # SwiGLU: gate, up, SiLU, product
                + 4 * 64 * FP32)  # logsumexp, 4 heads
    got = memory_model.activation_bytes(LLAMA, 1, microbatch_size=1, sharding=Sharding(cp=4))
    assert got == expected


def test_kv_blocks_in_flight_are_the_cp_workspace():
    """The ring holds two K/V blocks forward and four (K/V, dK/dV) backward; the all-gather the whole sequence's
    K/V forward, K/V and dK/dV backward. A block at cp 4: 64 tokens x (k, v) x 2 kv heads x 32 x 4 bytes."""
    block = 64 * 2 * 2 * 32 * FP32
    plain = memory_model.workspace_bytes(LLAMA, 1, microbatch_size=1, sharding=Sharding(cp=4))
    ring = memory_model.workspace_bytes(LLAMA, 1, microbatch_size=1, sharding=Sharding(cp=4), cp_comm="ring")
    gather = memory_model.workspace_bytes(LLAMA, 1, microbatch_size=1, sharding=Sharding(cp=4), cp_comm="allgather")
    assert plain == ring
    base_forward, base_backward = 2 * 64 * 128 * FP32, 3 * 64 * 352 * FP32  # a block's temporaries, its gradients
    assert (ring.forward, ring.backward) == (base_forward + 2 * block, base_backward + 4 * block)
    assert (gather.forward, gather.backward) == (base_forward + 4 * block, base_backward + 8 * block)


def test_at_cp_2_a_block_keeps_the_peers_k_v_but_not_under_full_recomputation():
    """One block, fp32, one sequence of 256 at cp 2: the peer's K/V is 128 tokens x (k, v) x 2 kv heads x 32 x 4
    bytes = 64 KiB beside what cp 4's arithmetic gives at 128 tokens; selective recomputes nothing of cp's
    attention, so it keeps the block too (and the rest of what no recomputation keeps: the Function's log-sum-exp
    and its k and v); full keeps the block's input only. In flight at cp 2: the ring's
    forward sends its own block (the arriving one stays, held), its backward passes dK/dV only (two blocks);
    the all-gather's forward gathers two, its backward stacks its own beside the kept one with dK/dV (three)."""
    peer = 128 * 2 * 2 * 32 * FP32
    act = lambda recompute, cp: memory_model.activation_bytes(LLAMA, 1, microbatch_size=1,  # noqa: E731
                                                               sharding=Sharding(cp=cp), recompute=recompute)
    per_token = lambda recompute: act(recompute, 4) * 2  # cp 4's 64 tokens, doubled  # noqa: E731
    assert act("none", 2) == per_token("none") + peer == 2 * 624_128 + 65_536  # cp 4 by hand: the test above
    assert act("selective", 2) == per_token("selective") + peer == act("none", 2)
    assert act("full", 2) == per_token("full") == 128 * 128 * FP32  # the block's input
    work = lambda comm: memory_model.workspace_bytes(LLAMA, 1, microbatch_size=1, sharding=Sharding(cp=2),  # noqa: E731
                                                     cp_comm=comm)
    base_forward, base_backward = 2 * 128 * 128 * FP32, 3 * 128 * 352 * FP32
    assert (work("ring").forward, work("ring").backward) == (base_forward + peer, base_backward + 2 * peer)
    assert (work("allgather").forward, work("allgather").backward) == (base_forward + 2 * peer,
                                                                       base_backward + 3 * peer)


def test_weights_stay_whole_and_zero_shards_over_dp_times_cp():
    stages = [(4, True, True)]
    state = lambda **kw: memory_model.state_bytes(LLAMA, stages, sharding=Sharding(**kw))  # noqa: E731
    assert state(cp=4).weights == state().weights and state(cp=4).gradients == state().gradients
    assert state(cp=4).optimizer == state().optimizer  # no ZeRO: every rank keeps its moments
    assert state(dp=2, cp=2, zero=1) == state(dp=4, zero=1)
    assert state(cp=2, zero=1).optimizer < state().optimizer  # ZeRO-1 over cp alone (dp 1) shards too
    between = memory_model.state_bytes(LLAMA, stages, sharding=Sharding(cp=2, zero=2), between_steps=True)
    assert 2 * between.gradients == state().gradients  # ZeRO-2 keeps a half of the gradients over cp 2 too
    plan = build_plan("1f1b", 2, 4)
    mem = lambda sh: memory_model.plan_memory(LLAMA, plan, [2, 2], microbatch_size=1, sharding=sh)  # noqa: E731
    assert all(x.dp_buffers == 0 for x in mem(Sharding(pp=2, cp=2)))  # averaged in the flat gradient buffer


# ---------------------------------------------------------------------------------------------------------
# time


def _costs(intra="400GB/s", inter="400GB/s", per_node=8, tflops=100.0):
    cluster = make_cluster(8, per_node, gpu_memory="80GiB", gpu_tflops=tflops, intra_node=intra, inter_node=inter,
                           hbm=2e12)
    return cluster, AnalyticalCosts(cluster, efficiency=0.5, layer_overhead_s=0.0)


def test_a_cp_rank_computes_its_share():
    """Without a host floor the block's compute divides by cp, and so does the head's and the embedding's but for
    its dense V x C weight gradient (read and written once in fp32 at HBM speed); the ring adds its merges: 3
    passes over the fp32 output block (L x C / tp) per step, at HBM speed; the all-gather has none."""
    _, costs = _costs()
    one = costs.compute(LLAMA, Shape(Sharding(), "none", 2))
    gather = costs.compute(LLAMA, Shape(Sharding(cp=4), "none", 2, "allgather"))
    ring = costs.compute(LLAMA, Shape(Sharding(cp=4), "none", 2, "ring"))
    for a, b in (one[0], gather[0]), (one[2], gather[2]):  # layer, head
        assert (a.f, a.b, a.w) == pytest.approx((4 * b.f, 4 * b.b, 4 * b.w), rel=1e-12)
    dense = 2 * 256 * 128 * FP32 / 2e12
    (e1, e4) = one[1], gather[1]
    assert (e1.f, e1.b - dense, e1.w - dense) == pytest.approx((4 * e4.f, 4 * (e4.b - dense), 4 * (e4.w - dense)),
                                                                rel=1e-12)
    merges = 3 * 3 * 2 * 64 * 128 * FP32 / 2e12  # cp - 1 steps, 3 passes, mbs 2 x 64 tokens x 128
    assert ring[0].f == pytest.approx(gather[0].f + merges, rel=1e-12)
    assert ring[0].b - ring[0].w == pytest.approx(gather[0].b - gather[0].w + merges, rel=1e-12)
    # selective recomputation leaves cp's attention alone (pipegpt.model.gpt): nothing more to compute; at cp 1
    # it recomputes attention's two T x T products, 4 x 256^2 x 128 FLOPs a sequence at 50 TFLOP/s
    assert costs.compute(LLAMA, Shape(Sharding(cp=4), "selective", 2, "ring")) == ring
    selective = costs.compute(LLAMA, Shape(Sharding(), "selective", 2))
    assert selective[0].b - one[0].b == pytest.approx(2 * 4 * 256 * 256 * 128 / 50e12, rel=1e-12)


def test_the_ring_shows_only_what_the_blocks_attention_does_not_hide():
    """seq 16384 at cp 2, tp 1, one sequence, bf16: a block is 8192 tokens x (k, v) x 2 kv heads x 32 x 2 bytes
    = 2 MiB; a causal block's attention 2 x 8192^2 x 128 FLOPs at 50 TFLOP/s (100 at 0.5): 344 us. At cp 2 the
    forward keeps the peer's K/V, so the backward passes only dK/dV, home after the last block."""
    model = replace(LLAMA, seq_len=16384)
    block, attention = 8192 * 2 * 2 * 32 * 2, 2 * 8192 * 8192 * 128 / 50e12
    shape = Shape(Sharding(cp=2), "none", 1, "ring")
    cluster, fast = _costs()
    lat = cluster.latency_intra_s
    assert lat + block / 400e9 < attention  # 10 us of transfer: hidden
    fast_step = lat + block / 400e9
    # hidden but for dK/dV's last hop home, after the backward's last block (measured: the ring sends cp blocks of
    # dK/dV, benchmarks/bench_context_parallel.py)
    assert fast.context_parallel(model, shape) == pytest.approx((0.0, fast_step), rel=1e-12)
    _, slow = _costs(intra="100MB/s")
    step = lat + block / 100e6
    assert step > attention  # 21 ms: shows less the attention it overlaps
    forward, backward = slow.context_parallel(model, shape)
    assert forward == pytest.approx(step - attention, rel=1e-12)  # cp - 1 = 1 step
    assert backward == pytest.approx(step, rel=1e-12)  # dK/dV home: nothing after it to hide behind
    gathered = fast.context_parallel(model, replace(shape, cp_comm="allgather"))  # never overlapped
    assert gathered == pytest.approx((fast_step, fast_step), rel=1e-12)  # backward: the reduce-scatter alone
    full = slow.context_parallel(model, replace(shape, recompute="full"))
    assert full == pytest.approx((forward, backward + forward), rel=1e-12)  # the recomputed forward's again
    # selective recomputes nothing of cp's attention (its Function keeps O(L)): no K/V again
    assert slow.context_parallel(model, replace(shape, recompute="selective")) == (forward, backward)


def test_at_cp_4_the_ring_passes_k_v_and_dk_dv_against_each_blocks_backward():
    """seq 16384 at cp 4: blocks of 4096 tokens, 1 MiB in bf16, a causal block's attention 2 x 4096^2 x 128
    FLOPs at 50 TFLOP/s: 86 us. Over 100 MB/s each backward step's K/V and dK/dV (2 MiB) outlast two blocks'."""
    model = replace(LLAMA, seq_len=16384)
    block, attention = 4096 * 2 * 2 * 32 * 2, 2 * 4096 * 4096 * 128 / 50e12
    cluster, slow = _costs(intra="100MB/s")
    lat = cluster.latency_intra_s
    step = lat + block / 100e6
    forward, backward = slow.context_parallel(model, Shape(Sharding(cp=4), "none", 1, "ring"))
    assert forward == pytest.approx(3 * (step - attention), rel=1e-12)
    assert backward == pytest.approx(3 * (lat + 2 * block / 100e6 - 2 * attention) + step, rel=1e-12)
    gathered = slow.context_parallel(model, Shape(Sharding(cp=4), "none", 1, "allgather"))
    assert gathered == pytest.approx((3 * step, 6 * step), rel=1e-12)  # K/V gathered again, dK/dV scattered


def test_on_cpu_ranks_the_ring_hides_only_latency_not_the_copy():
    """CPU ranks (gloo over TCP) copy the bytes on the cores that compute. seq 2048, GPT-2 width 128 (4 heads of
    32), fp32, cp 2: a block is 1024 tokens x (k, v) x 128 x 4 bytes = 1 MiB; over 2.5 GB/s with 100 us latency
    a hop is 519 us, of which 419 us the copy; a causal block's attention 2 x 1024^2 x 128 FLOPs at 0.2 TFLOP/s:
    1.34 ms, longer than the hop. On GPUs the same figures hide the whole hop."""
    model = replace(MODEL_PRESETS["tiny"], n_layer=2, n_embd=128, n_head=4, seq_len=2048, vocab_size=256)
    block, copy = 1024 * 2 * 128 * FP32, 1024 * 2 * 128 * FP32 / 2.5e9
    shape = Shape(Sharding(cp=2), "none", 1, "ring")
    cpu = make_cluster(2, 2, gpu_memory="8GiB", gpu_tflops=0.2, intra_node="2.5GB/s", precision="fp32",
                       hbm=10e9, reserve=0, name="CPU rank (this machine)")
    cpu = replace(cpu, latency_intra_s=100e-6)
    gpu = replace(cpu, name="custom GPU")
    assert (block, 1024 * 1024 * 256 / 0.2e12) == (2**20, pytest.approx(1.342e-3, rel=1e-3))
    def on(cluster, **kw):
        return AnalyticalCosts(cluster, efficiency=1.0, layer_overhead_s=0.0).context_parallel(model, replace(shape, **kw))

    assert on(gpu) == pytest.approx((0.0, 100e-6 + copy), rel=1e-12)  # the forward's hop hidden, dK/dV's home not
    assert on(cpu) == pytest.approx((copy, 100e-6 + copy), rel=1e-12)  # the forward's copy shows
    assert on(cpu, cp_comm="allgather") == on(gpu, cp_comm="allgather") == pytest.approx((100e-6 + copy,) * 2)


def test_calibrated_costs_hide_transfers_behind_attention_at_its_measured_speed():
    """A calibrated model computes at scale x the FLOP model at peak: a ring step's attention too."""
    from pipegpt.costs.calibrated_costs import CalibratedCosts
    model = replace(LLAMA, seq_len=16384)
    cluster, _ = _costs(intra="100MB/s")
    shape = Shape(Sharding(cp=2), "none", 1, "ring")
    block, attention = 8192 * 2 * 2 * 32 * 2, 2 * 8192 * 8192 * 128 / 100e12  # at peak
    calibrated = CalibratedCosts(cluster, 30.0, 60.0, 30.0, 0.0, 0.0)
    step = cluster.latency_intra_s + block / 100e6
    assert calibrated.context_parallel(model, shape)[0] == pytest.approx(step - 30 * attention, rel=1e-12)
    assert 30 * attention < step


def test_a_cp_group_across_nodes_pays_the_inter_node_link():
    """tp x cp consecutive ranks: inside a node when that divides the GPUs per node, over the network
    otherwise."""
    shape = Shape(Sharding(cp=4), "none", 1, "allgather")
    block = 64 * 2 * 2 * 32 * 2
    inside_cluster, inside = _costs(intra="400GB/s", inter="1GB/s", per_node=4)
    outside_cluster, outside = _costs(intra="400GB/s", inter="1GB/s", per_node=2)
    assert inside.context_parallel(LLAMA, shape)[0] == pytest.approx(
        3 * (inside_cluster.latency_intra_s + block / 400e9), rel=1e-12)
    assert outside.context_parallel(LLAMA, shape)[0] == pytest.approx(
        3 * (outside_cluster.latency_inter_s + block / 1e9), rel=1e-12)
    for group in ParallelDims(dp=2, cp=2, tp=2).groups(["cp"]):  # the mesh's order puts a group in a node of 4
        assert len({rank // 4 for rank in group}) == 1


def test_a_cp_rank_sends_three_blocks_per_layer_and_peer():
    """cp 4, seq 256, fp32, one sequence: a block is 64 tokens x (k, v) x 2 kv heads x 32 x 4 bytes = 32 KiB;
    forward 3 K/V blocks, backward 3 K/V and 3 dK/dV (the owner's share stays home), ring or all-gather alike;
    benchmarks/bench_context_parallel.py counts what the attention sends against this."""
    block = 64 * 2 * 2 * 32 * FP32
    for comm in ("ring", "allgather"):
        assert cp_bytes_per_layer(LLAMA, 1, Sharding(cp=4), comm) == 9 * block == 294912
    # cp 2: the backward's K/V is the forward's kept block: forward K/V and backward dK/dV only
    assert cp_bytes_per_layer(LLAMA, 2, Sharding(cp=2), "ring", "bf16") == 2 * (2 * 128 * 2 * 2 * 32 * 2)
    assert cp_bytes_per_layer(LLAMA, 1, Sharding(), "ring") == 0


# ---------------------------------------------------------------------------------------------------------
# the search


def test_branch_and_bound_with_cp_finds_what_evaluating_everything_finds():
    """The bounds stay below every plan with cp's costs in them (a model whose sequence needs cp to fit)."""
    model = replace(LLAMA, seq_len=4096, n_layer=4)
    cluster = make_cluster(8, 4, gpu_memory="1GiB", gpu_tflops=50, intra_node="50GB/s", inter_node="5GB/s",
                           reserve=0)
    req = Request(model, 4, cluster, AnalyticalCosts(cluster), top=1)
    best = search(req).best[0]
    assert best.layout.cp > 1
    brute = Search(req)
    steps = [ev.step for mesh in brute.layouts() for _, cand in brute.expand(mesh)
             for ev in [brute.evaluate(cand)] if ev is not None]
    assert best.step_time == pytest.approx(min(steps), rel=5e-3)


def test_cp_is_searched_in_powers_of_two_down_to_2048_tokens_a_rank():
    cluster = make_cluster(64, 8, "h100")
    ask = lambda model, **kw: Search(Request(model, 8, cluster, AnalyticalCosts(cluster), **kw))  # noqa: E731
    llama8k = MODEL_PRESETS["llama3-8b"]
    assert ask(llama8k).cp_choices(tp=1) == [1, 2, 4]  # 2,048 tokens a rank at cp 4
    assert ask(replace(llama8k, seq_len=1 << 20)).cp_choices(tp=8) == [1, 2, 4, 8]  # cp x tp <= 64 GPUs
    assert ask(llama8k, only={"cp": 16}).cp_choices(tp=1) == [16]  # --cp: taken as given
    assert ask(MODEL_PRESETS["gpt2"]).cp_choices(tp=1) == [1]  # 1,024 tokens: no cp searched


def plan_json(*args):
    result = invoke("plan", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


LONG_8B = ("--model", "llama3-8b", "--seq-len", "131072", "--gpus", "64", "--device", "h100",
           "--batch-tokens", "4194304")


@pytest.mark.slow  # the default suite's time (issue 43); its claim has a faster test there
def test_70b_at_128k_tokens_on_256_h100s_has_a_plan_with_cp():
    """Before context parallelism: "no plan fits" (activations)."""
    data = plan_json("--model", "llama3-70b", "--seq-len", "131072", "--gpus", "256", "--device", "h100",
                     "--batch-tokens", "16777216", "--top", "1")
    best = data["plans"][0]
    assert best["cp"] > 1 and best["peak_memory_bytes"] <= 78 * 2**30
    assert best["dp"] * best["pp"] * best["cp"] * best["tp"] == best["gpus"] <= 256
    assert f"--cp {best['cp']} --cp-comm {best['cp_comm']}" in best["command"]


def test_cp_and_cp_comm_keep_those_layouts_and_the_json_shows_them():
    for plan in plan_json(*LONG_8B, "--cp", "8", "--top", "3")["plans"]:
        assert plan["cp"] == 8 and "--cp 8 " in plan["command"]
    for plan in plan_json(*LONG_8B, "--cp", "2", "--cp-comm", "allgather", "--top", "2")["plans"]:
        assert (plan["cp"], plan["cp_comm"]) == (2, "allgather") and "--cp-comm allgather" in plan["command"]
    short = plan_json("--model", "llama3-8b", "--gpus", "8", "--device", "h100", "--batch-tokens", "131072",
                      "--cp", "1", "--top", "2")
    assert all(p["cp"] == 1 and "--cp" not in p["command"] for p in short["plans"])  # cp 1: the run's default


def test_with_a_slow_network_cp_groups_stay_inside_a_node():
    data = plan_json(*LONG_8B, "--inter-node-gbps", "4", "--top", "5")
    with_cp = [p for p in data["plans"] if p["cp"] > 1]
    assert with_cp and all(8 % (p["tp"] * p["cp"]) == 0 for p in with_cp)


def test_a_layout_with_cp_runs_with_cp():
    lay = Layout(1, 2, 2, "1f1b", 1, 8, 1, cp=4, cp_comm="allgather")
    assert lay.world == 16 and lay.sharding.cp == 4 and lay.mesh_name == "dp1 pp2 cp4(allgather) tp2"
    args = lay.run_args(TrainConfig().model, "bf16")
    assert args[args.index("--cp"):args.index("--cp") + 4] == ["--cp", "4", "--cp-comm", "allgather"]
    assert lay.settings()["cp"] == 4 and Layout(1, 2, 2, "1f1b", 1, 8, 1).settings()["cp"] == 1


@pytest.mark.parametrize("args,needle", [
    (["--cp", "3"], "2 x cp = 6 chunks"),
    (["--cp", "128"], "--cp 128 is more context-parallel ranks than the 64 GPUs"),
    (["--cp-comm", "both"], "'both' is not one of"),
])
def test_bad_cp_is_one_line(args, needle):
    assert_one_line_error(invoke("plan", *LONG_8B, *args), needle)
