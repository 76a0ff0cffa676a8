"""Peer-to-peer normal mode (`moekit.dispatch.p2p`): its kernels simulated in one process on
CPU (R ranks' buffers are plain tensors, the address tables point at them) against the NCCL
path's layout (pack_rows' twin); on GPUs (multigpu) the whole dispatcher against the NCCL
transport and the reference twin."""

from __future__ import annotations

import pytest
import torch

from moekit.dispatch.layout import MAX_CHUNKS, normal_plan, pack_rows_torch
from moekit.dispatch.slots import SlotMap
from moekit.placement import ExpertPlacement
from tests.dist_utils import ep_inputs

NC = MAX_CHUNKS + 1


def _simulate(Ts, R=3, E_logical=9, K=3, H=12, cap_tokens=64, seed=0, routing="masked"):
    """Every step of a p2p round trip for R simulated ranks: headers, offsets, remote packing,
    push back, the final sums. Returns per rank: (x, plan, counts, dst, recv rows, result)."""
    from moekit.dispatch._kernels import launch_p2p_offsets, launch_pack_rows, launch_push_back
    from moekit.dispatch.rows import gather_reduce

    torch.manual_seed(seed)
    E = E_logical // R
    slots = SlotMap(ExpertPlacement.contiguous(E_logical, R), E_logical)
    _, topks = ep_inputs(seed, Ts, E_logical, K, H, routing, skew_experts=E_logical // R)
    cap_rows = R * cap_tokens
    row_bytes = H * 2 + 8 * K
    ranks = []
    for i, T in enumerate(Ts):
        x = torch.randn(T, H).to(torch.float16)
        ids = topks[i].ids.to(torch.int32).contiguous()
        w = topks[i].weights.float().contiguous()
        plan = normal_plan(ids, slots, R, E, 1, impl="triton",
                           ticket=torch.zeros(1, dtype=torch.int32))
        ranks.append({"x": x, "w": w, "plan": plan, "header": plan.counts.clone(),
                      "recv": torch.zeros(cap_rows, row_bytes, dtype=torch.uint8),
                      "back": torch.full((cap_rows, H), float("nan"), dtype=torch.float16)})
    ptrs = torch.tensor([[r[k].data_ptr() for r in ranks] for k in ("header", "recv", "back")])
    for me, rk in enumerate(ranks):
        rk["counts"] = torch.zeros(2, R, NC, dtype=torch.int64)
        rk["dst"] = torch.zeros(R + 1, dtype=torch.int64)
        rk["ret"] = torch.zeros(R, dtype=torch.int64)
        rk["bounds"] = torch.zeros(R + 1, dtype=torch.int64)
        launch_p2p_offsets(ptrs[0], ptrs[1], ptrs[2], rk["counts"], rk["dst"], rk["ret"],
                           rk["bounds"], me, cap_rows, row_bytes, H * 2)
    for rk in ranks:  # every rank's counts are read before anyone writes rows
        T, plan = rk["x"].shape[0], rk["plan"]
        rk["rows"] = torch.full((T, R), -7, dtype=torch.int64)
        words = rk["recv"].view(torch.int32)
        if T:
            launch_pack_rows(rk["x"].view(torch.int32), plan.slot, rk["w"], plan.local,
                             plan.base, rk["rows"], words, words, E, plan.block, 0, T,
                             dst=rk["dst"], meta_words=H * 2 // 4)
    if not all(int(rk["dst"][R]) for rk in ranks):
        return ranks, E  # no room: nothing moved, the dispatcher takes the NCCL path
    for rk in ranks:  # the runner: each received row times 2 (its payload as fp16)
        n = int(rk["bounds"][R])
        rk["out"] = rk["recv"][:n, :H * 2].view(torch.float16) * 2
        launch_push_back(rk["out"], rk["ret"], rk["bounds"], rk["back"],
                         int(rk["counts"][1, :, 0].max()))
    for rk in ranks:
        rk["result"] = gather_reduce(rk["back"], rk["rows"], None, torch.float16, "triton")
    return ranks, E


@pytest.mark.parametrize("Ts, R, routing", [((20, 7, 33), 3, "masked"), ((0, 15, 4), 3, "masked"),
                                             ((40, 40, 40), 3, "random"),
                                             ((9, 30, 0, 17), 4, "skewed")])
def test_p2p_kernels_round_trip_matches_nccl_layout(Ts, R, routing):
    """Each rank receives exactly the rows the NCCL path would (source order, then its send
    order: payload, local ids, weights), the counts match the exchange's, and the return
    trip brings every partial back to its token (result = 2 x * ranks the token reaches).
    'skewed': every token goes to rank 0 only."""
    K, H = 3, 12
    ranks, E = _simulate(Ts, R=R, E_logical=3 * R, K=K, H=H, routing=routing)
    row_bytes = H * 2 + 8 * K
    sends = []
    for rk in ranks:  # the NCCL path's send buffer of each rank (the reference twin)
        n = int(rk["plan"].counts[:, 0].sum())
        buf = torch.zeros(max(n, 1), row_bytes, dtype=torch.uint8)
        pack_rows_torch(rk["x"], rk["plan"], rk["w"], E, buf[:, :H * 2].view(torch.float16),
                        buf[:, H * 2:].view(torch.int32))
        sends.append(buf)
    M = torch.stack([rk["header"][:, 0] for rk in ranks])  # [src, dst]
    for me, rk in enumerate(ranks):
        assert int(rk["dst"][R]) == 1  # room everywhere
        assert torch.equal(rk["counts"][0], rk["header"])
        assert torch.equal(rk["counts"][1], torch.stack([r["header"][me] for r in ranks]))
        want = torch.cat([sends[s][int(M[s, :me].sum()):int(M[s, :me + 1].sum())]
                          for s in range(R)])
        n = want.shape[0]
        assert int(rk["bounds"][R]) == n
        assert torch.equal(rk["recv"][:n], want)
        assert (rk["recv"][n:] == 0).all()  # nothing past the received rows
        assert torch.equal(rk["rows"], rk["plan"].rows())
        reach = (rk["plan"].rows() >= 0).sum(dim=1, keepdim=True).to(torch.float32)
        assert torch.equal(rk["result"], (rk["x"].float() * 2 * reach).half())


def test_p2p_offsets_refuse_batches_over_the_buffers():
    """Over the buffers' room (cap_rows) every rank gets the verdict 0 and no row moves."""
    ranks, _ = _simulate((30, 5, 9), cap_tokens=4)  # 12 rows per buffer < rank 0's 30 tokens
    for rk in ranks:
        assert int(rk["dst"][3]) == 0
        assert (rk["recv"] == 0).all()
        assert torch.equal(rk["rows"], rk["plan"].rows())


# ---- GPUs: the dispatcher over NVLink against the NCCL transport ------------------------------


def run_p2p_case() -> dict:
    """Normal mode with normal_transport 'p2p' (graphs and eager) against 'nccl', call after
    call with changing T on every rank (ranks 2, 3 repeat ranks 0, 1: empty ranks, every
    token to rank 0, a batch over the p2p buffers, which falls back to NCCL), bf16 and fp8
    rows: the same received rows, ids, weights and combine, bit for bit."""
    import torch.distributed as dist

    from moekit.dispatch.alltoall import AllToAllDispatcher
    from moekit.router import TopKOutput
    from moekit.stages import StandardRunnerOutput

    R, E, K, H = dist.get_world_size(), 16, 4, 256
    dev = torch.device("cuda", torch.cuda.current_device())
    me = dist.get_rank()
    placement = ExpertPlacement(torch.arange(E), R)
    out = {}
    for fp8 in (False, True):
        kw = {"group": dist.group.WORLD, "mode": "normal", "fp8_dispatch": fp8}
        ds = {"nccl": AllToAllDispatcher(placement, normal_transport="nccl", **kw),
              "p2p": AllToAllDispatcher(placement, normal_transport="p2p", p2p_tokens=320, **kw),
              "p2p/eager": AllToAllDispatcher(placement, normal_transport="p2p",
                                              normal_graphs="none", p2p_tokens=320, **kw)}
        cases = [((37, 300), "random"), ((300, 37), "random"), ((0, 9), "random"),
                 ((290, 290), "skewed"), ((600, 20), "random"), ((200, 150), "masked"),
                 ((0, 0), "random")]
        for i, (Ts, routing) in enumerate(cases):
            per_rank = tuple(Ts[r % 2] for r in range(R))  # every rank's T changes
            xs, topks = ep_inputs(i, per_rank, E, K, H, routing, torch.bfloat16,
                                  skew_experts=E // R)
            x = xs[me].to(dev)
            topk = TopKOutput(topks[me].weights.to(dev), topks[me].ids.to(dev))
            ref = ds["nccl"].dispatch(x, topk)
            y = StandardRunnerOutput(ref.x.float().mul(1.5).to(x.dtype))  # a fake runner
            want = ds["nccl"].combine(y, ref)
            for name in ("p2p", "p2p/eager"):
                got = ds[name].dispatch(x, topk)
                tag = (fp8, name, i)
                assert got.handle.recv_splits == ref.handle.recv_splits, tag
                assert torch.equal(got.x, ref.x) and torch.equal(got.topk.ids, ref.topk.ids), tag
                assert torch.equal(got.topk.weights, ref.topk.weights), tag
                assert torch.equal(ds[name].combine(y, got), want), tag
        assert ds["nccl"].p2p is None
        first = ds["p2p"].dispatch(x, topk)  # a dispatch overwritten before its combine
        ds["p2p/eager"].dispatch(x, topk)  # (the buffers are shared by every dispatcher)
        with pytest.raises(RuntimeError, match="combine each dispatch before the next one"):
            ds["p2p"].combine(StandardRunnerOutput(first.x.contiguous()), first)
        out[fp8] = {n: (d.p2p.captures, d.p2p_fallbacks) for n, d in ds.items() if d.p2p}
    return out


@pytest.mark.multigpu
@pytest.mark.parametrize("ranks", [2, 4])
def test_p2p_transport_matches_nccl(ranks):
    from tests.dist_utils import get_pool

    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    results = get_pool(ranks, "nccl").run(run_p2p_case)
    for res in results:
        for per in res.values():
            assert per["p2p"][0] >= 3, res  # graphs were captured and replayed
            assert per["p2p/eager"][0] == 0, res
            # (600, 20): a rank sends over R * 320 rows, the one fallback
            assert all(fb == 1 for _, fb in per.values()), res


def test_p2p_transport_errors_name_the_option():
    from moekit.config import ConfigError
    from moekit.dispatch.alltoall import AllToAllDispatcher
    from moekit.dispatch.p2p import p2p_unavailable

    placement = ExpertPlacement(torch.arange(4), 1)
    with pytest.raises(ConfigError, match="normal-transport"):
        AllToAllDispatcher(placement, normal_transport="nvlink")
    with pytest.raises(ConfigError, match="normal_transport 'p2p' cannot run here"):
        AllToAllDispatcher(placement, normal_transport="p2p")
    with pytest.raises(ConfigError, match="p2p_tokens"):
        AllToAllDispatcher(placement, p2p_tokens=0)
    with pytest.raises(ConfigError, match="impl 'torch' allows"):
        AllToAllDispatcher(placement, normal_transport="p2p", impl="torch")
    d = AllToAllDispatcher(placement, normal_transport="auto")
    assert d.normal_transport == "nccl"  # auto without a group: NCCL path (a copy)
    assert "CUDA" in p2p_unavailable(None, torch.device("cpu"))


def test_p2p_unavailable_reasons(monkeypatch):
    """Each condition of the p2p transport, with torch.distributed and CUDA faked."""
    import torch.distributed as dist

    from moekit.dispatch import p2p

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert "NCCL process group" in p2p.p2p_unavailable(object(), cuda)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert "one host" in p2p.p2p_unavailable(object(), cuda)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "1 visible, 4 ranks" in p2p.p2p_unavailable(object(), cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: b != 2)
    assert "GPU 0 cannot reach [2]" in p2p.p2p_unavailable(object(), cuda)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert p2p.p2p_unavailable(object(), cuda) is None
    assert "2+ ranks" in p2p.p2p_unavailable(None, cuda)


def test_host_wait_for_counts_has_a_deadline(monkeypatch):
    """A rank that never reaches the dispatch makes the others raise, not spin for ever."""
    from moekit.dispatch import exchange

    class Pending:  # the graph never finishes
        def query(self):
            return False

    monkeypatch.setattr(exchange, "WAIT_S", 0.05)
    flag = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="did not reach this dispatch"):
        exchange._Replayed(torch.zeros(3, dtype=torch.int64), flag, 1, Pending()).result()
    flag[0] = 1
    assert exchange._Replayed(torch.arange(3), flag, 1, Pending()).result() == [0, 1, 2]


def test_agreed_needs_no_collective_off_nccl():
    from moekit.dispatch.p2p import agreed

    assert agreed(None, "why") == "why" and agreed(None, None) is None
