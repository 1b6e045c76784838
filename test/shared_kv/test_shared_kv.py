"""The shared KV core: owner-classed allocation, the sharded store, direct write, the per-batch
dense plan, materialize with and without prefetch, and current reuse. The oracle is the
replicated store (today's SGLang pool) fed the same writes: every dense view must equal it bit for
bit at every logical slot of the batch."""

import os
import random
import sys

import pytest
import torch
from sglang.test.ci.ci_register import register_cpu_ci

from sglang_nsa_cp import kernels
from sglang_nsa_cp.comm import all_gather_rerange, run_ranks
from sglang_nsa_cp.layout import OutOfPages, OwnerClassedAllocator, RequestPageTable, page_owner
from sglang_nsa_cp.comm import TrafficCounter
from sglang_nsa_cp.envs import envs
from sglang_nsa_cp.shared_kv import (
    HistoryPrefetcher,
    KVStore,
    KVStoreError,
    PlanError,
    add_current_index,
    add_current_latent,
    build_dense_plan,
)
from sglang_nsa_cp.shared_kv import debug

register_cpu_ci(est_time=627, suite="nsa-cp-test-cpu")

LAYERS = 2


def _chunks(seed):
    """Three chunks of a chunked prefill: new requests, continuations (prefixes ending mid-page),
    and a radix-cache hit that shares a page-aligned prefix of another request."""
    rng = random.Random(seed)
    return [
        [("a", rng.randint(40, 300)), ("b", rng.randint(1, 90)), ("c", rng.randint(1, 5))],
        [("a", rng.randint(1, 200)), ("b", rng.randint(100, 400)), ("d", rng.randint(20, 60))],
        [("a", rng.randint(1, 70)), ("c", rng.randint(50, 300)), ("e", rng.randint(1, 40))],
    ]


def _logical_kv(num_tokens, latent_dim, dtype, seed):
    """Random KV every rank can regenerate: what the model would produce for the chunk."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(num_tokens, latent_dim, generator=g).to(dtype)
    key = torch.randint(0, 256, (num_tokens, 128), generator=g, dtype=torch.uint8)
    scale = torch.rand(num_tokens, generator=g) + 0.5
    return latent, key, scale


def _store_pair(rank, world, fp8, page_size, num_pages, latent_dim):
    kw = dict(num_layers=LAYERS, num_pages=num_pages, page_size=page_size, latent_dim=latent_dim, fp8_latent=fp8)
    return KVStore(cp_size=world, rank=rank, slack_pages=4, **kw), KVStore.replicated(**kw)


def _check_all_layouts(rank, world, group, mode):
    return [
        _check_materialize_matches_replicated(
            rank, world, group, mode, page_size, fp8, prefetch, world * 7 + page_size + fp8
        )
        for page_size, fp8, prefetch in ((16, False, True), (64, True, False), (16, True, True), (64, False, False))
    ]


def _plan(batch, store, rank):
    return build_dense_plan(
        batch.page_table(), batch.prefix_lens, batch.seq_lens, page_size=store.page_size,
        cp_size=store.cp_size, rank=rank, num_logical_pages=store.num_pages,
    )  # fmt: skip


def _check_materialize_matches_replicated(rank, world, group, mode, page_size, fp8, prefetch, seed):
    os.environ[envs.SGLANG_NSA_CP_DEBUG.name] = "1"  # this rank process: ownership and coverage checked on every call
    latent_dim = 576 if fp8 else 48
    num_pages = 96 * world
    table = RequestPageTable(OwnerClassedAllocator(num_pages, world), page_size)
    shared, replicated = _store_pair(rank, world, fp8, page_size, num_pages, latent_dim)
    counter = TrafficCounter()
    prefetcher = HistoryPrefetcher(
        shared, group, enabled=prefetch, counter=counter
    )  # one per store, as the pool keeps it
    stats = []
    for c, chunk in enumerate(_chunks(seed)):
        if c == 2:  # request "f" hits the radix cache on a's first whole pages
            table.fork("f", "a", (table.prefix_len("a") // page_size) * page_size)
            chunk = chunk + [("f", 7)]
        keys = [k for k, _ in chunk]
        plan, batch = table.schedule(keys, [n for _, n in chunk], mode)
        dense_plan = _plan(batch, shared, rank)
        dense_plan.check_slots(batch.out_cache_loc)
        assert dense_plan.has_history == (c > 0)
        calls_before = sum(v["calls"] for v in counter.as_dict().values())
        prefetcher.begin(dense_plan)
        rows = dense_plan.translate(batch.out_cache_loc)
        mine = plan.token_indices(rank)
        for layer in range(LAYERS):
            latent, key, scale = _logical_kv(plan.num_tokens, latent_dim, torch.bfloat16, seed * 100 + c * 10 + layer)
            gathered = all_gather_rerange(latent[mine], plan, group)
            assert torch.equal(gathered, latent)
            view = prefetcher.acquire(layer)
            if batch.compute_owned:  # compute-owner pages: each rank writes only what it computed
                shared.write(layer, batch.out_cache_loc[mine], latent[mine], key[mine], scale[mine])
            else:  # pages mix ranks' tokens: owners write from the gathered chunk
                shared.write(layer, batch.out_cache_loc, gathered, key, scale)
            debug.check_write_coverage(shared, batch.out_cache_loc, group)
            replicated.write(layer, batch.out_cache_loc, latent, key, scale)

            current = kernels.quantize_mla_fp8(gathered) if fp8 else gathered
            dense = add_current_latent(view.latent, rows, current)
            dense_index = add_current_index(view.index, rows, key, scale, page_size)

            # Oracle: the replicated pool at every logical slot of every request.
            slots = batch.req_to_token()
            valid = slots >= 0
            req_rows = dense_plan.translate(slots[valid])
            want = replicated.latent[layer][slots[valid]]
            assert torch.equal(dense[req_rows].view(torch.uint8), want.view(torch.uint8)), (c, layer)
            want_key, want_scale = kernels.read_index_k(replicated.index[layer], slots[valid], page_size)
            got_key, got_scale = kernels.read_index_k(dense_index, req_rows, page_size)
            assert torch.equal(got_key, want_key) and torch.equal(got_scale, want_scale), (c, layer)
        prefetcher.end()
        calls = sum(v["calls"] for v in counter.as_dict().values()) - calls_before
        # current reuse: no collective without history; otherwise one latent + one index gather per layer
        assert calls == (2 * LAYERS if dense_plan.has_history else 0), (c, calls)
        stats.append({"page_aligned": plan.page_aligned})
    used = {p for pages in table.pages.values() for p in pages}
    owned = sum(1 for p in used if page_owner(p, world) == rank)
    return {"chunks": stats, "owned_pages": owned, "used_pages": len(used), "requests": len(table.pages)}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", ["page_zigzag", "interleave"])
def test_materialized_views_equal_the_replicated_pool(world, mode):
    per_rank = run_ranks(_check_all_layouts, world, args=(mode,), timeout_s=240)
    for results in zip(*per_rank):  # one entry per (page size, layout), across ranks
        assert all(r["used_pages"] == results[0]["used_pages"] for r in results)
        assert sum(r["owned_pages"] for r in results) == results[0]["used_pages"]


def test_page_zigzag_allocation_makes_the_computing_rank_the_owner():
    table = RequestPageTable(OwnerClassedAllocator(4096, 4), page_size=16)
    for chunk in ([("x", 1000), ("y", 530)], [("x", 333), ("y", 700), ("z", 2000)]):
        plan, batch = table.schedule([k for k, _ in chunk], [n for _, n in chunk], "page_zigzag")
        assert plan.page_aligned and batch.compute_owned
        for rank in range(4):
            slots = batch.out_cache_loc[plan.token_indices(rank)]
            assert set(page_owner(slots // 16, 4).tolist()) <= {rank}
    pages = [p for ps in table.pages.values() for p in ps]
    assert len(pages) == len(set(pages))  # one owner each: a page id is held once


def test_a_borrowed_page_turns_direct_writes_off():
    allocator = OwnerClassedAllocator(8, 2)
    allocator.alloc([0, 0, 0])  # class 0 keeps one free page
    table = RequestPageTable(allocator, page_size=16)
    plan, batch = table.schedule(["x"], [64], "page_zigzag")  # wants owners 0, 1, 1, 0
    assert plan.page_aligned and not batch.compute_owned


def test_rotation_keeps_each_rank_within_one_page_of_its_share():
    table = RequestPageTable(OwnerClassedAllocator(4096, 4), page_size=16)
    for keys_lens in ([("p", 17), ("q", 300)], [("p", 500), ("r", 64)], [("q", 3), ("p", 90)]):
        table.schedule([k for k, _ in keys_lens], [n for _, n in keys_lens], "interleave")
    for pages in table.pages.values():
        share = [sum(1 for p in pages if page_owner(p, 4) == r) for r in range(4)]
        assert max(share) - min(share) <= 1, share


def test_persistent_bytes_per_rank_shared_vs_replicated():
    world, page_size = 4, 64
    table = RequestPageTable(OwnerClassedAllocator(1024, world), page_size)
    table.schedule(["a", "b", "c"], [5000, 3000, 700], "page_zigzag")
    table.schedule(["a", "b", "c"], [40, 1200, 3], "interleave")
    kw = dict(num_layers=LAYERS, num_pages=1024, page_size=page_size, latent_dim=576, fp8_latent=True)
    replicated = KVStore.replicated(**kw)
    page_bytes = replicated.nbytes() // 1024
    used = [p for pages in table.pages.values() for p in pages]
    replicated_bytes = len(used) * page_bytes
    bs = len(table.pages)
    for rank in range(world):
        shared_bytes = sum(1 for p in used if page_owner(p, world) == rank) * page_bytes
        print(f"rank {rank}: shared {shared_bytes} B, replicated {replicated_bytes} B")
        assert shared_bytes <= replicated_bytes / world + bs * page_bytes
        pool = KVStore(cp_size=world, rank=rank, **kw)
        assert pool.nbytes() <= replicated.nbytes() / world + page_bytes


def test_allocator_reuses_freed_pages_and_keeps_shared_prefix_owners():
    table = RequestPageTable(OwnerClassedAllocator(64, 4), page_size=16)
    table.schedule(["a"], [160], "page_zigzag")
    a_pages = list(table.pages["a"])
    table.fork("b", "a", 64)
    assert table.pages["b"] == a_pages[:4]
    table.release("a")  # b still holds a's first four pages
    assert table.allocator.free_pages() == 64 - 4
    table.release("b")
    assert table.allocator.free_pages() == 64
    with pytest.raises(OutOfPages, match="only 64 are free"):
        table.schedule(["big"], [16 * 65], "interleave")


def test_bad_slots_are_named_and_leave_the_store_unchanged():
    store = KVStore(num_layers=1, num_pages=8, page_size=16, cp_size=2, rank=0, latent_dim=8)
    before = store.latent[0].clone()
    with pytest.raises(KVStoreError, match=r"outside the pool of 128 slots.*\(1, 128\).*\(2, -5\)"):
        store.check_slots(torch.tensor([3, 128, -5]))
    with pytest.raises(KVStoreError, match=r"\(0, 9\)\] have no owner"):
        store.check_pages(torch.tensor([9, 1]))
    assert torch.equal(store.latent[0], before)


def test_shared_prefix_must_end_on_a_page_boundary():
    table = RequestPageTable(OwnerClassedAllocator(64, 2), page_size=16)
    table.schedule(["a"], [40], "interleave")
    with pytest.raises(ValueError, match="must end on a page boundary; 20"):
        table.fork("b", "a", 20)


def test_fp8_store_needs_the_flashmla_row_width():
    with pytest.raises(KVStoreError, match="needs latent_dim 576"):
        KVStore(num_layers=1, num_pages=8, page_size=16, cp_size=2, rank=0, latent_dim=64, fp8_latent=True)


def _check_prefetch(rank, world, group):
    """Prefetched views equal in-place materialize, whatever the launch order, over two batches
    of different sizes through one prefetcher (its scratch grows and is reused)."""
    page_size, num_pages = 16, 64 * world
    table = RequestPageTable(OwnerClassedAllocator(num_pages, world), page_size)
    store = KVStore(num_layers=4, num_pages=num_pages, page_size=page_size, cp_size=world, rank=rank, latent_dim=24)
    table.schedule(["a", "b"], [300, 77], "interleave")
    for layer in range(4):  # history written in an earlier batch
        latent, key, scale = _logical_kv(377, 24, torch.bfloat16, layer)
        store.write(layer, torch.cat([table.slots("a"), table.slots("b")]), latent, key, scale)
    prefetchers = {"ahead": HistoryPrefetcher(store, group), "off": HistoryPrefetcher(store, group, enabled=False)}
    orders = {"in order": [0, 1, 2, 3], "skipping": [0, 2, 3]}  # "skipping": layer 2 launched at its acquire
    outcomes = {}
    for b, new in enumerate(([40, 9], [200, 130])):
        _, batch = table.schedule(["a", "b"], new, "interleave")
        plan = _plan(batch, store, rank)
        latent, key, scale = _logical_kv(sum(new), 24, torch.bfloat16, 99 + b)
        rows = plan.translate(batch.out_cache_loc)
        req_slots = batch.req_to_token()
        req_rows = plan.translate(req_slots[req_slots >= 0])

        def views(prefetcher, order):
            prefetcher.begin(plan)
            out = {}
            for layer in order:
                view = prefetcher.acquire(layer)
                dense = add_current_latent(view.latent, rows, latent)
                dense_index = add_current_index(view.index, rows, key, scale, page_size)
                out[layer] = (dense[req_rows].clone(), *kernels.read_index_k(dense_index, req_rows, page_size))
            prefetcher.end()
            return out

        want = views(prefetchers["off"], orders["in order"])
        for name, order in orders.items():
            got = views(prefetchers["ahead"], order)
            for layer in order:
                assert all(torch.equal(g, w) for g, w in zip(got[layer], want[layer])), (b, name, layer)
        outcomes[b] = {name: (p.early, p.scratch_bytes()) for name, p in prefetchers.items()}
    tiny = HistoryPrefetcher(store, group, min_pages_per_rank=10**6)
    tiny.begin(plan)
    outcomes["tiny prefix"] = tiny.early
    tiny.acquire(1)
    with pytest.raises(RuntimeError, match="layer 0 acquired after layer 1"):
        tiny.acquire(0)
    return outcomes


def test_prefetch_gives_the_in_place_views_and_decides_alike_on_every_rank():
    per_rank = run_ranks(_check_prefetch, 3, timeout_s=120)
    assert all(r == per_rank[0] for r in per_rank)  # the same decisions everywhere
    outcome = per_rank[0]
    assert outcome[0]["ahead"][0] and not outcome[0]["off"][0] and not outcome["tiny prefix"]
    # the second, larger batch grew the scratch
    assert 0 < outcome[0]["ahead"][1] < outcome[1]["ahead"][1]


def _check_shard_ready(rank, world, group):
    """A layer's history is gathered only after `shard_ready(layer)` returned: here the history
    lands in the shard inside that call (as a host-tier load that the call waits for would), so a
    gather issued before it would read the poison left in its place."""
    page_size, num_pages = 16, 32 * world
    table = RequestPageTable(OwnerClassedAllocator(num_pages, world), page_size)
    store = KVStore(num_layers=3, num_pages=num_pages, page_size=page_size, cp_size=world, rank=rank, latent_dim=24)
    table.schedule(["a"], [150], "interleave")
    for layer in range(3):
        latent, key, scale = _logical_kv(150, 24, torch.bfloat16, layer)
        store.write(layer, table.slots("a"), latent, key, scale)
    _, batch = table.schedule(["a"], [20], "interleave")
    plan = _plan(batch, store, rank)

    history = plan.page_pos[torch.unique(table.slots("a")[:150] // page_size)]  # dense pages of the history

    def gathered(prefetcher):
        prefetcher.begin(plan)
        out = [tuple(t[history].clone() for t in prefetcher.acquire(layer) if t is not None) for layer in range(3)]
        prefetcher.end()
        return out

    want = gathered(HistoryPrefetcher(store, group))
    landed = [(store.latent[layer].clone(), store.index[layer].clone()) for layer in range(3)]
    for layer in range(3):
        store.latent[layer].view(torch.uint8).fill_(0xFF)
        store.index[layer].fill_(0xFF)
    calls = []

    def shard_ready(layer):
        calls.append(layer)
        store.latent[layer].copy_(landed[layer][0])
        store.index[layer].copy_(landed[layer][1])

    got = gathered(HistoryPrefetcher(store, group, shard_ready=shard_ready))
    for layer in range(3):
        assert all(torch.equal(g, w) for g, w in zip(got[layer], want[layer])), (
            f"{rank=}, {layer=}: gathered before it landed"
        )
    return calls


def test_history_is_gathered_only_after_the_shard_is_ready():
    per_rank = run_ranks(_check_shard_ready, 2, timeout_s=120)
    assert per_rank == [[0, 1, 2]] * 2, per_rank


def test_plan_places_each_page_once_with_history_owner_major():
    """The module docstring's example: N = 2, page size 4, A = 9 cached + 6 new tokens on pages
    6, 3, 9, 4; B new on page 8."""
    page_table = torch.tensor([[6, 3, 9, 4], [8, -1, -1, -1]])
    plans = [
        build_dense_plan(page_table, [9, 0], [15, 3], page_size=4, cp_size=2, rank=r, num_logical_pages=12)
        for r in range(2)
    ]
    for plan in plans:
        assert plan.pages_per_rank == 2 and plan.num_current_pages == 2 and plan.num_dense_pages == 7
        pos = plan.page_pos.tolist()
        assert [pos[p] for p in (6, 3, 9, 4, 8)] == [0, 2, 3, 4, 5]
        assert all(pos[p] == plan.trash_page == 6 for p in (0, 1, 2, 5, 7, 10, 11))
        assert plan.translate(torch.tensor([9 * 4 + 1, 4 * 4 + 3])).tolist() == [3 * 4 + 1, 4 * 4 + 3]
    assert plans[0].send_pages.tolist() == [3, -1] and plans[1].send_pages.tolist() == [1, 4]


def _gather_with_padding(rank, world, group):
    from sglang_nsa_cp.shared_kv.materialize import gather_history_pages

    page_table = torch.tensor([[6, 3, 9, 4], [8, -1, -1, -1]])  # the example above: rank 0 sends 3 and padding
    plan = build_dense_plan(page_table, [9, 0], [15, 3], page_size=4, cp_size=2, rank=rank, num_logical_pages=12)
    shard = torch.full((6, 8), float(rank + 1))  # [local pages, page row]
    out = torch.full((plan.num_dense_pages, 8), float("nan"))
    new_empty = torch.Tensor.new_empty
    # uninitialized memory, made visible: every new_empty buffer starts as NaN
    torch.Tensor.new_empty = lambda self, *a, **k: new_empty(self, *a, **k).fill_(float("nan"))
    try:
        return gather_history_pages(shard, plan, group, out)[: plan.num_gathered_pages]
    finally:
        torch.Tensor.new_empty = new_empty


def test_history_gather_sends_zeros_for_padding_pages():
    """A rank owning fewer history pages than pages_per_rank pads its send with zero pages, not
    uninitialized memory: those pages land in the dense view, and SGLang's forward reads dense
    row 0 for padded entries (as it reads its own pool's reserved slot 0), which is rank 0's
    padding when rank 0 owns no history page; with uninitialized padding, SGLang's DSA forward at
    CP=3 gave NaN-tainted logits in about half the runs (test_sglang_ext_hicache_forward.py)."""
    dense = run_ranks(_gather_with_padding, 2, timeout_s=120)
    for rank, got in enumerate(dense):
        assert got[[0, 2, 3]].tolist() == [[1.0] * 8, [2.0] * 8, [2.0] * 8], f"{rank=}: {got}"
        assert torch.equal(got[1], torch.zeros(8)), f"{rank=}: padding page {got[1]}"


def test_plan_without_history_gathers_nothing():
    plan = build_dense_plan(torch.tensor([[5, 2]]), [0], [70], page_size=64, cp_size=4, rank=1, num_logical_pages=8)
    assert not plan.has_history and plan.num_gathered_pages == 0 and plan.send_pages.numel() == 0
    assert plan.page_pos[5] == 0 and plan.page_pos[2] == 1 and plan.num_dense_pages == 3


def test_plan_refuses_slots_and_pages_it_cannot_place():
    plan = build_dense_plan(torch.tensor([[6, 3]]), [4], [8], page_size=4, cp_size=2, rank=0, num_logical_pages=12)
    plan.check_slots(torch.tensor([3 * 4, 3 * 4 + 3]))
    with pytest.raises(PlanError, match=r"\(1, 20\), \(2, 48\)\] are outside the pool of 48 slots or on pages"):
        plan.check_slots(torch.tensor([13, 20, 48]))
    with pytest.raises(PlanError, match="2 pages of the batch's page table are outside the pool of 12 pages"):
        build_dense_plan(torch.tensor([[6, 12, 30]]), [4], [9], page_size=4, cp_size=2, rank=0, num_logical_pages=12)
    with pytest.raises(ValueError, match="prefix <= seq"):
        build_dense_plan(torch.tensor([[6]]), [5], [4], page_size=4, cp_size=2, rank=0, num_logical_pages=12)


def test_plan_catches_a_chunk_page_that_is_also_cached():
    """An allocator bug (a fresh page still holding a cached prefix) must not silently alias."""
    with pytest.raises(AssertionError, match="also cached pages: 1"):
        build_dense_plan(
            torch.tensor([[6, 3], [6, 6]]), [4, 4], [8, 8], page_size=4, cp_size=2, rank=0, num_logical_pages=12
        )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
