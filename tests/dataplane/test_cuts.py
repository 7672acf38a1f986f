"""Tensor-parallel cuts: shard names read as cuts, which source ranks hold a worker's heads, a
payload's head slice, and ``FetchRequest.heads`` over real gRPC (the share served, bad ranges
refused naming the field). The cross-cut plans and loads end to end are in
tests/clients/vllm/test_resharding.py."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from sidecar.app import ServerThread
from sidecar.client import SyncSidecarClient
from sidecar.cuts import Cut, covering, cut_of, heads_layout
from sidecar.dataplane.cuts import CutFamilies, slice_heads
from sidecar.errors import InvalidArgument
from sidecar.identity import KVLayout
from sidecar.payload import stacked_view
from tests.conftest import make_config
from tests.dataplane.test_dataplane import IDENT, LAYOUT, payloads_for


def test_shard_names_read_as_cuts():
    assert cut_of("") == Cut(0, 1, "")
    assert cut_of("tp1of4") == Cut(1, 4, "")
    assert cut_of("tp1of2.pp0of2") == Cut(1, 2, "pp0of2") and cut_of("pp1of2") == Cut(0, 1, "pp1of2")
    assert Cut(3, 4, "pp1of2").shard(0) == "tp0of4.pp1of2" and Cut(0, 4, "").shard(0, 1) == ""
    for other in ("tp2of2", "tp0of1", "x", "tp0of2.tp1of2", "tp0of2.layer3"):
        assert cut_of(other) is None, other


def test_covering_ranks_hold_exactly_the_workers_heads():
    assert covering(8, 1, 4, 1) == [(0, 2, 2, 0)]  # TP 4 rank 1 from TP 1: heads 2-3 of the one shard
    assert covering(8, 0, 1, 4) == [(0, 0, 2, 0), (1, 0, 2, 2), (2, 0, 2, 4), (3, 0, 2, 6)]
    assert covering(8, 1, 2, 4) == [(2, 0, 2, 0), (3, 0, 2, 2)]
    assert covering(8, 3, 8, 2) == [(0, 3, 1, 0)]
    assert covering(2, 0, 4, 1) is None  # 2 heads over 4 ranks: vLLM replicates them


def test_families_remember_each_tp_size_of_a_model():
    fam = CutFamilies()
    fam.saw(replace(IDENT, shard="tp1of2"))
    fam.saw(replace(IDENT, shard=""))
    fam.saw(replace(IDENT, shard="tp3of4.pp0of2"))  # another stage: another model key
    fam.saw(replace(IDENT, model_id="other", shard="tp0of4"))
    assert [i.shard for i in fam.others(replace(IDENT, shard="tp0of4"))] == ["", "tp0of2"]
    assert [i.shard for i in fam.others(IDENT)] == ["tp0of2"]
    assert [i.shard for i in fam.others(replace(IDENT, shard="tp0of2.pp0of2"))] == ["tp0of4.pp0of2"]


def test_a_head_slice_is_those_heads_of_every_layer_and_part():
    layout = KVLayout.gqa(num_layers=3, num_kv_heads=8, head_dim=4, dtype="bfloat16")
    full = torch.randn(3, 2, 5, 8, 4).to(torch.bfloat16)
    out = slice_heads(full.contiguous().view(-1).view(torch.uint8), layout, 5, 2, 3)
    assert torch.equal(stacked_view(out, heads_layout(layout, 3), 5), full[:, :, :, 2:5])


@pytest.fixture
def served():
    with ServerThread(make_config()) as st, SyncSidecarClient(st.target, tenant="a") as c:
        yield st, c


def test_fetch_serves_only_the_heads_asked_for(served):
    _, c = served
    tokens = np.arange(1, 200, dtype=np.uint32)
    meta = c.store(tokens, identity=IDENT)
    pl = payloads_for(meta.chunk_bounds)
    c.store(tokens, identity=IDENT, layout=LAYOUT, payloads=pl)
    [hit] = [s for s in c.lookup(tokens, identity=IDENT).hits()][:1]
    [whole] = c.fetch([(hit.chunk_hash, 0)], identity=IDENT, layout=LAYOUT)
    [one] = c.fetch([(hit.chunk_hash, 0)], identity=IDENT, layout=LAYOUT, heads=(1, 1))
    n = whole.num_tokens
    assert len(one.data) * 2 == len(whole.data)
    assert torch.equal(stacked_view(bytearray(one.data), heads_layout(LAYOUT, 1), n),
                       stacked_view(bytearray(whole.data), LAYOUT, n)[:, :, :, 1:2])


@pytest.mark.parametrize("heads,why", [((1, 2), "not inside the layout's 2 KV heads"), ((0, 0), "not inside")])
def test_a_head_range_outside_the_layout_is_refused(served, heads, why):
    _, c = served
    with pytest.raises(InvalidArgument, match=f"^heads: .*{why}"):
        c.fetch([(1, 0)], identity=IDENT, layout=LAYOUT, heads=heads)


def test_heads_on_a_latent_layout_or_a_lease_are_refused(served):
    _, c = served
    mla = KVLayout.mla(num_layers=2, kv_lora_rank=16, qk_rope_head_dim=8)
    with pytest.raises(InvalidArgument, match="^heads: the layout has no KV head axis"):
        c.fetch([(1, 0)], identity=replace(IDENT, kv_layout=mla.fingerprint()), layout=mla, heads=(0, 1))
    import grpc

    from sidecar.api.kv import fetch_request
    from sidecar.v1 import sidecar_pb2 as pb
    from sidecar.v1 import sidecar_pb2_grpc as pb_grpc

    st, _ = served
    with grpc.insecure_channel(st.target) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            pb_grpc.KVSidecarStub(ch).LeaseFetch(pb.LeaseFetchRequest(
                fetch=fetch_request(IDENT, LAYOUT, None, [(1, 0)], heads=(0, 1))))
    assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith("fetch.heads: a lease answers whole chunks")
