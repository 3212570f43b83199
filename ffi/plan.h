// Matmul plans: the problem a plan is keyed by, the plan, and what is done with one.
//
// A plan is everything cuBLASLt needs for one problem except the data pointers: the
// matmul descriptor, the matrix layouts and the algorithm the heuristic chose. It is
// built once per problem (host-only work: no device allocation, no stream work) and
// reused by every call; a call only sets its bias / aux pointers (when they differ from
// the previous call's) and enqueues. The cache of plans is plan_cache.h; autotuning
// (autotune.h) works on a plan too, so this header depends on neither.
#ifndef JAX_EPILOG_FFI_PLAN_H_
#define JAX_EPILOG_FFI_PLAN_H_

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "epilogs.h"
#include "status.h"

namespace jax_epilog {

// log2 of the alignment cuBLASLt can rely on for a pointer whose batches start
// `batch_stride_bytes` apart, capped at 256 bytes (cuBLASLt's largest requirement
// and its default assumption).
uint8_t AlignmentLog2(const void* ptr, int64_t batch_stride_bytes);

// Everything a plan depends on. Pointer alignments are part of it because the
// heuristic picks algorithms for the alignment it is told.
struct Problem {
  int device = 0;  // CUDA device ordinal
  int32_t epilog = kDefaultEpilog;
  DType dtype = DType::kF32;    // a's; also b's and y's unless a is FP8
  DType dtype_b = DType::kF32;  // b's (FP8 operands may differ: e4m3 x e5m2)
  DType dtype_d = DType::kF32;  // y's (FP8 operands: 16/32-bit or FP8)
  bool amax = false;            // FP8 only: max |R| written (AMAX_D_POINTER)
  // A C matrix of its own (R = alpha P + beta C; the target jax_epilog_matmul_c): alpha and
  // beta are device scalars (CUBLASLT_POINTER_MODE_DEVICE), C has D's layout and type.
  bool has_c = false;
  bool transpose_a = false;
  bool transpose_b = false;
  bool allow_tf32 = false;  // normalised to false unless dtype is kF32
  // FP8 only (normalised to false otherwise, like allow_tf32): cuBLASLt's FP8 fast
  // accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM), partial sums not periodically promoted
  // to float32: faster, less accurate.
  bool fast_accumulation = false;
  // Block-scaled FP8 only (the target jax_epilog_matmul_block): the rows of a's and b's
  // scale tiles, 1 (1x128 tiles, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F) or 128 (128x128
  // blocks, _BLK128x128_32F), or kRowScales for both (one scale per row of each operand,
  // _OUTER_VEC_32F); 0 for both: per-tensor scalar scales.
  int32_t a_block_rows = 0, b_block_rows = 0;
  bool block_scaled() const { return a_block_rows != 0; }
  int64_t batch = 1, batch_b = 1, batch_bias = 1;
  int64_t m = 0, n = 0, k = 0;
  uint64_t workspace_bytes = 0;
  uint8_t align_a = 8, align_b = 8, align_y = 8, align_bias = 8, align_aux = 8;
  uint8_t align_c = 8;  // has_c only

  bool operator==(const Problem& o) const;
  std::string ToString() const;
};

// The `a_block_rows` / `b_block_rows` of row scales: one scale per row of the operand.
constexpr int32_t kRowScales = -1;

// The shape of a block-scale tensor (jax_epilog_matmul_block) of an operand with `rows` rows
// and K columns, in cuBLASLt's layout, row-major float32: 1x128 tiles (block_rows 1) as
// (K/128, rows rounded up to 4), 128x128 blocks as (ceil(rows/128), K/128 rounded up to 4),
// row scales (kRowScales) as (1, rows).
struct BlockScaleShape {
  int64_t outer = 0, inner = 0;
  BlockScaleShape(int32_t block_rows, int64_t rows, int64_t k) {
    auto round4 = [](int64_t x) { return (x + 3) / 4 * 4; };
    if (block_rows == kRowScales) {
      outer = 1;
      inner = rows;
      return;
    }
    outer = block_rows == 1 ? k / 128 : (rows + 127) / 128;
    inner = block_rows == 1 ? round4(rows) : round4(k / 128);
  }
  int64_t elements() const { return outer * inner; }
};

struct ProblemHash {
  size_t operator()(const Problem& p) const;
};

// Owners of cuBLASLt's opaque descriptors: each is destroyed with its own function.
template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
struct CublasDestroy {
  void operator()(Handle handle) const { Destroy(handle); }
};
template <typename Handle, cublasStatus_t (*Destroy)(Handle)>
using CublasOwner = std::unique_ptr<std::remove_pointer_t<Handle>, CublasDestroy<Handle, Destroy>>;
using MatmulDesc = CublasOwner<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using MatrixLayout = CublasOwner<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using MatmulPreference =
    CublasOwner<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

struct Plan {
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  int device = 0;
  cublasLtHandle_t handle = nullptr;  // per device, lives as long as the process
  MatmulDesc desc;
  // cuBLASLt's A is our b and its B our a (row-major Y = A B is column-major
  // Y^T = B^T A^T). C and D share one layout (C is the call's c, or without one aliases
  // D with beta = 0). An FP8 y is the exception: cuBLASLt has no FP8 C type, so its C
  // (never read: beta is 0, the pointer is null; never with c) has a layout of its own,
  // of type AuxDType(y) = bfloat16.
  MatrixLayout layout_a;
  MatrixLayout layout_b;
  MatrixLayout layout_cd;
  MatrixLayout layout_c;  // an FP8 y only
  cublasLtMatrixLayout_t c_layout() const {
    return layout_c ? layout_c.get() : layout_cd.get();
  }
  cublasLtMatmulAlgo_t algo{};  // the heuristic's first, until autotuned
  // True once `algo` was chosen by timing candidates or taken from the on-disk cache
  // (autotune.h), so it is not tuned again. Guarded by `mutex`.
  bool tuned = false;
  Problem problem;          // the key the plan was built for
  std::string description;  // Problem::ToString, for error messages
  bool sets_bias_pointer = false;
  bool sets_aux_pointer = false;
  bool sets_scale_pointers = false;  // FP8 operands: a's and b's scales
  bool sets_d_scale = false;         // an FP8 y: its scale
  bool sets_amax = false;
  // The bias / aux / scale / amax pointers on the descriptor (valid once `pointers_set`),
  // so that a call with the same buffers as the last skips setting them. Guarded by
  // `mutex`.
  bool pointers_set = false;
  const void* bias_pointer = nullptr;
  const void* aux_pointer = nullptr;
  const void* scale_pointers[3] = {nullptr, nullptr, nullptr};  // a, b, d
  const void* amax_pointer = nullptr;
  // The pointers of a call live on the shared descriptor, so setting them and
  // enqueueing the matmul (or tuning) must not interleave with another call of this plan.
  std::mutex mutex;
  // How recently the plan was looked up, for eviction (plan_cache.cc).
  std::atomic<uint64_t> last_used{0};
};

// kInvalidArgument unless `p` is a problem cuBLASLt can be asked about (a known epilog,
// no zero size, batches and types that fit together); the message names the problem.
ffi::Error CheckProblem(const Problem& p);

// Builds the plan for `p` (checked by CheckProblem) with the device's `handle`, choosing
// the heuristic's first algorithm. The caller has made p.device current. Errors:
// kUnimplemented when cuBLASLt has no algorithm for the problem (message: why),
// kFailedPrecondition for a CUDA failure, kInternal for any other cuBLASLt failure.
ffi::Error BuildPlan(const Problem& p, cublasLtHandle_t handle, Plan* plan);

// The data of one call, in our (row-major) naming.
struct CallBuffers {
  const void* a = nullptr;
  const void* b = nullptr;
  void* y = nullptr;
  void* bias = nullptr;  // bias input or bias-gradient output, when the epilog has one
  void* aux = nullptr;   // aux input or output, when the epilog has one
  // FP8 calls: device pointers to float32 scalars (XLA buffers), or for a block-scaled
  // call to its scale tensors (cuBLASLt's layouts: epilog_matmul.cc's DecodeBlockScale).
  const void* scale_a = nullptr;
  const void* scale_b = nullptr;
  const void* scale_d = nullptr;  // an FP8 y only
  void* amax = nullptr;           // with result_amax only
  // Calls with a C matrix: c (y's shape and type) and the float32 scalars alpha, beta.
  const void* c = nullptr;
  const void* alpha = nullptr;
  const void* beta = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// Enqueues the plan's matmul on `stream` (after zeroing the amax, when the call has one).
// The plan's device is current (a call's plan is the one for the device current in the
// call). Never allocates and never synchronises.
// Fails instead, with CUBLAS_STATUS_EXECUTION_FAILED, while failures are injected
// (fault_injection.h).
ffi::Error RunPlan(Plan& plan, const CallBuffers& buffers, cudaStream_t stream);

// The helpers below change the plan's descriptor: the caller holds plan.mutex and has
// made plan.device current.

// Up to `max_count` algorithms for the plan's problem, cuBLASLt's heuristic's best
// first. Errors as BuildPlan's; never empty on success.
ffi::Error HeuristicCandidates(Plan& plan, int max_count,
                               std::vector<cublasLtMatmulHeuristicResult_t>* candidates);

// Whether `algo` can run the plan's problem within its workspace (e.g. one read back
// from disk, possibly written by another cuBLASLt version).
bool AlgoFits(Plan& plan, const cublasLtMatmulAlgo_t& algo);

// Sets the bias / aux / scale / amax pointers of a call on the plan's descriptor (unless
// already there).
ffi::Error SetCallPointers(Plan& plan, const CallBuffers& buffers);

// Enqueues one cublasLtMatmul with `algo` (after SetCallPointers).
cublasStatus_t Enqueue(Plan& plan, const CallBuffers& buffers, const cublasLtMatmulAlgo_t& algo,
                       cudaStream_t stream);

// Makes `device` current for the scope (cuBLASLt handles are created for, and
// kernels launched on, the current device) and restores the previous one after.
class ScopedDevice {
 public:
  ScopedDevice() = default;
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;
  ~ScopedDevice();
  ffi::Error Enter(int device);

 private:
  int previous_ = -1;
};

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_PLAN_H_
