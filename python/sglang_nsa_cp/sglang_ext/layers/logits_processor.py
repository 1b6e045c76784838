"""Already-pruned hidden states for the logits processor. Mirrors `sglang/srt/layers/logits_processor.py`.

Target: `LogitsProcessor._get_pruned_states` (AROUND). For an extend batch without input
logprobs SGLang keeps rows `cumsum(extend_seq_lens) - 1` of a [total_tokens, hidden] tensor. After
the narrow tail gather (`layers/cp/utils.py`) it receives [bs, hidden]: exactly those rows, in
request order. The hook recognises that shape and passes the rows through, returning what
SGLang's own branch returns (pruned rows, no sample or input-logprob indices).

The test is on shapes alone and is exact: in that branch a [bs, hidden] input with
bs < total_tokens cannot come from anywhere else (SGLang's own indexing would run past its end),
and with bs == total_tokens every token is a last token, so both paths give the same rows.
"""

from __future__ import annotations

from sglang_nsa_cp.sglang_ext.server_args import is_enabled


def is_compact(hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata) -> bool:
    mode = logits_metadata.forward_mode
    lens = logits_metadata.extend_seq_lens_cpu
    return (
        not (mode.is_decode_or_idle() or mode.is_target_verify() or mode.is_draft_extend_v2())
        and mode.is_extend()
        and not logits_metadata.extend_return_logprob
        and hidden_states_before_norm is None
        and aux_hidden_states is None
        and lens is not None
        and hidden_states.shape[0] == len(lens)
        and len(lens) < sum(lens)
    )


def get_pruned_states(original, self, hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata):
    """AROUND `_get_pruned_states`: last-token rows that are already pruned pass through."""
    if is_enabled() and is_compact(hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata):
        # (pruned_states, pruned_states_before_norm, aux_pruned_states, sample_indices,
        #  input_logprob_indices, token_to_seq_idx), as SGLang's no-logprob extend branch
        return hidden_states, None, None, None, None, []
    return original(self, hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata)
