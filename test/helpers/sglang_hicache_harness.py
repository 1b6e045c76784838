"""Drive SGLang 0.5.23's HiCache host tier (`HybridCacheController` over the DSA host pools) on
CPU, over SGLang's KV sharding (`--enable-kv-cache-sharding`, which the plugin's flag turns on)
and over SGLang's unmodified `DSATokenToKVPool`.

Under sharding each rank holds SGLang's `PageInterleaveDSATokenToKVPool` (the plugin's subclass
with the flag's decision, as the plugin's hook on SGLang's pool builder hands it out) of the per-rank size, with its `PageShardSpec` and shard group, and
SGLang's `PageInterleavePoolAllocator(..., shard_spec=spec)` over it, as SGLang's configurator
builds them. Used by test_sglang_ext_hicache.py (`round_trips`: one spawned process, world 1; the
N ranks of a CP group are N pools in that process, since write-back and load-back never
communicate: each rank moves only its own pages) and test_sglang_ext_hicache_forward.py
(`evict_and_load_back`: one process per rank). SGLang's own code builds and runs everything:
`DSATokenToKVPool.host_pool_decls`, `prepare_host_pool_config`, `build_host_pool_group` (which wraps
the latent host pool in a `PageInterleaveHostPool` for a page-interleaved device pool),
`MLATokenToKVPoolHost`, `DSAIndexerPoolHost`, `HybridCacheController.write` / `start_writing` /
`load` / `start_loading` (owner-matched host slots, `owned_rows` narrowing, `alloc_cyclic`
load-back) and `PageInterleavePoolAllocator`.

Stand-ins, all for CUDA-only code with no CPU path in SGLang:
- `cudaHostRegister` (page-locking the host buffers): a no-op; the buffers are the same.
- `torch.cpu.Stream.synchronize` (SGLang's L2 transfer engine syncs its stream when a transfer
  raises): a no-op; CPU copies are complete when they return.
- `sgl_kernel.kvcacheio.transfer_kv_per_layer_mla` / `transfer_kv_all_layer_mla` (only imported
  under CUDA/ROCm/XPU): copy `item_size`-byte items `dst[dst_indices] = src[src_indices]`, per layer;
  the all-layer variant takes tables of data pointers, resolved here to the tensors they point at.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from unittest import mock

import torch

from helpers import sglang_cpu_stand_ins as stand_ins

PAGE = 64
LAYERS = 2
PER_RANK_TOKENS = 8 * PAGE  # one rank's device rows (the replicated pool: N x this, logical)


def setup_process(model_path: str):
    """Publish ServerArgs with HiCache on (kernel I/O, layer_first, host:device ratio 2), build
    SGLang's groups on the spawned process's gloo world and load the plugin with the flag's decision
    (the pools SGLang builds become its subclass)."""
    for k, v in stand_ins.ENV.items():
        os.environ[k] = v
    stand_ins.install_process_stand_ins()
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path=model_path, device="cpu", attention_backend="dsa", kv_cache_dtype="bfloat16",
        dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="flashmla_sparse", dsa_topk_backend="torch",
        skip_tokenizer_init=True, tp_size=1, moe_dense_tp_size=1,
        enable_hierarchical_cache=True, hicache_io_backend="kernel", hicache_mem_layout="layer_first",
    )  # fmt: skip
    reset_context()
    with mock.patch("torch.cuda.get_device_capability", lambda *a, **k: stand_ins.SM90):
        publish(sa, role="test", ranks=SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    initialize_model_parallel(backend="gloo")
    _install_transfer_stand_ins()
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_nsa_cp.sglang_ext.server_args import ATTR

    setattr(sa, ATTR, True)  # the decision the flag's start-up validation writes
    return sa


_TENSORS_BY_PTR: dict[int, torch.Tensor] = {}


def _items(t: torch.Tensor, item_size: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1, item_size)


# A fault to inject: after this many more per-layer copies (a load moves each layer's latent rows,
# then its index pages, one call each), the next one raises. None: no fault.
FAULT = {"per_layer_copies_left": None}


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size):
    left = FAULT["per_layer_copies_left"]
    if left is not None:
        if left == 0:
            raise RuntimeError("injected host-to-device transfer failure")
        FAULT["per_layer_copies_left"] = left - 1
    _items(dst, item_size)[dst_indices.long()] = _items(src, item_size)[src_indices.long()]


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
    for i in range(num_layers):
        src, dst = _TENSORS_BY_PTR[int(src_layers[i])], _TENSORS_BY_PTR[int(dst_layers[i])]
        transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size)


def _install_transfer_stand_ins(all_layer=transfer_kv_all_layer_mla):
    """`all_layer`: the all-layer copy to bind (a live server has no pointer table: the server
    plugin passes `sglang_cpu_stand_ins.transfer_kv_all_layer_mla_by_pointer`)."""
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.dsa as host_dsa
    import sglang.srt.mem_cache.pool_host.mla as host_mla

    host_common._cuda_host_register = lambda *a, **k: None
    if not hasattr(torch.cpu.Stream, "synchronize"):  # SGLang's L2 engine syncs its stream on a failed transfer
        torch.cpu.Stream.synchronize = lambda self: None  # CPU work is already complete when it returns
    for module in (host_mla, host_dsa):
        module.transfer_kv_per_layer_mla = transfer_kv_per_layer_mla
        module.transfer_kv_all_layer_mla = all_layer


class Tier:
    """One rank's device pool, allocator, host pools and SGLang's cache controller."""

    def __init__(self, pool, allocator):
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
            build_host_pool_group,
            prepare_host_pool_config,
        )
        from sglang.srt.runtime_context import get_memory, get_parallel

        self.pool, self.allocator = pool, allocator
        config = prepare_host_pool_config(
            decls=pool.host_pool_decls(), full_layer_mapping={i: i for i in range(LAYERS)},
            transfer_layer_id_max=LAYERS, transfer_page_size=PAGE, packed_draft_device_pools=(),
        )  # fmt: skip
        self.hosts = build_host_pool_group(config=config)
        # The index pages ride on the latent pages' slots, as UnifiedRadixCache sends them.
        self.sidecars = [c.decl.sidecar_spec() for c in config.pools if not c.decl.is_primary]
        self.kv_host = self.hosts.entries[0].host_pool
        self.index_host = self.hosts.entries[1].host_pool
        for t in (*pool.kv_buffer, *self.kv_host.data_refs, *self.index_host.packed_device_index_buffers,
                  *self.index_host.index_k_data_refs):  # fmt: skip
            _TENSORS_BY_PTR[t.data_ptr()] = t
        memory = get_memory()
        self.controller = HybridCacheController(
            allocator, self.hosts, PAGE, get_parallel().tp_group.cpu_group, load_cache_event=threading.Event(),
            write_policy=memory.hicache_write_policy, io_backend=memory.hicache_io_backend,
            transfer_layer_id_max=LAYERS, host_memory_mode=memory.hicache_host_memory_mode,
        )  # fmt: skip

    def host_buffers(self) -> list[torch.Tensor]:
        """Every host tensor this rank allocated for the KV tier (latent rows and index pages)."""
        kv = self.kv_host.host_pool if hasattr(self.kv_host, "host_pool") else self.kv_host
        return [kv.kv_buffer, self.index_host.index_k_with_scale_buffer]

    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host_buffers())

    def _sidecar_transfers(self):
        """What `UnifiedRadixCache._build_sidecar_transfers` passes along a KV transfer."""
        from sglang.srt.mem_cache.hicache_storage import PoolTransfer

        return [
            PoolTransfer(name=s.pool_name, hit_policy=s.hit_policy, indices_from_pool=s.indices_from_pool)
            for s in self.sidecars
        ]

    def write_back(self, device_slots: torch.Tensor, start_owner: int | None) -> torch.Tensor:
        """`UnifiedRadixCache._execute_kv_backup`: the owner of the node's first page is the start owner."""
        kw = {} if start_owner is None else {"start_owner": start_owner}
        host_slots = self.controller.write(device_slots, node_id=1, extra_pools=self._sidecar_transfers(), **kw)
        assert host_slots is not None, "host tier full"
        self.controller.start_writing()
        return host_slots

    def load_back(self, host_slots: torch.Tensor) -> torch.Tensor:
        device_slots = self.controller.load(host_slots, node_id=1, extra_pools=self._sidecar_transfers())
        assert device_slots is not None, "device pool full"
        self.controller.start_loading()
        return device_slots


def kv_pool_kwargs(size: int) -> dict:
    return dict(size=size, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64,
                layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
                kv_cache_dim=576)  # fmt: skip


def sharded_allocator(pool):
    """SGLang's allocator over a sharded pool, as its configurator builds it under
    `kv_shard_size > 1` (the count it passes is per rank; the allocator widens it x N)."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    return PageInterleavePoolAllocator(
        pool.size, physical_page_size=PAGE, shard_size=pool.shard_size, dtype=torch.bfloat16, device="cpu",
        kvcache=pool, need_sort=False, shard_spec=pool.shard_spec,
    )  # fmt: skip


def sharded_tier(rank: int, n: int) -> Tier:
    """CP rank `rank` of `n`: SGLang's sharded DSA pool of PER_RANK_TOKENS rows (the plugin's
    subclass) and its allocator. The N ranks live in one process, so the shard group is a
    stand-in naming the rank: a round trip never gathers (the pool's scratch and its
    communicator serve prefill extends only)."""
    from sglang.srt.mem_cache import page_interleave_pool

    from helpers.sglang_model_harness import as_sglang_builds, shard_spec

    group = SimpleNamespace(world_size=n, rank_in_group=rank, cpu_group=None, device=torch.device("cpu"))
    spec = shard_spec(rank, n, context_len=PER_RANK_TOKENS, chunk_tokens=PAGE, contexts=1)
    pool = as_sglang_builds(
        page_interleave_pool.PageInterleaveDSATokenToKVPool(
            **kv_pool_kwargs(PER_RANK_TOKENS), shard_spec=spec, shard_group=group
        )
    )
    return Tier(pool, sharded_allocator(pool))


def replicated_tier(n: int) -> Tier:
    """SGLang's unmodified DSA pool over the same logical capacity (what every rank of replicated
    CP holds) with its stock paged allocator."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    pool = DSATokenToKVPool(**kv_pool_kwargs(n * PER_RANK_TOKENS))
    allocator = PagedTokenToKVPoolAllocator(
        n * PER_RANK_TOKENS, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False
    )
    return Tier(pool, allocator)


# ---- the scenario: one chain of pages written back and loaded into fresh pages ---------------------


def _shard(pool) -> tuple[int, int]:
    """(N, rank) of a sharded pool; (1, 0) for SGLang's unsharded pool."""
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    return (pool.shard_size, pool.shard_rank) if isinstance(pool, PageInterleaveKVPoolMixin) else (1, 0)


def _local_page(pool, page: int) -> int:
    """Logical page `page`'s page in the pool that holds it (its owner's shard, or SGLang's pool)."""
    return page // _shard(pool)[0]


def _local_rows(pool, page: int) -> slice:
    local = _local_page(pool, page)
    return slice(local * PAGE, (local + 1) * PAGE)


def _owner(pool, page: int) -> int:
    return page % _shard(pool)[0]


def _pages(slots: torch.Tensor) -> list[int]:
    return (slots[::PAGE] // PAGE).tolist()


def _put(tiers, pages, content):
    """Page i of the chain gets content[i] (latent rows, index page) in every layer, in the tier that holds it."""
    for i, page in enumerate(pages):
        for tier in tiers:
            pool = tier.pool
            if _owner(pool, page) != _shard(pool)[1]:
                continue
            for layer in range(LAYERS):
                pool.kv_buffer[layer][_local_rows(pool, page), 0] = content[layer][0][i]
                pool.index_k_with_scale_buffer[layer][_local_page(pool, page)] = content[layer][1][i]


def _get(tier, page, layer):
    pool = tier.pool
    return pool.kv_buffer[layer][_local_rows(pool, page), 0], pool.index_k_with_scale_buffer[layer][
        _local_page(pool, page)
    ]


def round_trips(rank, world, group, model_path, cases):
    """`round_trip` for each (n, num_pages) of `cases`, in one process."""
    setup_process(model_path)
    return [round_trip(n, num_pages, seed=i) for i, (n, num_pages) in enumerate(cases)]


def round_trip(n, num_pages, seed=0):
    """Write a `num_pages` chain back to host and load it into fresh device pages, on the N sharded
    tiers and on a replicated tier. Returns what the test checks."""
    sharded = [sharded_tier(r, n) for r in range(n)]
    replicated = replicated_tier(n)
    g = torch.Generator().manual_seed(seed)
    index_bytes = sharded[0].pool.index_k_with_scale_buffer[0].shape[1]
    content = [
        (torch.randn(num_pages, PAGE, 576, generator=g).to(torch.bfloat16),
         torch.randint(0, 256, (num_pages, index_bytes), generator=g, dtype=torch.uint8))
        for _ in range(LAYERS)
    ]  # fmt: skip
    for tier in (*sharded, replicated):
        for t in tier.host_buffers():
            t.zero_()  # host rows a transfer never wrote stay zero
        for layer in range(LAYERS):  # poison the device pools: a page read before it was written shows
            tier.pool.kv_buffer[layer].view(torch.uint8).fill_(0xFF)
            tier.pool.index_k_with_scale_buffer[layer].fill_(0xFF)

    # The allocator and controller are mirrored: every rank makes the same choices (SPMD).
    start_owner = 1 % n
    chains = [t.allocator.alloc_cyclic(start_class=start_owner, need_size=num_pages * PAGE) for t in sharded]
    assert all(torch.equal(c, chains[0]) for c in chains), (
        f"{n=}: ranks allocated different pages {[_pages(c) for c in chains]}"
    )
    dev = chains[0]
    dev_rep = replicated.allocator.alloc(num_pages * PAGE)
    _put(sharded, _pages(dev), content)
    _put([replicated], _pages(dev_rep), content)

    host = [t.write_back(dev, start_owner=int(t.pool.placement.owner_of(dev[:1]))) for t in sharded]
    assert all(torch.equal(h, host[0]) for h in host), f"{n=}: ranks chose different host slots"
    host_rep = replicated.write_back(dev_rep, start_owner=None)
    host_pages = _pages(host[0])
    assert [p % n for p in host_pages] == [p % n for p in _pages(dev)], (
        f"{n=}: host pages {host_pages} do not keep the owners of device pages {_pages(dev)}"
    )

    loaded = [t.load_back(h) for t, h in zip(sharded, host)]
    assert all(torch.equal(d, loaded[0]) for d in loaded), f"{n=}: ranks loaded into different pages"
    new = loaded[0]
    loaded_rep = replicated.load_back(host_rep)
    assert not set(_pages(new)) & set(_pages(dev)), f"{n=}: load-back reused the source pages {_pages(new)}"
    return dict(
        pool_modules=[type(t.pool).__module__ for t in sharded],
        host_pools=[type(t.kv_host).__name__ for t in sharded],
        dev=_pages(dev), host=host_pages, new=_pages(new), new_rep=_pages(loaded_rep),
        content=content,
        # every rank's whole shard and host tier after the round trip, to check against the content
        shards=[[(t.pool.kv_buffer[layer].clone(), t.pool.index_k_with_scale_buffer[layer].clone()) for layer in range(LAYERS)] for t in sharded],
        replicated_new=[[_get(replicated, p, layer) for layer in range(LAYERS)] for p in _pages(loaded_rep)],
        host_kv=[t.host_buffers()[0].clone() for t in sharded],
        host_nbytes=[t.host_nbytes() for t in sharded],
        replicated_host_nbytes=replicated.host_nbytes(),
        host_shapes=[[tuple(b.shape) for b in t.host_buffers()] for t in sharded + [replicated]],
    )  # fmt: skip


# ---- a model forward over a prefix evicted to host and loaded back ---------------------------------


class AllocatorRequests:
    """`req_to_token` rows filled by SGLang's allocator (`alloc_extend`), the interface of
    `paged_requests.PagedRequests` that `sglang_model_harness.Engine.forward_batch` calls. With the
    owner-classed allocator each request carries its chain's rotation base, as SGLang's
    `_kv_shard_rotation_bases` reads it from the radix node (None: a new chain, least-full class)."""

    def __init__(self, req_to_token: torch.Tensor, allocator):
        from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size

        self.req_to_token, self.allocator = req_to_token, allocator
        self.shard_size = page_interleave_shard_size(allocator)
        self.lens: dict[int, int] = {}
        self.bases: dict[int, int | None] = {}

    def adopt(self, idx: int, slots: torch.Tensor) -> None:
        """A radix hit: request `idx` starts with cached `slots` (whole pages)."""
        self.req_to_token[idx, : len(slots)] = slots.to(self.req_to_token.dtype)
        self.lens[idx] = len(slots)
        if self.shard_size > 1:  # the chain's base: the owner of its first page
            self.bases[idx] = int(slots[0]) // PAGE % self.shard_size

    def slots(self, idx: int) -> torch.Tensor:
        return self.req_to_token[idx, : self.lens[idx]].long()

    def extend(self, batch):
        prefix = [self.lens.get(idx, 0) for idx, _ in batch]
        seq = [p + n for p, (_, n) in zip(prefix, batch)]
        last = [int(self.req_to_token[idx, p - 1]) if p else -1 for (idx, _), p in zip(batch, prefix)]
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        kw = {}
        if self.shard_size > 1:
            kw["rotation_bases"] = [self.bases.get(idx) for idx, _ in batch]
        loc = self.allocator.alloc_extend(t(prefix), t(prefix), t(seq), t(seq), t(last), sum(seq) - sum(prefix), **kw)
        assert loc is not None, "device pool full"
        start = 0
        for i, ((idx, n), p) in enumerate(zip(batch, prefix)):
            self.req_to_token[idx, p : p + n] = loc[start : start + n].to(self.req_to_token.dtype)
            self.lens[idx] = p + n
            if self.shard_size > 1:
                self.bases[idx] = kw["rotation_bases"][i]  # resolved in place for new chains
            start += n
        return prefix, seq, loc

    def release(self, idx: int, shared_tokens: int = 0) -> None:
        """The request finished and its pages were evicted from the device: free them, but for its
        first `shared_tokens`, which another request (a radix node) still holds."""
        self.allocator.free(self.slots(idx)[shared_tokens:])
        self.lens.pop(idx)


CACHED_PAGES = 3  # request 0's prefix that goes to host and comes back
FORWARD_POOL_PAGES = 24  # logical device pages (a multiple of every N used)


def _hicache_engine(mode, rank, world, model_path):
    """A rank's model, pool and allocator as SGLang builds them: sharded, its page-interleaved
    pool (the plugin's subclass) of FORWARD_POOL_PAGES / N pages with its spec and the CP group,
    and its owner-classed allocator; off and replicated, `DSATokenToKVPool` and its stock paged
    allocator. Plus the rank's HiCache tier."""
    from helpers import sglang_model_harness as H
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    cp = 1 if mode == "off" else world
    sa = H.setup_process(
        rank, world, model_path, cp, enable_hierarchical_cache=True, hicache_io_backend="kernel",
        hicache_mem_layout="layer_first", hicache_ratio=2,
    )  # fmt: skip
    _install_transfer_stand_ins()
    if mode == "sharded":
        from sglang.srt.plugins import load_plugins

        from sglang_nsa_cp.sglang_ext.server_args import ATTR

        load_plugins()  # the plugin's entry point: with the decision, SGLang's pools become its subclass
        setattr(sa, ATTR, True)  # the decision its start-up validation writes (see docs)
    mc, model = H.build_model(sa)
    if mode == "sharded":
        engine = H.RotatedEngine(sa, mc, model, FORWARD_POOL_PAGES // world, world, sharded=True)
        H.poison_gather_scratch(engine.pool)
        allocator = sharded_allocator(engine.pool)
    else:
        engine = H.Engine(sa, mc, model, pool_pages=FORWARD_POOL_PAGES)
        allocator = PagedTokenToKVPoolAllocator(
            FORWARD_POOL_PAGES * PAGE, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=engine.pool,
            need_sort=True,
        )  # fmt: skip
    tier = Tier(engine.pool, allocator)
    engine.pool.register_layer_transfer_counter(tier.controller.layer_done_counter)  # as the scheduler does
    engine.requests = AllocatorRequests(engine.req_to_token, allocator)
    return engine, tier


def _poison(pool, pages):
    """0xFF (NaN latent rows) over `pages` in the rows of them this rank holds."""
    for page in pages:
        if _owner(pool, page) != _shard(pool)[1]:
            continue
        for layer in range(LAYERS):
            pool.kv_buffer[layer][_local_rows(pool, page)].view(torch.uint8).fill_(0xFF)
            pool.index_k_with_scale_buffer[layer][_local_page(pool, page)] = 0xFF


def _free_pages(allocator) -> int:
    """Free pages (the owner-classed allocator's `available_size` is its least-free class x N)."""
    if hasattr(allocator, "class_free_page_counts"):
        return sum(allocator.class_free_page_counts())
    return allocator.available_size() // PAGE


def evict_and_load_back(rank, world, group, model_path, mode):
    """Request 0 is prefilled; its first CACHED_PAGES pages are written to host (SGLang's
    `HybridCacheController.write`, as `UnifiedRadixCache` backs up a node) and evicted from the
    device (freed); request 2 then reuses the freed pages; the pages are loaded back into fresh
    device pages (`load`, `start_loading`: the owner-classed `alloc_cyclic` under sharding) and
    request 3 extends the loaded prefix. Request 4 extends the same prefix from request 0's
    original pages before the eviction (the control). Returns logits, pages and host bytes."""
    from helpers import sglang_model_harness as H
    from sglang.srt.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    engine, tier = _hicache_engine(mode, rank, world, model_path)
    for t in tier.host_buffers():
        t.zero_()  # host rows a transfer never wrote stay zero
    reqs, toks = engine.requests, H.token_ids()
    cached = CACHED_PAGES * PAGE
    toks[3] = toks[4] = torch.cat([toks[0][:cached], toks[3][cached:]])  # request 0's prefix, then new tokens
    free_at_start = _free_pages(tier.allocator)
    logits = {}
    logits["first"] = engine.run(engine.forward_batch([(0, cached + 10), (1, PAGE)], toks))
    prefix = reqs.slots(0)[:cached].clone()
    reqs.adopt(4, prefix)
    logits["control"] = engine.run(engine.forward_batch([(4, 40)], toks))
    reqs.release(4, shared_tokens=cached)  # the prefix stays with request 0

    start_owner = int(tier.pool.placement.owner_of(prefix[:1])) if mode == "sharded" else None
    host = tier.write_back(prefix, start_owner=start_owner)
    reqs.release(0)  # evicted: its device pages go back to the allocator
    _poison(tier.pool, _pages(prefix))  # as if reused: a read of the evicted pages gives NaN logits
    # other requests run meanwhile; request 1 continues from a whole page (owner-classed extends start on one)
    logits["reuse"] = engine.run(engine.forward_batch([(2, H.MAX_TOKENS), (1, 5)], toks))

    loaded = tier.controller.load(host, node_id=1, extra_pools=tier._sidecar_transfers())
    assert loaded is not None, "device pool full"
    tier.controller.layer_done_counter.set_consumer(tier.controller.start_loading())
    reqs.adopt(3, loaded)
    logits["loaded"] = engine.run(engine.forward_batch([(3, 40)], toks))  # the control's batch, loaded prefix
    for idx in (1, 2, 3):
        reqs.release(idx)
    leaked = free_at_start - _free_pages(tier.allocator)
    failed_load = _load_failing_half_way(tier, host)
    out = dict(
        pool_module=type(tier.pool).__module__, host_pool=type(tier.kv_host).__name__,
        logits=logits, prefix=_pages(prefix), host=_pages(host), loaded=_pages(loaded), pages_leaked=leaked,
        failed_load=failed_load, host_nbytes=tier.host_nbytes(),
        host_shapes=[tuple(b.shape) for b in tier.host_buffers()], host_pages_written=_host_pages_written(tier),
    )  # fmt: skip
    destroy_model_parallel()
    destroy_distributed_environment()
    return out


def _load_failing_half_way(tier, host_slots) -> dict:
    """Load the prefix again with the copy failing after its first layer's latent rows: what
    `start_loading` (SGLang's scheduler calls it before the batch's forward) does with the error."""
    acks = len(tier.controller.ack_load_queue)
    assert tier.controller.load(host_slots, node_id=2, extra_pools=tier._sidecar_transfers()) is not None
    FAULT["per_layer_copies_left"] = 1
    try:
        tier.controller.start_loading()
        raised = None
    except RuntimeError as e:
        raised = str(e)
    finally:
        FAULT["per_layer_copies_left"] = None
    return dict(
        raised=raised, new_acks=len(tier.controller.ack_load_queue) - acks, queued=len(tier.controller.load_queue)
    )


def _host_pages_written(tier) -> int:
    """Host latent pages (any layer) holding data: written by a back-up."""
    kv = tier.host_buffers()[0]  # [layers, rows, 1, 576]
    pages = kv.view(torch.uint8).reshape(kv.shape[0], -1, PAGE * kv.shape[-1] * kv.element_size())
    return int((pages != 0).any(-1).any(0).sum())
