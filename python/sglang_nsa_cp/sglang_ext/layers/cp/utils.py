"""The narrow tail gather. Mirrors `sglang/srt/layers/cp/utils.py`.

Target: `sglang.srt.layers.cp.utils.cp_gather_after_forward` (AROUND), called by
`EagerRunner._execute_extend_cp` once per CP prefill batch, between the model body and the logits
processor. Today it all-gathers every token's hidden state (total_tokens x hidden). When the
batch needs only each request's last token (no input logprobs, no hidden-state capture, no
speculative or multi-item scoring work), the hook gathers one row per request per rank
(N x bs x hidden, `comm.gather_last_token_hidden`, the original design's
`cp_collect_last_token_hidden`) and returns what SGLang's gather returns, [total_tokens, hidden]
in token order, with only the last-token rows filled (the rest zero): the logits processor reads
exactly those rows (`cumsum(extend_seq_lens) - 1`). The same allocation as SGLang's gather
output, 1/(total_tokens / bs) of its traffic, and nothing downstream changes.

The choice is a pure function of the batch (every CP rank holds the same ForwardBatch), so all
ranks issue the same collective. `comm.plan_tail` names each request's last-token rank and row
under SGLang's interleave split (test/comm/test_tail.py checks it against SGLang's own metadata).
"""

from __future__ import annotations

import logging

import torch

from sglang_nsa_cp.comm import gather_last_token_hidden, plan_tail
from sglang_nsa_cp.sglang_ext.server_args import is_enabled

_PLAN_ATTR = "_nsa_cp_tail_plan"
logger = logging.getLogger(__name__)


def why_every_token(x, forward_batch) -> str | None:
    """In a shared-KV prefill: why this batch's tail must gather every token's hidden state
    (SGLang's own gather), or None when each request's last row is all the logits processor reads."""
    from sglang.srt.layers.cp.base import is_interleave
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
    from sglang.srt.runtime_context import get_parallel

    fb = forward_batch
    checks = (  # in order, each read only once the ones before it hold
        (lambda: isinstance(x, torch.Tensor), f"the model body returned {type(x).__name__}, not a tensor"),
        (is_interleave, "not the interleave CP strategy"),
        (lambda: get_parallel().attn_dp_size == 1, "DP attention"),
        (lambda: fb.forward_mode == ForwardMode.EXTEND, "not an extend forward"),
        (lambda: not fb.return_logprob, "the batch returns logprobs"),
        (lambda: fb.capture_hidden_mode == CaptureHiddenMode.NULL, "the batch captures hidden states"),
        (lambda: fb.spec_info is None, "speculative decoding"),
        (lambda: getattr(fb, "multi_item_delimiter_indices", None) is None, "multi-item scoring"),
        (lambda: getattr(fb, "token_indices_to_pool", None) is None, "token pooling"),
        # SGLang's gather (interleave `_gather_interleaved_tensor`) takes x as this rank's interleave
        # rows whatever `attn_tp_sequence_sharded` says (DSA prefill CP clears that sharding); so does this
        (lambda: _holds_local_rows(x, fb), "the model body's rows are not this rank's interleave share"),
        (lambda: getattr(fb, "mm_input_embeds", None) is None, "multimodal input embeddings"),
    )
    return next((reason for holds, reason in checks if not holds()), None)


def _holds_local_rows(x, forward_batch) -> bool:
    from sglang.srt.runtime_context import get_parallel

    metadata = forward_batch.attn_cp_metadata  # None: SGLang's gather raises its own error
    if metadata is None:
        return False
    lens = metadata.per_rank_logical_token or metadata.per_rank_actual_token
    return x.shape[0] >= lens[get_parallel().attn_cp_rank]


_REPORTED: set[str] = set()


def _report_once(reason: str) -> None:
    if reason not in _REPORTED:
        _REPORTED.add(reason)
        logger.info("the narrow tail gather is off for a batch (SGLang's gather runs): %s", reason)


def tail_plan(forward_batch, cp_size: int):
    """The batch's tail plan (SGLang's interleave split), built once per batch."""
    plan = getattr(forward_batch, _PLAN_ATTR, None)
    if plan is None or plan.cp_size != cp_size:
        plan = plan_tail(forward_batch.extend_seq_lens_cpu, cp_size)
        setattr(forward_batch, _PLAN_ATTR, plan)
    return plan


def cp_gather_after_forward(original, x, forward_batch, stream=None):
    """AROUND `cp_gather_after_forward`: only the last-token rows, when that is all the batch needs."""
    if not is_enabled():  # without the flag SGLang's gather, and nothing logged
        return original(x, forward_batch, stream)
    reason = why_every_token(x, forward_batch)
    if reason is not None:
        _report_once(reason)
        return original(x, forward_batch, stream)
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    plan = tail_plan(forward_batch, parallel.attn_cp_size)
    rows = gather_last_token_hidden(x, plan, parallel.attn_cp_rank, parallel.attn_cp_group.device_group)
    full = rows.new_zeros((sum(plan.extend_lens), *rows.shape[1:]))
    return full.index_copy_(0, plan.device_tensor("last_tokens", rows.device), rows)
