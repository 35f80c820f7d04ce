"""benchmarks/bench_overlap.py's emulated link: the command that puts a run in a network namespace of its own with
a qdisc on that namespace's loopback (never the root namespace's), its refusal where that cannot be made, and the
all-to-all fitted to a measured slowdown. Commands and the simulator only: nothing here is timed."""
import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_overlap", ROOT / "benchmarks" / "bench_overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_link_runs_the_command_as_it_is(bench):
    assert bench.link_prefix(None, None) == []
    assert bench.link_prefix(None, 0.0) == []


def test_a_rate_is_a_tbf_on_the_new_namespaces_loopback(bench):
    prefix = bench.link_prefix("400mbit", None)
    assert prefix[:4] == ["unshare", "--net", "--", "sh"]
    assert prefix[4] == "-c" and prefix[6] == "sh"  # "$@" is the command after the prefix, $0 is "sh"
    assert prefix[5] == ("ip link set lo up && tc qdisc add dev lo root handle 1: tbf rate 400mbit burst 256kb "
                         'limit 64mb && exec "$@"')


def test_a_delay_is_netem_alone_or_under_the_rate(bench):
    assert bench.link_prefix(None, 2.0)[5] == ('ip link set lo up && tc qdisc add dev lo root netem delay 2ms '
                                               'limit 100000 && exec "$@"')
    both = bench.link_prefix("1gbit", 0.5)[5]
    assert both == ("ip link set lo up && tc qdisc add dev lo root handle 1: tbf rate 1gbit burst 256kb limit 64mb"
                    ' && tc qdisc add dev lo parent 1:1 handle 10: netem delay 0.5ms limit 100000 && exec "$@"')


def test_the_prefix_hands_the_command_its_arguments_unchanged(bench):
    """The script ends in exec "$@": the command's words arrive as they were given, spaces and quotes included
    (here without unshare: the same sh -c with the qdisc lines left out)."""
    script = bench.link_prefix("1gbit", None)[5].split(" && ")[-1]
    out = subprocess.run(["sh", "-c", script, "sh", "printf", "%s|", "a b", "'c'", "$HOME"], capture_output=True,
                         text=True, check=True).stdout
    assert out == "a b|'c'|$HOME|"


def test_every_rate_with_every_delay_is_a_row(bench):
    args = bench.argparse.Namespace(link_rate="none,400mbit", link_delay_ms="0,2")
    assert [label for label, _ in bench.links(args)] == ["none", "2 ms", "400mbit", "400mbit + 2 ms"]
    assert [bool(prefix) for _, prefix in bench.links(args)] == [False, True, True, True]


def test_the_link_is_refused_before_anything_runs_where_tools_are_missing(bench, monkeypatch):
    monkeypatch.setattr(bench.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")
    with pytest.raises(SystemExit, match="need tc"):
        bench.check_link(bench.link_prefix("1gbit", None))
    bench.check_link([])  # no link: nothing to check


def test_a_failed_namespace_is_refused_with_its_reason(bench, monkeypatch):
    monkeypatch.setattr(bench.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    failed = subprocess.CompletedProcess([], 2, "", "Error: Specified qdisc kind is unknown.\n")
    monkeypatch.setattr(bench.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(SystemExit, match=r"qdisc kind is unknown \(this kernel has no netem"):
        bench.check_link(bench.link_prefix(None, 2.0))
    with pytest.raises(SystemExit, match=r"qdisc kind is unknown\. It needs root"):
        bench.check_link(bench.link_prefix("1gbit", None))


@pytest.mark.parametrize("schedule,stages", [("1f1b-overlap", 1), ("dualpipev", 2)])
def test_the_fitted_all_to_all_gives_the_measured_slowdown(bench, schedule, stages):
    """a2a is fitted so that the simulated unpaired step over the one without exchanges is the measured off / ep1.
    On one stage per rank with no bubble that is m (3 + 2 a2a) / 3m: a slowdown of 1.2 is a2a 0.3."""
    a2a = bench.fit_a2a(schedule, stages, 8, 1.2)
    off = bench.simulated(schedule, stages, 8, a2a, "off")
    assert off / bench.simulated(schedule, stages, 8, 0.0, "off") == pytest.approx(1.2, rel=1e-6)
    if stages == 1:
        assert a2a == pytest.approx(0.3, rel=1e-6)
    assert bench.simulated(schedule, stages, 8, a2a, "on") < off  # pairs hide some of it
    assert bench.fit_a2a(schedule, stages, 8, 0.9) == 0.0  # ep 1 slower than off: no exchange to fit


def test_the_exchange_share_is_the_union_of_a_ranks_exchanges_over_its_actions(bench, tmp_path):
    """Rank 0: actions over 0..100 us, exchanges 10..30 and 20..40 on two lanes (their union: 30) and 60..70: 40%.
    Rank 1: actions over 0..200, one exchange of 20: 10%. The share is the ranks' mean, 25%."""
    def x(rank, ts, dur):
        return {"ph": "X", "pid": rank, "tid": 0, "ts": ts, "dur": dur, "name": "F0"}

    def a2a(rank, lane, start, stop):
        return [{"ph": "B", "pid": rank, "tid": lane, "ts": start, "cat": "expert all-to-all", "name": "dispatch"},
                {"ph": "E", "pid": rank, "tid": lane, "ts": stop, "cat": "expert all-to-all", "name": "dispatch"}]

    events = [x(0, 0, 50), x(0, 50, 50), *a2a(0, 1, 10, 30), *a2a(0, 2, 20, 40), *a2a(0, 1, 60, 70),
              x(1, 0, 200), *a2a(1, 1, 100, 120), {"ph": "M", "pid": 0, "tid": 1, "name": "thread_name"}]
    (tmp_path / "trace.json").write_text(bench.json.dumps({"traceEvents": events}))
    assert bench.exchange_share(tmp_path) == pytest.approx(0.25)


def test_layouts_pair_schedules_with_their_stages(bench):
    def of(schedule, stages):
        return bench.layouts(bench.argparse.Namespace(schedule=schedule, stages=stages))

    assert of("1f1b-overlap,dualpipev", "1,2") == [("1f1b-overlap", 1), ("dualpipev", 2)]
    assert of("dualpipev", "1,2") == [("dualpipev", 1), ("dualpipev", 2)]
    assert of("dualpipev", "2") == [("dualpipev", 2)]
    with pytest.raises(SystemExit, match="pair them"):
        of("a,b,c", "1,2")
