// Device code of the fused FP8 passes (fused_params.h says what each computes). Compiled by
// nvcc to a fatbin at build time (CMakeLists.txt), embedded in libjax_epilog_ffi.so and
// loaded on first use (fused_passes.cc); nothing here is linked with host code.
//
// The arithmetic is the plain-JAX formulation's (jax_epilog/float8/fused.py), operation for
// operation, so that the FP8 bytes are the same: float32 products rounded to nearest,
// clipped to the format's largest finite value (NaN kept), then one round-to-nearest-even
// conversion to FP8 (PTX cvt.rn.satfinite, the instruction XLA emits on Hopper).
//
// Layout of a block: 256 threads as 16 x 16, thread (tx, ty) owns rows ty*8 .. ty*8+7 and
// columns tx*8 .. tx*8+7 of a 128 x 128 tile. Row-major outputs are stored straight from
// registers (16 threads write 128 contiguous bytes of a row); the transposed copy goes
// through shared memory, 8-byte chunks swizzled (chunk ^ row/8) so that neither the writes
// nor the reads have bank conflicts, and is stored 8 bytes per thread along rows of the
// transposed tensor. Elements past the tensor's edges are read as 0, never stored, and
// left out of the amax.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fused_params.h"

namespace jax_epilog::fused {
namespace {

constexpr int kSide = 16;  // threads along a tile's side
constexpr int kSub = 8;    // each thread: kSub x kSub elements
static_assert(kSide * kSub == kTile && kSide * kSide == kThreads, "tile shape");

struct Bf16 {
  static __device__ __forceinline__ float ToFloat(uint16_t bits) {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
  static __device__ __forceinline__ float Round(float v) {
    return ToFloat(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
  }
};

struct F16 {
  static __device__ __forceinline__ float ToFloat(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  static __device__ __forceinline__ float Round(float v) {
    return __half2float(__float2half_rn(v));
  }
};

template <__nv_fp8_interpretation_t kFormat>
struct Fp8 {
  static constexpr float kLargest = kFormat == __NV_E4M3 ? 448.0f : 57344.0f;
  // saturating_cast: clip (NaN stays NaN: both compares are false), then one rounding.
  static __device__ __forceinline__ float Clip(float v) {
    return v > kLargest ? kLargest : (v < -kLargest ? -kLargest : v);
  }
  // Two values to FP8, a in the low byte.
  static __device__ __forceinline__ uint16_t Encode2(float a, float b) {
    return static_cast<uint16_t>(
        __nv_cvt_float2_to_fp8x2(make_float2(Clip(a), Clip(b)), __NV_SATFINITE, kFormat));
  }
};

__device__ __forceinline__ float DecodeFp8(uint8_t v, bool e5m2) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(v, e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half2float(__half(h));
}

// scalars[i], read only where there are rows: a launch over no rows (the handlers' initialize
// stage, fused_passes.cc) touches no memory.
__device__ __forceinline__ float Scalar(const float* scalars, int i, int64_t rows) {
  return rows > 0 ? scalars[i] : 0.0f;
}

// The columns of a thread's 8-element segment at (row, col) that lie inside the tensor.
__device__ __forceinline__ int Valid(int64_t row, int64_t col, int64_t rows, int64_t cols) {
  if (row >= rows || col >= cols) return 0;
  return cols - col >= kSub ? kSub : static_cast<int>(cols - col);
}

// 8 16-bit elements of row `row` from column `col` (ld: the row length), 0 past the edge.
__device__ __forceinline__ void Load16(const uint16_t* __restrict__ base, int64_t ld,
                                       int64_t row, int64_t col, int valid, bool vector,
                                       uint16_t (&v)[kSub]) {
  if (valid == kSub && vector) {
    const uint4 w = *reinterpret_cast<const uint4*>(base + row * ld + col);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < kSub; j += 2) {
      v[j] = static_cast<uint16_t>(words[j / 2] & 0xffffu);
      v[j + 1] = static_cast<uint16_t>(words[j / 2] >> 16);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kSub; ++j) v[j] = j < valid ? base[row * ld + col + j] : uint16_t{0};
}

// 8 bytes likewise.
__device__ __forceinline__ void Load8(const uint8_t* __restrict__ base, int64_t ld, int64_t row,
                                      int64_t col, int valid, bool vector, uint8_t (&v)[kSub]) {
  if (valid == kSub && vector) {
    const uint2 w = *reinterpret_cast<const uint2*>(base + row * ld + col);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[j] = static_cast<uint8_t>(w.x >> (8 * j));
      v[j + 4] = static_cast<uint8_t>(w.y >> (8 * j));
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kSub; ++j) v[j] = j < valid ? base[row * ld + col + j] : uint8_t{0};
}

__device__ __forceinline__ uint2 Pack(const uint8_t (&b)[kSub]) {
  uint2 w;
  w.x = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
  w.y = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
  return w;
}

// The first `valid` of 8 bytes to row `row` from column `col`.
__device__ __forceinline__ void Store8(uint8_t* __restrict__ base, int64_t ld, int64_t row,
                                       int64_t col, int valid, bool vector,
                                       const uint8_t (&b)[kSub]) {
  if (valid == kSub && vector) {
    *reinterpret_cast<uint2*>(base + row * ld + col) = Pack(b);
    return;
  }
#pragma unroll
  for (int j = 0; j < kSub; ++j)
    if (j < valid) base[row * ld + col + j] = b[j];
}

// Shared memory of one transposed tile: row n (a column of the input tile), 16 chunks of 8
// bytes (8 rows of the input each), chunk c stored at c ^ (n / 8).
using Stage = uint2[kTile][kSide];

// The thread's 8 x 8 bytes b[i][j] (input row ty*8+i, column tx*8+j of the tile at (row0,
// col0)) stored transposed: to dst rows dst_row0 + tile column, columns row0 + tile row (dst's
// row length `rows`). `cols_left`: the tile's columns inside the tensor. Every thread of the
// block must call it; the stage is free again on return.
__device__ __forceinline__ void StoreTransposed(Stage& stage, const uint8_t (&b)[kSub][kSub],
                                                uint8_t* __restrict__ dst, int64_t dst_row0,
                                                int64_t cols_left, int64_t row0, int64_t rows,
                                                bool vector) {
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    uint8_t column[kSub];
#pragma unroll
    for (int i = 0; i < kSub; ++i) column[i] = b[i][j];
    stage[tx * kSub + j][ty ^ tx] = Pack(column);
  }
  __syncthreads();
  const int chunk = threadIdx.x % kSide;
  const int64_t m = row0 + chunk * kSub;
  const int m_valid = m >= rows ? 0 : (rows - m >= kSub ? kSub : static_cast<int>(rows - m));
#pragma unroll
  for (int k = 0; k < kTile / kSide; ++k) {
    const int n = k * kSide + threadIdx.x / kSide;
    if (n >= cols_left || m_valid == 0) continue;
    const uint2 w = stage[n][chunk ^ (n / kSub)];
    uint8_t* p = dst + (dst_row0 + n) * rows + m;
    if (m_valid == kSub && vector) {
      *reinterpret_cast<uint2*>(p) = w;
    } else {
      for (int i = 0; i < m_valid; ++i)
        p[i] = static_cast<uint8_t>((i < 4 ? w.x >> (8 * i) : w.y >> (8 * (i - 4))) & 0xffu);
    }
  }
  __syncthreads();
}

// max |v| as the bits of a non-negative float (NaN, whose bits are the largest, wins).
__device__ __forceinline__ uint32_t MaxAbs(uint32_t bits, float v) {
  return max(bits, __float_as_uint(fabsf(v)));
}

// The block's largest of each thread's `bits[k]`, merged into out[k] (zeroed before the
// launch). Every thread of the block must call it.
template <int K>
__device__ __forceinline__ void MergeAmaxes(const uint32_t (&bits)[K], unsigned int* out) {
  __shared__ uint32_t warps[K][kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t m = __reduce_max_sync(0xffffffffu, bits[k]);
    if (lane == 0) warps[k][warp] = m;
  }
  __syncthreads();
  if (threadIdx.x < K) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) m = max(m, warps[threadIdx.x][w]);
    if (m != 0) atomicMax(out + threadIdx.x, m);
  }
}

template <typename In, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void CastTranspose(const CastTransposeParams& p) {
  __shared__ Stage stage;
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col = col0 + tx * kSub;
  const float q = Scalar(p.multiplier, 0, p.rows);
  const auto* x = static_cast<const uint16_t*>(p.x);
  uint8_t b[kSub][kSub];
  uint32_t amax[1] = {0};
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = row0 + ty * kSub + i;
    const int valid = Valid(row, col, p.rows, p.cols);
    uint16_t v[kSub];
    Load16(x, p.cols, row, col, valid, p.vector_in, v);
#pragma unroll
    for (int j = 0; j < kSub; j += 2) {
      const float a = In::ToFloat(v[j]), c = In::ToFloat(v[j + 1]);
      if (j < valid) amax[0] = MaxAbs(amax[0], a);
      if (j + 1 < valid) amax[0] = MaxAbs(amax[0], c);
      const uint16_t pair = Fp8<kFormat>::Encode2(__fmul_rn(a, q), __fmul_rn(c, q));
      b[i][j] = static_cast<uint8_t>(pair & 0xffu);
      b[i][j + 1] = static_cast<uint8_t>(pair >> 8);
    }
    Store8(p.y, p.cols, row, col, valid, p.vector_out, b[i]);
  }
  StoreTransposed(stage, b, p.yt, col0, p.cols - col0, row0, p.rows, p.vector_t);
  MergeAmaxes<1>(amax, p.amax);
}

// silu(g) = g * sigmoid(g), sigmoid(g) = 1 / (1 + exp(-g)) (XLA's expansion of logistic),
// IEEE division.
__device__ __forceinline__ float Sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// g and u of one thread's row segment of [g u] as float32.
template <typename In>
__device__ __forceinline__ void LoadGateUp(const SwigluParams& p, int64_t row, int64_t col,
                                           int valid, float (&g)[kSub], float (&u)[kSub]) {
  const auto* gu = static_cast<const uint16_t*>(p.gu);
  uint16_t vg[kSub], vu[kSub];
  Load16(gu, 2 * p.hidden, row, col, valid, p.vector_in, vg);
  Load16(gu, 2 * p.hidden, row, p.hidden + col, valid, p.vector_in, vu);
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    g[j] = In::ToFloat(vg[j]);
    u[j] = In::ToFloat(vu[j]);
  }
}

template <typename In>
__device__ __forceinline__ float Hidden(float g, float u) {
  return __fmul_rn(__fmul_rn(g, Sigmoid(g)), u);
}

template <typename In>
__device__ __forceinline__ void SwigluAmaxes(const SwigluParams& p) {
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx * kSub;
  uint32_t amax[3] = {0, 0, 0};
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = row0 + ty * kSub + i;
    const int valid = Valid(row, col, p.rows, p.hidden);
    float g[kSub], u[kSub];
    LoadGateUp<In>(p, row, col, valid, g, u);
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if (j >= valid) continue;
      amax[0] = MaxAbs(amax[0], Hidden<In>(g[j], u[j]));
      amax[1] = MaxAbs(amax[1], g[j]);
      amax[2] = MaxAbs(amax[2], u[j]);
    }
  }
  MergeAmaxes<3>(amax, p.amaxes);
}

template <typename In, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void SwigluQuantize(const SwigluParams& p) {
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx * kSub;
  const float qh = Scalar(p.multipliers, 0, p.rows), qg = Scalar(p.multipliers, 1, p.rows),
              qu = Scalar(p.multipliers, 2, p.rows);
  const bool keep = p.g8 != nullptr;
  using F = Fp8<kFormat>;
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = row0 + ty * kSub + i;
    const int valid = Valid(row, col, p.rows, p.hidden);
    if (valid == 0) continue;
    float g[kSub], u[kSub];
    LoadGateUp<In>(p, row, col, valid, g, u);
    uint8_t h8[kSub], g8[kSub], u8[kSub];
#pragma unroll
    for (int j = 0; j < kSub; j += 2) {
      const uint16_t h2 = F::Encode2(__fmul_rn(Hidden<In>(g[j], u[j]), qh),
                                     __fmul_rn(Hidden<In>(g[j + 1], u[j + 1]), qh));
      const uint16_t g2 = F::Encode2(__fmul_rn(g[j], qg), __fmul_rn(g[j + 1], qg));
      const uint16_t u2 = F::Encode2(__fmul_rn(u[j], qu), __fmul_rn(u[j + 1], qu));
      h8[j] = h2 & 0xffu, h8[j + 1] = h2 >> 8;
      g8[j] = g2 & 0xffu, g8[j + 1] = g2 >> 8;
      u8[j] = u2 & 0xffu, u8[j + 1] = u2 >> 8;
    }
    Store8(p.h8, p.hidden, row, col, valid, p.vector_out, h8);
    if (keep) {
      Store8(p.g8, p.hidden, row, col, valid, p.vector_out, g8);
      Store8(p.u8, p.hidden, row, col, valid, p.vector_out, u8);
    }
  }
}

// dg and du of one thread's row segment, each rounded to the compute dtype (In), as float32.
template <typename In>
__device__ __forceinline__ void Gradients(const SwigluGradParams& p, int64_t row, int64_t col,
                                          int valid, float (&dg)[kSub], float (&du)[kSub]) {
  uint16_t vdh[kSub];
  uint8_t vg[kSub], vu[kSub];
  Load16(static_cast<const uint16_t*>(p.dh), p.hidden, row, col, valid, p.vector_in, vdh);
  Load8(p.g8, p.hidden, row, col, valid, p.vector_in, vg);
  Load8(p.u8, p.hidden, row, col, valid, p.vector_in, vu);
  const float g_scale = Scalar(p.scales, 0, p.rows), u_scale = Scalar(p.scales, 1, p.rows);
  const bool e5m2 = p.saved_e5m2;
#pragma unroll
  for (int j = 0; j < kSub; ++j) {
    const float g = __fmul_rn(DecodeFp8(vg[j], e5m2), g_scale);
    const float u = __fmul_rn(DecodeFp8(vu[j], e5m2), u_scale);
    const float dh = In::ToFloat(vdh[j]);
    const float s = Sigmoid(g);
    const float silu = __fmul_rn(g, s);
    // silu'(g) = s (1 + g (1 - s)), each operation rounded (no contraction into an FMA)
    const float dsilu = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, s))));
    dg[j] = In::Round(__fmul_rn(__fmul_rn(dh, u), dsilu));
    du[j] = In::Round(__fmul_rn(dh, silu));
  }
}

template <typename In>
__device__ __forceinline__ void SwigluGradAmax(const SwigluGradParams& p) {
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx * kSub;
  uint32_t amax[1] = {0};
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = row0 + ty * kSub + i;
    const int valid = Valid(row, col, p.rows, p.hidden);
    float dg[kSub], du[kSub];
    Gradients<In>(p, row, col, valid, dg, du);
#pragma unroll
    for (int j = 0; j < kSub; ++j) {
      if (j >= valid) continue;
      amax[0] = MaxAbs(MaxAbs(amax[0], dg[j]), du[j]);
    }
  }
  MergeAmaxes<1>(amax, p.amax);
}

template <typename In, __nv_fp8_interpretation_t kFormat>
__device__ __forceinline__ void SwigluGradQuantize(const SwigluGradParams& p) {
  __shared__ Stage stage;
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int64_t col = col0 + tx * kSub;
  const float q = Scalar(p.scales, 2, p.rows);
  uint8_t bg[kSub][kSub], bu[kSub][kSub];
#pragma unroll
  for (int i = 0; i < kSub; ++i) {
    const int64_t row = row0 + ty * kSub + i;
    const int valid = Valid(row, col, p.rows, p.hidden);
    float dg[kSub], du[kSub];
    Gradients<In>(p, row, col, valid, dg, du);
#pragma unroll
    for (int j = 0; j < kSub; j += 2) {
      const uint16_t g2 = Fp8<kFormat>::Encode2(__fmul_rn(dg[j], q), __fmul_rn(dg[j + 1], q));
      const uint16_t u2 = Fp8<kFormat>::Encode2(__fmul_rn(du[j], q), __fmul_rn(du[j + 1], q));
      bg[i][j] = g2 & 0xffu, bg[i][j + 1] = g2 >> 8;
      bu[i][j] = u2 & 0xffu, bu[i][j + 1] = u2 >> 8;
    }
    Store8(p.dgu8, 2 * p.hidden, row, col, valid, p.vector_out, bg[i]);
    Store8(p.dgu8, 2 * p.hidden, row, p.hidden + col, valid, p.vector_out, bu[i]);
  }
  StoreTransposed(stage, bg, p.dgu8t, col0, p.hidden - col0, row0, p.rows, p.vector_t);
  StoreTransposed(stage, bu, p.dgu8t, p.hidden + col0, p.hidden - col0, row0, p.rows,
                  p.vector_t);
}

}  // namespace
}  // namespace jax_epilog::fused

// The entry points, by unmangled name (fused_passes.cc looks them up): one per input dtype
// and FP8 output format.
#define JAX_EPILOG_KERNEL(name, Params, body)                                          \
  extern "C" __global__ void __launch_bounds__(jax_epilog::fused::kThreads) name(     \
      const jax_epilog::fused::Params p) {                                             \
    body(p);                                                                           \
  }

#define JAX_EPILOG_FORMATS(prefix, Params, Fn, In)                                     \
  JAX_EPILOG_KERNEL(prefix##_e4m3, Params, (jax_epilog::fused::Fn<jax_epilog::fused::In, \
                                                                  __NV_E4M3>))          \
  JAX_EPILOG_KERNEL(prefix##_e5m2, Params, (jax_epilog::fused::Fn<jax_epilog::fused::In, \
                                                                  __NV_E5M2>))

JAX_EPILOG_FORMATS(jax_epilog_cast_transpose_bf16, CastTransposeParams, CastTranspose, Bf16)
JAX_EPILOG_FORMATS(jax_epilog_cast_transpose_f16, CastTransposeParams, CastTranspose, F16)
JAX_EPILOG_FORMATS(jax_epilog_swiglu_quantize_bf16, SwigluParams, SwigluQuantize, Bf16)
JAX_EPILOG_FORMATS(jax_epilog_swiglu_quantize_f16, SwigluParams, SwigluQuantize, F16)
JAX_EPILOG_FORMATS(jax_epilog_swiglu_grad_quantize_bf16, SwigluGradParams, SwigluGradQuantize,
                   Bf16)
JAX_EPILOG_FORMATS(jax_epilog_swiglu_grad_quantize_f16, SwigluGradParams, SwigluGradQuantize,
                   F16)
JAX_EPILOG_KERNEL(jax_epilog_swiglu_amaxes_bf16, SwigluParams,
                  jax_epilog::fused::SwigluAmaxes<jax_epilog::fused::Bf16>)
JAX_EPILOG_KERNEL(jax_epilog_swiglu_amaxes_f16, SwigluParams,
                  jax_epilog::fused::SwigluAmaxes<jax_epilog::fused::F16>)
JAX_EPILOG_KERNEL(jax_epilog_swiglu_grad_amax_bf16, SwigluGradParams,
                  jax_epilog::fused::SwigluGradAmax<jax_epilog::fused::Bf16>)
JAX_EPILOG_KERNEL(jax_epilog_swiglu_grad_amax_f16, SwigluGradParams,
                  jax_epilog::fused::SwigluGradAmax<jax_epilog::fused::F16>)
