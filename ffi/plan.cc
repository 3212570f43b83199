#include "plan.h"

#include <algorithm>
#include <climits>
#include <mutex>
#include <tuple>
#include <vector>

#include "fault_injection.h"

namespace jax_epilog {
namespace {

const char* DTypeName(DType t) {
  switch (t) {
    case DType::kF16:
      return "float16";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF32:
      return "float32";
    case DType::kE4M3:
      return "float8_e4m3fn";
    case DType::kE5M2:
      return "float8_e5m2";
  }
  return "?";
}

// `problem` (Problem::ToString) goes into the message only on failure.
template <typename T>
ffi::Error SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                   const T& value, const char* name, const std::string& problem) {
  JAX_EPILOG_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)),
                    std::string("setting ") + name + " for " + problem);
  return ffi::Error::Success();
}

template <typename T>
ffi::Error SetLayout(cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t attr,
                     const T& value, const char* name, const std::string& problem) {
  JAX_EPILOG_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, attr, &value, sizeof(value)),
                    std::string("setting ") + name + " for " + problem);
  return ffi::Error::Success();
}

// A column-major `rows x cols` layout with `batch` matrices `stride` elements apart.
ffi::Error MakeLayout(MatrixLayout* layout, cudaDataType_t type, int64_t rows, int64_t cols,
                      int64_t ld, int64_t batch, int64_t stride, const char* name,
                      const std::string& problem) {
  cublasLtMatrixLayout_t created = nullptr;
  JAX_EPILOG_CUBLAS(cublasLtMatrixLayoutCreate(&created, type, static_cast<uint64_t>(rows),
                                               static_cast<uint64_t>(cols), ld),
                    std::string("creating the layout of ") + name + " for " + problem);
  layout->reset(created);
  const int32_t count = static_cast<int32_t>(batch);
  JAX_EPILOG_RETURN_IF_ERROR(SetLayout(created, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, count,
                                       "CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT", problem));
  return SetLayout(created, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, stride,
                   "CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET", problem);
}

// The epilog's attributes on the plan's descriptor: the bias (or bias gradient) and aux
// batch strides and the aux leading dimension.
ffi::Error SetEpilogAttributes(const Problem& p, const EpilogInfo& epilog, Plan* plan) {
  cublasLtMatmulDesc_t desc = plan->desc.get();
  const std::string& problem = plan->description;
  const int64_t bias_grad = epilog.BiasGradLength(p.m, p.n);
  if (epilog.bias_in || bias_grad > 0) {
    plan->sets_bias_pointer = true;
    // The bias runs along cuBLASLt's rows (our N); a shared bias has batch stride 0.
    // A bias gradient is one vector per batch.
    const int64_t stride = epilog.bias_in ? (p.batch_bias > 1 ? p.n : 0) : bias_grad;
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, stride,
                                       "CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE", problem));
  }
  // FP8 operands (SPEC §5): the bias / bias gradient and the GELU buffer have the aux
  // type (bfloat16 for an FP8 y), set explicitly: cuBLASLt's defaults follow D (or, for
  // some FP8 kernels, differ), which would not match our buffers. The scale and amax
  // pointers are a call's (SetCallPointers); 16/32-bit operands keep the defaults.
  if (IsFp8(p.dtype)) {
    plan->sets_scale_pointers = true;
    plan->sets_d_scale = IsFp8(p.dtype_d);
    plan->sets_amax = p.amax;
    const int32_t aux_type = CudaType(AuxDType(p.dtype_d));
    if (epilog.bias_in || bias_grad > 0)
      JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, aux_type,
                                         "CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE", problem));
    if (epilog.aux() == Aux::kGelu)
      JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                         aux_type, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE",
                                         problem));
  }
  if (const Aux aux = epilog.aux(); aux != Aux::kNone) {
    plan->sets_aux_pointer = true;
    // cuBLASLt requires the ReLU mask's leading dimension (in bits) to be a multiple
    // of 128 and the GELU input's (in elements) a multiple of 8, both at least its
    // row count (our N); the batch strides must be multiples of the same.
    const int64_t ld = (aux == Aux::kRelu ? 8 : 1) * AuxRow(aux, p.n);
    const int64_t stride = ld * p.m;
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld,
                                       "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD", problem));
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE,
                                       stride, "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE",
                                       problem));
  }
  return ffi::Error::Success();
}

// The layouts of cuBLASLt's A (our b), B (our a) and C = D (our y); C of its own type for
// an FP8 y. FP8 kernels take only op(A) = T, op(B) = N ("TN", both operands K-major): in
// our naming a (M, K) and b (N, K), which the Python lowering arranges (lowering.py).
ffi::Error MakeLayouts(const Problem& p, Plan* plan) {
  const std::string& problem = plan->description;
  // Row-major (rows, cols) is column-major cols x rows with ld = cols.
  // cuBLASLt A = our b: (K, N) row-major is N x K, op N; (N, K) is K x N, op T.
  JAX_EPILOG_RETURN_IF_ERROR(MakeLayout(
      &plan->layout_a, CudaType(p.dtype_b), p.transpose_b ? p.k : p.n,
      p.transpose_b ? p.n : p.k, p.transpose_b ? p.k : p.n, p.batch,
      p.batch_b > 1 ? p.n * p.k : 0, "b", problem));
  // cuBLASLt B = our a: (M, K) row-major is K x M, op N; (K, M) is M x K, op T.
  JAX_EPILOG_RETURN_IF_ERROR(MakeLayout(
      &plan->layout_b, CudaType(p.dtype), p.transpose_a ? p.m : p.k, p.transpose_a ? p.k : p.m,
      p.transpose_a ? p.m : p.k, p.batch, p.m * p.k, "a", problem));
  // cuBLASLt D = our y: (M, N) row-major is N x M.
  JAX_EPILOG_RETURN_IF_ERROR(MakeLayout(&plan->layout_cd, CudaType(p.dtype_d), p.n, p.m, p.n,
                                        p.batch, p.m * p.n, "y", problem));
  if (!IsFp8(p.dtype_d)) return ffi::Error::Success();
  return MakeLayout(&plan->layout_c, CudaType(AuxDType(p.dtype_d)), p.n, p.m, p.n, p.batch,
                    p.m * p.n, "C", problem);
}

// Block scaling (docs/fp8.md, "Block scaling"): FP8 operands in the TN layout (a (M, K), b
// (N, K)), K a multiple of 128, one GEMM, a 16/32-bit y without C or amax, tiles of 1 or
// 128 rows and not both 128 (cuBLASLt has no 128x128 by 128x128 kernel). Row scales
// ("Row scaling"): both operands', any K, fast accumulation allowed, the epilog left to
// cuBLASLt.
ffi::Error CheckBlockScaling(const Problem& p) {
  if (p.a_block_rows == 0 && p.b_block_rows == 0) return ffi::Error::Success();
  if (p.a_block_rows == kRowScales || p.b_block_rows == kRowScales) {
    if (p.a_block_rows != p.b_block_rows || !IsFp8(p.dtype) || IsFp8(p.dtype_d) || p.amax ||
        p.has_c || p.transpose_a || !p.transpose_b || p.batch != 1 || p.batch_b != 1)
      return ffi::Error::InvalidArgument(
          "row scales take both operands' rows scaled, FP8 a (M, K) and b (N, K), batch 1 "
          "and a 16/32-bit y without C or amax: " + p.ToString());
    return ffi::Error::Success();
  }
  auto tile = [](int32_t rows) { return rows == 1 || rows == 128; };
  if (!tile(p.a_block_rows) || !tile(p.b_block_rows) ||
      (p.a_block_rows == 128 && p.b_block_rows == 128) || !IsFp8(p.dtype) ||
      IsFp8(p.dtype_d) || p.amax || p.has_c || p.fast_accumulation || p.transpose_a ||
      !p.transpose_b || p.k % 128 != 0 || p.batch != 1 || p.batch_b != 1)
    return ffi::Error::InvalidArgument(
        "block scaling takes tiles of 1 or 128 rows (not both 128), FP8 a (M, K) and b (N, K) "
        "with K a multiple of 128, batch 1 and a 16/32-bit y without C, amax or fast "
        "accumulation: " + p.ToString());
  return ffi::Error::Success();
}

// The block scale modes on the descriptor (cuBLASLt's A is our b). Headers before 12.9 have
// no such modes: the plan is then unsupported, and the Python side runs the reference.
ffi::Error SetBlockScaleModes(const Problem& p, cublasLtMatmulDesc_t desc,
                              const std::string& problem) {
#if CUBLAS_VERSION >= 120900
  auto mode = [](int32_t rows) {
    return int32_t{rows == kRowScales ? CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F
                   : rows == 1        ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                                      : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F};
  };
  JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                     mode(p.b_block_rows), "CUBLASLT_MATMUL_DESC_A_SCALE_MODE",
                                     problem));
  return SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode(p.a_block_rows),
                 "CUBLASLT_MATMUL_DESC_B_SCALE_MODE", problem);
#else
  (void)p;
  (void)desc;
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "block scaling needs cuBLASLt 12.9 or later at build time: " + problem);
#endif
}

}  // namespace

ffi::Error CheckProblem(const Problem& p) {
  if (FindEpilog(p.epilog) == nullptr)
    return ffi::Error::InvalidArgument("unknown epilog " + std::to_string(p.epilog));
  if (p.batch <= 0 || p.m <= 0 || p.n <= 0 || p.k <= 0)
    return ffi::Error::InvalidArgument(
        "zero-sized problems are handled before cuBLASLt and must not reach it: " +
        p.ToString());
  if (p.batch > INT32_MAX)
    return ffi::Error::InvalidArgument("batch exceeds cuBLASLt's int32 batch count: " +
                                       p.ToString());
  if ((p.batch_b != 1 && p.batch_b != p.batch) ||
      (p.batch_bias != 1 && p.batch_bias != p.batch))
    return ffi::Error::InvalidArgument("batch_b and batch_bias must be 1 or batch: " +
                                       p.ToString());
  if (p.device < 0)
    return ffi::Error::InvalidArgument("negative device ordinal: " + p.ToString());
  // Types: 16/32-bit operands give their own type and no amax; FP8 operands are both
  // FP8, not both e5m2 (cuBLASLt has no such GEMM), and give any result type.
  const bool fp8 = IsFp8(p.dtype);
  if (fp8 != IsFp8(p.dtype_b) || (!fp8 && (p.dtype_b != p.dtype || p.dtype_d != p.dtype)) ||
      (!fp8 && p.amax) || (p.dtype == DType::kE5M2 && p.dtype_b == DType::kE5M2))
    return ffi::Error::InvalidArgument(
        "a, b and y types: 16/32-bit operands of one type give that type (and no amax); FP8 "
        "operands are both FP8, not both e5m2: " + p.ToString());
  // The C of an FP8 y is 16-bit (AuxDType), a type the public API does not offer for c.
  if (p.has_c && IsFp8(p.dtype_d))
    return ffi::Error::InvalidArgument("a C matrix with an FP8 y is not supported: " +
                                       p.ToString());
  return CheckBlockScaling(p);
}

ffi::Error BuildPlan(const Problem& p, cublasLtHandle_t handle, Plan* plan) {
  plan->problem = p;
  plan->description = p.ToString();
  const std::string& problem = plan->description;
  const EpilogInfo& epilog = *FindEpilog(p.epilog);  // CheckProblem made sure
  plan->device = p.device;
  plan->handle = handle;

  const cublasComputeType_t compute = p.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32
                                                   : CUBLAS_COMPUTE_32F;
  cublasLtMatmulDesc_t desc = nullptr;
  JAX_EPILOG_CUBLAS(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F),
                    "creating the matmul descriptor for " + problem);
  plan->desc.reset(desc);

  // Transposes are expressed only through the descriptor: nothing is ever copied.
  const int32_t op_a = p.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_b = p.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const uint32_t epilogue = epilog.cublaslt;
  JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a,
                                     "CUBLASLT_MATMUL_DESC_TRANSA", problem));
  JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b,
                                     "CUBLASLT_MATMUL_DESC_TRANSB", problem));
  JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue,
                                     "CUBLASLT_MATMUL_DESC_EPILOGUE", problem));
  JAX_EPILOG_RETURN_IF_ERROR(SetEpilogAttributes(p, epilog, plan));
  // FP8 fast accumulation (GetPlan keeps it only for FP8 operands); unset is cuBLASLt's
  // default, float32 promotion of the partial sums.
  if (p.fast_accumulation)
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, int8_t{1},
                                       "CUBLASLT_MATMUL_DESC_FAST_ACCUM", problem));
  if (p.block_scaled()) JAX_EPILOG_RETURN_IF_ERROR(SetBlockScaleModes(p, desc, problem));
  // A call with c passes alpha and beta as device pointers (its traced operands), so new
  // values need no new plan; calls without c keep the host constants 1 and 0 (Enqueue).
  if (p.has_c)
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE,
                                       int32_t{CUBLASLT_POINTER_MODE_DEVICE},
                                       "CUBLASLT_MATMUL_DESC_POINTER_MODE", problem));
  JAX_EPILOG_RETURN_IF_ERROR(MakeLayouts(p, plan));

  std::vector<cublasLtMatmulHeuristicResult_t> results;
  JAX_EPILOG_RETURN_IF_ERROR(HeuristicCandidates(*plan, 1, &results));
  plan->algo = results[0].algo;
  // cuBLASLt documents unsupported FP8 scale / amax / type combinations as rejected by
  // cublasLtMatmul (CUBLAS_STATUS_INVALID_VALUE), and an algorithm need not take device
  // pointers for alpha and beta (CUBLASLT_ALGO_CAP_POINTER_MODE_MASK); checking the chosen
  // algorithm against the whole descriptor now turns such a problem into "unsupported" at
  // lowering time (the reference) rather than a failure at run time.
  if ((IsFp8(p.dtype) || p.has_c) && !AlgoFits(*plan, plan->algo))
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "cublasLtMatmulAlgoCheck rejects the heuristic's algorithm for " + problem);
  return ffi::Error::Success();
}

uint8_t AlignmentLog2(const void* ptr, int64_t batch_stride_bytes) {
  const uint64_t bits = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ptr)) |
                        static_cast<uint64_t>(batch_stride_bytes) | uint64_t{256};
  return static_cast<uint8_t>(__builtin_ctzll(bits));
}

bool Problem::operator==(const Problem& o) const {
  auto fields = [](const Problem& p) {
    return std::tie(p.device, p.epilog, p.dtype, p.dtype_b, p.dtype_d, p.amax, p.has_c,
                    p.transpose_a, p.transpose_b, p.allow_tf32, p.fast_accumulation,
                    p.a_block_rows, p.b_block_rows, p.batch,
                    p.batch_b, p.batch_bias, p.m, p.n, p.k, p.workspace_bytes, p.align_a,
                    p.align_b, p.align_y, p.align_bias, p.align_aux, p.align_c);
  };
  return fields(*this) == fields(o);
}

std::string Problem::ToString() const {
  auto align = [](uint8_t log2) { return std::to_string(1u << log2); };
  return std::string("epilog ") + EpilogName(epilog) + " (" + std::to_string(epilog) +
         "), " + DTypeName(dtype) +
         (IsFp8(dtype) ? std::string(" x ") + DTypeName(dtype_b) + " -> " + DTypeName(dtype_d) +
                             (amax ? " with amax" : "")
                       : std::string()) +
         (allow_tf32 ? " (tf32)" : "") + (fast_accumulation ? " (fast accumulation)" : "") +
         (a_block_rows == kRowScales ? std::string(" (row scales)")
          : block_scaled() ? " (block scales: a " + std::to_string(a_block_rows) + "x128, b " +
                                 std::to_string(b_block_rows) + "x128)"
                           : std::string()) +
         (has_c ? ", with C (device alpha, beta)" : "") +
         ", batch=" + std::to_string(batch) + " batch_b=" + std::to_string(batch_b) +
         " batch_bias=" + std::to_string(batch_bias) + ", M=" + std::to_string(m) +
         " N=" + std::to_string(n) + " K=" + std::to_string(k) +
         ", transpose_a=" + (transpose_a ? "true" : "false") +
         " transpose_b=" + (transpose_b ? "true" : "false") +
         ", workspace=" + std::to_string(workspace_bytes) +
         " bytes, alignment a/b/y/bias/aux=" + align(align_a) + "/" + align(align_b) + "/" +
         align(align_y) + "/" + align(align_bias) + "/" + align(align_aux) +
         (has_c ? ", alignment c=" + align(align_c) : std::string()) +
         ", CUDA device " + std::to_string(device);
}

size_t ProblemHash::operator()(const Problem& p) const {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  };
  mix(static_cast<uint64_t>(p.device) | uint64_t{static_cast<uint16_t>(p.a_block_rows)} << 32 |
      uint64_t{static_cast<uint16_t>(p.b_block_rows)} << 48);
  mix(static_cast<uint64_t>(p.epilog));
  mix(static_cast<uint64_t>(p.dtype_b) | uint64_t{static_cast<uint8_t>(p.dtype_d)} << 8 |
      uint64_t{p.amax} << 16 | uint64_t{p.has_c} << 17 | uint64_t{p.fast_accumulation} << 18 |
      uint64_t{p.align_c} << 24);
  mix(static_cast<uint64_t>(p.dtype) | uint64_t{p.transpose_a} << 8 |
      uint64_t{p.transpose_b} << 9 | uint64_t{p.allow_tf32} << 10 |
      uint64_t{p.align_a} << 16 | uint64_t{p.align_b} << 24 | uint64_t{p.align_y} << 32 |
      uint64_t{p.align_bias} << 40 | uint64_t{p.align_aux} << 48);
  for (int64_t v : {p.batch, p.batch_b, p.batch_bias, p.m, p.n, p.k})
    mix(static_cast<uint64_t>(v));
  mix(p.workspace_bytes);
  return static_cast<size_t>(h);
}

ScopedDevice::~ScopedDevice() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

ffi::Error ScopedDevice::Enter(int device) {
  int current = -1;
  JAX_EPILOG_CUDA(cudaGetDevice(&current), "querying the current CUDA device");
  if (current != device) {
    JAX_EPILOG_CUDA(cudaSetDevice(device),
                    "making CUDA device " + std::to_string(device) + " current");
    previous_ = current;
  }
  return ffi::Error::Success();
}

// The heuristic does not dereference the bias / aux pointers but reads their
// alignment off their value, so it is shown stand-ins with the plan's alignments. The
// FP8 scale and amax pointers are shown non-null stand-ins (a call's never are null:
// which kernels apply depends on whether they are set).
ffi::Error SetStandInPointers(Plan& plan) {
  CallBuffers stand_ins;
  stand_ins.bias = reinterpret_cast<void*>(uintptr_t{1} << plan.problem.align_bias);
  stand_ins.aux = reinterpret_cast<void*>(uintptr_t{1} << plan.problem.align_aux);
  void* scalar = reinterpret_cast<void*>(uintptr_t{256});
  stand_ins.scale_a = stand_ins.scale_b = stand_ins.scale_d = scalar;
  stand_ins.amax = scalar;
  return SetCallPointers(plan, stand_ins);
}

ffi::Error HeuristicCandidates(Plan& plan, int max_count,
                               std::vector<cublasLtMatmulHeuristicResult_t>* candidates) {
  const Problem& p = plan.problem;
  const std::string where = " for " + plan.description;
  JAX_EPILOG_RETURN_IF_ERROR(SetStandInPointers(plan));
  cublasLtMatmulPreference_t raw_preference = nullptr;
  JAX_EPILOG_CUBLAS(cublasLtMatmulPreferenceCreate(&raw_preference),
                    "creating the matmul preference" + where);
  MatmulPreference preference(raw_preference);
  const uint64_t workspace = p.workspace_bytes;
  JAX_EPILOG_CUBLAS(
      cublasLtMatmulPreferenceSetAttribute(preference.get(),
                                           CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace, sizeof(workspace)),
      "setting CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES" + where);
  const struct {
    cublasLtMatmulPreferenceAttributes_t attr;
    uint8_t log2;
  } alignments[] = {{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align_b},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align_a},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.has_c ? p.align_c : p.align_y},
                    {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align_y}};
  for (const auto& alignment : alignments) {
    const uint32_t bytes = uint32_t{1} << alignment.log2;
    JAX_EPILOG_CUBLAS(cublasLtMatmulPreferenceSetAttribute(preference.get(), alignment.attr,
                                                           &bytes, sizeof(bytes)),
                      "setting a CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT attribute" + where);
  }

  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(max_count));
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      plan.handle, plan.desc.get(), plan.layout_a.get(), plan.layout_b.get(),
      plan.c_layout(), plan.layout_cd.get(), preference.get(), max_count, results.data(),
      &found);
  // The heuristic answers NOT_SUPPORTED or INVALID_VALUE for configurations the
  // library does not implement (e.g. BGRADA with op(A) = T, K = 1 with DRELU), so
  // both mean "unsupported" here; the problem itself was validated above.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE)
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      StatusName(status) + " from cublasLtMatmulAlgoGetHeuristic" + where);
  JAX_EPILOG_CUBLAS(status, "running cublasLtMatmulAlgoGetHeuristic" + where);
  candidates->clear();
  for (int i = 0; i < found; ++i)
    if (results[i].state == CUBLAS_STATUS_SUCCESS) candidates->push_back(results[i]);
  if (candidates->empty())
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "no algorithm: cuBLASLt's heuristic returned none" + where);
  return ffi::Error::Success();
}

bool AlgoFits(Plan& plan, const cublasLtMatmulAlgo_t& algo) {
  if (!SetStandInPointers(plan).success()) return false;
  cublasLtMatmulHeuristicResult_t result{};
  const cublasStatus_t status = cublasLtMatmulAlgoCheck(
      plan.handle, plan.desc.get(), plan.layout_a.get(), plan.layout_b.get(),
      plan.c_layout(), plan.layout_cd.get(), &algo, &result);
  return status == CUBLAS_STATUS_SUCCESS &&
         result.workspaceSize <= plan.problem.workspace_bytes;
}

ffi::Error SetCallPointers(Plan& plan, const CallBuffers& buffers) {
  const void* scales[3] = {buffers.scale_a, buffers.scale_b, buffers.scale_d};
  if (plan.pointers_set && buffers.bias == plan.bias_pointer && buffers.aux == plan.aux_pointer &&
      std::equal(scales, scales + 3, plan.scale_pointers) && buffers.amax == plan.amax_pointer)
    return ffi::Error::Success();
  plan.pointers_set = false;  // until all are set
  // cuBLASLt's A is our b: its A scale is b's, its B scale a's.
  const struct {
    bool set;
    cublasLtMatmulDescAttributes_t attr;
    const void* pointer;
    const char* name;
  } scalars[] = {
      {plan.sets_scale_pointers, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, buffers.scale_b,
       "CUBLASLT_MATMUL_DESC_A_SCALE_POINTER"},
      {plan.sets_scale_pointers, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, buffers.scale_a,
       "CUBLASLT_MATMUL_DESC_B_SCALE_POINTER"},
      {plan.sets_d_scale, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, buffers.scale_d,
       "CUBLASLT_MATMUL_DESC_D_SCALE_POINTER"},
      {plan.sets_amax, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, buffers.amax,
       "CUBLASLT_MATMUL_DESC_AMAX_D_POINTER"}};
  for (const auto& scalar : scalars)
    if (scalar.set)
      JAX_EPILOG_RETURN_IF_ERROR(
          SetDesc(plan.desc.get(), scalar.attr, scalar.pointer, scalar.name, plan.description));
  if (plan.sets_bias_pointer)
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(plan.desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                       buffers.bias, "CUBLASLT_MATMUL_DESC_BIAS_POINTER",
                                       plan.description));
  if (plan.sets_aux_pointer)
    JAX_EPILOG_RETURN_IF_ERROR(SetDesc(
        plan.desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, buffers.aux,
        "CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER", plan.description));
  plan.bias_pointer = buffers.bias;
  plan.aux_pointer = buffers.aux;
  std::copy(scales, scales + 3, plan.scale_pointers);
  plan.amax_pointer = buffers.amax;
  plan.pointers_set = true;
  return ffi::Error::Success();
}

cublasStatus_t Enqueue(Plan& plan, const CallBuffers& buffers, const cublasLtMatmulAlgo_t& algo,
                       cudaStream_t stream) {
  static const float kOne = 1.0f;
  static const float kZero = 0.0f;
  // With c: the call's c and its device alpha and beta (the plan's pointer mode). Without:
  // host 1 and 0, so C is never read; it aliases D as cuBLASLt allows, except for an FP8
  // y, whose C has another type: then it is null (as TransformerEngine passes it).
  const bool has_c = plan.problem.has_c;
  const void* alpha = has_c ? buffers.alpha : &kOne;
  const void* beta = has_c ? buffers.beta : &kZero;
  const void* c = has_c ? buffers.c : plan.layout_c ? nullptr : buffers.y;
  return cublasLtMatmul(plan.handle, plan.desc.get(), alpha, buffers.b, plan.layout_a.get(),
                        buffers.a, plan.layout_b.get(), beta, c, plan.c_layout(), buffers.y,
                        plan.layout_cd.get(), &algo, buffers.workspace, buffers.workspace_bytes,
                        stream);
}

ffi::Error RunPlan(Plan& plan, const CallBuffers& buffers, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(plan.mutex);
  JAX_EPILOG_RETURN_IF_ERROR(SetCallPointers(plan, buffers));
  CountIfCaptured(stream);
  // cuBLASLt documents the amax as set on completion; zeroing it first (a memset node in
  // a command buffer) keeps a kernel that max-reduces into it from reading XLA's garbage.
  if (plan.sets_amax)
    JAX_EPILOG_CUDA(cudaMemsetAsync(buffers.amax, 0, sizeof(float), stream),
                    "zeroing the amax of " + plan.description);
  const cublasStatus_t status = TakeInjectedFailure() ? CUBLAS_STATUS_EXECUTION_FAILED
                                                      : Enqueue(plan, buffers, plan.algo, stream);
  JAX_EPILOG_CUBLAS(status, "enqueueing cublasLtMatmul for " + plan.description);
  return ffi::Error::Success();
}

}  // namespace jax_epilog
