"""`demo --pd`: PD disaggregation end to end with the reference model, over a standalone transport.

    demo.py       shared-KV CP prefill ranks -> owned-page transfer -> greedy decode on a non-CP
                  decode pool, checked against the single-rank oracle (`run_pd`, `DecodeKV`)
    sender.py     prefill side: plan, handshake, destination pages, batched write, manifest
    receiver.py   decode side: sockets and threads around transfers.py; commit or fail
    transfers.py  the decode's bookkeeping: uses of a request id, early messages, fences
    protocol.py   typed, bounded, keyed ZMQ messages (the manifest carries `disagg.PageClaims`)
    engine.py     Mooncake's TransferEngine, and the batch of (src, dst, length) entries
    status.py     what receiver.poll() returns; the decode's counters

Only the demo, its tests and `benchmark/bench_pd_transfer.py` use this transport. This package
exports the transport; the demo (model, kernels, oracle) is imported from `pd.demo` when wanted. The plan of
owned pages, the manifest structure, the commit rule, checksums and the PD secret are
`sglang_nsa_cp.disagg`, which the SGLang plugin shares (it rides SGLang's own Mooncake transfer).
Needs pyzmq, msgspec and Mooncake, imported only here. See docs/disagg.md.
"""

from sglang_nsa_cp.pd.engine import EngineConfig, MooncakeEngine, TransferBatch, TransferError, build_transfer_batch
from sglang_nsa_cp.pd.protocol import Manifest, ProtocolError, new_nonce
from sglang_nsa_cp.pd.receiver import OwnedPageReceiver
from sglang_nsa_cp.pd.sender import OwnedPageSender, SendResult, SenderStats
from sglang_nsa_cp.pd.status import Committed, Failed, Pending, RankStats, ReceiverStats

__all__ = [
    "Committed",
    "EngineConfig",
    "Failed",
    "Manifest",
    "MooncakeEngine",
    "OwnedPageReceiver",
    "OwnedPageSender",
    "Pending",
    "ProtocolError",
    "RankStats",
    "ReceiverStats",
    "SendResult",
    "SenderStats",
    "TransferBatch",
    "TransferError",
    "build_transfer_batch",
    "new_nonce",
]
