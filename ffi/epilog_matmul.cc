// The XLA FFI handler of `jax_epilog_matmul` (see README.md for the contract): it
// checks every buffer against the contract, maps the row-major problem onto
// cuBLASLt's column-major one (plan.cc) and runs the cached plan on XLA's
// stream.
//
// Three targets share this code: jax_epilog_matmul, jax_epilog_matmul_c for calls
// with a C matrix (R = alpha P + beta C), whose last three operands are c, alpha and
// beta, and jax_epilog_matmul_block for block-scaled FP8 calls, whose scales are tensors
// of 1x128 tiles or 128x128 blocks (two more attributes: the tiles' rows); a call
// without c or block scales is exactly what it was before either existed.
//
// Two stages are exported for each. JaxEpilogMatmulInitialize runs in XLA's initialize
// stage, before execution and outside any command-buffer capture, with the same
// buffers (their addresses are assigned; their contents must not be relied on): it
// builds and caches the plan and, with autotuning on, tunes it (autotune.h).
// JaxEpilogMatmul (execute) looks the plan up, building it if needed, sets the call's
// pointers and enqueues the matmul; it never tunes.
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>

#include "autotune.h"
#include "plan.h"
#include "plan_cache.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jax_epilog {
namespace {

std::string DataTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F8E4M3FN:
      return "float8_e4m3fn";
    case ffi::DataType::F8E5M2:
      return "float8_e5m2";
    case ffi::DataType::U8:
      return "uint8";
    default:
      return "XLA dtype #" + std::to_string(static_cast<int>(t));
  }
}

// A buffer's dimensions (ffi::AnyBuffer::Dimensions) or the ones expected of it.
template <typename Dims>
std::string ShapeString(const Dims& dims) {
  std::string s = "(";
  for (auto it = dims.begin(); it != dims.end(); ++it)
    s += (it != dims.begin() ? ", " : "") + std::to_string(*it);
  return s + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error CheckBuffer(const ffi::AnyBuffer& buffer, const char* name, ffi::DataType dtype,
                       std::initializer_list<int64_t> dims) {
  const auto got = buffer.dimensions();
  bool ok = buffer.element_type() == dtype && got.size() == dims.size();
  size_t i = 0;
  for (auto it = dims.begin(); ok && it != dims.end(); ++it, ++i) ok = got[i] == *it;
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      std::string("jax_epilog_matmul: ") + name + " must be " + DataTypeName(dtype) +
      ShapeString(dims) + ", got " + DataTypeName(buffer.element_type()) +
      ShapeString(got));
}

// A call's attributes (Binding() below), as the handler receives them.
struct Attributes {
  int32_t epilog;
  bool transpose_a;
  bool transpose_b;
  bool allow_tf32;
  bool fast_accumulation;  // FP8 operands only; ignored (normalised to false) otherwise
  int32_t a_block_rows = 0;  // jax_epilog_matmul_block only: 1, 128 or kRowScales (0: scalar)
  int32_t b_block_rows = 0;
};

// A call decoded and checked: the problem (plan key) and its buffers.
struct Call {
  Problem problem;
  CallBuffers buffers;
  const EpilogInfo* epilog = nullptr;
};

// What alignment sees of a (batch, ...) buffer with `elements` per batch: the bytes
// between batches, 0 when there is one batch (or one shared across the batch).
int64_t BatchStrideBytes(int64_t batch, int64_t elements, size_t element_bytes) {
  return batch > 1 ? elements * static_cast<int64_t>(element_bytes) : 0;
}

std::string BoolName(bool value) { return value ? "true" : "false"; }

// Our element types and XLA's.
bool ToDType(ffi::DataType t, DType* dtype) {
  switch (t) {
    case ffi::DataType::F16:
      *dtype = DType::kF16;
      return true;
    case ffi::DataType::BF16:
      *dtype = DType::kBF16;
      return true;
    case ffi::DataType::F32:
      *dtype = DType::kF32;
      return true;
    case ffi::DataType::F8E4M3FN:
      *dtype = DType::kE4M3;
      return true;
    case ffi::DataType::F8E5M2:
      *dtype = DType::kE5M2;
      return true;
    default:
      return false;
  }
}

ffi::DataType ToXla(DType t) {
  switch (t) {
    case DType::kF16:
      return ffi::DataType::F16;
    case DType::kBF16:
      return ffi::DataType::BF16;
    case DType::kF32:
      return ffi::DataType::F32;
    case DType::kE4M3:
      return ffi::DataType::F8E4M3FN;
    case DType::kE5M2:
      return ffi::DataType::F8E5M2;
  }
  return ffi::DataType::F32;
}

// a and b: the element types, the shapes, and M, N, K and the batches they give.
ffi::Error DecodeOperands(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, Problem* p) {
  if (!ToDType(a.element_type(), &p->dtype))
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: a must be float16, bfloat16, float32, float8_e4m3fn or "
        "float8_e5m2, got " + DataTypeName(a.element_type()));
  const auto a_dims = a.dimensions();
  const auto b_dims = b.dimensions();
  if (a_dims.size() != 3 || b_dims.size() != 3)
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: a and b must be rank 3 (batch, rows, cols), got a" +
        ShapeString(a_dims) + " and b" + ShapeString(b_dims));
  p->batch = a_dims[0];
  p->m = p->transpose_a ? a_dims[2] : a_dims[1];
  p->k = p->transpose_a ? a_dims[1] : a_dims[2];
  p->batch_b = b_dims[0];
  p->n = p->transpose_b ? b_dims[1] : b_dims[2];
  const int64_t k_b = p->transpose_b ? b_dims[2] : b_dims[1];
  // FP8 operands may mix formats (not e5m2 x e5m2); others have one type.
  const bool b_ok = ToDType(b.element_type(), &p->dtype_b) &&
                    (IsFp8(p->dtype) ? IsFp8(p->dtype_b) &&
                                           !(p->dtype == DType::kE5M2 && p->dtype_b == DType::kE5M2)
                                     : p->dtype_b == p->dtype);
  if (!b_ok)
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: b must have a's dtype " + DataTypeName(a.element_type()) +
        " (for FP8 operands: FP8, and not float8_e5m2 with an e5m2 a), got " +
        DataTypeName(b.element_type()));
  if (k_b != p->k || (p->batch_b != p->batch && p->batch_b != 1))
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: b" + ShapeString(b_dims) + " does not match a" +
        ShapeString(a_dims) + " (transpose_a=" + BoolName(p->transpose_a) +
        ", transpose_b=" + BoolName(p->transpose_b) +
        "): K must agree and b's batch must be a's or 1");
  return ffi::Error::Success();
}

// y's type: the operands' for 16/32-bit operands; any of ours for FP8 operands (read
// off the first result, which DecodeResults then checks in full).
ffi::Error DecodeResultType(const ffi::RemainingRets& rets, Problem* p) {
  p->dtype_d = p->dtype;
  if (!IsFp8(p->dtype) || rets.size() == 0) return ffi::Error::Success();
  auto y = rets.get<ffi::AnyBuffer>(0);
  if (!y.has_value()) return y.error();
  if (!ToDType((*y.value()).element_type(), &p->dtype_d))
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: with FP8 operands y must be float16, bfloat16, float32, "
        "float8_e4m3fn or float8_e5m2, got " + DataTypeName((*y.value()).element_type()));
  return ffi::Error::Success();
}

// A float32 scalar operand (an FP8 scale).
ffi::Error DecodeScalar(const ffi::RemainingArgs& args, size_t index, const char* name,
                        const void** pointer) {
  auto arg = args.get<ffi::AnyBuffer>(index);
  if (!arg.has_value()) return arg.error();
  JAX_EPILOG_RETURN_IF_ERROR(CheckBuffer(arg.value(), name, ffi::DataType::F32, {}));
  *pointer = arg.value().untyped_data();
  return ffi::Error::Success();
}

// A block-scale tensor (jax_epilog_matmul_block) of an operand with `rows` rows and K
// columns, in cuBLASLt's layout (BlockScaleShape).
ffi::Error DecodeBlockScale(const ffi::RemainingArgs& args, size_t index, const char* name,
                            int32_t block_rows, int64_t rows, int64_t k, const void** pointer) {
  auto arg = args.get<ffi::AnyBuffer>(index);
  if (!arg.has_value()) return arg.error();
  const BlockScaleShape shape(block_rows, rows, k);
  JAX_EPILOG_RETURN_IF_ERROR(
      CheckBuffer(arg.value(), name, ffi::DataType::F32, {shape.outer, shape.inner}));
  *pointer = arg.value().untyped_data();
  return ffi::Error::Success();
}

// The aux matrix, input or output alike: (batch, M, AuxRow) of its own type.
ffi::Error DecodeAux(const ffi::AnyBuffer& buffer, Aux aux, Call* call) {
  Problem& p = call->problem;
  const int64_t row = AuxRow(aux, p.n);
  const ffi::DataType dtype = aux == Aux::kRelu ? ffi::DataType::U8 : ToXla(AuxDType(p.dtype_d));
  JAX_EPILOG_RETURN_IF_ERROR(CheckBuffer(buffer, AuxName(aux), dtype, {p.batch, p.m, row}));
  call->buffers.aux = buffer.untyped_data();
  const size_t elem = AuxElementBytes(aux, p.dtype_d);
  p.align_aux = AlignmentLog2(buffer.untyped_data(), BatchStrideBytes(p.batch, p.m * row, elem));
  return ffi::Error::Success();
}

// c, alpha and beta, the last three operands of a call with a C matrix (from `first`):
// c has y's shape and cuBLASLt's C type for y (y's own; an FP8 y, which GetPlan refuses
// with c, would have a 16-bit C), alpha and beta are float32 device scalars.
ffi::Error DecodeC(const ffi::RemainingArgs& args, size_t first, Call* call) {
  Problem& p = call->problem;
  auto c = args.get<ffi::AnyBuffer>(first);
  if (!c.has_value()) return c.error();
  JAX_EPILOG_RETURN_IF_ERROR(
      CheckBuffer(c.value(), "c", ToXla(AuxDType(p.dtype_d)), {p.batch, p.m, p.n}));
  call->buffers.c = c.value().untyped_data();
  p.align_c = AlignmentLog2(call->buffers.c, BatchStrideBytes(p.batch, p.m * p.n,
                                                              ElementBytes(AuxDType(p.dtype_d))));
  JAX_EPILOG_RETURN_IF_ERROR(DecodeScalar(args, first + 1, "alpha", &call->buffers.alpha));
  return DecodeScalar(args, first + 2, "beta", &call->buffers.beta);
}

// The operands after a and b: the bias or the aux input when the epilog reads one, then
// the FP8 scales (a's and b's with FP8 operands, then d's for an FP8 y), then c, alpha
// and beta for a call with a C matrix. DecodeResultType has run: c's type is y's.
ffi::Error DecodeInput(const ffi::RemainingArgs& args, Call* call) {
  const EpilogInfo& epilog = *call->epilog;
  Problem& p = call->problem;
  const size_t want = (epilog.bias_in || epilog.aux_in != Aux::kNone) ? 1 : 0;
  const size_t scales = IsFp8(p.dtype) ? (IsFp8(p.dtype_d) ? 3 : 2) : 0;
  const size_t c_operands = p.has_c ? 3 : 0;
  if (args.size() != want + scales + c_operands)
    return ffi::Error::InvalidArgument(
        std::string("jax_epilog_matmul: epilog ") + epilog.name + " takes " +
        std::to_string(2 + want + scales + c_operands) + " operands" +
        (scales ? " (with " + std::to_string(scales) + " FP8 scales)" : std::string()) +
        (p.has_c ? " (with c, alpha, beta)" : "") + ", got " + std::to_string(2 + args.size()));
  if (p.has_c) JAX_EPILOG_RETURN_IF_ERROR(DecodeC(args, want + scales, call));
  if (p.block_scaled()) {
    JAX_EPILOG_RETURN_IF_ERROR(DecodeBlockScale(args, want, "scale_a", p.a_block_rows, p.m, p.k,
                                                &call->buffers.scale_a));
    JAX_EPILOG_RETURN_IF_ERROR(DecodeBlockScale(args, want + 1, "scale_b", p.b_block_rows, p.n,
                                                p.k, &call->buffers.scale_b));
  } else if (scales > 0) {
    JAX_EPILOG_RETURN_IF_ERROR(DecodeScalar(args, want, "scale_a", &call->buffers.scale_a));
    JAX_EPILOG_RETURN_IF_ERROR(DecodeScalar(args, want + 1, "scale_b", &call->buffers.scale_b));
    if (scales == 3)
      JAX_EPILOG_RETURN_IF_ERROR(
          DecodeScalar(args, want + 2, "scale_d", &call->buffers.scale_d));
  }
  if (want == 0) return ffi::Error::Success();
  auto input = args.get<ffi::AnyBuffer>(0);
  if (!input.has_value()) return input.error();
  const ffi::AnyBuffer& buffer = input.value();
  if (epilog.aux_in != Aux::kNone) return DecodeAux(buffer, epilog.aux_in, call);
  const ffi::DataType dtype = ToXla(AuxDType(p.dtype_d));
  // A bias is per batch when its leading dim is the batch, else shared (and then it
  // must be (1, N), which CheckBuffer enforces).
  const auto dims = buffer.dimensions();
  p.batch_bias = dims.size() == 2 && dims[0] == p.batch ? p.batch : 1;
  JAX_EPILOG_RETURN_IF_ERROR(CheckBuffer(buffer, "bias", dtype, {p.batch_bias, p.n}));
  call->buffers.bias = buffer.untyped_data();
  const size_t elem = ElementBytes(AuxDType(p.dtype_d));
  p.align_bias =
      AlignmentLog2(buffer.untyped_data(), BatchStrideBytes(p.batch_bias, p.n, elem));
  return ffi::Error::Success();
}

// cuBLASLt wants a 256-byte aligned workspace; an XLA buffer may be less aligned, so
// the usable part starts at the next 256-byte boundary.
ffi::Error DecodeWorkspace(const ffi::AnyBuffer& workspace, Call* call) {
  if (workspace.element_type() != ffi::DataType::U8 || workspace.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: workspace must be uint8 of shape (bytes,), got " +
        DataTypeName(workspace.element_type()) + ShapeString(workspace.dimensions()));
  const uintptr_t start = reinterpret_cast<uintptr_t>(workspace.untyped_data());
  const uintptr_t aligned = (start + 255) & ~uintptr_t{255};
  const uint64_t size = static_cast<uint64_t>(workspace.dimensions()[0]);
  const uint64_t skipped = aligned - start;
  call->buffers.workspace = reinterpret_cast<void*>(aligned);
  call->buffers.workspace_bytes = size > skipped ? size - skipped : 0;
  call->problem.workspace_bytes = call->buffers.workspace_bytes;
  return ffi::Error::Success();
}

// Results: y, the aux output, the bias gradient, the FP8 amax, the workspace (those that
// apply). With FP8 operands one result more than the epilog's is the amax.
ffi::Error DecodeResults(const ffi::RemainingRets& rets, Call* call) {
  const EpilogInfo& epilog = *call->epilog;
  Problem& p = call->problem;
  const bool aux_out = epilog.aux_out != Aux::kNone;
  const int64_t bias_grad = epilog.BiasGradLength(p.m, p.n);
  const size_t base = 2 + (aux_out ? 1 : 0) + (bias_grad > 0 ? 1 : 0);
  p.amax = IsFp8(p.dtype) && rets.size() == base + 1;
  const size_t want = base + (p.amax ? 1 : 0);
  if (rets.size() != want)
    return ffi::Error::InvalidArgument(
        std::string("jax_epilog_matmul: epilog ") + epilog.name + " has " +
        std::to_string(base) + " results (y" + (aux_out ? ", aux" : "") +
        (bias_grad > 0 ? ", bias gradient" : "") + ", workspace" +
        (IsFp8(p.dtype) ? "; one more, the amax, with FP8 operands" : "") + "), got " +
        std::to_string(rets.size()));
  std::optional<ffi::AnyBuffer> results[5];  // no allocation: this runs on every call
  for (size_t i = 0; i < want; ++i) {
    auto result = rets.get<ffi::AnyBuffer>(i);
    if (!result.has_value()) return result.error();
    results[i] = *result.value();
  }
  const ffi::DataType aux_dtype = ToXla(AuxDType(p.dtype_d));
  const size_t aux_elem = ElementBytes(AuxDType(p.dtype_d));
  const ffi::AnyBuffer& y = *results[0];
  JAX_EPILOG_RETURN_IF_ERROR(CheckBuffer(y, "y", ToXla(p.dtype_d), {p.batch, p.m, p.n}));
  call->buffers.y = y.untyped_data();
  p.align_y = AlignmentLog2(y.untyped_data(),
                            BatchStrideBytes(p.batch, p.m * p.n, ElementBytes(p.dtype_d)));
  if (aux_out) JAX_EPILOG_RETURN_IF_ERROR(DecodeAux(*results[1], epilog.aux_out, call));
  if (bias_grad > 0) {
    const ffi::AnyBuffer& grad = *results[base - 2];
    JAX_EPILOG_RETURN_IF_ERROR(
        CheckBuffer(grad, "bias gradient", aux_dtype, {p.batch, bias_grad}));
    call->buffers.bias = grad.untyped_data();
    p.align_bias =
        AlignmentLog2(grad.untyped_data(), BatchStrideBytes(p.batch, bias_grad, aux_elem));
  }
  if (p.amax) {
    const ffi::AnyBuffer& amax = *results[base - 1];
    JAX_EPILOG_RETURN_IF_ERROR(CheckBuffer(amax, "result_amax", ffi::DataType::F32, {}));
    call->buffers.amax = amax.untyped_data();
  }
  return DecodeWorkspace(*results[want - 1], call);
}

ffi::Error Decode(int32_t xla_device, bool has_c, ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::RemainingArgs args, ffi::RemainingRets rets, const Attributes& attrs,
                  Call* call) {
  Problem& p = call->problem;
  p.epilog = attrs.epilog;
  p.has_c = has_c;
  p.transpose_a = attrs.transpose_a;
  p.transpose_b = attrs.transpose_b;
  JAX_EPILOG_RETURN_IF_ERROR(DecodeOperands(a, b, &p));
  p.allow_tf32 = attrs.allow_tf32 && p.dtype == DType::kF32;
  p.fast_accumulation = attrs.fast_accumulation && IsFp8(p.dtype);
  p.a_block_rows = attrs.a_block_rows;
  p.b_block_rows = attrs.b_block_rows;
  const bool rows = p.a_block_rows == kRowScales;
  if (p.block_scaled() &&
      (p.b_block_rows == 0 || !IsFp8(p.dtype) || (rows ? p.b_block_rows != kRowScales
                                                        : p.k % 128 != 0)))
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul_block: block scales need FP8 operands, tiles for both (1 or 128 "
        "rows) and K a multiple of 128, or row scales for both (" +
        std::to_string(kRowScales) + "), got a_block_rows " + std::to_string(p.a_block_rows) +
        ", b_block_rows " + std::to_string(p.b_block_rows) + ", K=" + std::to_string(p.k));
  call->epilog = FindEpilog(attrs.epilog);
  if (call->epilog == nullptr)
    return ffi::Error::InvalidArgument("jax_epilog_matmul: unknown epilog " +
                                       std::to_string(attrs.epilog));
  if (p.batch == 0 || p.m == 0 || p.n == 0 || p.k == 0)
    return ffi::Error::InvalidArgument(
        "jax_epilog_matmul: zero-sized problem (batch=" + std::to_string(p.batch) +
        ", M=" + std::to_string(p.m) + ", N=" + std::to_string(p.n) + ", K=" +
        std::to_string(p.k) + "); these are handled in Python and must not reach the "
        "custom call");
  JAX_EPILOG_RETURN_IF_ERROR(DecodeResultType(rets, &p));
  JAX_EPILOG_RETURN_IF_ERROR(DecodeInput(args, call));
  JAX_EPILOG_RETURN_IF_ERROR(DecodeResults(rets, call));

  call->buffers.a = a.untyped_data();
  call->buffers.b = b.untyped_data();
  p.align_a = AlignmentLog2(a.untyped_data(),
                            BatchStrideBytes(p.batch, p.m * p.k, ElementBytes(p.dtype)));
  p.align_b = AlignmentLog2(b.untyped_data(),
                            BatchStrideBytes(p.batch_b, p.n * p.k, ElementBytes(p.dtype_b)));

  // The plan is keyed by the CUDA device XLA made current for this call: XLA's device
  // ordinal can differ from it (e.g. with jax_cuda_visible_devices). cudaGetDevice only
  // reads thread state, so it is legal while XLA captures a command buffer (asking the
  // stream for its device, cudaStreamGetDevice, is not).
  JAX_EPILOG_CUDA(cudaGetDevice(&p.device),
                  "finding the current CUDA device of XLA device " + std::to_string(xla_device));
  return ffi::Error::Success();
}

// Exceptions (std::bad_alloc, std::system_error from a mutex) must not unwind into
// XLA's C frames; they become errors.
template <typename Body>
ffi::Error NoThrow(Body body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jax_epilog_matmul: ") + e.what());
  }
}

// Both stages of every target: decode and check the call, find (or build) its plan, then
// tune it (initialize) or run it (execute). has_c: the target with a C matrix
// (jax_epilog_matmul_c).
template <ffi::ExecutionStage kStage>
ffi::Error Run(cudaStream_t stream, int32_t xla_device, bool has_c, ffi::AnyBuffer a,
               ffi::AnyBuffer b, ffi::RemainingArgs args, ffi::RemainingRets rets,
               const Attributes& attrs) {
  return NoThrow([&] {
    Call call;
    std::shared_ptr<Plan> plan;
    JAX_EPILOG_RETURN_IF_ERROR(Decode(xla_device, has_c, a, b, args, rets, attrs, &call));
    JAX_EPILOG_RETURN_IF_ERROR(GetPlan(call.problem, &plan));
    if constexpr (kStage == ffi::ExecutionStage::kExecute) {
      return RunPlan(*plan, call.buffers, stream);
    } else {  // tuning allocates and synchronises, which execute (maybe captured) must not
      if (!AutotuneEnabled()) return ffi::Error::Success();
      return TunePlan(*plan, stream);
    }
  });
}

// jax_epilog_matmul (kHasC false) and jax_epilog_matmul_c.
template <ffi::ExecutionStage kStage, bool kHasC>
ffi::Error Matmul(cudaStream_t stream, int32_t xla_device, ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t epilog,
                  bool transpose_a, bool transpose_b, bool allow_tf32, bool fast_accumulation) {
  const Attributes attrs{epilog, transpose_a, transpose_b, allow_tf32, fast_accumulation};
  return Run<kStage>(stream, xla_device, kHasC, a, b, args, rets, attrs);
}

// jax_epilog_matmul_block: the tiles' rows of a's and b's scales (1 or 128) besides.
template <ffi::ExecutionStage kStage>
ffi::Error MatmulBlock(cudaStream_t stream, int32_t xla_device, ffi::AnyBuffer a,
                       ffi::AnyBuffer b, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       int32_t epilog, bool transpose_a, bool transpose_b, bool allow_tf32,
                       bool fast_accumulation, int32_t a_block_rows, int32_t b_block_rows) {
  const Attributes attrs{epilog,      transpose_a,       transpose_b, allow_tf32,
                         fast_accumulation, a_block_rows, b_block_rows};
  return Run<kStage>(stream, xla_device, false, a, b, args, rets, attrs);
}

// Both stages bind the same parameters, so either can be registered alone.
template <ffi::ExecutionStage stage>
auto Binding() {
  return ffi::Ffi::Bind<stage>()
      .template Ctx<ffi::PlatformStream<cudaStream_t>>()
      .template Ctx<ffi::DeviceOrdinal>()
      .template Arg<ffi::AnyBuffer>()  // a
      .template Arg<ffi::AnyBuffer>()  // b
      .RemainingArgs()                 // bias or aux input, FP8 scales, c, alpha, beta
      .RemainingRets()                 // y, aux output, bias gradient, FP8 amax, workspace
      .template Attr<int32_t>("epilog")
      .template Attr<bool>("transpose_a")
      .template Attr<bool>("transpose_b")
      .template Attr<bool>("allow_tf32")
      .template Attr<bool>("fast_accumulation");  // FP8 operands only (else ignored)
}

template <ffi::ExecutionStage stage>
auto BlockBinding() {
  return Binding<stage>()
      .template Attr<int32_t>("a_block_rows")   // 1: 1x128 tiles, 128: blocks, -1: rows
      .template Attr<int32_t>("b_block_rows");
}

}  // namespace
}  // namespace jax_epilog

JAX_EPILOG_EXPORT XLA_FFI_Error* JaxEpilogMatmul(XLA_FFI_CallFrame* call_frame);
JAX_EPILOG_EXPORT XLA_FFI_Error* JaxEpilogMatmulInitialize(XLA_FFI_CallFrame* call_frame);
JAX_EPILOG_EXPORT XLA_FFI_Error* JaxEpilogMatmulC(XLA_FFI_CallFrame* call_frame);
JAX_EPILOG_EXPORT XLA_FFI_Error* JaxEpilogMatmulCInitialize(XLA_FFI_CallFrame* call_frame);
JAX_EPILOG_EXPORT XLA_FFI_Error* JaxEpilogMatmulBlock(XLA_FFI_CallFrame* call_frame);
JAX_EPILOG_EXPORT XLA_FFI_Error* JaxEpilogMatmulBlockInitialize(XLA_FFI_CallFrame* call_frame);

// Each handler is in parentheses: the macro would split its template arguments at the
// comma. Execute is command-buffer compatible: a call always enqueues exactly one
// cublasLtMatmul (after one memset of its amax, when it has one), with no allocation and
// no synchronisation, so it can be captured into a CUDA graph.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpilogMatmul,
    (jax_epilog::Matmul<xla::ffi::ExecutionStage::kExecute, false>),
    jax_epilog::Binding<xla::ffi::ExecutionStage::kExecute>(),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpilogMatmulInitialize,
    (jax_epilog::Matmul<xla::ffi::ExecutionStage::kInitialize, false>),
    jax_epilog::Binding<xla::ffi::ExecutionStage::kInitialize>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpilogMatmulC,
    (jax_epilog::Matmul<xla::ffi::ExecutionStage::kExecute, true>),
    jax_epilog::Binding<xla::ffi::ExecutionStage::kExecute>(),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpilogMatmulCInitialize,
    (jax_epilog::Matmul<xla::ffi::ExecutionStage::kInitialize, true>),
    jax_epilog::Binding<xla::ffi::ExecutionStage::kInitialize>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpilogMatmulBlock,
    (jax_epilog::MatmulBlock<xla::ffi::ExecutionStage::kExecute>),
    jax_epilog::BlockBinding<xla::ffi::ExecutionStage::kExecute>(),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxEpilogMatmulBlockInitialize,
    (jax_epilog::MatmulBlock<xla::ffi::ExecutionStage::kInitialize>),
    jax_epilog::BlockBinding<xla::ffi::ExecutionStage::kInitialize>());
