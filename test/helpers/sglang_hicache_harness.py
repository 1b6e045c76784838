"""Drive SGLang 0.5.23's HiCache host tier (`HybridCacheController` over the DSA host pools) on
CPU, over the plugin's `SharedKVDSATokenToKVPool` and over SGLang's unmodified `DSATokenToKVPool`.

Used by test_sglang_ext_hicache.py; runs inside one spawned process (`comm.run_ranks`, world 1):
the N ranks of a CP group are N pools in that process, since write-back and load-back never
communicate (each rank moves only its own pages). SGLang's own code builds and runs everything:
`DSATokenToKVPool.host_pool_decls`, `prepare_host_pool_config`, `build_host_pool_group` (which wraps
the latent host pool in a `PageInterleaveHostPool` for a page-interleaved device pool),
`MLATokenToKVPoolHost`, `DSAIndexerPoolHost`, `HybridCacheController.write` / `start_writing` /
`load` / `start_loading` (owner-matched host slots, `owned_rows` narrowing, `alloc_cyclic`
load-back) and `PageInterleavePoolAllocator`.

Two stand-ins, both for CUDA-only code with no CPU path in SGLang:
- `cudaHostRegister` (page-locking the host buffers): a no-op; the buffers are the same.
- `sgl_kernel.kvcacheio.transfer_kv_per_layer_mla` / `transfer_kv_all_layer_mla` (only imported
  under CUDA/ROCm/XPU): copy `item_size`-byte items `dst[dst_indices] = src[src_indices]`, per layer;
  the all-layer variant takes tables of data pointers, resolved here to the tensors they point at.
"""

from __future__ import annotations

import os
import threading
from unittest import mock

from helpers import sglang_cpu_stand_ins as stand_ins
import torch

PAGE = 64
LAYERS = 2
PER_RANK_TOKENS = 8 * PAGE  # one rank's device rows (the replicated pool: N x this, logical)


def setup_process(model_path: str):
    """Publish ServerArgs with HiCache on (kernel I/O, layer_first, host:device ratio 2) and
    build SGLang's groups on the spawned process's gloo world."""
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
    return sa


_TENSORS_BY_PTR: dict[int, torch.Tensor] = {}


def _items(t: torch.Tensor, item_size: int) -> torch.Tensor:
    return t.view(torch.uint8).reshape(-1, item_size)


def transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size):
    _items(dst, item_size)[dst_indices.long()] = _items(src, item_size)[src_indices.long()]


def transfer_kv_all_layer_mla(src_layers, dst_layers, src_indices, dst_indices, item_size, num_layers):
    for i in range(num_layers):
        src, dst = _TENSORS_BY_PTR[int(src_layers[i])], _TENSORS_BY_PTR[int(dst_layers[i])]
        transfer_kv_per_layer_mla(src, dst, src_indices, dst_indices, item_size)


def _install_transfer_stand_ins():
    import sglang.srt.mem_cache.pool_host.common as host_common
    import sglang.srt.mem_cache.pool_host.dsa as host_dsa
    import sglang.srt.mem_cache.pool_host.mla as host_mla

    host_common._cuda_host_register = lambda *a, **k: None
    for module in (host_mla, host_dsa):
        module.transfer_kv_per_layer_mla = transfer_kv_per_layer_mla
        module.transfer_kv_all_layer_mla = transfer_kv_all_layer_mla


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


def shared_tier(rank: int, n: int, group) -> Tier:
    """The plugin's pool for CP rank `rank` of `n` (logical capacity n x PER_RANK_TOKENS) with
    SGLang's owner-classed allocator."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    from sglang_nsa_cp.sglang_ext.mem_cache.memory_pool import SharedKVDSATokenToKVPool

    pool = SharedKVDSATokenToKVPool(**kv_pool_kwargs(n * PER_RANK_TOKENS), cp_rank=rank, cp_size=n, cp_group=group)
    allocator = PageInterleavePoolAllocator(
        PER_RANK_TOKENS, physical_page_size=PAGE, shard_size=n, dtype=torch.bfloat16, device="cpu",
        kvcache=pool, need_sort=False,
    )  # fmt: skip
    return Tier(pool, allocator)


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


def _local_rows(pool, page: int) -> slice:
    """Latent rows of logical page `page` in the pool that holds it (its owner's shard, or SGLang's pool)."""
    local = page // pool.cp_size if hasattr(pool, "cp_size") else page
    return slice(local * PAGE, (local + 1) * PAGE)


def _local_page(pool, page: int) -> int:
    return page // pool.cp_size if hasattr(pool, "cp_size") else page


def _owner(pool, page: int) -> int:
    return page % pool.cp_size if hasattr(pool, "cp_size") else 0


def _pages(slots: torch.Tensor) -> list[int]:
    return (slots[::PAGE] // PAGE).tolist()


def _put(tiers, pages, content):
    """Page i of the chain gets content[i] (latent rows, index page) in every layer, in the tier that holds it."""
    for i, page in enumerate(pages):
        for tier in tiers:
            pool = tier.pool
            if _owner(pool, page) != getattr(pool, "cp_rank", 0):
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
    return [round_trip(group, n, num_pages, seed=i) for i, (n, num_pages) in enumerate(cases)]


def round_trip(group, n, num_pages, seed=0):
    """Write a `num_pages` chain back to host and load it into fresh device pages, on the N shared
    tiers and on a replicated tier. Returns what the test checks."""
    shared = [shared_tier(r, n, group) for r in range(n)]
    replicated = replicated_tier(n)
    g = torch.Generator().manual_seed(seed)
    index_bytes = shared[0].pool.index_k_with_scale_buffer[0].shape[1]
    content = [
        (torch.randn(num_pages, PAGE, 576, generator=g).to(torch.bfloat16),
         torch.randint(0, 256, (num_pages, index_bytes), generator=g, dtype=torch.uint8))
        for _ in range(LAYERS)
    ]  # fmt: skip
    for tier in (*shared, replicated):
        for t in tier.host_buffers():
            t.zero_()  # host rows a transfer never wrote stay zero
        for layer in range(LAYERS):  # poison the device pools: a page read before it was written shows
            tier.pool.kv_buffer[layer].view(torch.uint8).fill_(0xFF)
            tier.pool.index_k_with_scale_buffer[layer].fill_(0xFF)

    # The allocator and controller are mirrored: every rank makes the same choices (SPMD).
    start_owner = 1 % n
    chains = [t.allocator.alloc_cyclic(start_class=start_owner, need_size=num_pages * PAGE) for t in shared]
    assert all(torch.equal(c, chains[0]) for c in chains), (
        f"{n=}: ranks allocated different pages {[_pages(c) for c in chains]}"
    )
    dev = chains[0]
    dev_rep = replicated.allocator.alloc(num_pages * PAGE)
    _put(shared, _pages(dev), content)
    _put([replicated], _pages(dev_rep), content)

    host = [t.write_back(dev, start_owner=int(t.pool.placement.owner_of(dev[:1]))) for t in shared]
    assert all(torch.equal(h, host[0]) for h in host), f"{n=}: ranks chose different host slots"
    host_rep = replicated.write_back(dev_rep, start_owner=None)
    host_pages = _pages(host[0])
    assert [p % n for p in host_pages] == [p % n for p in _pages(dev)], (
        f"{n=}: host pages {host_pages} do not keep the owners of device pages {_pages(dev)}"
    )

    loaded = [t.load_back(h) for t, h in zip(shared, host)]
    assert all(torch.equal(d, loaded[0]) for d in loaded), f"{n=}: ranks loaded into different pages"
    new = loaded[0]
    loaded_rep = replicated.load_back(host_rep)
    assert not set(_pages(new)) & set(_pages(dev)), f"{n=}: load-back reused the source pages {_pages(new)}"
    return dict(
        dev=_pages(dev), host=host_pages, new=_pages(new), new_rep=_pages(loaded_rep),
        content=content,
        # every rank's whole shard and host tier after the round trip, to check against the content
        shards=[[(t.pool.kv_buffer[layer].clone(), t.pool.index_k_with_scale_buffer[layer].clone()) for layer in range(LAYERS)] for t in shared],
        replicated_new=[[_get(replicated, p, layer) for layer in range(LAYERS)] for p in _pages(loaded_rep)],
        host_kv=[t.host_buffers()[0].clone() for t in shared],
        host_nbytes=[t.host_nbytes() for t in shared],
        replicated_host_nbytes=replicated.host_nbytes(),
        host_shapes=[[tuple(b.shape) for b in t.host_buffers()] for t in shared + [replicated]],
    )  # fmt: skip
