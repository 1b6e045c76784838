"""CPU (in process): the
decode allocates a shared-KV request's pages grouped by prefill owner
(sglang_ext/disaggregation/owner_grouped_pages.py, decode.py), so each prefill CP rank writes one
run per layer and kind.

SGLang's own code run: `PagedTokenToKVPoolAllocator` (alloc_extend, free, alloc_decode),
`alloc_for_decode_prealloc` and the plugin's hook on `DecodePreallocQueue._alloc_for_decode_prealloc`
(applied by `HookRegistry`), and the prefill's page selection and coalescing
(`filter_kv_indices_for_shard_rank`, `group_concurrent_contiguous`), which decide the Mooncake
batch entries. Checked: every position gets exactly one of the allocated pages; each rank's runs
are one per chunk on a consecutive free list, and on fragmented free lists exactly the gaps that
fall inside its group (never more than in request order); a decode step continues the
regrouped last page; a stock prefill (no sharding, CP 1), a cached prefix and a request the queue
does not know are left in request order.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402

from sglang_nsa_cp.sglang_ext.disaggregation.owner_grouped_pages import (  # noqa: E402
    owner_grouped_pages,
    regroup_token_slots,
)

register_cpu_ci(est_time=15, suite="nsa-cp-test-cpu-unit")

PAGE = 64


def _runs_per_rank(prefill_pages, dst_pages, cp_size, chunk_pages=None):
    """Mooncake runs each prefill rank writes for one kind and layer, as SGLang's prefill path
    finds them: per chunk, owned pages and their positions (`filter_kv_indices_for_shard_rank`),
    destinations `dst[positions]`, coalesced by `group_concurrent_contiguous`."""
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    from sglang.srt.disaggregation.utils import filter_kv_indices_for_shard_rank

    n = len(prefill_pages)
    chunk_pages = chunk_pages or n
    runs, written = [0] * cp_size, []
    for rank in range(cp_size):
        for start in range(0, n, chunk_pages):
            stop = min(n, start + chunk_pages)
            local, positions = filter_kv_indices_for_shard_rank(
                kv_indices=np.asarray(prefill_pages[start:stop], dtype=np.int64),
                index_slice=slice(start, stop), shard_rank=rank, shard_size=cp_size,
            )  # fmt: skip
            dst = np.asarray(dst_pages)[positions]
            src_runs, _ = group_concurrent_contiguous(local.astype(np.int32), dst.astype(np.int32))
            runs[rank] += len(src_runs)
            written.extend(positions.tolist())
    assert sorted(written) == list(range(n)), "every position written exactly once"
    return runs


def test_grouped_pages_are_a_permutation_with_each_class_consecutive():
    for cp_size in (1, 2, 3, 4, 8):
        for n in (1, 2, 7, 8, 9, 64, 130):
            pages = np.arange(100, 100 + n)
            dst = owner_grouped_pages(pages[::-1], cp_size)  # any order in, sorted pages dealt out
            assert sorted(dst.tolist()) == pages.tolist()
            for c in range(cp_size):
                cls = dst[c::cp_size]
                assert np.all(np.diff(cls) == 1), (cp_size, n, c)
    with pytest.raises(ValueError, match="cp_size must be at least 1"):
        owner_grouped_pages([1, 2], 0)


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_one_run_per_rank_and_chunk_on_a_consecutive_free_list(cp_size):
    n = 8 * cp_size + 3  # ranks owning different page counts
    for first_logical in (1, 2, 5):  # the request's first prefill page decides which class a rank owns
        prefill = np.arange(first_logical, first_logical + n)
        decode = np.arange(500, 500 + n)
        grouped = owner_grouped_pages(decode, cp_size)
        assert _runs_per_rank(prefill, grouped, cp_size) == [1] * cp_size
        in_order = _runs_per_rank(prefill, decode, cp_size)
        assert in_order == [len(range(r, n, cp_size)) for r in [(r - first_logical) % cp_size for r in range(cp_size)]]
        # chunked prefill: each chunk is its own send, so one run per rank and chunk
        chunk = 2 * cp_size + 1
        chunks = -(-n // chunk)
        runs = _runs_per_rank(prefill, grouped, cp_size, chunk_pages=chunk)
        assert all(1 <= r <= chunks for r in runs) and sum(runs) <= chunks * cp_size


def _expected_runs(sorted_pages, cp_size):
    """Runs per residue class when sorted pages are dealt out class by class: one, plus one per
    gap between consecutive pages of the same class's slot range."""
    n = len(sorted_pages)
    out, start = [], 0
    for c in range(cp_size):
        size = len(range(c, n, cp_size))
        block = sorted_pages[start : start + size]
        out.append(1 + int(np.count_nonzero(np.diff(block) != 1)) if size else 0)
        start += size
    return out


def _allocator(num_pages):
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    return PagedTokenToKVPoolAllocator(num_pages * PAGE, PAGE, torch.int64, "cpu", kvcache=None, need_sort=True)


@pytest.fixture
def opted_in(monkeypatch):
    """The plugin's hooks applied, in a decode that opted in (the flag's decision published)."""
    from sglang.srt import runtime_context
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_nsa_cp.sglang_ext import register
    from sglang_nsa_cp.sglang_ext.server_args import DECODE_ATTR

    register()
    HookRegistry.apply_hooks()
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: SimpleNamespace(**{DECODE_ATTR: True}))


def _queue(req, cp_size, sharded=True):
    """A DecodePreallocQueue as the hook sees it: its queue of DecodeRequests, their receivers'
    bootstrap address, the manager's table of prefill info fetched at bootstrap."""
    info = SimpleNamespace(attn_cp_size=cp_size, enable_kv_cache_sharding=sharded)
    receiver = SimpleNamespace(bootstrap_addr="prefill:8998")
    return SimpleNamespace(queue=[SimpleNamespace(req=req, kv_receiver=receiver)],
                           kv_manager=SimpleNamespace(prefill_info_table={"prefill:8998": info}))  # fmt: skip


def _prealloc(allocator, queue, req, fill_len, prefix_len=0):
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    return DecodePreallocQueue._alloc_for_decode_prealloc(
        queue, allocator, req=req, fill_len=fill_len, delta_len=fill_len - prefix_len, prefix_len=prefix_len,
        total_prefix_len=prefix_len, prefix_indices=None, uses_swa_tail=False, swa_tail_len=0,
    )  # fmt: skip


def _pages_of(kv_loc):
    slots = kv_loc.long()
    pages = slots[::PAGE] // PAGE
    n = len(slots)
    assert torch.equal(slots, pages.repeat_interleave(PAGE)[:n] * PAGE + torch.arange(n) % PAGE)
    return pages.numpy()


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_decode_hook_on_sglang_allocator_fragmented_free_lists(cp_size, opted_in):
    rng = np.random.default_rng(cp_size)
    for trial in range(6):
        allocator = _allocator(400)
        # fragment the free list: take every page, give a random share back (trial 0: all of it)
        held = allocator.alloc(allocator.available_size())
        total = held.numel() // PAGE
        back = rng.random(total) < [1.0, 0.9, 0.7, 0.5, 0.3, 0.2][trial]
        allocator.free(held.view(total, PAGE)[torch.from_numpy(back)].reshape(-1))
        n = int(rng.integers(2 * cp_size, 60))
        fill = n * PAGE - int(rng.integers(0, PAGE))  # last page partly filled
        req = SimpleNamespace(kv=SimpleNamespace())
        kv_loc = _prealloc(allocator, _queue(req, cp_size), req, fill)
        assert kv_loc.numel() == fill
        dst = _pages_of(kv_loc)
        allocated = np.sort(dst)
        assert len(set(dst.tolist())) == n
        prefill = np.arange(7, 7 + n)
        runs = _runs_per_rank(prefill, dst, cp_size)
        class_of_rank = [(r - 7) % cp_size for r in range(cp_size)]
        assert runs == [_expected_runs(allocated, cp_size)[c] for c in class_of_rank], trial
        in_order = _runs_per_rank(prefill, allocated, cp_size)
        assert all(g <= o for g, o in zip(runs, in_order))
        if trial == 0:  # everything came back: a sorted, consecutive free list, one run per rank
            assert runs == [1] * cp_size
        # a decode step continues the request's last (regrouped) page, then takes a fresh one
        last = kv_loc[-1:].long()
        nxt = allocator.alloc_decode(torch.tensor([fill + 1]), torch.tensor([fill + 1]), last)
        if fill % PAGE:
            assert int(nxt) == int(last) + 1 and int(nxt) // PAGE == dst[-1]
        else:
            assert int(nxt) // PAGE not in set(dst.tolist())


def test_decode_hook_leaves_other_requests_in_request_order(opted_in):
    for cp_size, sharded in ((4, False), (1, True)):  # a stock prefill (no sharding); CP 1
        allocator = _allocator(64)
        req = SimpleNamespace(kv=SimpleNamespace())
        kv_loc = _prealloc(allocator, _queue(req, cp_size, sharded), req, 10 * PAGE)
        assert np.all(np.diff(_pages_of(kv_loc)) == 1)
    allocator = _allocator(64)
    req, other = SimpleNamespace(kv=SimpleNamespace()), SimpleNamespace(kv=SimpleNamespace())
    assert np.all(np.diff(_pages_of(_prealloc(allocator, _queue(other, 4), req, 10 * PAGE))) == 1)  # unknown request
    # a decode-side cached prefix: the positions sent start after it; left alone
    prefix = allocator.alloc(2 * PAGE)
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    kv_loc = DecodePreallocQueue._alloc_for_decode_prealloc(
        _queue(req, 4), allocator, req=req, fill_len=12 * PAGE, delta_len=10 * PAGE, prefix_len=2 * PAGE,
        total_prefix_len=2 * PAGE, prefix_indices=prefix, uses_swa_tail=False, swa_tail_len=0,
    )  # fmt: skip
    assert np.all(np.diff(_pages_of(kv_loc)) == 1)


def test_regroup_keeps_slots_it_cannot_read_as_whole_pages():
    odd = torch.tensor([5, 6, 7, 200, 201], dtype=torch.int64)  # not page-aligned slots
    assert regroup_token_slots(odd, PAGE, 4) is odd
    one_page = torch.arange(64, 64 + 30)
    assert regroup_token_slots(one_page, PAGE, 4) is one_page
    slots = torch.arange(3 * PAGE, 9 * PAGE, dtype=torch.int32)
    out = regroup_token_slots(slots, PAGE, 2)
    assert out.dtype == torch.int32 and _pages_of(out).tolist() == [3, 6, 4, 7, 5, 8]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
