"""Which worker (a node's radix cache: one per CP group, one per DP rank) serves each request.

- sticky: by conversation (`TraceRequest.conversation`), hashed over the workers;
- round_robin: request i to worker i % n;
- cache_aware: sglang-router 0.3.2's cache-aware policy with its defaults (`router_args.py`:
  cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5). When the busiest
  worker has more than 64 requests in flight over the idlest and more than 1.5 x its count, the
  request goes to the idlest; otherwise to the worker whose approximate tree matches the most of
  it, if that match is over 30 % of the prompt, else to the worker with the smallest tree. The
  router's tree holds what it sent each worker (not what the worker still caches). Here the tree
  is over the trace's blocks instead of the prompt's characters, it is never trimmed (the router
  trims to 2^26 characters per worker every 60 s: more than this trace sends one worker), and
  "in flight" is a FIFO estimate: each worker prefills the request's unmatched tokens at
  `tokens_per_s` after the ones before it.
"""

from __future__ import annotations

import collections
import zlib

CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5
ROUTINGS = ("sticky", "round_robin", "cache_aware")


def route(requests, workers: int, policy: str, tokens_per_s: float = 60000.0) -> list[int]:
    """The worker index of every request."""
    if workers == 1:
        return [0] * len(requests)
    if policy == "sticky":
        return [zlib.crc32(r.conversation.to_bytes(8, "little", signed=True)) % workers for r in requests]
    if policy == "round_robin":
        return [i % workers for i in range(len(requests))]
    if policy == "cache_aware":
        return _cache_aware(requests, workers, tokens_per_s)
    raise ValueError(f"routing {policy!r}: must be one of {', '.join(ROUTINGS)}")


def _cache_aware(requests, workers: int, tokens_per_s: float) -> list[int]:
    tree: dict[tuple, set] = {}  # block prefix (parent id, block) -> workers that were sent it
    node_of: dict[tuple, int] = {}
    tree_size = [0] * workers  # blocks sent to each worker (the router: characters)
    in_flight = [collections.deque() for _ in range(workers)]  # finish times
    free_at = [0.0] * workers
    out = []
    for r in requests:
        now = r.arrival_s
        for q in in_flight:
            while q and q[0] <= now:
                q.popleft()
        loads = [len(q) for q in in_flight]
        matched = [0] * workers
        parent, depth, alive = 0, 0, set(range(workers))
        for b in r.blocks:
            key = (parent, b)
            holders = tree.get(key)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            depth += 1
            for w in alive:
                matched[w] = depth
            parent = node_of[key]
        lo, hi = min(loads), max(loads)
        if hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo:
            w = loads.index(lo)
        else:
            best = max(range(workers), key=lambda i: (matched[i], -i))
            if matched[best] / len(r.blocks) > CACHE_THRESHOLD:
                w = best
            else:
                w = min(range(workers), key=lambda i: (tree_size[i], i))
        parent = 0
        for b in r.blocks:
            key = (parent, b)
            holders = tree.setdefault(key, set())
            if w not in holders:
                holders.add(w)
                tree_size[w] += 1
            parent = node_of.setdefault(key, len(node_of) + 1)
        hit_tokens = min(matched[w] * 512, r.input_len)
        free_at[w] = max(free_at[w], now) + (r.input_len - hit_tokens) / tokens_per_s
        in_flight[w].append(free_at[w])
        out.append(w)
    return out


DP_DISPATCH = ("dp_aware", "bootstrap_room")
ROOM_SEED = 45  # the router's bootstrap rooms are random 63-bit integers: one fixed draw


def route_dp(requests, nodes: int, dp: int, policy: str, dispatch: str, tokens_per_s: float = 60000.0) -> list[int]:
    """The DP rank (node * dp + rank) of every request on `nodes` DP-attention nodes of `dp` ranks.

    - dp_aware: sglang-router `--dp-aware` addresses every DP rank as a worker, so `policy`
      routes over nodes x dp radix caches;
    - bootstrap_room: SGLang's default for a PD prefill (`handle_load_balance_method` resolves
      `auto` to `follow_bootstrap_room`): the router picks a node by `policy` and the node's
      DataParallelController sends the request to DP rank `bootstrap_room % dp`; the room is the
      router's random draw, so the rank is uniform and blind to the cache.
    """
    if dispatch == "dp_aware":
        return route(requests, nodes * dp, policy, tokens_per_s)
    if dispatch != "bootstrap_room":
        raise ValueError(f"DP dispatch {dispatch!r}: must be one of {', '.join(DP_DISPATCH)}")
    import random

    node = route(requests, nodes, policy, tokens_per_s * dp)
    rooms = random.Random(ROOM_SEED)
    return [n * dp + rooms.getrandbits(63) % dp for n in node]
