"""Bytes one prefill forward moves between the GPUs of an 8-GPU node, per arm, from the formulas
SGLang 0.5.23's code (and the plugin's) implies. One `Term` per collective kind, per layer or per
forward, with the stream it runs on (what the cost model may hide) and the rule it follows.

`bus_bytes` is what an NCCL collective's time is proportional to: time = bus_bytes / busBW, busBW
as nccl-tests reports it. For an all-gather of an S-byte output over n ranks bus_bytes = S (n-1)/n
(what each rank receives); a broadcast of S bytes: S (every non-owner receives all of it); an
all-reduce of S bytes: 2 S (n-1)/n; a reduce-scatter of an S-byte input: S (n-1)/n.

- shared (the flag: SGLang's `PageInterleaveDSATokenToKVPool`, `mem_cache/page_interleave_pool.py`):
  per layer, one in-place all-gather of the batch's distinct history pages into the scratch, each
  rank's block padded to sum_i ceil(pages_i / N) pages (`begin_shard_extend`), for the latent rows
  and the index-K pages (`_gather_pairs`); on its own stream one layer ahead (`_prefetch_layer`);
  none when the batch has no history.
- layer_split (`mem_cache/dsa_cache_layer_split.py`): per layer, the owner broadcasts its WHOLE
  layer buffer into every rank's remote scratch, whatever the batch: the latent `remote_kv_buffer`
  ((pool rows + a page) x kv_cache_dim) on `kv_broadcast_stream`, kicked after the previous
  layer's attention (`maybe_prefetch_next_full_attention_kv`), and the index-K `remote_buffer`
  ((rows + page + 1) // page pages x 64 x 132 B) on the compute stream (`get_broadcastable_buffer`,
  the attention-CP group's PyNccl). The busiest rank receives the layers it does not own.
- every attention-CP arm (replicated, shared, layer_split; `layers/cp/interleave.py`): per layer,
  the chunk's new latent (576 bf16) and indexer key (128 bf16) all-gathered over the CP group
  (`materialize_full_mla_kv`, `materialize_full_indexer_k_cache`), every rank's block the longest
  rank's share rounded up to a multiple of N (`physical_rows`), on the compute stream (the key on an alternate stream that the compute stream waits for).
- hidden states: every layout moves the layer's hidden states around the MoE, which runs over
  all 8 GPUs. Attention CP and DP gather every token to every GPU before it and reduce-scatter
  after (`attn_cp_reduce_scatter_output`, DP's gather / reduce-scatterv): 2 x T x hidden x 2 B x 7/8;
  plain TP all-reduces after the attention and after the MoE: 2 x 2 T x hidden x 2 B x 7/8. At CP
  or DP W < 8 the attention-TP group's reduction of o_proj is taken as inside that sum (a stated
  simplification: not read from SGLang's boundary code). The last layer's tokens are then
  gathered for the logits: the flag's narrow tail gather (N x requests x hidden), everyone else
  the whole chunk (T x hidden).
- DP attention and TP move no KV.
"""

from __future__ import annotations

import dataclasses

PAGE = 64
NODE_GPUS = 8
LATENT_ROW_BYTES = {"bf16": 576 * 2, "fp8": 656}  # SGLang's pool row of one token, one layer
INDEX_ROW_BYTES = 128 + 4  # FP8 index K + fp32 scale
CHUNK_LATENT_BYTES = 576 * 2  # the chunk's latent before the pool write: bf16 (kv_a output)
CHUNK_INDEX_KEY_BYTES = 128 * 2  # the indexer's key before quantization: bf16
HIDDEN_BYTES = 2  # bf16 hidden states
ARMS = ("replicated", "shared", "layer_split", "dp_attention", "tp")


@dataclasses.dataclass(frozen=True)
class Term:
    name: str
    collective: str  # all_gather, broadcast, all_reduce, gather+reduce_scatter
    per: str  # "layer" or "forward"
    count: int  # how many of them one forward issues
    bus_bytes: float  # of one: time = bus_bytes / busBW
    received_bytes: float  # what the busiest rank receives over the forward, all of them
    stream: str  # "side" (may hide under compute) or "compute"
    rule: str

    @property
    def forward_bus_bytes(self) -> float:
        return self.bus_bytes * self.count


@dataclasses.dataclass(frozen=True)
class Batch:
    """One forward of one worker: per request (new tokens, cached history tokens)."""

    requests: tuple[tuple[int, int], ...]

    @property
    def new(self) -> int:
        return sum(n for n, _ in self.requests)

    def history_pages(self, cp: int) -> tuple[int, int]:
        """(distinct history pages, pages the padded all-gather moves: N x sum_i ceil(pages_i / N))."""
        pages = [h // PAGE for _, h in self.requests]
        return sum(pages), cp * sum(-(-p // cp) for p in pages)


def _ring(n: int) -> float:
    return (n - 1) / n


def physical_rows(tokens: int, cp: int) -> int:
    """Rows an interleave CP all-gather moves for `tokens`: every rank sends the busiest rank's
    share rounded up to a multiple of N (SGLang's layers/cp/padding.py `pad_logical_token_to_physical`)."""
    share = -(-tokens // cp)
    return cp * (-(-share // cp) * cp)


def kv_terms(arm: str, cp: int, kv: str, layers: int, batch: Batch, pool_rows: int) -> list[Term]:
    """The KV collectives of one forward. `pool_rows`: one rank's pool (layer split's broadcast size)."""
    terms = []
    if arm in ("replicated", "shared", "layer_split"):
        padded = physical_rows(batch.new, cp)
        for name, row in (("chunk latent", CHUNK_LATENT_BYTES), ("chunk indexer key", CHUNK_INDEX_KEY_BYTES)):
            out = padded * row
            terms.append(Term(f"{name} all-gather", "all_gather", "layer", layers, out * _ring(cp),
                              layers * out * _ring(cp), "compute",
                              f"N x ceil(ceil(new / N) / N) x N x {row} B (bf16), (N-1)/N"))  # fmt: skip
    if arm == "shared":
        _, moved = batch.history_pages(cp)
        row = LATENT_ROW_BYTES[kv] + INDEX_ROW_BYTES
        out = moved * PAGE * row
    if arm == "shared" and moved:
        terms.append(Term("history all-gather (latent + index K)", "all_gather", "layer", layers,
                          out * _ring(cp), layers * out * _ring(cp), "side",
                          f"history pages (padded to N x sum ceil(p_i / N)) x 64 x {row} B, (N-1)/N; "
                          "one layer ahead on the gather stream"))  # fmt: skip
    if arm == "layer_split":
        from trace_budget import layer_split_layers

        _, _, fewest = layer_split_layers(layers, cp)
        latent = (pool_rows + PAGE) * LATENT_ROW_BYTES[kv]
        index = (pool_rows + PAGE + 1) // PAGE * PAGE * INDEX_ROW_BYTES
        terms.append(Term("owner broadcast, latent buffer", "broadcast", "layer", layers, latent,
                          (layers - fewest) * latent, "side",
                          f"(pool rows + 64) x {LATENT_ROW_BYTES[kv]} B, every layer, every forward; "
                          "after the previous layer's attention on kv_broadcast_stream"))  # fmt: skip
        terms.append(Term("owner broadcast, index-K buffer", "broadcast", "layer", layers, index,
                          (layers - fewest) * index, "compute",
                          f"(rows + 65) // 64 pages x 64 x {INDEX_ROW_BYTES} B, every layer, on the compute stream"))  # fmt: skip
    return terms


def hidden_terms(arm: str, cp: int, hidden: int, layers: int, batch: Batch, gpus: int = NODE_GPUS) -> list[Term]:
    """What every layout moves instead of (or besides) KV: hidden states around the MoE, and the tail."""
    t = batch.new
    ring = _ring(gpus)
    if arm == "tp":
        one = 2 * t * hidden * HIDDEN_BYTES * 2 * ring
        terms = [Term("hidden all-reduce (attention out, MoE out)", "all_reduce", "layer", layers, one,
                      layers * one, "compute", f"2 all-reduces of T x {hidden} x 2 B, 2 (n-1)/n, n = {gpus}")]  # fmt: skip
    else:
        one = 2 * t * hidden * HIDDEN_BYTES * ring
        terms = [Term("hidden gather + reduce-scatter around the MoE", "gather+reduce_scatter", "layer", layers, one,
                      layers * one, "compute", f"2 x T x {hidden} x 2 B x (n-1)/n, n = {gpus}")]  # fmt: skip
    if arm == "shared":
        tail = cp * len(batch.requests) * hidden * HIDDEN_BYTES * _ring(cp)
        rule = "the plugin's narrow tail gather: N x requests x hidden"
    elif arm in ("replicated", "layer_split"):
        tail = physical_rows(t, cp) * hidden * HIDDEN_BYTES * _ring(cp)
        rule = "every token's last hidden state, N x ceil(ceil(T / N) / N) x N x hidden"
    else:
        tail, rule = 0.0, "none (tokens already where the logits run)"
    if tail:
        terms.append(Term("tail gather for the logits", "all_gather", "forward", 1, tail, tail, "compute", rule))
    return terms


def forward_terms(arm: str, cp: int, kv: str, model: dict, batch: Batch, pool_rows: int) -> list[Term]:
    layers = model["num_hidden_layers"]
    return kv_terms(arm, cp, kv, layers, batch, pool_rows) + hidden_terms(arm, cp, model["hidden_size"], layers, batch)


def kv_bytes_per_forward(terms: list[Term]) -> float:
    """KV the busiest rank receives over one forward (the number the docs compare)."""
    return sum(t.received_bytes for t in terms if "hidden" not in t.name and "tail" not in t.name)


def describe(terms: list[Term]) -> list[str]:
    return [f"{t.name}: {t.count} x {t.bus_bytes / 1e6:,.1f} MB bus ({t.collective}, {t.stream} stream), "
            f"busiest rank receives {t.received_bytes / 1e9:,.2f} GB a forward; {t.rule}" for t in terms]  # fmt: skip
