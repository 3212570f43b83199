// The parameters of the fused FP8 passes' kernels (fused_kernels.cu), shared by the device
// code and the handlers that launch them (fused_passes.cc). Each kernel takes one of these
// structs by value, so a launch passes one argument whose layout both sides agree on.
//
// Every tensor is row-major and dense. A tile is kTile x kTile elements of the 16-bit input
// (rows x columns), one block of kThreads threads, each thread an 8 x 8 square of it.
#ifndef JAX_EPILOG_FFI_FUSED_PARAMS_H_
#define JAX_EPILOG_FFI_FUSED_PARAMS_H_

#include <cstdint>

namespace jax_epilog::fused {

constexpr int kThreads = 256;
constexpr int kTile = 128;
// The largest grid.y: tiles of rows.
constexpr int64_t kMaxRowTiles = 65535;

// cast-transpose: x (rows, cols) 16-bit -> y = Q(x) (rows, cols), yt = y^T (cols, rows), and
// amax |x| (as float bits: atomicMax on the bits of non-negative floats orders as the floats).
struct CastTransposeParams {
  const void* x;
  const float* multiplier;  // q: y = saturate(x * q) rounded to the FP8 format
  uint8_t* y;
  uint8_t* yt;
  unsigned int* amax;
  int64_t rows;
  int64_t cols;
  int vector_in;   // 16-byte loads of x (cols % 8 == 0, x 16-byte aligned)
  int vector_out;  // 8-byte stores of y (cols % 8 == 0, y 8-byte aligned)
  int vector_t;    // 8-byte stores of yt (rows % 8 == 0, yt 8-byte aligned)
};

// SwiGLU forward from gu = [g u] (rows, 2F) 16-bit, h = silu(g) u in float32:
// amax pass: amaxes[0..2] = amax |h|, |g|, |u|;
// quantize pass: h8, and (keep) g8, u8, each (rows, F), with multipliers q[0..2].
struct SwigluParams {
  const void* gu;
  const float* multipliers;  // (3,): h's, g's, u's
  uint8_t* h8;
  uint8_t* g8;  // null: not written
  uint8_t* u8;
  unsigned int* amaxes;  // (3,) amax pass only
  int64_t rows;
  int64_t hidden;  // F
  int vector_in;   // F % 8 == 0 and gu 16-byte aligned
  int vector_out;  // F % 8 == 0 and the outputs 8-byte aligned
};

// SwiGLU backward: dh (rows, F) 16-bit, g8, u8 (rows, F) FP8 (saved_e5m2: their format) with
// dequantization scales; dg = dh u silu'(g), du = dh silu(g), each rounded to dh's dtype;
// amax pass: amax |[dg du]|; quantize pass: dgu8 = Q([dg du]) (rows, 2F) and dgu8^T (2F, rows).
struct SwigluGradParams {
  const void* dh;
  const uint8_t* g8;
  const uint8_t* u8;
  const float* scales;  // (3,): g's and u's dequantization scales, [dg du]'s multiplier
  uint8_t* dgu8;
  uint8_t* dgu8t;
  unsigned int* amax;  // amax pass only
  int64_t rows;
  int64_t hidden;
  int saved_e5m2;
  int vector_in;   // F % 8 == 0, dh 16-byte and g8, u8 8-byte aligned
  int vector_out;  // F % 8 == 0 and dgu8 8-byte aligned
  int vector_t;    // rows % 8 == 0 and dgu8t 8-byte aligned
};

}  // namespace jax_epilog::fused

#endif  // JAX_EPILOG_FFI_FUSED_PARAMS_H_
