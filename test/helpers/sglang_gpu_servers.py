"""SGLang 0.5.23's real servers on one GPU: the GPU variant of `sglang_servers.Cluster`.

The same roles as on CPU (a PD prefill at CP=N with --enable-nsa-prefill-cp-shared-kv, the same
prefill without it, a decode, a non-CP oracle, SGLang's router), launched on the GPU machine from
the bundle of docs/gpu_bundle.md: FlashMLA's real sparse kernels, Mooncake's CUDA transfer engine
over TCP on loopback, SGLang's PyNccl all-gather between CP ranks that share GPU 0 (each its own
NCCL host). Every process starts through `sglang_gpu_server_stand_ins`, which installs the
stand-ins the bundle needs and logs each one used. docs/sglang_gpu_server.md says what runs for
real and what is stood in for.
"""

from __future__ import annotations

from dataclasses import dataclass

from helpers import glm5_shaped
from helpers import sglang_gpu_harness as G
from helpers import sglang_servers as S
from helpers.distributed import SHARED_GPU_NCCL_ENV

# The CPU servers' model with a vocabulary that splits at TP 4 (SGLang pads each vocabulary
# shard to 64), a context long enough for the long prompt, and a top-k of 128 (a multiple of
# FlashMLA's 64-index block).
CONTEXT_TOKENS = 131072
MODEL = dict(
    S.MODEL, vocab_size=256, index_topk=128, max_position_embeddings=CONTEXT_TOKENS,
    rope_scaling=dict(S.MODEL["rope_scaling"], original_max_position_embeddings=CONTEXT_TOKENS),
)  # fmt: skip

MTP_CONTEXT = 8192
MTP_MODEL = dict(
    S.MODEL, architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_nextn_predict_layers=1,
    hidden_size=512,  # the NextN layer's fused_eh_norm takes hidden sizes in (256, 8192], multiples of 256
    index_topk=128, max_position_embeddings=MTP_CONTEXT,
    rope_scaling=dict(S.MODEL["rope_scaling"], original_max_position_embeddings=MTP_CONTEXT),
)  # fmt: skip

CHUNK_TOKENS = 8192
PREFILL_TOKENS_PER_RANK = 40960  # every CP prefill's pool per rank (the same KV bytes per rank): < 100k
BIG_POOL_TOKENS = 140000  # the decode's and the oracle's: they hold a 100k-token prompt


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint the server check runs, with its pools: every CP prefill `per_rank` tokens per
    rank, the decode and the oracle `big`; `long_prompt` (past one rank's pool, within the shared
    prefill's logical capacity less four chunks at CP 4); `top_logprobs` > 0: requests ask for
    SGLang's logprobs, compared between paths (helpers.logprob_compare)."""

    name: str
    config: dict
    chunk: int
    per_rank: int
    big: int
    long_prompt: int
    top_logprobs: int
    speculative: bool = False  # EAGLE over the checkpoint's NextN layer on both prefills and the decode

    @property
    def context(self) -> int:
        return self.config["max_position_embeddings"]

    def pools(self, long_prompt: int | None = None) -> dict:
        return dict(per_rank=self.per_rank, big=self.big, chunk=self.chunk, context=self.context,
                    long_prompt=self.long_prompt if long_prompt is None else long_prompt)  # fmt: skip


# toy: the CPU servers' 2-layer model; glm5-shaped: helpers/glm5_shaped.py (GLM-5's attention,
# indexer and vocabulary, 1 dense + 2 MoE layers): a 131,072-token prompt at CP 4 = 4 x 40,960 less
# four chunks, and 140,000 tokens for the decode and the oracle.
MODELS = {
    "toy": ModelSpec("toy", MODEL, CHUNK_TOKENS, PREFILL_TOKENS_PER_RANK, BIG_POOL_TOKENS, 100_000, 0),
    "glm5-shaped": ModelSpec("glm5-shaped", glm5_shaped.GLM5_SHAPED, 8192, 40960, 140000, 131072, 5),
    # the same with every layer dense: no expert routing for a rounding difference to flip
    "glm5-shaped-dense": ModelSpec(
        "glm5-shaped-dense", glm5_shaped.GLM5_SHAPED | {"first_k_dense_replace": 3}, 8192, 40960, 140000, 131072, 5
    ),  # fmt: skip
    # GLM-5's architecture with its NextN layer built from the target's weights (helpers/sglang_spec_model.py),
    # served with EAGLE: the CPU speculative test's model with the GPU toy's top-k and a longer context
    "mtp-toy": ModelSpec("mtp-toy", MTP_MODEL, 1024, 4096, 8192, 0, 0, speculative=True),
}
# EAGLE as GLM-5 runs it over PD (top-k 1; SGLang's sharded MTP draft supports no other), the draft's
# DSA top-k in torch (sgl-kernel's cannot load here), no CUDA graphs (as dsa_args)
SPEC_STEPS, SPEC_DRAFT_TOKENS = 2, 3
SPEC_ARGS = [
    "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1",
    "--speculative-num-steps", str(SPEC_STEPS), "--speculative-num-draft-tokens", str(SPEC_DRAFT_TOKENS),
    "--speculative-dsa-topk-backend", "torch",
]  # fmt: skip
SPEC_ROLES = ("shared", "replicated", "decode")
# SGLang's own counters of a speculative request (meta_info), equal between the two prefills
SPEC_FIELDS = ("spec_accept_length", "spec_verify_ct", "spec_num_correct_drafts", "spec_correct_drafts_histogram")
SPEC_ENV = "NSA_CP_TEST_SPECULATIVE"  # the servers' stand-in plugin adds the NextN layer's dense MLP

# SGLang's own switches on this machine: multicast off (KINDS.md), the memory-balance check off
# (the ranks of several servers share one GPU, so their free memory differs by the others' use),
# the symmetric-memory gather off (an NCCL window; SGLang turns it off itself below NCCL 2.31.2).
GPU_ENV = {
    **G.ENV, **SHARED_GPU_NCCL_ENV,
    "TRITON_INTERPRET": "0", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1", "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
    "SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER": "0",
}  # fmt: skip
CPU_ONLY_ENV = ("OMP_NUM_THREADS", "SGLANG_CPU_OMP_THREADS_BIND", *S.sglang_cpu_stand_ins.ENV)
PLUGIN_ENTRY_POINT = "[sglang.srt.plugins]\ngpu_stand_ins = helpers.sglang_gpu_server_stand_ins:register\n"


def dsa_args(kv_cache_dtype: str, chunk: int = CHUNK_TOKENS) -> list[str]:
    """SGLang's DSA path on SM90 with the kernels the bundle can run: FlashMLA's sparse prefill
    (the flag's backend), flashmla_kv to decode an fp8 cache (SGLang's SM90 default), the torch
    top-k, cuBLAS GEMMs, eager (no CUDA graphs), NCCL instead of the custom all-reduce."""
    decode = "flashmla_kv" if kv_cache_dtype == "fp8_e4m3" else "flashmla_sparse"
    return ["--device", "cuda", "--attention-backend", "dsa", "--kv-cache-dtype", kv_cache_dtype,
            "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", decode, "--dsa-topk-backend", "torch",
            "--bf16-gemm-backend", "torch", "--disable-cuda-graph", "--disable-custom-all-reduce",
            "--chunked-prefill-size", str(chunk)]  # fmt: skip


def roles(cp: int, spec: ModelSpec = MODELS["toy"]) -> dict[str, tuple[list[str], bool]]:
    """The CPU cluster's roles at CP=`cp`, with the GPU's pool sizes for `spec`."""
    cp_args = ["--tp", str(cp), "--enable-prefill-cp", "--cp-strategy", "interleave", "--attn-cp-size", str(cp),
               "--moe-dense-tp-size", "1", *S.PD_ARGS, "--disaggregation-mode", "prefill",
               "--max-total-tokens", str(spec.per_rank)]  # fmt: skip
    big = ["--max-total-tokens", str(spec.big)]
    table = {
        "shared": (cp_args + ["--enable-nsa-prefill-cp-shared-kv"], True),
        "replicated": (cp_args, True),
        # SGLang's own layer split beside the flag (sglang_server_check.py --layer-split): the same rows per rank
        "layer_split": (cp_args + ["--enable-dsa-cache-layer-split"], True),
        "decode": (
            S.PD_ARGS
            + [
                "--disaggregation-mode",
                "decode",
                "--enable-nsa-prefill-cp-shared-kv",
                *S.ONE_AT_A_TIME,
                *S.DECODE_EXTRA_SLOTS,
                *big,
            ],  # fmt: skip
            False,
        ),
        "single": (S.ONE_AT_A_TIME + big, False),
    }
    if spec.speculative:  # the oracle stays non-speculative
        table.update({name: (table[name][0] + SPEC_ARGS, table[name][1]) for name in SPEC_ROLES})
    return table


@dataclass
class GpuCluster(S.Cluster):
    """`sglang_servers.Cluster` on one GPU at CP=`cp` with `kv_cache_dtype` KV, serving `spec`'s
    model: from `checkpoint` when given (written once for several clusters), else written here."""

    kv_cache_dtype: str = "bfloat16"
    spec: ModelSpec = MODELS["toy"]
    checkpoint: str = ""

    def write_model(self, path: str) -> str:
        if self.checkpoint:
            return self.checkpoint
        return write_model(path, self.spec)

    def server_env(self) -> dict:
        env = S.server_env(S.write_plugin_site(str(self.workdir / "plugin_site"), PLUGIN_ENTRY_POINT))
        for key in CPU_ONLY_ENV:
            env.pop(key, None)
        return env | GPU_ENV | ({SPEC_ENV: "1"} if self.spec.speculative else {}) | self.env

    def role(self, name: str) -> tuple[list[str], bool]:
        return roles(self.cp, self.spec)[name]

    def server_command(self, port: int, role_args: list[str], bootstrap_port: int | None, nccl_port: int):
        cmd = [S.PYTHON, "-m", "helpers.sglang_gpu_server_stand_ins", "--model-path", self.model,
               "--host", "127.0.0.1", "--port", str(port), "--nccl-port", str(nccl_port),
               *dsa_args(self.kv_cache_dtype, self.spec.chunk), "--skip-server-warmup", *role_args]  # fmt: skip
        if bootstrap_port is not None:
            cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        return cmd


def write_model(path: str, spec: ModelSpec, device: str = "cpu") -> str:
    """`spec`'s checkpoint and tokenizer in `path` (glm5-shaped: its tensors made on `device`)."""
    if spec.speculative:
        from helpers import sglang_spec_model

        S.H.write_checkpoint(path, spec.config, 0, tensors=sglang_spec_model.checkpoint)
        S.write_tokenizer(path, spec.config["vocab_size"])
        return path
    if spec.name == "toy":
        S.H.write_checkpoint(path, spec.config)
        S.write_tokenizer(path, spec.config["vocab_size"])
        return path
    return glm5_shaped.write_checkpoint(path, spec.config, device=device)
