// Fused quantize + store of owned bf16 MLA latent rows into FlashMLA's 656-byte fp8 rows: the
// CUDA version of mla_fp8_store.store_owned_mla_fp8_triton, bitwise equal to
// mla_fp8_store.store_owned_mla_fp8_torch. Built on first use by kernels/mla_fp8_store.py.
//
// One warp per token. Lane l holds values 16l..16l+15 of the 512 nope values (two 16-byte
// loads), so 8 lanes make one 128-value block: amax by three shuffles, then 16 fp8 codes stored
// as one 16-byte word. Lanes 0-3 (one per block) store the fp32 scales; lanes 0-7 copy the 64
// rope values (128 bytes). Row layout: 512 codes | 4 fp32 scales | 64 bf16 rope = 656 bytes.
//
// Why not Triton: on an H200 the Triton kernel reached 0.84 of copy bandwidth at 256 MiB, this
// one 0.92 (docs/kernels.md). The work per value is short only if the registers are: capped at
// 32 per thread (8 blocks of 256 threads per SM), warps keep enough loads in flight.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <torch/extension.h>

#include <cstdint>

namespace {

constexpr int kRowBytes = 656;
constexpr int kScaleOffset = 512;
constexpr int kRopeOffset = 528;
constexpr int kWarpsPerBlock = 8;
constexpr float kInvFp8Max = 1.0f / 448.0f;  // fp32(1/448), as the reference multiplies

// The fp8 code of x / d as an IEEE division would give it: x * RN(1/d) and one fma correction.
// For every bf16 x and bf16 amax >= |x| the code equals the division's (all 1,065,402,240 pairs
// are checked by test_kernels_gpu.py). The correction turns -0 into +0: put x's sign back.
__device__ __forceinline__ float quotient(float x, float d, float r) {
  float q = x * r;
  q = fmaf(fmaf(-q, d, x), r, q);
  return __int_as_float(__float_as_int(q) | (__float_as_int(x) & 0x80000000));
}

__device__ __forceinline__ uint32_t four_codes(const __nv_bfloat162* h, float d, float r) {
  const float2 a = __bfloat1622float2(h[0]);
  const float2 b = __bfloat1622float2(h[1]);
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(quotient(a.x, d, r), quotient(a.y, d, r)), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(quotient(b.x, d, r), quotient(b.y, d, r)), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

template <typename Slot>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 8) store_owned_mla_fp8_kernel(
    uint8_t* __restrict__ shard, const Slot* __restrict__ slots, const __nv_bfloat16* __restrict__ kv,
    int64_t kv_stride, int64_t n_rows, int rank, int cp_size, int page_size) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  if (row >= n_rows) return;
  const int64_t slot = __ldg(slots + row);
  const int64_t page = slot / page_size;
  if (slot < 0 || page % cp_size != rank) return;  // the whole warp: not this rank's row
  const int64_t dst = (page / cp_size) * page_size + slot % page_size;

  const uint4* src = reinterpret_cast<const uint4*>(kv + row * kv_stride);
  const uint4 v0 = __ldg(src + 2 * lane);
  const uint4 v1 = __ldg(src + 2 * lane + 1);
  uint4 rope;
  if (lane < 8) rope = __ldg(src + 64 + lane);

  const __nv_bfloat162* h0 = reinterpret_cast<const __nv_bfloat162*>(&v0);
  const __nv_bfloat162* h1 = reinterpret_cast<const __nv_bfloat162*>(&v1);
  __nv_bfloat162 m = __habs2(h0[0]);  // |x| compares the same in bf16 as in fp32
#pragma unroll
  for (int i = 1; i < 4; ++i) m = __hmax2(m, __habs2(h0[i]));
#pragma unroll
  for (int i = 0; i < 4; ++i) m = __hmax2(m, __habs2(h1[i]));
  float amax = fmaxf(__bfloat162float(m.x), __bfloat162float(m.y));
#pragma unroll
  for (int offset = 4; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float d = fmaxf(amax, 1e-12f) * kInvFp8Max;
  const float r = __frcp_rn(d);

  uint8_t* out = shard + dst * kRowBytes;
  *reinterpret_cast<uint4*>(out + 16 * lane) =
      make_uint4(four_codes(h0, d, r), four_codes(h0 + 2, d, r), four_codes(h1, d, r), four_codes(h1 + 2, d, r));
  if ((lane & 7) == 0) reinterpret_cast<float*>(out + kScaleOffset)[lane >> 3] = d;
  if (lane < 8) reinterpret_cast<uint4*>(out + kRopeOffset)[lane] = rope;
}

}  // namespace

// Arguments are checked by the Python caller (mla_fp8_store.store_owned_mla_fp8_cuda).
void store_owned_mla_fp8(torch::Tensor shard, torch::Tensor slots, torch::Tensor kv, int64_t rank, int64_t cp_size,
                         int64_t page_size) {
  const int64_t n = kv.size(0);
  if (n == 0) return;
  const at::cuda::CUDAGuard guard(kv.device());
  const int64_t blocks = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto* kv_ptr = reinterpret_cast<const __nv_bfloat16*>(kv.data_ptr<at::BFloat16>());
  if (slots.scalar_type() == at::kLong) {
    store_owned_mla_fp8_kernel<int64_t><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        shard.data_ptr<uint8_t>(), slots.data_ptr<int64_t>(), kv_ptr, kv.stride(0), n, int(rank), int(cp_size),
        int(page_size));
  } else {
    store_owned_mla_fp8_kernel<int32_t><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        shard.data_ptr<uint8_t>(), slots.data_ptr<int32_t>(), kv_ptr, kv.stride(0), n, int(rank), int(cp_size),
        int(page_size));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_owned_mla_fp8", &store_owned_mla_fp8, "fused fp8 quantize + store of owned MLA latent rows");
}
