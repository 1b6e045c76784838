"""What the tests share: the one place a test imports from besides the project and SGLang.

Imported by absolute import, `from helpers import sglang_model_harness as H`, with test/ on the
path: pytest puts it there (`pythonpath` in pyproject.toml), and the scripts and benchmarks that
use a helper insert it themselves. No test module imports another; anything two tests share lives
here. Importing this package does nothing, so `gpu_stand_ins` can still come before SGLang.

- `sglang_model_harness`, `sglang_draft_harness`, `sglang_hicache_harness`: SGLang's own DSA model,
  NextN draft and HiCache host tier driven on CPU ranks; `sglang_cpu_stand_ins`: their CPU
  stand-ins for CUDA-only pieces (also a test-only server plugin); `sglang_servers`: real servers;
  `sglang_pool_writes`: one fp8 batch of pool writes per pool class (SGLang's, the plugin's).
- `sglang_gpu_harness`, `gpu_stand_ins`, `mqa_logits_triton`: the same model forward on CUDA GPUs;
  `sglang_gpu_row0`: SGLang's pool class beside the plugin's with a poisoned scratch there.
- `sglang_cp_reference`: SGLang's own CP split and gather, the reference for our split plans.
- `paged_requests`, `dsa_pool`, `kernel_bytes`: request tables, pool arguments, byte-exact checks.
"""
