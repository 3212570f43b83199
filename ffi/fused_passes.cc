// The XLA FFI handlers of the fused FP8 passes (jax_epilog/float8/fused.py is their Python
// side; fused_params.h says what each computes):
//
//   jax_epilog_cast_transpose        x, q            -> y, yt, amax
//   jax_epilog_swiglu_amaxes         gu              -> amaxes (3,)
//   jax_epilog_swiglu_quantize       gu, q (3,)      -> h8 [, g8, u8]
//   jax_epilog_swiglu_grad_amax      dh, g8, u8, s   -> amax
//   jax_epilog_swiglu_grad_quantize  dh, g8, u8, s   -> dgu8, dgu8t
//
// The kernels are device code compiled by nvcc when the package is built (fused_kernels.cu),
// embedded here as a fatbin (JAX_EPILOG_FUSED_FATBIN) and loaded on first use with the CUDA
// runtime's library API, so that loading libjax_epilog_ffi.so touches no GPU. A build without
// nvcc has the handlers but no fatbin: jax_epilog_fused_kernels_built() says 0 and every call
// fails with kUnimplemented (Python does not emit them then).
//
// The initialize stage (outside any command-buffer capture) loads the library and the call's
// kernel into the current device's context (a launch over no rows); execute only enqueues: one
// memset of the amax output where there is one, then one kernel, no allocation and no
// synchronisation, so it can be captured into a CUDA graph.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>

#include "fused_params.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

#ifdef JAX_EPILOG_FUSED_FATBIN
// fused_kernels_blob.cc: the fatbin's bytes.
extern "C" const unsigned char jax_epilog_fused_fatbin[];
#endif

namespace jax_epilog {
namespace {

using fused::CastTransposeParams;
using fused::SwigluGradParams;
using fused::SwigluParams;

#ifdef JAX_EPILOG_FUSED_FATBIN
// The library of kernels, loaded once per process, and the kernels looked up so far (their
// handles are context-independent), so that an execution makes no driver call but its launch.
struct KernelLibrary {
  std::once_flag once;
  cudaLibrary_t library = nullptr;
  cudaError_t error = cudaSuccess;
  std::mutex mutex;
  std::unordered_map<std::string, cudaKernel_t> kernels;
};

KernelLibrary& Library() {
  static KernelLibrary* library = new KernelLibrary;  // never destroyed: used at exit by XLA
  return *library;
}
#endif

ffi::Error LoadKernel(const std::string& name, cudaKernel_t* kernel) {
#ifndef JAX_EPILOG_FUSED_FATBIN
  (void)kernel;
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    name + ": libjax_epilog_ffi.so was built without nvcc, so it has no fused "
                           "kernels; rebuild with a CUDA 13 nvcc (docs/fp8.md, \"Fused passes\")");
#else
  KernelLibrary& lib = Library();
  std::call_once(lib.once, [&lib] {
    lib.error = cudaLibraryLoadData(&lib.library, jax_epilog_fused_fatbin, nullptr, nullptr, 0,
                                    nullptr, nullptr, 0);
  });
  JAX_EPILOG_CUDA(lib.error, "loading the fused kernels' library (" + name + ")");
  std::lock_guard<std::mutex> lock(lib.mutex);
  if (auto it = lib.kernels.find(name); it != lib.kernels.end()) {
    *kernel = it->second;
    return ffi::Error::Success();
  }
  JAX_EPILOG_CUDA(cudaLibraryGetKernel(kernel, lib.library, name.c_str()),
                  "finding kernel " + name);
  lib.kernels.emplace(name, *kernel);
  return ffi::Error::Success();
#endif
}

std::string FormatSuffix(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN ? "_e4m3" : t == ffi::DataType::F8E5M2 ? "_e5m2" : "";
}

std::string InputSuffix(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? "_bf16" : t == ffi::DataType::F16 ? "_f16" : "";
}

bool IsFp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

bool Is16Bit(ffi::DataType t) { return t == ffi::DataType::BF16 || t == ffi::DataType::F16; }

bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

std::string Dims(const ffi::AnyBuffer& b) {
  std::string s = "(";
  const auto dims = b.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

ffi::Error Invalid(const std::string& target, const std::string& what) {
  return ffi::Error::InvalidArgument(target + ": " + what);
}

// A 2-D buffer of `rows` x `cols` (or any, where negative) of one of the accepted dtypes.
ffi::Error Check2d(const std::string& target, const char* name, const ffi::AnyBuffer& b,
                   bool (*dtype_ok)(ffi::DataType), const char* dtypes, int64_t rows,
                   int64_t cols) {
  const auto dims = b.dimensions();
  const bool ok = dtype_ok(b.element_type()) && dims.size() == 2 &&
                  (rows < 0 || dims[0] == rows) && (cols < 0 || dims[1] == cols);
  if (ok) return ffi::Error::Success();
  return Invalid(target, std::string(name) + " must be 2-D " + dtypes + " of shape (" +
                             (rows < 0 ? "any" : std::to_string(rows)) + ", " +
                             (cols < 0 ? "any" : std::to_string(cols)) + "), got dtype #" +
                             std::to_string(static_cast<int>(b.element_type())) + " " +
                             Dims(b));
}

ffi::Error CheckScalars(const std::string& target, const char* name, const ffi::AnyBuffer& b,
                        int64_t count) {
  const auto dims = b.dimensions();
  const bool ok = b.element_type() == ffi::DataType::F32 &&
                  (count == 0 ? dims.size() == 0 : dims.size() == 1 && dims[0] == count);
  if (ok) return ffi::Error::Success();
  return Invalid(target, std::string(name) + " must be float32 " +
                             (count == 0 ? "()" : "(" + std::to_string(count) + ",)") +
                             ", got " + Dims(b));
}

// The grid of a tensor's tiles: x along columns, y along rows.
ffi::Error Grid(const std::string& target, int64_t rows, int64_t cols, dim3* grid) {
  const int64_t row_tiles = (rows + fused::kTile - 1) / fused::kTile;
  const int64_t col_tiles = (cols + fused::kTile - 1) / fused::kTile;
  if (row_tiles > fused::kMaxRowTiles || col_tiles > INT32_MAX)
    return Invalid(target, "too many rows (" + std::to_string(rows) + "; at most " +
                               std::to_string(fused::kMaxRowTiles * fused::kTile) + ")");
  *grid = dim3(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles), 1);
  return ffi::Error::Success();
}

// Initialize: the library loaded and the kernel run once on no rows and null buffers (it then
// touches no memory: the call's buffers are not ours to read yet), which loads its module into
// this device's context, so that no execution (maybe captured into a CUDA graph) loads code;
// nothing where XLA's stream is capturing. Execute: zero the amaxes, launch.
template <ffi::ExecutionStage kStage, typename Params>
ffi::Error Launch(cudaStream_t stream, const std::string& name, dim3 grid, Params params,
                  unsigned int* amax, size_t amax_count, bool empty) {
  try {
    cudaKernel_t kernel;
    JAX_EPILOG_RETURN_IF_ERROR(LoadKernel(name, &kernel));
    const void* function = reinterpret_cast<const void*>(kernel);
    if constexpr (kStage == ffi::ExecutionStage::kInitialize) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      JAX_EPILOG_CUDA(cudaStreamIsCapturing(stream, &capturing), "asking XLA's stream");
      if (capturing != cudaStreamCaptureStatusNone) return ffi::Error::Success();
      Params none{};  // no rows, null buffers
      void* args[] = {&none};
      JAX_EPILOG_CUDA(cudaLaunchKernel(function, dim3(1), dim3(fused::kThreads), args, 0, stream),
                      "loading kernel " + name);
      return ffi::Error::Success();
    }
    if (amax != nullptr)
      JAX_EPILOG_CUDA(cudaMemsetAsync(amax, 0, amax_count * sizeof(float), stream),
                      "zeroing the amax of " + name);
    if (empty) return ffi::Error::Success();
    void* args[] = {&params};
    JAX_EPILOG_CUDA(cudaLaunchKernel(function, grid, dim3(fused::kThreads), args, 0, stream),
                    "launching " + name);
    return ffi::Error::Success();
  } catch (const std::exception& e) {  // must not unwind into XLA's C frames
    return ffi::Error::Internal(name + ": " + e.what());
  }
}

const char* const k16Bit = "bfloat16 or float16";
const char* const kFp8 = "float8_e4m3fn or float8_e5m2";

template <ffi::ExecutionStage kStage>
ffi::Error CastTranspose(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer q,
                         ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> yt,
                         ffi::Result<ffi::AnyBuffer> amax) {
  const std::string target = "jax_epilog_cast_transpose";
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "x", x, Is16Bit, k16Bit, -1, -1));
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  JAX_EPILOG_RETURN_IF_ERROR(CheckScalars(target, "q", q, 0));
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "y", *y, IsFp8, kFp8, rows, cols));
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "yt", *yt, IsFp8, kFp8, cols, rows));
  JAX_EPILOG_RETURN_IF_ERROR(CheckScalars(target, "amax", *amax, 0));
  if (yt->element_type() != y->element_type())
    return Invalid(target, "y and yt must have the same FP8 dtype");
  CastTransposeParams p;
  p.x = x.untyped_data();
  p.multiplier = static_cast<const float*>(q.untyped_data());
  p.y = static_cast<uint8_t*>(y->untyped_data());
  p.yt = static_cast<uint8_t*>(yt->untyped_data());
  p.amax = static_cast<unsigned int*>(amax->untyped_data());
  p.rows = rows;
  p.cols = cols;
  p.vector_in = cols % 8 == 0 && Aligned(p.x, 16);
  p.vector_out = cols % 8 == 0 && Aligned(p.y, 8);
  p.vector_t = rows % 8 == 0 && Aligned(p.yt, 8);
  dim3 grid;
  JAX_EPILOG_RETURN_IF_ERROR(Grid(target, rows, cols, &grid));
  const std::string name = "jax_epilog_cast_transpose" + InputSuffix(x.element_type()) +
                           FormatSuffix(y->element_type());
  return Launch<kStage>(stream, name, grid, p, p.amax, 1, rows == 0 || cols == 0);
}

// gu (rows, 2F) and F, checked.
ffi::Error GateUp(const std::string& target, const ffi::AnyBuffer& gu, int64_t* rows,
                  int64_t* hidden) {
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "gu", gu, Is16Bit, k16Bit, -1, -1));
  *rows = gu.dimensions()[0];
  if (gu.dimensions()[1] % 2)
    return Invalid(target, "gu must be [g u], (rows, 2F), got " + Dims(gu));
  *hidden = gu.dimensions()[1] / 2;
  return ffi::Error::Success();
}

template <ffi::ExecutionStage kStage>
ffi::Error SwigluAmaxes(cudaStream_t stream, ffi::AnyBuffer gu,
                        ffi::Result<ffi::AnyBuffer> amaxes) {
  const std::string target = "jax_epilog_swiglu_amaxes";
  SwigluParams p{};
  JAX_EPILOG_RETURN_IF_ERROR(GateUp(target, gu, &p.rows, &p.hidden));
  JAX_EPILOG_RETURN_IF_ERROR(CheckScalars(target, "amaxes", *amaxes, 3));
  p.gu = gu.untyped_data();
  p.amaxes = static_cast<unsigned int*>(amaxes->untyped_data());
  p.vector_in = p.hidden % 8 == 0 && Aligned(p.gu, 16);
  dim3 grid;
  JAX_EPILOG_RETURN_IF_ERROR(Grid(target, p.rows, p.hidden, &grid));
  return Launch<kStage>(stream, target + InputSuffix(gu.element_type()), grid, p, p.amaxes, 3,
                        p.rows == 0 || p.hidden == 0);
}

template <ffi::ExecutionStage kStage>
ffi::Error SwigluQuantize(cudaStream_t stream, ffi::AnyBuffer gu, ffi::AnyBuffer q,
                          ffi::Result<ffi::AnyBuffer> h8, ffi::RemainingRets kept) {
  const std::string target = "jax_epilog_swiglu_quantize";
  SwigluParams p{};
  JAX_EPILOG_RETURN_IF_ERROR(GateUp(target, gu, &p.rows, &p.hidden));
  JAX_EPILOG_RETURN_IF_ERROR(CheckScalars(target, "q", q, 3));
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "h8", *h8, IsFp8, kFp8, p.rows, p.hidden));
  if (kept.size() != 0 && kept.size() != 2)
    return Invalid(target, "expected h8 alone or h8, g8 and u8 as results, got " +
                               std::to_string(kept.size() + 1));
  p.gu = gu.untyped_data();
  p.multipliers = static_cast<const float*>(q.untyped_data());
  p.h8 = static_cast<uint8_t*>(h8->untyped_data());
  bool aligned = Aligned(p.h8, 8);
  const char* names[] = {"g8", "u8"};
  for (size_t i = 0; i < kept.size(); ++i) {
    auto r = kept.get<ffi::AnyBuffer>(i);
    if (!r.has_value()) return r.error();
    JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, names[i], *r.value(), IsFp8, kFp8, p.rows,
                                       p.hidden));
    if ((*r.value()).element_type() != h8->element_type())
      return Invalid(target, std::string(names[i]) + " must have h8's FP8 dtype");
    auto* data = static_cast<uint8_t*>((*r.value()).untyped_data());
    (i == 0 ? p.g8 : p.u8) = data;
    aligned = aligned && Aligned(data, 8);
  }
  p.vector_in = p.hidden % 8 == 0 && Aligned(p.gu, 16);
  p.vector_out = p.hidden % 8 == 0 && aligned;
  dim3 grid;
  JAX_EPILOG_RETURN_IF_ERROR(Grid(target, p.rows, p.hidden, &grid));
  return Launch<kStage>(stream, target + InputSuffix(gu.element_type()) +
                                    FormatSuffix(h8->element_type()),
                        grid, p, nullptr, 0, p.rows == 0 || p.hidden == 0);
}

// dh, g8, u8 and the scales of the backward's passes, checked, into p.
ffi::Error GradInputs(const std::string& target, const ffi::AnyBuffer& dh,
                      const ffi::AnyBuffer& g8, const ffi::AnyBuffer& u8,
                      const ffi::AnyBuffer& scales, SwigluGradParams* p) {
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "dh", dh, Is16Bit, k16Bit, -1, -1));
  p->rows = dh.dimensions()[0];
  p->hidden = dh.dimensions()[1];
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "g8", g8, IsFp8, kFp8, p->rows, p->hidden));
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "u8", u8, IsFp8, kFp8, p->rows, p->hidden));
  if (g8.element_type() != u8.element_type())
    return Invalid(target, "g8 and u8 must have the same FP8 dtype");
  JAX_EPILOG_RETURN_IF_ERROR(CheckScalars(target, "scales", scales, 3));
  p->dh = dh.untyped_data();
  p->g8 = static_cast<const uint8_t*>(g8.untyped_data());
  p->u8 = static_cast<const uint8_t*>(u8.untyped_data());
  p->scales = static_cast<const float*>(scales.untyped_data());
  p->saved_e5m2 = g8.element_type() == ffi::DataType::F8E5M2;
  p->vector_in = p->hidden % 8 == 0 && Aligned(p->dh, 16) && Aligned(p->g8, 8) &&
                 Aligned(p->u8, 8);
  return ffi::Error::Success();
}

template <ffi::ExecutionStage kStage>
ffi::Error SwigluGradAmax(cudaStream_t stream, ffi::AnyBuffer dh, ffi::AnyBuffer g8,
                          ffi::AnyBuffer u8, ffi::AnyBuffer scales,
                          ffi::Result<ffi::AnyBuffer> amax) {
  const std::string target = "jax_epilog_swiglu_grad_amax";
  SwigluGradParams p{};
  JAX_EPILOG_RETURN_IF_ERROR(GradInputs(target, dh, g8, u8, scales, &p));
  JAX_EPILOG_RETURN_IF_ERROR(CheckScalars(target, "amax", *amax, 0));
  p.amax = static_cast<unsigned int*>(amax->untyped_data());
  dim3 grid;
  JAX_EPILOG_RETURN_IF_ERROR(Grid(target, p.rows, p.hidden, &grid));
  return Launch<kStage>(stream, target + InputSuffix(dh.element_type()), grid, p, p.amax, 1,
                        p.rows == 0 || p.hidden == 0);
}

template <ffi::ExecutionStage kStage>
ffi::Error SwigluGradQuantize(cudaStream_t stream, ffi::AnyBuffer dh, ffi::AnyBuffer g8,
                              ffi::AnyBuffer u8, ffi::AnyBuffer scales,
                              ffi::Result<ffi::AnyBuffer> dgu8,
                              ffi::Result<ffi::AnyBuffer> dgu8t) {
  const std::string target = "jax_epilog_swiglu_grad_quantize";
  SwigluGradParams p{};
  JAX_EPILOG_RETURN_IF_ERROR(GradInputs(target, dh, g8, u8, scales, &p));
  JAX_EPILOG_RETURN_IF_ERROR(Check2d(target, "dgu8", *dgu8, IsFp8, kFp8, p.rows, 2 * p.hidden));
  JAX_EPILOG_RETURN_IF_ERROR(
      Check2d(target, "dgu8t", *dgu8t, IsFp8, kFp8, 2 * p.hidden, p.rows));
  if (dgu8t->element_type() != dgu8->element_type())
    return Invalid(target, "dgu8 and dgu8t must have the same FP8 dtype");
  p.dgu8 = static_cast<uint8_t*>(dgu8->untyped_data());
  p.dgu8t = static_cast<uint8_t*>(dgu8t->untyped_data());
  p.vector_out = p.hidden % 8 == 0 && Aligned(p.dgu8, 8);
  p.vector_t = p.rows % 8 == 0 && Aligned(p.dgu8t, 8);
  dim3 grid;
  JAX_EPILOG_RETURN_IF_ERROR(Grid(target, p.rows, p.hidden, &grid));
  return Launch<kStage>(stream, target + InputSuffix(dh.element_type()) +
                                    FormatSuffix(dgu8->element_type()),
                        grid, p, nullptr, 0, p.rows == 0 || p.hidden == 0);
}

template <ffi::ExecutionStage stage>
auto Stream() {
  return ffi::Ffi::Bind<stage>().template Ctx<ffi::PlatformStream<cudaStream_t>>();
}

}  // namespace
}  // namespace jax_epilog

JAX_EPILOG_EXPORT int jax_epilog_fused_kernels_built(void) {
#ifdef JAX_EPILOG_FUSED_FATBIN
  return 1;
#else
  return 0;
#endif
}

// Each target's execute and initialize stages, as for the matmul targets (epilog_matmul.cc).
#define JAX_EPILOG_FUSED_TARGET(symbol, function, binding)                               \
  JAX_EPILOG_EXPORT XLA_FFI_Error* symbol(XLA_FFI_CallFrame* call_frame);                \
  JAX_EPILOG_EXPORT XLA_FFI_Error* symbol##Initialize(XLA_FFI_CallFrame* call_frame);    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                         \
      symbol, (jax_epilog::function<xla::ffi::ExecutionStage::kExecute>),                \
      binding(jax_epilog::Stream<xla::ffi::ExecutionStage::kExecute>()),                 \
      {xla::ffi::Traits::kCmdBufferCompatible});                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                         \
      symbol##Initialize, (jax_epilog::function<xla::ffi::ExecutionStage::kInitialize>), \
      binding(jax_epilog::Stream<xla::ffi::ExecutionStage::kInitialize>()))

#define JAX_EPILOG_CAST_TRANSPOSE(b) \
  b.Arg<xla::ffi::AnyBuffer>()       \
      .Arg<xla::ffi::AnyBuffer>()    \
      .Ret<xla::ffi::AnyBuffer>()    \
      .Ret<xla::ffi::AnyBuffer>()    \
      .Ret<xla::ffi::AnyBuffer>()
#define JAX_EPILOG_SWIGLU_AMAXES(b) b.Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>()
#define JAX_EPILOG_SWIGLU_QUANTIZE(b) \
  b.Arg<xla::ffi::AnyBuffer>().Arg<xla::ffi::AnyBuffer>().Ret<xla::ffi::AnyBuffer>().RemainingRets()
#define JAX_EPILOG_SWIGLU_GRAD_AMAX(b) \
  b.Arg<xla::ffi::AnyBuffer>()         \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Arg<xla::ffi::AnyBuffer>()      \
      .Ret<xla::ffi::AnyBuffer>()
#define JAX_EPILOG_SWIGLU_GRAD_QUANTIZE(b) JAX_EPILOG_SWIGLU_GRAD_AMAX(b).Ret<xla::ffi::AnyBuffer>()

JAX_EPILOG_FUSED_TARGET(JaxEpilogCastTranspose, CastTranspose, JAX_EPILOG_CAST_TRANSPOSE);
JAX_EPILOG_FUSED_TARGET(JaxEpilogSwigluAmaxes, SwigluAmaxes, JAX_EPILOG_SWIGLU_AMAXES);
JAX_EPILOG_FUSED_TARGET(JaxEpilogSwigluQuantize, SwigluQuantize, JAX_EPILOG_SWIGLU_QUANTIZE);
JAX_EPILOG_FUSED_TARGET(JaxEpilogSwigluGradAmax, SwigluGradAmax, JAX_EPILOG_SWIGLU_GRAD_AMAX);
JAX_EPILOG_FUSED_TARGET(JaxEpilogSwigluGradQuantize, SwigluGradQuantize,
                        JAX_EPILOG_SWIGLU_GRAD_QUANTIZE);
