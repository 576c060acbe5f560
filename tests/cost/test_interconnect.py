"""Interconnect specs and NCCL's collective cost model (fuel.cost.interconnect)."""

from __future__ import annotations

import pytest

from fuel.cost.interconnect import (
    BASE_LATENCY_NS, InterconnectError, NoInterconnect, collective_cost, default_intra_node,
    load_interconnects, parse_interconnects,
)

LINKS = load_interconnects()


def test_every_interconnect_states_the_source_of_each_number():
    assert {"nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "infiniband-ndr", "roce-400g"} <= set(LINKS)
    for link in LINKS.values():
        assert link.sources["bandwidth"].strip() and link.sources["latency"].strip()
        assert link.bandwidth_bytes_per_s > 0 and link.hop_latency_ns > 0


def test_nvlink_generations_double_per_direction_bandwidth():
    rates = [LINKS[n].bandwidth_bytes_per_s for n in ("nvlink3", "nvlink4", "nvlink5")]
    assert rates == [300e9, 450e9, 900e9]
    assert default_intra_node("h100-sxm").name == "nvlink4"
    assert isinstance(default_intra_node("rtx-4090"), NoInterconnect)


def test_ring_all_reduce_is_latency_plus_two_p_minus_one_over_p_of_the_bytes():
    link = LINKS["nvlink4"]
    cost = collective_cost("all_reduce", 1 << 20, 4, link)
    assert cost.algorithm == "ring"
    assert cost.latency_ns == pytest.approx(BASE_LATENCY_NS["ring"] + 6 * link.hop_latency_ns)
    assert cost.transfer_ns == pytest.approx(2 * 3 / 4 * (1 << 20) / link.bandwidth_bytes_per_s * 1e9)


def test_all_gather_moves_every_other_ranks_slice_once():
    link = LINKS["pcie5"]
    cost = collective_cost("all_gather", 1000, 8, link)
    assert cost.transfer_ns == pytest.approx(7 * 1000 / link.bandwidth_bytes_per_s * 1e9)
    assert cost.latency_ns == pytest.approx(BASE_LATENCY_NS["ring"] + 7 * link.hop_latency_ns)


def test_many_servers_pick_the_tree_and_need_a_network():
    intra, net = LINKS["nvlink4"], LINKS["infiniband-ndr"]
    over_servers = collective_cost("all_reduce", 16384, 64, intra, net, nodes=8)
    assert over_servers.algorithm == "tree"
    # 8 ranks per server: 7 NVLink hops and log2(8) = 3 network hops, up and down the tree
    assert over_servers.latency_ns == pytest.approx(
        BASE_LATENCY_NS["tree"] + 2 * (7 * intra.hop_latency_ns + 3 * net.hop_latency_ns))
    assert isinstance(collective_cost("all_reduce", 16384, 16, intra, None, nodes=2), NoInterconnect)
    assert collective_cost("all_reduce", 16384, 1, intra).ns == 0.0


def test_a_malformed_interconnect_names_the_key():
    text = ('[interconnect.x]\ntitle = "x"\nscope = "intra_node"\nbandwidth_gb_s = -1\n'
            'hop_latency_us = 1\n[interconnect.x.sources]\nbandwidth = "a"\nlatency = "b"\n')
    with pytest.raises(InterconnectError, match="interconnect.x.bandwidth_gb_s"):
        parse_interconnects(text, "devices.toml")
    with pytest.raises(InterconnectError, match="interconnect.x.sources.latency"):
        parse_interconnects(text.replace("-1", "5").replace('latency = "b"\n', ""), "devices.toml")
