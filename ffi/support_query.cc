// C entry points for the Python side (ctypes): library versions and whether cuBLASLt
// supports a problem on a device. The lowering asks before emitting the custom call
// and routes what cuBLASLt cannot do (e.g. a backward epilog with K = 1) to plain XLA.
// None of them may crash: on a machine without a GPU or driver they report an error.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "plan.h"
#include "plan_cache.h"
#include "status.h"

namespace {

void CopyMessage(const std::string& text, char* message, size_t message_len) {
  if (message == nullptr || message_len == 0) return;
  const size_t n = text.size() < message_len - 1 ? text.size() : message_len - 1;
  std::memcpy(message, text.data(), n);
  message[n] = '\0';
}

int QuerySupport(int device, int epilog, int dtype, int dtype_b, int dtype_d, int amax,
                 int has_c, int transpose_a, int transpose_b, int64_t batch, int64_t batch_b,
                 int64_t batch_bias, int64_t m, int64_t n, int64_t k, int allow_tf32,
                 int fast_accumulation, int a_block_rows, int b_block_rows,
                 uint64_t workspace_bytes, std::string* message) {
  using jax_epilog::DType;
  for (int t : {dtype, dtype_b, dtype_d}) {
    if (t < 0 || t >= jax_epilog::kDTypeCount) {
      *message = "dtypes must be 0 (float16), 1 (bfloat16), 2 (float32), 3 (float8_e4m3fn) "
                 "or 4 (float8_e5m2), got " + std::to_string(t);
      return -1;
    }
  }
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    *message = jax_epilog::StatusName(e) + " while counting CUDA devices";
    return -1;
  }
  if (device < 0 || device >= count) {
    *message = "CUDA device " + std::to_string(device) + " does not exist (" +
               std::to_string(count) + " visible)";
    return -1;
  }
  jax_epilog::Problem p;
  p.device = device;
  p.epilog = epilog;
  p.dtype = static_cast<DType>(dtype);
  p.dtype_b = static_cast<DType>(dtype_b);
  p.dtype_d = static_cast<DType>(dtype_d);
  p.amax = amax != 0;
  p.has_c = has_c != 0;
  p.transpose_a = transpose_a != 0;
  p.transpose_b = transpose_b != 0;
  p.allow_tf32 = allow_tf32 != 0;
  p.fast_accumulation = fast_accumulation != 0;  // GetPlan keeps it for FP8 operands only
  p.a_block_rows = a_block_rows;
  p.b_block_rows = b_block_rows;
  p.batch = batch;
  p.batch_b = batch_b;
  p.batch_bias = batch_bias;
  p.m = m;
  p.n = n;
  p.k = k;
  p.workspace_bytes = workspace_bytes;
  // The pointer alignments (c's included) keep Problem's default, 256 bytes, what XLA's
  // buffers normally have; a call with less aligned buffers gets its own plan at run time.
  std::shared_ptr<jax_epilog::Plan> plan;
  const xla::ffi::Error error = jax_epilog::GetPlan(p, &plan);
  if (error.success()) return 1;
  *message = error.message();
  // Types cuBLASLt has no GEMM for (e5m2 x e5m2) are "unsupported" too.
  const bool unsupported = error.errc() == xla::ffi::ErrorCode::kUnimplemented ||
                           (error.errc() == xla::ffi::ErrorCode::kInvalidArgument &&
                            jax_epilog::IsFp8(p.dtype));
  return unsupported ? 0 : -1;
}

}  // namespace

// The cuBLASLt version number (e.g. 130100 for 13.1.0); needs no GPU.
JAX_EPILOG_EXPORT size_t jax_epilog_cublaslt_version(void) { return cublasLtGetVersion(); }

// Whether this build knows FP8 operands (the Python side asks before sending one).
JAX_EPILOG_EXPORT int jax_epilog_supports_fp8(void) { return 1; }

// The interface between this library and the Python package: the FFI targets' attributes and
// the ctypes entry points' arguments. Raised whenever either changes (2: the
// fast_accumulation attribute; 3: the block-scaled target and its query; 4: the fused
// FP8 passes' targets, fused_passes.cc), so the package
// refuses a library built from older sources
// (cuda_library.ABI_VERSION) instead of failing to decode its calls.
JAX_EPILOG_EXPORT int jax_epilog_abi_version(void) { return 4; }

// 1: cuBLASLt has an algorithm for the problem (its plan is now cached, so the first
// call does not pay for it); 0: it has none, `message` says why; -1: the question
// could not be answered (no driver or device, bad argument, a cuBLASLt failure),
// `message` says why. `dtype` (a's), `dtype_b`, `dtype_d` (y's): 0 float16, 1 bfloat16,
// 2 float32, 3 float8_e4m3fn, 4 float8_e5m2; `amax`: an FP8 call's result_amax.
// `has_c`: a call with a C matrix (device alpha and beta, the plan jax_epilog_matmul_c
// builds). `fast_accumulation`: cuBLASLt's FP8 fast accumulation (FP8 operands only;
// ignored for others). `a_block_rows`, `b_block_rows`: a block-scaled FP8 call's tile rows
// (1 or 128; 0 for both: scalar scales). `epilog` is the public value. Never throws.
JAX_EPILOG_EXPORT int jax_epilog_query_support(int device, int epilog, int dtype,
                                               int dtype_b, int dtype_d, int amax, int has_c,
                                               int transpose_a, int transpose_b,
                                               int64_t batch, int64_t batch_b,
                                               int64_t batch_bias, int64_t m, int64_t n,
                                               int64_t k, int allow_tf32,
                                               int fast_accumulation, int a_block_rows,
                                               int b_block_rows, uint64_t workspace_bytes, char* message,
                                               size_t message_len) {
  CopyMessage("", message, message_len);
  try {
    std::string text;
    const int answer = QuerySupport(device, epilog, dtype, dtype_b, dtype_d, amax, has_c,
                                    transpose_a, transpose_b, batch, batch_b, batch_bias, m, n, k,
                                    allow_tf32, fast_accumulation, a_block_rows, b_block_rows,
                                    workspace_bytes, &text);
    CopyMessage(text, message, message_len);
    return answer;
  } catch (const std::exception& e) {  // e.g. std::bad_alloc; must not cross into C
    CopyMessage(std::string("internal error: ") + e.what(), message, message_len);
    return -1;
  }
}
