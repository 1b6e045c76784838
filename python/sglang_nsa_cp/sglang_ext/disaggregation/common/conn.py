"""Guard: the owned-page PD transfer is not wired into SGLang yet. Mirrors
`sglang/srt/disaggregation/common/conn.py`.

Target: `CommonKVManager.__init__` (AROUND). With shared KV a prefill rank's registered buffers
(`get_contiguous_buf_infos`, `get_state_buf_infos`) hold only the pages it owns, at local page
`page // N`, while SGLang's default sender ships the request's logical page ids from CP rank 0
alone. Left alone, the decode instance would receive pages read past the end of rank 0's shard.
Until the owned-page transfer (`sglang_nsa_cp.disagg`) is hooked into the Mooncake manager, the
prefill rank refuses to start its KV manager, with this explanation, instead of serving wrong KV.
This hook goes when that transfer lands.
"""

from __future__ import annotations

from sglang_nsa_cp.sglang_ext.server_args import FLAG, is_enabled

UNWIRED = (
    f"{FLAG}: the PD transfer of owned pages is not wired into SGLang's Mooncake KV manager yet "
    "(each CP rank holds only its own pages; SGLang would send logical page ids from CP rank 0 "
    "alone, which address past the end of its shard). Run without the flag until the owned-page "
    "sender lands (see docs/sglang_plugin.md, 'Not done')."
)


def refuse_unwired_prefill_transfer(original, self, args, disaggregation_mode, *rest, **kwargs):
    """AROUND `CommonKVManager.__init__`: refuse the prefill-side manager while shared KV is on."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    if is_enabled() and disaggregation_mode == DisaggregationMode.PREFILL:
        raise NotImplementedError(UNWIRED)
    return original(self, args, disaggregation_mode, *rest, **kwargs)


HOOKS = [
    ("sglang.srt.disaggregation.common.conn.CommonKVManager.__init__", refuse_unwired_prefill_transfer, "AROUND"),
]
