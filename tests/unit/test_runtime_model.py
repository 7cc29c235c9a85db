"""The runtime model (algorithms/rules/runtime_model.py) against the communication patterns written out by
hand: ring all-reduce 2(n-1) rounds of M/n, a shaped link shared by the flows that cross it, gossip
overlapped with compute, periodic rounds amortized over h steps."""
from __future__ import annotations

import math

import pytest

from algorithms.rules.runtime_model import (
    Compute,
    Network,
    PolicySpec,
    all_to_all,
    exchange,
    hierarchical_allreduce,
    predict,
    ring_allreduce,
    ring_peers,
)

M = 1.2e6            # model bytes
B = 100e6 / 8        # 100 Mbit/s in bytes/s
L = 0.001            # 1 ms one way
LO = 2e9             # loopback per flow
NET = Network.uniform(2, 2, B, L, loopback_bytes_per_s=LO)  # ranks 0, 1 on node 0; 2, 3 on node 1


def test_flat_ring_all_reduce_is_bound_by_its_two_crossing_edges():
    # ring 0->1->2->3->0: edges 1->2 and 3->0 cross, one flow each way; 6 rounds of M/4 at B, each + L
    assert ring_allreduce(NET, [0, 1, 2, 3], M) == pytest.approx(6 * (M / 4 / B + L))


def test_an_interleaved_ring_shares_each_link_between_two_flows():
    net = Network(node_of_rank=(0, 1, 0, 1), bandwidth=NET.bandwidth, latency=NET.latency, loopback_bytes_per_s=LO)
    # every edge crosses; 0->1 and 2->3 share node0->node1, so each flow gets B/2
    assert ring_allreduce(net, [0, 1, 2, 3], M) == pytest.approx(6 * (M / 4 / (B / 2) + L))


def test_hierarchical_sends_the_gradients_across_once_per_node():
    # intra-node gather and scatter on loopback (M / LO each), the two leaders' ring: 2 rounds of M/2
    assert hierarchical_allreduce(NET, M) == pytest.approx(2 * (M / LO) + 2 * (M / 2 / B + L))
    assert hierarchical_allreduce(NET, M) < ring_allreduce(NET, [0, 1, 2, 3], M)


def test_all_to_all_and_gossip_load_the_link_with_every_crossing_flow():
    # all-to-all of M: each of the 2 ranks on node 0 sends M/4 to each of the 2 on node 1: 4 flows share B
    assert all_to_all(NET, [0, 1, 2, 3], M) == pytest.approx(M / 4 / (B / 4) + L)
    # ring gossip: 1->2 and 0->3 cross node0->node1 with M each
    assert exchange(NET, lambda r: ring_peers(r, 4), M) == pytest.approx(M / (B / 2) + L)


def test_bsp_adds_communication_to_the_slowest_compute_and_gossip_hides_it_behind_compute():
    compute = Compute(0.05)
    bsp = predict(PolicySpec("bsp"), NET, compute, M)
    assert bsp.step_s == pytest.approx(0.05 + 6 * (M / 4 / B + L))
    assert bsp.bytes_per_step == pytest.approx(1.5 * M)
    slow_gossip = predict(PolicySpec("dpsgd"), NET, compute, M)
    assert slow_gossip.step_s == pytest.approx(max(0.05, M / (B / 2) + L))  # the exchange is the longer
    fast_gossip = predict(PolicySpec("dpsgd", codec_ratio=0.25), Network.uniform(2, 2, 10 * B, L), compute, M)
    assert fast_gossip.step_s == pytest.approx(0.05)  # hidden behind compute
    assert fast_gossip.bytes_per_step == pytest.approx(2 * 0.25 * M)


def test_periodic_rounds_are_amortized_and_wait_for_the_slowest_sum_of_h_steps():
    compute = Compute(0.01, factors=(1, 3, 1, 1))
    local = predict(PolicySpec("local_sgd", h=8), NET, compute, M)
    assert local.step_s == pytest.approx(0.03 + 6 * (M / 4 / B + L) / 8)
    bsp = predict(PolicySpec("bsp"), NET, compute, M)
    assert bsp.step_s == pytest.approx(0.03 + 6 * (M / 4 / B + L))


def test_jitter_makes_a_synchronous_step_wait_for_the_expected_maximum():
    sigma = 0.5
    compute = Compute(0.02, jitter_sigma=sigma, samples=20000)
    # E[max of 4 iid lognormals] by numeric integration of 1 - F(x)^4
    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(math.log(x / 0.02) / (sigma * math.sqrt(2))))
    xs = [0.02 * math.exp(sigma * (-6 + 12 * k / 4000)) for k in range(4001)]
    expected = sum((1 - cdf(0.5 * (a + b)) ** 4) * (b - a) for a, b in zip(xs, xs[1:])) + xs[0]
    assert compute.expected_max([0, 1, 2, 3]) == pytest.approx(expected, rel=0.02)


def test_the_background_kind_runs_at_each_members_own_pace():
    shadow = predict(PolicySpec("shadow"), NET, Compute(0.02, factors=(1, 3, 1, 1)), M)
    assert shadow.step_s == pytest.approx(0.02)


def test_the_background_kinds_rounds_send_their_bytes_spread_over_the_steps_they_span():
    """(It predicted 0 bytes; the lab measured 0.19-0.81 of the model per step.) One node, loopback
    1e9 B/s a flow: a ring all-reduce of 4 MB among 4 ranks is 6 rounds of 1 MB, 6 ms; a round adds
    one foreground step (20 ms) of waiting for the model lock: 26 ms, so 20/26 rounds a step, each
    sending 2(4-1)/4 of 4 MB."""
    one = Network((0, 0, 0, 0), ((float("inf"),),), ((0.0,),), loopback_bytes_per_s=1e9)
    p = predict(PolicySpec("shadow"), one, Compute(0.02), 4e6)
    assert p.step_s == pytest.approx(0.02)
    assert p.bytes_per_step == pytest.approx(1.5 * 4e6 * 0.020 / 0.026)
    spaced = predict(PolicySpec("shadow", interval_s=0.1), one, Compute(0.02), 4e6)  # a round every 100 ms at most
    assert spaced.bytes_per_step == pytest.approx(1.5 * 4e6 * 0.020 / 0.120)


def test_hierarchical_bsp_bytes_are_the_busiest_ranks_a_leaders():
    """(They were the flat ring's 1.5 M; the lab measured rank 0's 2.0 M.) A leader sends its node's sum
    to each member (M each) and 2(k-1)/k M in the leaders' ring."""
    assert predict(PolicySpec("bsp", hierarchical=True), NET, Compute(0.05), M).bytes_per_step == pytest.approx(2 * M)
    three = Network.uniform(3, 2, B, L, loopback_bytes_per_s=LO)
    assert predict(PolicySpec("bsp", hierarchical=True), three, Compute(0.05), M).bytes_per_step == \
        pytest.approx(M + 2 * 2 / 3 * M)
    assert predict(PolicySpec("bsp"), three, Compute(0.05), M).bytes_per_step == pytest.approx(2 * 5 / 6 * M)


def test_qadam_without_a_step_limit_is_past_its_warm_up():
    """(A job without stop.max_steps was predicted as all warm-up: every step a full all-reduce.) With
    no end given, the compressed scatter-gather of every step after warm-up: its share tends to 1."""
    unbounded = predict(PolicySpec("qadam", codec_ratio=0.25, codec="uint8", warmup_steps=100), NET, Compute(0.05), M)
    long_run = predict(PolicySpec("qadam", codec_ratio=0.25, codec="uint8", warmup_steps=100, total_steps=10 ** 9),
                       NET, Compute(0.05), M)
    compressed = predict(PolicySpec("bytegrad", codec_ratio=0.25, codec="uint8"), NET, Compute(0.05), M)
    assert unbounded.step_s == pytest.approx(long_run.step_s) == pytest.approx(compressed.step_s)
    assert unbounded.bytes_per_step == pytest.approx(1.5 * 0.25 * M)


def test_an_unknown_pattern_is_named():
    with pytest.raises(KeyError, match="asp"):
        predict(PolicySpec("asp"), NET, Compute(0.01), M)


def test_emulated_nodes_on_one_machine_share_its_copying_rate():
    """The lab's nodes share one machine: a round moves at most `host_bytes_per_s` in all. The flat
    ring's round has 4 flows of M/4 (M in all); at a host rate below the link's, the host bounds it."""
    host = B / 2
    net = Network.uniform(2, 2, B, L, loopback_bytes_per_s=LO, host_bytes_per_s=host)
    assert ring_allreduce(net, [0, 1, 2, 3], M) == pytest.approx(6 * (M / host + L))
    assert ring_allreduce(Network.uniform(2, 2, B, L, loopback_bytes_per_s=LO, host_bytes_per_s=100 * B),
                          [0, 1, 2, 3], M) == pytest.approx(6 * (M / 4 / B + L))  # the link is slower


def test_a_synchronization_takes_the_longer_of_its_links_and_its_host_time():
    """In the lab each pattern's host time (`Network.host_s`) bounds a synchronization from below, as a
    roofline: a slow link hides it, a fast link exposes it. A periodic kind pays it once per round (over
    h), D-PSGD only its own CPU work (its exchange overlaps the forward pass), CHOCO its whole blocking
    exchange, the background kind never."""
    compute = Compute(0.05)
    host = (("bsp/none", 0.01), ("allreduce", 0.01), ("bytegrad/uint8", 0.02), ("dpsgd/uint8", 0.02),
            ("dpsgd/uint8:cpu", 0.003), ("choco/uint8", 0.015))
    slow = Network.uniform(2, 2, B, L, loopback_bytes_per_s=LO, host_s=host)
    ring = 6 * (M / 4 / B + L)
    assert ring > 0.01
    assert predict(PolicySpec("bsp"), slow, compute, M).step_s == pytest.approx(0.05 + ring)  # the link is longer
    fast = Network.uniform(2, 2, 1e6 * B, 0.0, loopback_bytes_per_s=1e6 * LO, host_s=host)
    assert predict(PolicySpec("bsp"), fast, compute, M).step_s == pytest.approx(0.05 + 0.01, rel=1e-3)
    assert predict(PolicySpec("local_sgd", h=8), fast, compute, M).step_s == pytest.approx(0.05 + 0.01 / 8, rel=1e-3)
    bytegrad = PolicySpec("bytegrad", codec_ratio=0.25, codec="uint8")
    assert predict(bytegrad, fast, compute, M).step_s == pytest.approx(0.05 + 0.02, rel=1e-3)
    dpsgd = PolicySpec("dpsgd", codec_ratio=0.25, codec="uint8")
    assert predict(dpsgd, fast, compute, M).step_s == pytest.approx(0.05 + 0.003, rel=1e-3)
    choco = PolicySpec("choco", codec_ratio=0.25, codec="uint8")
    assert predict(choco, fast, compute, M).step_s == pytest.approx(0.05 + 0.015, rel=1e-3)
    assert predict(PolicySpec("shadow"), fast, compute, M).step_s == pytest.approx(0.05)
    assert predict(bytegrad, Network.uniform(2, 2, 1e6 * B, 0.0, loopback_bytes_per_s=1e6 * LO), compute, M).step_s \
        == pytest.approx(0.05, rel=1e-3)  # real nodes: no host time measured, none counted


def test_choco_waits_for_its_peers_messages_before_its_forward_pass():
    """CHOCO mixes before the forward pass: nothing hides its exchange. A rank waits for its slowest
    incoming message (one flow on the link: M/4 at B, uint8), and the links must carry every step's
    traffic (two flows of M/4 share each direction)."""
    size = 0.25 * M
    slow = predict(PolicySpec("choco", codec_ratio=0.25), NET, Compute(0.005), M)
    assert slow.step_s == pytest.approx(max(2 * size / B + L, 0.005 + size / B + L))  # the links bound it
    busy = predict(PolicySpec("choco", codec_ratio=0.25), NET, Compute(0.05), M)
    assert busy.step_s == pytest.approx(0.05 + size / B + L)  # compute, then the wait
    dpsgd = predict(PolicySpec("dpsgd", codec_ratio=0.25), NET, Compute(0.05), M)
    assert dpsgd.step_s == pytest.approx(max(0.05, 2 * size / B + L))  # D-PSGD hides it behind compute


def test_hierarchical_bytegrad_compresses_only_the_leaders_exchange():
    """Full precision within a node (gather and scatter of M on loopback); between the two leaders the
    compressed scatter-gather: an all-to-all of half the uint8 payload each way, then one all-gather
    round of the summed half."""
    q = 0.25 * M
    expected = 2 * (M / LO) + (q / 2 / B + L) + (q / 2 / B + L)
    assert hierarchical_allreduce(NET, M, 0.25) == pytest.approx(expected)
    spec = PolicySpec("bytegrad", codec_ratio=0.25, hierarchical=True)
    p = predict(spec, NET, Compute(0.05), M)
    assert p.step_s == pytest.approx(0.05 + expected)
    # the busiest rank, a leader: M down to its member, and its half of the leaders' scatter-gather (q/2
    # out in the all-to-all, q/2 in the all-gather): what rank 0 counts (1.25 M measured in the lab)
    assert p.bytes_per_step == pytest.approx(M + q)
    assert p.step_s < predict(PolicySpec("bytegrad", codec_ratio=0.25), NET, Compute(0.05), M).step_s


def test_bsps_buckets_overlap_the_backward_pass_that_produces_them():
    """4 buckets ready at 1/4, 2/4, 3/4 and the end of a 40 ms backward, each all-reduced in comm/4, one
    after another. comm 100 ms: they run back to back from 10 ms, done at 110 ms, 70 ms after backward;
    comm 20 ms: each 5-ms bucket is done before the next is ready, only the last one's 5 ms is left.
    (The model assumed no overlap at all: the step paid the whole all-reduce.)"""
    def exposed(comm: float, backward: float, buckets: int) -> float:
        finish = 0.0
        for i in range(1, buckets + 1):  # bucket i ready at i/k of backward
            finish = max(finish, backward * i / buckets) + comm / buckets
        return finish - backward
    from algorithms.rules.runtime_model import overlapped_with_backward

    for comm in (0.1, 0.02, 0.03):
        assert overlapped_with_backward(comm, 0.04, [1e6] * 4) == pytest.approx(exposed(comm, 0.04, 4))
    assert overlapped_with_backward(0.1, 0.04, [1e6] * 4) == pytest.approx(0.07)
    assert overlapped_with_backward(0.1, 0.04, [4e6]) == 0.1  # one bucket: launched after backward
    one = NET
    ring = 4 * ring_allreduce(one, [0, 1, 2, 3], 1e6)  # four buckets, an all-reduce each
    p = predict(PolicySpec("bsp", bucket_bytes=1e6), one, Compute(0.05, backward_s=0.04), 4e6)
    assert p.step_s == pytest.approx(0.05 + exposed(ring, 0.04, 4))
    whole = ring_allreduce(one, [0, 1, 2, 3], 4e6)
    assert predict(PolicySpec("bsp"), one, Compute(0.05, backward_s=0.04), 4e6).step_s == pytest.approx(0.05 + whole)


def test_the_overlap_counts_the_jobs_real_buckets_each_ready_as_backward_produces_its_bytes():
    """The digits MLP in 0.25 MiB buckets is three buckets of 22568, 1048576 and 133120 bytes (torch's
    reducer's grouping; test_planner.py works them out). Backward produces them in that order, each
    ready once its bytes are: at 22568/T, (22568+1048576)/T and T/T of a 40 ms backward (T the total).
    Each all-reduce is a ring's 6 (b/4/B + L) on the 2x2 lab ring and starts when its bucket is ready
    and the one before is done. Counted as ceil(T / 0.25 MiB) = 5 equal buckets, as before, the wait
    after backward is another figure."""
    from algorithms.rules.runtime_model import buckets, overlapped_with_backward

    sizes = [22568.0, 1048576.0, 133120.0]
    total = sum(sizes)
    bandwidth, latency = 1.25e7, 0.001  # 100 Mbit/s, 1 ms: the lab's pairs
    net = Network.uniform(2, 2, bandwidth, latency)  # 2 nodes of 2 ranks
    spec = PolicySpec("bsp", bucket_bytes=0.25 * 2**20, bucket_sizes=tuple(int(b) for b in sizes))
    assert buckets(spec, total) == pytest.approx(sizes)
    each = [6 * (b / 4 / bandwidth + latency) for b in sizes]
    assert each == pytest.approx([ring_allreduce(net, [0, 1, 2, 3], b) for b in sizes])
    backward, finish, produced = 0.04, 0.0, 0.0
    for size, comm_i in zip(sizes, each):  # the reference: one bucket after another, from the equations
        produced += size
        finish = max(finish, backward * produced / total) + comm_i
    wait = finish - backward
    p = predict(spec, net, Compute(0.05, backward_s=backward), total)
    assert p.comm_s == pytest.approx(wait) and p.step_s == pytest.approx(0.05 + wait)
    five = overlapped_with_backward(sum(each), backward, [total / 5] * 5)
    assert abs(five - wait) > 1e-3, "five equal buckets are not the job's three"


def test_a_nodes_nic_is_shared_by_its_flows_to_every_other_node_where_the_labs_pairs_are_not():
    """3 nodes of one rank, links of B bytes/s. An all-to-all of P bytes: each node sends P/3 to each of
    the two others at once. Shaped per pair (the lab) each flow has a link: (P/3)/B. Through one NIC a
    node (the model of a real cluster) its two flows share B: 2(P/3)/B. A ring all-reduce sends to one
    node at a time: 2(n-1) rounds of (P/3)/B either way."""
    from algorithms.rules.runtime_model import Network, all_to_all, ring_allreduce

    b, p = 1e8, 3e6
    pairs = Network.uniform(3, 1, b)
    nic = Network(pairs.node_of_rank, pairs.bandwidth, pairs.latency, nic_bytes_per_s=(b, b, b))
    assert all_to_all(pairs, [0, 1, 2], p) == pytest.approx(p / 3 / b)
    assert all_to_all(nic, [0, 1, 2], p) == pytest.approx(2 * p / 3 / b)
    assert ring_allreduce(nic, [0, 1, 2], p) == pytest.approx(ring_allreduce(pairs, [0, 1, 2], p)) == pytest.approx(4 * p / 3 / b)


def test_the_probes_network_shares_each_nodes_nic_at_its_fastest_measured_pair():
    from orchestrator.planner import network_from_probe

    cluster = {"nodes": ["a", "b", "c"], "node_of_rank": [0, 1, 2],
               "links": [{"a": 0, "b": 1, "bytes_per_s": 1e8, "latency_s": 0.0},
                         {"a": 0, "b": 2, "bytes_per_s": 5e7, "latency_s": 0.0},
                         {"a": 1, "b": 2, "bytes_per_s": 5e7, "latency_s": 0.0}]}
    assert network_from_probe(cluster).nic_bytes_per_s == (1e8, 1e8, 5e7)


def test_each_bucket_is_a_collective_of_its_own_and_pays_its_rounds_latencies():
    """k buckets reduced one after another on the 2x2 ring: each 6 rounds of (b/4)/B + L, so k buckets of
    M/k move the same bytes as one bucket and pay 6kL of latency instead of 6L. The same for hierarchical
    BSP (gather, the leaders' 2-rank ring, scatter per bucket) and bytegrad's scatter-gather per bucket."""
    from algorithms.rules.runtime_model import Compute, PolicySpec

    c = Compute(0.02)
    one = predict(PolicySpec("bsp"), NET, c, M).step_s - 0.02
    five = predict(PolicySpec("bsp", bucket_sizes=(M / 5,) * 5), NET, c, M).step_s - 0.02
    assert one == pytest.approx(6 * (M / 4 / B + L))
    assert five == pytest.approx(5 * 6 * (M / 20 / B + L))
    assert five - one == pytest.approx(24 * L)
    # unequal buckets as the job makes them: each its own bandwidth term, each its latencies
    sizes = (0.9e6, 0.2e6, 0.1e6)
    assert predict(PolicySpec("bsp", bucket_sizes=sizes), NET, c, M).step_s - 0.02 == pytest.approx(
        sum(6 * (b / 4 / B + L) for b in sizes))
    # hierarchical: node-local gather and scatter over loopback, the two leaders' ring (2 rounds of b/2)
    hier = predict(PolicySpec("bsp", hierarchical=True, bucket_sizes=(M / 2,) * 2), NET, c, M).step_s - 0.02
    assert hier == pytest.approx(2 * ((M / 2) / LO + 2 * ((M / 4) / B + L) + (M / 2) / LO))
    # bytegrad uint8: all-to-all of q/4 chunks (node 0's two ranks send two chunks each to node 1: 4 flows
    # share the link) then a ring all-gather of q/4 sums, 3 rounds; per bucket
    q = 0.25
    sg = predict(PolicySpec("bytegrad", codec_ratio=q, bucket_sizes=(M / 3,) * 3), NET, c, M).step_s - 0.02
    per = (M / 3 * q / 4) / (B / 4) + L + 3 * ((M / 3 * q / 4) / B + L)
    assert sg == pytest.approx(3 * per)
    # `bucket_bytes` alone: split evenly into ceil(M / bucket) buckets
    assert predict(PolicySpec("bsp", bucket_bytes=M / 5), NET, c, M).step_s == pytest.approx(0.02 + five)


def test_a_ranks_own_cpu_work_in_a_gossip_step_takes_its_share_of_a_core():
    """D-PSGD's step: its compute plus its own thread's CPU time (encoding, decoding, mixing), which every
    rank runs at once: with 8 ranks on 2 cores each rank's 4 ms of CPU take 4 x 4 = 16 ms on the clock."""
    import dataclasses

    from algorithms.rules.runtime_model import Compute, PolicySpec

    host = (("dpsgd/uint8", 0.001), ("dpsgd/uint8:cpu", 0.004))
    fast = Network.uniform(2, 2, 1e12, 0.0, loopback_bytes_per_s=LO, host_s=host)
    spec = PolicySpec("dpsgd", codec_ratio=0.25, codec="uint8")
    assert predict(spec, fast, Compute(0.02), M).step_s == pytest.approx(0.02 + 0.004)
    shared = dataclasses.replace(fast, cpu_share=4.0)
    assert predict(spec, shared, Compute(0.02), M).step_s == pytest.approx(0.02 + 4 * 0.004)
