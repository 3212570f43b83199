#include "autotune.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "algo_store.h"

namespace jax_epilog {
namespace {

// On: measured on the H200 (benchmarks/results/autotune.md) to win up to 1.21x (G3
// forward) for 3-250 ms once per problem and machine; never measurably slower.
constexpr bool kAutotuneByDefault = true;
constexpr int kMaxCandidates = 8;
// FP8 plans time more: the heuristic's first choice for M1's forward GEMMs on the H200 takes
// 1.69-1.72 ms where XLA's GEMM, chosen by timing up to 128 heuristic candidates, takes
// 1.42-1.47 ms (docs/fp8.md). 32 bounds a tuning to 32 x 7 launches of the GEMM.
constexpr int kMaxFp8Candidates = 32;
// The most algorithm ids asked of cublasLtMatmulAlgoGetIds (EnumeratedCandidates).
constexpr int kMaxAlgoIds = 128;
// Candidates are timed in turn, twice over, so drift of the GPU's clock hits all alike;
// each time is a few back-to-back launches between one pair of events.
constexpr int kRounds = 2;
constexpr int kLaunchesPerRound = 3;
// Another candidate replaces the heuristic's first only when clearly faster than
// timing noise (about 1% between rounds).
constexpr float kMinGain = 0.02f;

// A candidate must compute what the heuristic's choice computes: its outputs (the whole
// bias gradient and amax, the first kCheckBytes of y and of a GELU pre-activation) are read
// back and compared with the heuristic's, and one that differs by more than rounding (Agrees)
// is dropped.
// Seen on the H200: a candidate whose BGRADA bias gradient was wrong (fp16, M=300 N=1
// K=129). The ReLU mask is not compared: its bits may rightly differ where the
// pre-activation is within rounding of 0.
constexpr size_t kCheckBytes = size_t{1} << 20;
constexpr float kCheckTolerance = 0.05f;  // of the largest magnitude in the heuristic's sample
// The period of the inputs' pattern (FillInputs), a multiple of the 256-byte parts.
constexpr size_t kPatternBytes = size_t{1} << 20;

std::atomic<bool> autotune_on{kAutotuneByDefault};
std::atomic<bool> autotune_log{false};

// E.g. "NVIDIA_H200 sm_90": GPUs of one model share tuning results.
ffi::Error GpuIdentity(int device, std::string* identity) {
  static std::mutex* mutex = new std::mutex;
  static auto* identities = new std::map<int, std::string>;
  std::lock_guard<std::mutex> lock(*mutex);
  if (auto it = identities->find(device); it != identities->end()) {
    *identity = it->second;
    return ffi::Error::Success();
  }
  cudaDeviceProp properties{};
  JAX_EPILOG_CUDA(cudaGetDeviceProperties(&properties, device),
                  "reading the properties of CUDA device " + std::to_string(device));
  std::string name = properties.name;
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-') c = '_';
  *identity = name + " sm_" + std::to_string(properties.major) +
              std::to_string(properties.minor);
  identities->emplace(device, *identity);
  return ffi::Error::Success();
}

// Everything a tuned algorithm depends on: the GPU model, cuBLASLt's version and the
// whole problem except the device ordinal. dtype is support_query's number. A problem
// with c adds " c=1" and c's alignment, so the keys of problems without c stay as they were;
// likewise FP8 fast accumulation adds " fast_accum=1", and FP8 operands add b's and y's
// types and " amax=1" with an amax (they change which kernels apply; a's is dtype; an FP8 y's
// scale comes with its type).
ffi::Error StoreKey(const Problem& p, std::string* key) {
  std::string gpu;
  JAX_EPILOG_RETURN_IF_ERROR(GpuIdentity(p.device, &gpu));
  auto number = [](int64_t v) { return std::to_string(v); };
  auto align = [](uint8_t log2) { return std::to_string(1u << log2); };
  *key = "v1 " + gpu + " cublasLt=" + number(static_cast<int64_t>(cublasLtGetVersion())) +
         " epilog=" + number(p.epilog) + " dtype=" + number(static_cast<int>(p.dtype)) +
         " tf32=" + number(p.allow_tf32) + " transpose_a=" + number(p.transpose_a) +
         " transpose_b=" + number(p.transpose_b) + " batch=" + number(p.batch) +
         " batch_b=" + number(p.batch_b) + " batch_bias=" + number(p.batch_bias) +
         " m=" + number(p.m) + " n=" + number(p.n) + " k=" + number(p.k) +
         " workspace=" + number(static_cast<int64_t>(p.workspace_bytes)) +
         " align=" + align(p.align_a) + "," + align(p.align_b) + "," + align(p.align_y) +
         "," + align(p.align_bias) + "," + align(p.align_aux) +
         (p.has_c ? " c=1 align_c=" + align(p.align_c) : std::string()) +
         (p.fast_accumulation ? " fast_accum=1" : std::string()) +
         (IsFp8(p.dtype) ? " dtype_b=" + number(static_cast<int>(p.dtype_b)) +
                               " dtype_d=" + number(static_cast<int>(p.dtype_d)) +
                               (p.amax ? " amax=1" : "")
                         : std::string()) +
         (p.block_scaled() ? " block_rows=" + number(p.a_block_rows) + "," +
                                 number(p.b_block_rows)
                           : std::string());
  return ffi::Error::Success();
}

// Bytes of the epilog's aux matrix (input or output).
int64_t AuxBytes(Aux aux, const Problem& p) {
  return p.batch * p.m * AuxRow(aux, p.n) * static_cast<int64_t>(AuxElementBytes(aux, p.dtype_d));
}

// 2^-ceil(log2(K) / 2), about 1/sqrt(K), exact in float32: P, a sum of K terms of random sign
// of the inputs' order of magnitude, grows as sqrt(K), so this factor brings it back to it.
float InverseSqrtK(int64_t k) {
  int half_log2_k = 0;
  while ((int64_t{1} << (2 * half_log2_k)) < k) ++half_log2_k;
  return std::ldexp(1.0f, -half_log2_k);
}

// Bytes of scratch input, from `offset`, holding values of `dtype` (FillInputs).
struct Fill {
  size_t offset = 0;
  size_t bytes = 0;
  DType dtype = DType::kF32;
};

// Scratch stand-ins for every buffer of a call, parts of one allocation at `base`, each
// 256-byte aligned and of its buffer's own type: the inputs first (`fills`, filled by
// FillInputs), then the float32 scalars (`scalars`, set from `scalar_values` by SetScalars):
// alpha and beta of a problem with c, the scales of FP8 operands; then the outputs (amax
// included) and the workspace; `bytes` in all.
constexpr size_t kScalarSlot = 256 / sizeof(float);

struct ScratchLayout {
  CallBuffers buffers;
  std::vector<Fill> fills;
  void* scalars = nullptr;
  std::vector<float> scalar_values;
  size_t bytes = 0;
};

ScratchLayout LayOut(const Problem& p, uintptr_t base) {
  const EpilogInfo& epilog = *FindEpilog(p.epilog);
  const DType aux_type = AuxDType(p.dtype_d);
  auto bytes = [](DType dtype) { return static_cast<int64_t>(ElementBytes(dtype)); };
  ScratchLayout layout;
  auto take = [&](int64_t size) {
    void* at = reinterpret_cast<void*>(base + layout.bytes);
    layout.bytes += (static_cast<size_t>(size) + 255) & ~size_t{255};
    return at;
  };
  // An input part, filled with `dtype`'s pattern; consecutive parts of one type are one
  // fill (so 16/32-bit problems, whose inputs share one type, have a single fill).
  auto take_input = [&](int64_t size, DType dtype) {
    const size_t offset = layout.bytes;
    void* at = take(size);
    if (!layout.fills.empty() && layout.fills.back().dtype == dtype)
      layout.fills.back().bytes = layout.bytes - layout.fills.back().offset;
    else
      layout.fills.push_back({offset, layout.bytes - offset, dtype});
    return at;
  };
  CallBuffers& scratch = layout.buffers;
  scratch.a = take_input(p.batch * p.m * p.k * bytes(p.dtype), p.dtype);
  scratch.b = take_input(p.batch_b * p.n * p.k * bytes(p.dtype_b), p.dtype_b);
  if (epilog.bias_in) scratch.bias = take_input(p.batch_bias * p.n * bytes(aux_type), aux_type);
  // Any bytes are a ReLU mask; the aux type's pattern serves it too.
  if (epilog.aux_in != Aux::kNone) scratch.aux = take_input(AuxBytes(epilog.aux_in, p), aux_type);
  if (p.has_c) scratch.c = take_input(p.batch * p.m * p.n * bytes(p.dtype_d), p.dtype_d);
  // Block scales: tensors in cuBLASLt's layout, filled with the float32 pattern like the
  // inputs (so a candidate that reads them in another order fails the check).
  if (p.block_scaled()) {
    const int64_t f32 = bytes(DType::kF32);
    scratch.scale_a =
        take_input(BlockScaleShape(p.a_block_rows, p.m, p.k).elements() * f32, DType::kF32);
    scratch.scale_b =
        take_input(BlockScaleShape(p.b_block_rows, p.n, p.k).elements() * f32, DType::kF32);
  }
  // alpha and beta: both terms of alpha P + beta C of the inputs' order of magnitude, so a
  // candidate that mishandles either fails the check. FP8 scales: a's and b's 1 (unless
  // block-scaled, above), an FP8 y's 1/sqrt(K) keeping it of order 1, far inside e4m3's
  // largest finite value (448).
  if (p.has_c) layout.scalar_values = {InverseSqrtK(p.k), 1.0f};
  if (IsFp8(p.dtype)) {
    if (!p.block_scaled()) layout.scalar_values.insert(layout.scalar_values.end(), {1.0f, 1.0f});
    layout.scalar_values.push_back(InverseSqrtK(p.k));
  }
  // Each scalar in a part of its own (kScalarSlot floats), 256-byte aligned like the
  // stand-ins the heuristic chose for (SetStandInPointers) and like XLA's buffers: on the
  // H200 cuBLASLt refused (NOT_SUPPORTED) an FP8 plan whose scales were 4 bytes apart.
  if (!layout.scalar_values.empty()) {
    std::vector<float> slots(layout.scalar_values.size() * kScalarSlot, 0.0f);
    for (size_t i = 0; i < layout.scalar_values.size(); ++i)
      slots[i * kScalarSlot] = layout.scalar_values[i];
    layout.scalar_values = std::move(slots);
    layout.scalars = take(static_cast<int64_t>(layout.scalar_values.size() * sizeof(float)));
    const float* scalar = static_cast<const float*>(layout.scalars);
    auto next = [&] {
      const float* at = scalar;
      scalar += kScalarSlot;
      return at;
    };
    if (p.has_c) {
      scratch.alpha = next();
      scratch.beta = next();
    }
    if (IsFp8(p.dtype)) {
      if (!p.block_scaled()) {
        scratch.scale_a = next();
        scratch.scale_b = next();
      }
      if (IsFp8(p.dtype_d)) scratch.scale_d = next();
    }
  }
  scratch.y = take(p.batch * p.m * p.n * bytes(p.dtype_d));
  if (epilog.aux_out != Aux::kNone) scratch.aux = take(AuxBytes(epilog.aux_out, p));
  if (epilog.bias_grad != BiasGrad::kNone)
    scratch.bias = take(p.batch * epilog.BiasGradLength(p.m, p.n) * bytes(aux_type));
  if (p.amax) scratch.amax = take(sizeof(float));
  scratch.workspace = take(static_cast<int64_t>(p.workspace_bytes));
  scratch.workspace_bytes = p.workspace_bytes;
  return layout;
}

float ToFloat(DType dtype, const uint8_t* at) {
  if (dtype == DType::kE4M3) {  // no infinities; S.1111.111 is NaN
    const int exponent = (*at >> 3) & 0xf;
    const int mantissa = *at & 7;
    float value;
    if (exponent == 15 && mantissa == 7)
      value = std::numeric_limits<float>::quiet_NaN();
    else if (exponent == 0)
      value = std::ldexp(static_cast<float>(mantissa), -9);
    else
      value = std::ldexp(static_cast<float>(mantissa | 8), exponent - 10);
    return (*at & 0x80) ? -value : value;
  }
  if (dtype == DType::kE5M2) {  // float16's upper byte
    const uint16_t half = static_cast<uint16_t>(*at << 8);
    return ToFloat(DType::kF16, reinterpret_cast<const uint8_t*>(&half));
  }
  if (dtype == DType::kF32) {
    float value;
    std::memcpy(&value, at, sizeof(value));
    return value;
  }
  uint16_t half;
  std::memcpy(&half, at, sizeof(half));
  if (dtype == DType::kBF16) {
    const uint32_t bits = uint32_t{half} << 16;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  const int exponent = (half >> 10) & 0x1f;
  const uint32_t mantissa = half & 0x3ff;
  float value;
  if (exponent == 0)
    value = std::ldexp(static_cast<float>(mantissa), -24);
  else if (exponent == 31)
    value = mantissa ? std::numeric_limits<float>::quiet_NaN()
                     : std::numeric_limits<float>::infinity();
  else
    value = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  return (half & 0x8000) ? -value : value;
}

// A fixed pseudo-random sequence of `dtype` values, ±[1/8, 2) (a float16 with a 7-bit
// mantissa, so exact in every 16/32-bit dtype; for FP8 the top 2 of those bits, exact in
// e4m3 and e5m2), `bytes` long rounded down to whole elements. The fill at `offset` starts
// the sequence there, so that fills of different types (a and b) do not repeat each other.
std::vector<uint8_t> Pattern(DType dtype, size_t bytes, size_t offset) {
  const size_t elem = ElementBytes(dtype);
  std::vector<uint8_t> pattern(bytes / elem * elem);
  uint64_t state = 0x9e3779b97f4a7c15ull + offset;
  for (size_t at = 0; at < pattern.size(); at += elem) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;  // Knuth's MMIX LCG
    const uint32_t bits = static_cast<uint32_t>(state >> 33);
    const uint32_t exponent = 12 + (bits >> 16) % 4;  // 2^-3 .. 2^0
    const uint32_t mantissa = IsFp8(dtype) ? (bits & 0x60) << 3 : (bits & 0x7f) << 3;
    const uint16_t half = static_cast<uint16_t>((bits & 0x8000) | exponent << 10 | mantissa);
    const float value = ToFloat(DType::kF16, reinterpret_cast<const uint8_t*>(&half));
    uint32_t word;
    std::memcpy(&word, &value, sizeof(word));
    const uint16_t top = static_cast<uint16_t>(word >> 16);
    // e5m2 is float16's upper byte; e4m3 has the sign, the exponent rebiased from 15 to 7
    // and the two mantissa bits followed by a 0 (never S.1111.111, NaN).
    const uint8_t e5m2 = static_cast<uint8_t>(half >> 8);
    const uint8_t e4m3 =
        static_cast<uint8_t>((e5m2 & 0x80) | (exponent - 8) << 3 | (e5m2 & 3) << 1);
    const void* source = dtype == DType::kF32    ? static_cast<const void*>(&word)
                         : dtype == DType::kBF16 ? static_cast<const void*>(&top)
                         : dtype == DType::kE4M3 ? static_cast<const void*>(&e4m3)
                         : dtype == DType::kE5M2 ? static_cast<const void*>(&e5m2)
                                                 : static_cast<const void*>(&half);
    std::memcpy(pattern.data() + at, source, elem);
  }
  return pattern;
}

// Fills the scratch inputs (`fills` of `base`) with Pattern: the tuning's inputs are
// defined, whatever the call's buffers hold (NaN or Inf there would make every candidate's
// check fail). Each fill's pattern is made once on the host (at most kPatternBytes, held in
// `patterns` until the stream is synchronised) and doubled on the device by device-to-device
// copies; every scratch part starts on an element.
ffi::Error FillInputs(const std::vector<Fill>& fills, uintptr_t base, cudaStream_t stream,
                      std::vector<std::vector<uint8_t>>* patterns) {
  const std::string what = "filling the autotuning inputs";
  patterns->clear();
  for (const Fill& fill : fills) {
    patterns->push_back(Pattern(fill.dtype, std::min(fill.bytes, kPatternBytes), fill.offset));
    const std::vector<uint8_t>& pattern = patterns->back();
    const uintptr_t start = base + fill.offset;
    JAX_EPILOG_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(start), pattern.data(),
                                    pattern.size(), cudaMemcpyHostToDevice, stream), what);
    for (size_t filled = pattern.size(); filled > 0 && filled < fill.bytes; filled *= 2)
      JAX_EPILOG_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(start + filled),
                                      reinterpret_cast<void*>(start),
                                      std::min(filled, fill.bytes - filled),
                                      cudaMemcpyDeviceToDevice, stream), what);
  }
  return ffi::Error::Success();
}

// Copies the layout's scalars (alpha, beta, FP8 scales) to the device; the layout holds the
// host values until the stream is synchronised, as FillInputs' patterns.
ffi::Error SetScalars(const ScratchLayout& layout, cudaStream_t stream) {
  if (layout.scalar_values.empty()) return ffi::Error::Success();
  JAX_EPILOG_CUDA(cudaMemcpyAsync(layout.scalars, layout.scalar_values.data(),
                                  layout.scalar_values.size() * sizeof(float),
                                  cudaMemcpyHostToDevice, stream),
                  "setting alpha, beta and the FP8 scales for autotuning");
  return ffi::Error::Success();
}

// One candidate's checked outputs, as floats, one part per output, with the type it was
// stored in.
struct SampledOutput {
  DType dtype;
  std::vector<float> values;
};
using Sample = std::vector<SampledOutput>;

ffi::Error SampleOutputs(const Problem& p, const CallBuffers& buffers, cudaStream_t stream,
                         Sample* sample) {
  const EpilogInfo& epilog = *FindEpilog(p.epilog);
  const DType aux_type = AuxDType(p.dtype_d);
  struct Part {
    const void* at;
    size_t bytes;
    DType dtype;
  };
  std::vector<Part> parts = {
      {buffers.y,
       std::min(static_cast<size_t>(p.batch * p.m * p.n) * ElementBytes(p.dtype_d), kCheckBytes),
       p.dtype_d}};
  if (epilog.aux_out == Aux::kGelu)
    parts.push_back({buffers.aux,
                     std::min(static_cast<size_t>(AuxBytes(Aux::kGelu, p)), kCheckBytes),
                     aux_type});
  if (epilog.bias_grad != BiasGrad::kNone)
    parts.push_back({buffers.bias,
                     static_cast<size_t>(p.batch * epilog.BiasGradLength(p.m, p.n)) *
                         ElementBytes(aux_type),
                     aux_type});
  if (p.amax) parts.push_back({buffers.amax, sizeof(float), DType::kF32});
  std::vector<std::vector<uint8_t>> host(parts.size());
  const std::string what = "reading a candidate's outputs back, to autotune";
  for (size_t i = 0; i < parts.size(); ++i) {
    host[i].resize(parts[i].bytes);
    JAX_EPILOG_CUDA(cudaMemcpyAsync(host[i].data(), parts[i].at, parts[i].bytes,
                                    cudaMemcpyDeviceToHost, stream), what);
  }
  JAX_EPILOG_CUDA(cudaStreamSynchronize(stream), what);
  sample->assign(parts.size(), {});
  for (size_t i = 0; i < parts.size(); ++i) {
    const size_t elem = ElementBytes(parts[i].dtype);
    (*sample)[i].dtype = parts[i].dtype;
    for (size_t at = 0; at + elem <= host[i].size(); at += elem)
      (*sample)[i].values.push_back(ToFloat(parts[i].dtype, host[i].data() + at));
  }
  return ffi::Error::Success();
}

// The spacing of `dtype`'s values at magnitude `x` for FP8 (3 mantissa bits in e4m3, 2 in
// e5m2); 0 for 16/32-bit types, whose rounding is far inside kCheckTolerance.
float Fp8Spacing(DType dtype, float x) {
  if (!IsFp8(dtype) || !(x > 0.0f)) return 0.0f;
  int exponent = 0;
  std::frexp(x, &exponent);  // x in [2^(exponent-1), 2^exponent)
  return std::ldexp(1.0f, exponent - 1 - (dtype == DType::kE4M3 ? 3 : 2));
}

// Whether every value of `got` is within kCheckTolerance of `reference` (NaN never is). An
// FP8 output may also differ by one step of its format at the sample's largest magnitude:
// two correct candidates sum in different orders, and a float32 result that lands near the
// midpoint of two FP8 values rounds to either (a step there is 1/16 to 1/8 of the value in
// e4m3, 1/8 to 1/4 in e5m2, more than kCheckTolerance alone allows).
bool Agrees(const Sample& reference, const Sample& got) {
  for (size_t part = 0; part < reference.size(); ++part) {
    const std::vector<float>& want = reference[part].values;
    float scale = 0.0f;
    for (float value : want) scale = std::max(scale, std::fabs(value));
    const float allowed = kCheckTolerance * scale + Fp8Spacing(reference[part].dtype, scale);
    for (size_t i = 0; i < want.size(); ++i)
      if (!(std::fabs(got[part].values[i] - want[i]) <= allowed)) return false;
  }
  return true;
}

// Stream-ordered scratch memory, freed on the stream (at the latest when it goes out
// of scope).
class Scratch {
 public:
  explicit Scratch(cudaStream_t stream) : stream_(stream) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { Release(); }
  // False when the memory is not there (the failure is cleared: it is no error).
  bool Allocate(size_t bytes) {
    if (cudaMallocAsync(&base_, bytes, stream_) == cudaSuccess) return true;
    base_ = nullptr;
    cudaGetLastError();
    return false;
  }
  void Release() {
    if (base_ != nullptr) cudaFreeAsync(base_, stream_);
    base_ = nullptr;
  }
  uintptr_t base() const { return reinterpret_cast<uintptr_t>(base_); }

 private:
  cudaStream_t stream_;
  void* base_ = nullptr;
};

class Events {
 public:
  Events() = default;
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  ~Events() {
    for (cudaEvent_t event : events_) cudaEventDestroy(event);
  }
  ffi::Error Create(size_t count) {
    for (size_t i = 0; i < count; ++i) {
      cudaEvent_t event = nullptr;
      JAX_EPILOG_CUDA(cudaEventCreate(&event), "creating a CUDA event for autotuning");
      events_.push_back(event);
    }
    return ffi::Error::Success();
  }
  cudaEvent_t operator[](size_t i) const { return events_[i]; }

 private:
  std::vector<cudaEvent_t> events_;
};

// Lets this thread synchronise and allocate even while another thread captures a
// CUDA graph in global mode (which would otherwise forbid it).
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&previous_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&previous_); }

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

// The ids `attr` (CUBLASLT_ALGO_CAP_TILE_IDS or _STAGES_IDS) lists for `algo`, or {`none`}
// (the attribute's undefined value) when it lists none.
std::vector<uint32_t> CapIds(const cublasLtMatmulAlgo_t& algo,
                             cublasLtMatmulAlgoCapAttributes_t attr, uint32_t none) {
  size_t bytes = 0;
  std::vector<uint32_t> ids;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) ==
          CUBLAS_STATUS_SUCCESS &&
      bytes >= sizeof(uint32_t)) {
    ids.resize(bytes / sizeof(uint32_t));
    if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, ids.data(), ids.size() * sizeof(uint32_t),
                                          &bytes) == CUBLAS_STATUS_SUCCESS)
      ids.resize(bytes / sizeof(uint32_t));
    else
      ids.clear();
  }
  if (ids.empty()) ids.push_back(none);
  return ids;
}

template <typename T>
bool SetConfig(cublasLtMatmulAlgo_t* algo, cublasLtMatmulAlgoConfigAttributes_t attr, T value) {
  return cublasLtMatmulAlgoConfigSetAttribute(algo, attr, &value, sizeof(value)) ==
         CUBLAS_STATUS_SUCCESS;
}

// Algorithms for the plan's problem found without the heuristic: every algorithm id cuBLASLt
// has for the plan's compute, scale and A/B/C/D types (read off its descriptor and layouts),
// one configuration per id and tile (the first stages id that fits), split-K 1, the cluster
// shape left to cuBLASLt (CUBLASLT_CLUSTER_SHAPE_AUTO: this header lists no cluster shape
// capability). Of those that fit (AlgoFits) at most `max_count`, evenly spaced over all of
// them (by id, then tile), so that the cap leaves no range of ids or tiles out.
std::vector<cublasLtMatmulAlgo_t> EnumeratedCandidates(Plan& plan, size_t max_count) {
  int32_t compute = 0, scale = 0;
  uint32_t types[4] = {};  // cuBLASLt's A, B, C, D
  const cublasLtMatrixLayout_t layouts[4] = {plan.layout_a.get(), plan.layout_b.get(),
                                             plan.c_layout(), plan.layout_cd.get()};
  size_t written = 0;
  cublasLtMatmulDesc_t desc = plan.desc.get();
  if (cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &compute,
                                     sizeof(compute), &written) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescGetAttribute(desc, CUBLASLT_MATMUL_DESC_SCALE_TYPE, &scale,
                                     sizeof(scale), &written) != CUBLAS_STATUS_SUCCESS)
    return {};
  for (int i = 0; i < 4; ++i)
    if (cublasLtMatrixLayoutGetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_TYPE, &types[i],
                                         sizeof(types[i]), &written) != CUBLAS_STATUS_SUCCESS)
      return {};
  const auto compute_type = static_cast<cublasComputeType_t>(compute);
  const auto scale_type = static_cast<cudaDataType_t>(scale);
  const auto type = [&](int i) { return static_cast<cudaDataType_t>(types[i]); };
  std::vector<int> ids(kMaxAlgoIds);
  int id_count = 0;
  if (cublasLtMatmulAlgoGetIds(plan.handle, compute_type, scale_type, type(0), type(1), type(2),
                               type(3), kMaxAlgoIds, ids.data(), &id_count) !=
      CUBLAS_STATUS_SUCCESS)
    return {};
  std::vector<cublasLtMatmulAlgo_t> fitting;
  for (int i = 0; i < std::min(id_count, kMaxAlgoIds); ++i) {
    cublasLtMatmulAlgo_t base{};
    if (cublasLtMatmulAlgoInit(plan.handle, compute_type, scale_type, type(0), type(1), type(2),
                               type(3), ids[i], &base) != CUBLAS_STATUS_SUCCESS ||
        !SetConfig(&base, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, int32_t{1}))
      continue;
    const std::vector<uint32_t> stages =
        CapIds(base, CUBLASLT_ALGO_CAP_STAGES_IDS, CUBLASLT_MATMUL_STAGES_UNDEFINED);
    for (uint32_t tile : CapIds(base, CUBLASLT_ALGO_CAP_TILE_IDS, CUBLASLT_MATMUL_TILE_UNDEFINED))
      for (uint32_t stage : stages) {
        cublasLtMatmulAlgo_t algo = base;
        if (SetConfig(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, tile) &&
            SetConfig(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, stage) && AlgoFits(plan, algo)) {
          fitting.push_back(algo);
          break;
        }
      }
  }
  if (fitting.size() <= max_count) return fitting;
  std::vector<cublasLtMatmulAlgo_t> spaced;
  for (size_t i = 0; i < max_count; ++i) spaced.push_back(fitting[i * fitting.size() / max_count]);
  return spaced;
}

// The candidates to time, the plan's current choice first: the heuristic's (up to
// kMaxCandidates, kMaxFp8Candidates for FP8 operands) and, for FP8 operands where the
// heuristic gives fewer than 2, the enumerated ones (EnumeratedCandidates) up to the same
// cap; false when the heuristic gives none.
bool Candidates(Plan& plan, std::vector<cublasLtMatmulAlgo_t>* candidates) {
  const bool fp8 = IsFp8(plan.problem.dtype);
  const int max_count = fp8 ? kMaxFp8Candidates : kMaxCandidates;
  std::vector<cublasLtMatmulHeuristicResult_t> results;
  if (!HeuristicCandidates(plan, max_count, &results).success()) return false;
  *candidates = {plan.algo};
  auto add = [&](const cublasLtMatmulAlgo_t& algo) {
    for (const cublasLtMatmulAlgo_t& known : *candidates)
      if (std::memcmp(&known, &algo, sizeof(algo)) == 0) return;
    if (candidates->size() < static_cast<size_t>(max_count)) candidates->push_back(algo);
  };
  for (const auto& result : results) add(result.algo);
  if (fp8 && candidates->size() < 2)
    for (const auto& algo : EnumeratedCandidates(plan, max_count - candidates->size())) add(algo);
  return true;
}

// One warm-up launch of each candidate; `ok` says which ran and computed what the first
// (the heuristic's choice) computed. The amax is zeroed before each, as RunPlan does, so each
// candidate's is its own, not the previous candidate's.
ffi::Error CheckCandidates(Plan& plan, const std::vector<cublasLtMatmulAlgo_t>& candidates,
                           const CallBuffers& buffers, cudaStream_t stream,
                           std::vector<bool>* ok, cublasStatus_t* first_status) {
  ok->assign(candidates.size(), false);
  Sample reference;  // the heuristic's outputs
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (buffers.amax != nullptr)
      JAX_EPILOG_CUDA(cudaMemsetAsync(buffers.amax, 0, sizeof(float), stream),
                      "zeroing the amax, to autotune " + plan.description);
    const cublasStatus_t status = Enqueue(plan, buffers, candidates[i], stream);
    if (i == 0) *first_status = status;
    (*ok)[i] = status == CUBLAS_STATUS_SUCCESS;
    if (!(*ok)[i]) continue;
    Sample sample;
    JAX_EPILOG_RETURN_IF_ERROR(SampleOutputs(plan.problem, buffers, stream, &sample));
    if (i == 0)
      reference = std::move(sample);
    else
      (*ok)[i] = Agrees(reference, sample);
  }
  return ffi::Error::Success();
}

// Each candidate still `ok`'s best round in milliseconds (`ms`, infinite for the others):
// kRounds rounds over all candidates in turn, kLaunchesPerRound launches between two
// events each, then one synchronisation (after the scratch memory is freed on the stream).
ffi::Error TimeCandidates(Plan& plan, const std::vector<cublasLtMatmulAlgo_t>& candidates,
                          const CallBuffers& buffers, cudaStream_t stream, Scratch* scratch,
                          std::vector<bool>* ok, std::vector<float>* ms) {
  const size_t count = candidates.size();
  Events events;
  JAX_EPILOG_RETURN_IF_ERROR(events.Create(2 * kRounds * count));
  const std::string what = "timing candidates to autotune " + plan.description;
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < count; ++i) {
      if (!(*ok)[i]) continue;
      const size_t start = 2 * (round * count + i);
      JAX_EPILOG_CUDA(cudaEventRecord(events[start], stream), what);
      for (int launch = 0; launch < kLaunchesPerRound && (*ok)[i]; ++launch)
        (*ok)[i] = Enqueue(plan, buffers, candidates[i], stream) == CUBLAS_STATUS_SUCCESS;
      JAX_EPILOG_CUDA(cudaEventRecord(events[start + 1], stream), what);
    }
  }
  scratch->Release();
  JAX_EPILOG_CUDA(cudaStreamSynchronize(stream), what);

  ms->assign(count, std::numeric_limits<float>::infinity());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < count; ++i) {
      if (!(*ok)[i]) continue;
      const size_t start = 2 * (round * count + i);
      float elapsed = 0.0f;
      JAX_EPILOG_CUDA(cudaEventElapsedTime(&elapsed, events[start], events[start + 1]), what);
      (*ms)[i] = std::min((*ms)[i], elapsed);
    }
  }
  for (size_t i = 0; i < count; ++i)
    if (!(*ok)[i]) (*ms)[i] = std::numeric_limits<float>::infinity();
  return ffi::Error::Success();
}

// The index of the fastest candidate, given each one's best round in milliseconds
// (infinite for one cuBLASLt rejected): the first, the heuristic's choice, unless
// another is clearly faster; -1 when every candidate failed.
int Fastest(const std::vector<float>& ms) {
  int best = -1;
  for (size_t i = 0; i < ms.size(); ++i)
    if (ms[i] < std::numeric_limits<float>::infinity() && (best < 0 || ms[i] < ms[best]))
      best = static_cast<int>(i);
  if (best > 0 && ms[best] > ms[0] * (1.0f - kMinGain)) return 0;
  return best;
}

// With the log on (SetAutotuneLog), one line per tuned problem on stderr: each
// candidate's milliseconds per launch (heuristic order; "-" for rejected) and the choice.
void LogTuning(const std::string& problem, const std::vector<float>& ms, int winner) {
  if (!autotune_log.load(std::memory_order_relaxed)) return;
  std::string times;
  for (size_t i = 0; i < ms.size(); ++i) {
    char text[32] = "-";
    if (ms[i] < std::numeric_limits<float>::infinity())
      std::snprintf(text, sizeof(text), "%.4f", ms[i] / kLaunchesPerRound);
    times += (i ? " " : "") + std::string(text);
  }
  std::fprintf(stderr, "jax_epilog autotune: %s: ms per launch [%s] -> candidate %d\n",
               problem.c_str(), times.c_str(), winner);
}

// With the log on, why a problem was left with the heuristic's choice.
void LogNotTuned(const std::string& problem, const char* why) {
  if (autotune_log.load(std::memory_order_relaxed))
    std::fprintf(stderr, "jax_epilog autotune: %s: not tuned: %s\n", problem.c_str(), why);
}

}  // namespace

bool AutotuneEnabled() { return autotune_on.load(std::memory_order_relaxed); }

void SetAutotune(bool enabled) { autotune_on.store(enabled, std::memory_order_relaxed); }

void SetAutotuneLog(bool enabled) { autotune_log.store(enabled, std::memory_order_relaxed); }

bool ApplyStoredAlgo(Plan& plan) {
  std::string key;
  cublasLtMatmulAlgo_t algo{};
  if (!StoreKey(plan.problem, &key).success() || !ProcessAlgoStore().LookUp(key, &algo) ||
      !AlgoFits(plan, algo))
    return false;
  plan.algo = algo;
  plan.tuned = true;
  return true;
}

ffi::Error TunePlan(Plan& plan, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(plan.mutex);
  if (plan.tuned) return ffi::Error::Success();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JAX_EPILOG_CUDA(cudaStreamIsCapturing(stream, &capture),
                  "asking whether XLA's stream is capturing, to autotune " + plan.description);
  // Timing needs synchronisation, which capture forbids: a later call tunes.
  if (capture != cudaStreamCaptureStatusNone) return ffi::Error::Success();
  ScopedDevice scoped;
  JAX_EPILOG_RETURN_IF_ERROR(scoped.Enter(plan.device));
  RelaxedCaptureMode relaxed;
  if (ApplyStoredAlgo(plan)) return ffi::Error::Success();
  plan.tuned = true;  // tuned once, whatever happens below

  std::vector<cublasLtMatmulAlgo_t> candidates;
  Scratch scratch(stream);
  if (!Candidates(plan, &candidates)) {
    LogNotTuned(plan.description, "cuBLASLt's heuristic failed");
    return ffi::Error::Success();
  }
  if (candidates.size() < 2) {
    LogNotTuned(plan.description, "a single candidate");
    return ffi::Error::Success();
  }
  if (!scratch.Allocate(LayOut(plan.problem, 0).bytes)) {
    LogNotTuned(plan.description, "no scratch memory");
    return ffi::Error::Success();
  }
  const ScratchLayout layout = LayOut(plan.problem, scratch.base());
  std::vector<std::vector<uint8_t>> patterns;
  JAX_EPILOG_RETURN_IF_ERROR(FillInputs(layout.fills, scratch.base(), stream, &patterns));
  JAX_EPILOG_RETURN_IF_ERROR(SetScalars(layout, stream));
  JAX_EPILOG_RETURN_IF_ERROR(SetCallPointers(plan, layout.buffers));

  std::vector<bool> ok;
  cublasStatus_t first_status = CUBLAS_STATUS_SUCCESS;
  JAX_EPILOG_RETURN_IF_ERROR(
      CheckCandidates(plan, candidates, layout.buffers, stream, &ok, &first_status));
  if (!ok[0]) {  // nothing to check the others against
    LogNotTuned(plan.description, ("the heuristic's choice did not run on the scratch buffers: " +
                                   StatusName(first_status)).c_str());
    return ffi::Error::Success();
  }
  std::vector<float> ms;
  JAX_EPILOG_RETURN_IF_ERROR(
      TimeCandidates(plan, candidates, layout.buffers, stream, &scratch, &ok, &ms));
  const int winner = Fastest(ms);
  LogTuning(plan.description, ms, winner);
  if (winner < 0) return ffi::Error::Success();
  plan.algo = candidates[winner];
  std::string key;
  if (StoreKey(plan.problem, &key).success()) ProcessAlgoStore().Put(key, plan.algo);
  return ffi::Error::Success();
}

}  // namespace jax_epilog
