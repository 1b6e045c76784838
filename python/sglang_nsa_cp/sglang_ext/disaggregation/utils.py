"""SGLang builds the plugin's Mooncake classes. Mirrors `sglang/srt/disaggregation/utils.py`.

Target: `get_kv_class` (AROUND), through which SGLang's prefill and decode queues get their KV
manager, sender and receiver classes (`PrefillBootstrapQueue._init_kv_manager`, `_create_sender`,
`DecodePreallocQueue._init_kv_manager`, `_create_receiver`). For the Mooncake backend it answers
the plugin's subclasses (`mooncake/conn.py`) only where the operator asked for them: a shared-KV
prefill, or a decode started with the flag (its opt-in). Everywhere else (no flag: any other
model's PD deployment, SGLang's own `--enable-kv-cache-sharding`), and for every other backend and
class type, SGLang's own classes.
"""

from __future__ import annotations


def get_kv_class(original, transfer_backend, class_type):
    """AROUND `get_kv_class`."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

    from sglang_nsa_cp.sglang_ext.server_args import acts

    if transfer_backend == TransferBackend.MOONCAKE and acts():
        from sglang_nsa_cp.sglang_ext.disaggregation.mooncake import conn

        owned_page_classes = {
            KVClassType.MANAGER: conn.OwnedPageKVManager,
            KVClassType.SENDER: conn.OwnedPageKVSender,
            KVClassType.RECEIVER: conn.OwnedPageKVReceiver,
        }
        if class_type in owned_page_classes:
            return owned_page_classes[class_type]
    return original(transfer_backend, class_type)
