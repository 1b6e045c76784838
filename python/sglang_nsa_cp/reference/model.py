"""A small DSA model (DeepSeek-V3.2 / GLM-5 attention) in plain torch: the correctness oracle.

One decoder layer::

    h += o_proj(W_UV . sparse_mla(q, topk_rows(indexer(x))))      x = input_layernorm(h)
    h += down(silu(gate(y)) * up(y))                              y = post_attention_layernorm(h)

Choices, fixed here so every path (single rank, replicated CP, shared-KV CP) agrees:

- RoPE is NeoX style (rotate half) everywhere: on q_rope / k_rope of MLA and on the *first*
  ``qk_rope_head_dim`` dims of the index query and key (DeepSeek-V3.2 puts the indexer's rope
  part first too).
- The KV cache row of a token is ``cat(c_kv, k_rope)`` ([kv_lora_rank + qk_rope_head_dim]);
  attention uses absorbed weights, so no per-head K or V is ever built.
- The index key is stored fp8 (e4m3fn bytes + one fp32 scale per token, scale = amax / 448);
  the index query stays in the model dtype (no fp8 query, no Hadamard rotation).
- Top-k picks the ``min(index_topk, p + 1)`` highest index scores among positions ``0..p`` of
  the query's request; ties go to the lower position (stable sort), so the choice does not
  depend on the sort kernel.

The KV seam: each layer hands its tokens' fresh KV to ``kv.begin_layer(...)``, computes its
index queries and absorbed attention queries, then gets a :class:`DenseKV` view of every token it
may attend to from ``kv.finish_layer(...)``. How that view is stored or gathered (one slot cache,
replicated CP, shared-KV CP with materialize) is the context's business; the gap between the two
calls is where a CP context's all-gather of the chunk overlaps the indexer's work.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from sglang_nsa_cp.kernels.formats import FP8_MAX

from .config import DSAConfig

DEFAULT_QUERY_CHUNK = 1024  # queries per indexer/attention step: bounds the [chunk, kv_len] buffers


@dataclass
class DenseKV:
    """One layer's KV as the attention reads it.

    latent       [S, kv_lora_rank + qk_rope_head_dim]  model dtype
    index_key    [S, 128] uint8 (float8_e4m3fn bytes)
    index_scale  [S] float32
    req_rows     [batch_size, max_seq_len] int64: row of (request i, position p); only
                 p < that request's kv_len is read.
    """

    latent: torch.Tensor
    index_key: torch.Tensor
    index_scale: torch.Tensor
    req_rows: torch.Tensor


class KVContext(Protocol):
    def begin_layer(
        self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor, index_scale: torch.Tensor
    ) -> None:
        """Take this process's fresh KV of ``layer_id`` (start exchanging it, if the context does)."""
        ...

    def finish_layer(self, layer_id: int) -> DenseKV:
        """The dense view of ``layer_id`` to attend to, its fresh KV stored."""
        ...


class SynchronousKV:
    """`KVContext` for contexts with nothing to overlap: all the work happens in ``layer_kv``."""

    def begin_layer(self, layer_id, latent, index_key, index_scale) -> None:
        self._fresh = (layer_id, latent, index_key, index_scale)

    def finish_layer(self, layer_id: int) -> DenseKV:
        fresh, self._fresh = self._fresh, None
        if fresh is None or fresh[0] != layer_id:
            raise RuntimeError(f"finish_layer({layer_id}) without a matching begin_layer")
        return self.layer_kv(*fresh)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and fp8 scaling run in at least float32 (the model dtype itself for fp32 / fp64)."""
    return torch.promote_types(dtype, torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style RoPE over the last dim of ``x`` [T, ..., d] at ``positions`` [T].

    Angles are computed in float64 so a token's rotation does not depend on the batch it is in.
    """
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angles.cos().to(x.dtype).view(shape), angles.sin().to(x.dtype).view(shape)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def quantize_index_key(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 index key: ``scale = max(amax|k| / 448, 1e-12)``, bytes = fp8(k / scale).

    key [T, 128] model dtype -> (uint8 [T, 128], float32 [T]). The scale is rounded to float32
    before dividing, so dequantizing with the stored scale is the exact inverse of the rounding.
    """
    acc = _acc_dtype(key.dtype)
    k = key.to(acc)
    scale = (k.abs().amax(dim=-1) / FP8_MAX).clamp_min(1e-12).to(torch.float32)
    q = (k / scale.to(acc)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize_index_key(key_bytes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_index_key`: uint8 [S, 128], float32 [S] -> [S, 128] ``dtype``."""
    acc = _acc_dtype(dtype)
    return (key_bytes.view(torch.float8_e4m3fn).to(acc) * scale.to(acc)[:, None]).to(dtype)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``score[t, j] = sum_h weights[t, h] * relu(q[t, h] . keys[j])``.

    q [C, Hi, 128], weights [C, Hi], keys [L, 128] -> [C, L]. One head at a time, so the buffer
    is [C, L], never [C, Hi, L].
    """
    scores = q.new_zeros(q.shape[0], keys.shape[0])
    for h in range(q.shape[1]):
        scores += weights[:, h : h + 1] * torch.relu(q[:, h] @ keys.T)
    return scores


def select_topk(scores: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Positions each query attends to: ``min(topk, p + 1)`` best of ``0..p``, sorted ascending.

    scores [C, L] over candidate positions 0..L-1, positions [C] (p < L) -> int64
    [C, min(topk, L)], padded with -1 where p + 1 < topk.
    """
    num_keys = scores.shape[1]
    cand = torch.arange(num_keys, device=scores.device)
    # "+ 0.0" turns -0.0 (w < 0 times relu 0) into +0.0: bit-pattern sorts would split the tie.
    scores = scores.masked_fill(cand[None, :] > positions[:, None], -math.inf) + 0.0
    k = min(topk, num_keys)
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    valid = cand[None, :k] <= positions[:, None]
    best = torch.where(valid, best, num_keys).sort(dim=-1).values
    return torch.where(best < num_keys, best, -1)


def sparse_mla(
    q: torch.Tensor, selected: torch.Tensor, latent: torch.Tensor, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """Absorbed MLA over the selected rows: ``softmax(q . latent_j * scale) @ c_kv_j``.

    q [C, H, W] = cat(q_nope @ W_UK, q_rope), selected [C, k] rows of ``latent`` (-1 = none),
    latent [L, W] -> output latent [C, H, kv_lora_rank].
    """
    valid = selected >= 0
    rows = latent[selected.clamp_min(0)]  # [C, k, W]
    logits = torch.bmm(q, rows.transpose(1, 2)) * scale
    logits = logits.masked_fill(~valid[:, None, :], -math.inf)
    probs = logits.softmax(dim=-1, dtype=_acc_dtype(q.dtype)).to(q.dtype)
    return torch.bmm(probs, rows[..., :kv_lora_rank])


@dataclass
class _QueryChunk:
    token_idx: torch.Tensor  # [C] indices into the forward's T tokens, ascending position
    positions: torch.Tensor  # [C]
    kv_len: int  # max position in the chunk + 1: candidates needed


@dataclass
class _RequestPlan:
    request: int
    kv_len: int
    chunks: list[_QueryChunk]


def _plan_queries(positions: torch.Tensor, request_ids: torch.Tensor, chunk_size: int) -> list[_RequestPlan]:
    """Group tokens by request and cut each request's queries into position-sorted chunks.

    Built once per forward (its host syncs are per request, not per layer or chunk); sorting by
    position lets early chunks read only the candidates they can see.
    """
    plans = []
    for request in torch.unique(request_ids).tolist():
        token_idx = (request_ids == request).nonzero().squeeze(1)
        pos, order = positions[token_idx].sort(stable=True)
        token_idx = token_idx[order]
        starts = list(range(0, len(token_idx), chunk_size))
        ends = [min(s + chunk_size, len(token_idx)) for s in starts]
        kv_lens = (pos[torch.tensor(ends, device=pos.device) - 1] + 1).tolist()
        chunks = [_QueryChunk(token_idx[s:e], pos[s:e], n) for s, e, n in zip(starts, ends, kv_lens)]
        plans.append(_RequestPlan(request, kv_lens[-1], chunks))
    return plans


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_acc_dtype(x.dtype))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Indexer(nn.Module):
    """NSA lightning indexer (DeepSeek-V3.2 ``Indexer``): scores every visible key per query."""

    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.cfg = cfg
        self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, cfg.index_head_dim, bias=False)
        self.k_norm = nn.LayerNorm(cfg.index_head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)

    def _rope_first(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dr = self.cfg.qk_rope_head_dim
        return torch.cat([apply_rope(x[..., :dr], positions, self.cfg.rope_theta), x[..., dr:]], dim=-1)

    def key(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Index key [T, 128] (before fp8): what the KV cache stores for the indexer."""
        k = self.wk(x)
        acc = _acc_dtype(k.dtype)
        k = F.layer_norm(k.to(acc), k.shape[-1:], self.k_norm.weight.to(acc), self.k_norm.bias.to(acc), self.k_norm.eps)
        return self._rope_first(k.to(x.dtype), positions)

    def query(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor):
        """Index query [T, Hi, 128] and head weights [T, Hi]."""
        cfg = self.cfg
        q = self.wq_b(q_latent).view(-1, cfg.index_n_heads, cfg.index_head_dim)
        weights = self.weights_proj(x) * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
        return self._rope_first(q, positions), weights


class MLAAttention(nn.Module):
    """DeepSeek MLA with absorbed weights, attending only to the indexer's top-k keys."""

    def __init__(self, cfg: DSAConfig, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        h, dn, dr, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + dr, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (dn + dv), bias=False)
        self.o_proj = nn.Linear(h * dv, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, kv: KVContext, plans: list[_RequestPlan], want_topk: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cfg = self.cfg
        t, h, dn, dr, dv = x.shape[0], cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, dr], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), apply_rope(k_rope, positions, cfg.rope_theta)], dim=-1)
        kv.begin_layer(self.layer_id, latent, *quantize_index_key(self.indexer.key(x, positions)))

        # Queries need nothing from other tokens: computed while the context exchanges the KV.
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rope = self.q_b_proj(q_latent).view(t, h, dn + dr).split([dn, dr], dim=-1)
        w_uk, w_uv = self.kv_b_proj.weight.view(h, dn + dv, cfg.kv_lora_rank).split([dn, dv], dim=1)
        q = torch.cat([torch.einsum("thd,hdc->thc", q_nope, w_uk), apply_rope(q_rope, positions, cfg.rope_theta)], -1)
        index_q, index_w = self.indexer.query(x, q_latent, positions)
        dense = kv.finish_layer(self.layer_id)

        out_latent = x.new_empty(t, h, cfg.kv_lora_rank)
        topk = torch.full((t, cfg.index_topk), -1, dtype=torch.long, device=x.device) if want_topk else None
        for plan in plans:
            rows = dense.req_rows[plan.request, : plan.kv_len]
            cand_latent = dense.latent[rows]
            cand_keys = dequantize_index_key(dense.index_key[rows], dense.index_scale[rows], x.dtype)
            for c in plan.chunks:
                scores = index_scores(index_q[c.token_idx], index_w[c.token_idx], cand_keys[: c.kv_len])
                selected = select_topk(scores, c.positions, cfg.index_topk)
                out_latent[c.token_idx] = sparse_mla(
                    q[c.token_idx], selected, cand_latent[: c.kv_len], cfg.kv_lora_rank, cfg.softmax_scale
                )
                if topk is not None:
                    topk[c.token_idx, : selected.shape[1]] = selected
        out = torch.einsum("thc,hvc->thv", out_latent, w_uv).reshape(t, h * dv)
        return self.o_proj(out), topk


class MLP(nn.Module):
    def __init__(self, cfg: DSAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, positions, kv, plans, want_topk):
        attn, topk = self.self_attn(self.input_layernorm(h), positions, kv, plans, want_topk)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), topk


class DSAModel(nn.Module):
    """The reference DSA model; weights are a pure function of ``(config, seed)``.

    ``seed=None`` leaves the weights uninitialized (used by :meth:`from_pretrained`).
    """

    def __init__(self, config: DSAConfig, seed: int | None = 0, dtype: torch.dtype = torch.float32, device="cpu"):
        super().__init__()
        self.config = config
        self.query_chunk_size = DEFAULT_QUERY_CHUNK
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(dtype=dtype).to_empty(device=device).requires_grad_(False)
        if seed is not None:
            self._init_weights(seed)

    @torch.no_grad()
    def _init_weights(self, seed: int) -> None:
        """N(0, 1/fan_in) projections keep activations O(1); the two residual writers (o_proj,
        down_proj) are shrunk by 1/sqrt(2 * num_layers) so the stream does not grow with depth.
        Norm gains are 1 + 0.1 N(0, 1) so a mixed-up norm weight changes the output.
        Drawn in float32 on the CPU in parameter order: identical weights on every device/dtype."""
        gen = torch.Generator().manual_seed(seed)
        residual_scale = (2 * self.config.num_layers) ** -0.5
        for name, p in self.named_parameters():
            w = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                w = 1.0 + 0.1 * w
            elif name.endswith("norm.bias"):
                w = 0.1 * w
            elif name != "embed_tokens.weight":
                w = w * p.shape[-1] ** -0.5
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    w = w * residual_scale
            p.copy_(w)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        request_ids: torch.Tensor,
        kv: KVContext,
        return_topk: bool = False,
    ):
        """Hidden states (before the final norm) of the T tokens this process computes.

        input_ids, positions, request_ids: int64 [T], tokens in any order; ``positions`` count
        from the start of the request (cached prefix included), ``request_ids`` index the rows
        of the ``req_rows`` the context returns. Returns hidden [T, hidden_size], and with
        ``return_topk`` also one int64 [T, index_topk] per layer: the selected *positions*,
        ascending, padded with -1.
        """
        shapes = [tuple(input_ids.shape), tuple(positions.shape), tuple(request_ids.shape)]
        if any(len(s) != 1 for s in shapes) or len(set(shapes)) != 1:
            raise ValueError(f"input_ids, positions, request_ids must be 1-D of one length, got shapes {shapes}")
        plans = _plan_queries(positions, request_ids, self.query_chunk_size)
        h = self.embed_tokens(input_ids)
        topks = []
        for layer in self.layers:
            h, topk = layer(h, positions, kv, plans, return_topk)
            topks.append(topk)
        return (h, topks) if return_topk else h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> logits [n, vocab_size] (final norm + LM head)."""
        return self.lm_head(self.norm(hidden))

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``config.json`` (HF style, DeepSeek-V3.2 key names) and ``model.safetensors``."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        hf = {**self.config.to_hf_dict(), "torch_dtype": str(self.embed_tokens.weight.dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, device="cpu") -> DSAModel:
        """Load what :meth:`save_pretrained` wrote; ``dtype=None`` keeps the stored dtype."""
        from safetensors.torch import load_file

        path = Path(path)
        config = DSAConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
        tensors = load_file(str(path / "model.safetensors"), device=str(device))
        model = cls(config, seed=None, dtype=dtype or tensors["embed_tokens.weight"].dtype, device=device)
        model.load_state_dict(tensors, strict=True)
        return model
