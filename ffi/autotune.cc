#include "autotune.h"

#include <algorithm>
#include <array>
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
// Candidates are timed in turn, twice over, so drift of the GPU's clock hits all alike;
// each time is a few back-to-back launches between one pair of events.
constexpr int kRounds = 2;
constexpr int kLaunchesPerRound = 3;
// Another candidate replaces the heuristic's first only when clearly faster than
// timing noise (about 1% between rounds).
constexpr float kMinGain = 0.02f;

// A candidate must compute what the heuristic's choice computes: its outputs (the whole
// bias gradient, the first kCheckBytes of y and of a GELU pre-activation) are read back and
// compared with the heuristic's, and one that differs by more than rounding is dropped.
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
// likewise FP8 fast accumulation adds " fast_accum=1" (FP8 plans are not tuned yet, see
// TunePlan, but their key already tells the two accumulation modes apart).
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
         (p.fast_accumulation ? " fast_accum=1" : std::string());
  return ffi::Error::Success();
}

// Bytes of the epilog's aux matrix (input or output).
int64_t AuxBytes(Aux aux, const Problem& p) {
  return p.batch * p.m * AuxRow(aux, p.n) * static_cast<int64_t>(AuxElementBytes(aux, p.dtype_d));
}

// Scratch stand-ins for every buffer of a call, parts of one allocation at `base`, each
// 256-byte aligned: the inputs first (`input_bytes` of them, filled by FillInputs), then
// alpha and beta of a problem with c (`scalars`, set by SetScalars), then the outputs and
// the workspace; `bytes` in all.
struct ScratchLayout {
  CallBuffers buffers;
  size_t input_bytes = 0;
  void* scalars = nullptr;
  size_t bytes = 0;
};

ScratchLayout LayOut(const Problem& p, uintptr_t base) {
  const EpilogInfo& epilog = *FindEpilog(p.epilog);
  const int64_t elem = static_cast<int64_t>(ElementBytes(p.dtype));
  ScratchLayout layout;
  auto take = [&](int64_t size) {
    void* at = reinterpret_cast<void*>(base + layout.bytes);
    layout.bytes += (static_cast<size_t>(size) + 255) & ~size_t{255};
    return at;
  };
  CallBuffers& scratch = layout.buffers;
  scratch.a = take(p.batch * p.m * p.k * elem);
  scratch.b = take(p.batch_b * p.n * p.k * elem);
  if (epilog.bias_in) scratch.bias = take(p.batch_bias * p.n * elem);
  if (epilog.aux_in != Aux::kNone) scratch.aux = take(AuxBytes(epilog.aux_in, p));
  if (p.has_c) scratch.c = take(p.batch * p.m * p.n * elem);
  layout.input_bytes = layout.bytes;
  if (p.has_c) {
    layout.scalars = take(2 * sizeof(float));
    scratch.alpha = layout.scalars;
    scratch.beta = static_cast<const float*>(layout.scalars) + 1;
  }
  scratch.y = take(p.batch * p.m * p.n * elem);
  if (epilog.aux_out != Aux::kNone) scratch.aux = take(AuxBytes(epilog.aux_out, p));
  if (epilog.bias_grad != BiasGrad::kNone)
    scratch.bias = take(p.batch * epilog.BiasGradLength(p.m, p.n) * elem);
  scratch.workspace = take(static_cast<int64_t>(p.workspace_bytes));
  scratch.workspace_bytes = p.workspace_bytes;
  return layout;
}

float ToFloat(DType dtype, const uint8_t* at) {
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
// mantissa, so exact in every dtype), `bytes` long rounded down to whole elements.
std::vector<uint8_t> Pattern(DType dtype, size_t bytes) {
  const size_t elem = ElementBytes(dtype);
  std::vector<uint8_t> pattern(bytes / elem * elem);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (size_t at = 0; at < pattern.size(); at += elem) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;  // Knuth's MMIX LCG
    const uint32_t bits = static_cast<uint32_t>(state >> 33);
    const uint32_t exponent = 12 + (bits >> 16) % 4;  // 2^-3 .. 2^0
    const uint16_t half =
        static_cast<uint16_t>((bits & 0x8000) | exponent << 10 | (bits & 0x7f) << 3);
    const float value = ToFloat(DType::kF16, reinterpret_cast<const uint8_t*>(&half));
    uint32_t word;
    std::memcpy(&word, &value, sizeof(word));
    const uint16_t top = static_cast<uint16_t>(word >> 16);
    const void* source = dtype == DType::kF32    ? static_cast<const void*>(&word)
                         : dtype == DType::kBF16 ? static_cast<const void*>(&top)
                                                 : static_cast<const void*>(&half);
    std::memcpy(pattern.data() + at, source, elem);
  }
  return pattern;
}

// Fills the first `bytes` of `base` (the scratch inputs) with Pattern: the tuning's
// inputs are defined, whatever the call's buffers hold (NaN or Inf there would make
// every candidate's check fail). The pattern is made once on the host (at most
// kPatternBytes, held in `pattern` until the stream is synchronised) and doubled on the
// device by device-to-device copies; every scratch part starts on an element.
ffi::Error FillInputs(DType dtype, uintptr_t base, size_t bytes, cudaStream_t stream,
                      std::vector<uint8_t>* pattern) {
  *pattern = Pattern(dtype, std::min(bytes, kPatternBytes));
  const std::string what = "filling the autotuning inputs";
  void* start = reinterpret_cast<void*>(base);
  JAX_EPILOG_CUDA(cudaMemcpyAsync(start, pattern->data(), pattern->size(),
                                  cudaMemcpyHostToDevice, stream), what);
  for (size_t filled = pattern->size(); filled > 0 && filled < bytes; filled *= 2)
    JAX_EPILOG_CUDA(cudaMemcpyAsync(reinterpret_cast<void*>(base + filled), start,
                                    std::min(filled, bytes - filled),
                                    cudaMemcpyDeviceToDevice, stream), what);
  return ffi::Error::Success();
}

// alpha and beta of a problem with c, so that both terms of alpha P + beta C are of the
// inputs' order of magnitude and a candidate that mishandles either fails the check:
// beta = 1, alpha = 2^-ceil(log2(K) / 2), about 1/sqrt(K) (P, a sum of K terms of random
// sign, grows as sqrt(K)), exact in float32. `host` holds them until the stream is
// synchronised, as FillInputs' pattern.
ffi::Error SetScalars(const Problem& p, void* scalars, cudaStream_t stream,
                      std::array<float, 2>* host) {
  int half_log2_k = 0;
  while ((int64_t{1} << (2 * half_log2_k)) < p.k) ++half_log2_k;
  *host = {std::ldexp(1.0f, -half_log2_k), 1.0f};
  JAX_EPILOG_CUDA(cudaMemcpyAsync(scalars, host->data(), sizeof(*host), cudaMemcpyHostToDevice,
                                  stream),
                  "setting alpha and beta for autotuning");
  return ffi::Error::Success();
}

// One candidate's checked outputs, as floats, one vector per output.
using Sample = std::vector<std::vector<float>>;

ffi::Error SampleOutputs(const Problem& p, const CallBuffers& buffers, cudaStream_t stream,
                         Sample* sample) {
  const EpilogInfo& epilog = *FindEpilog(p.epilog);
  const size_t elem = ElementBytes(p.dtype);
  auto capped = [&](int64_t elements) {
    return std::min(static_cast<size_t>(elements) * elem, kCheckBytes);
  };
  std::vector<std::pair<const void*, size_t>> parts = {{buffers.y, capped(p.batch * p.m * p.n)}};
  if (epilog.aux_out == Aux::kGelu)
    parts.emplace_back(buffers.aux, std::min(static_cast<size_t>(AuxBytes(Aux::kGelu, p)),
                                             kCheckBytes));
  if (epilog.bias_grad != BiasGrad::kNone)
    parts.emplace_back(buffers.bias,
                       static_cast<size_t>(p.batch * epilog.BiasGradLength(p.m, p.n)) * elem);
  std::vector<std::vector<uint8_t>> host(parts.size());
  const std::string what = "reading a candidate's outputs back, to autotune";
  for (size_t i = 0; i < parts.size(); ++i) {
    host[i].resize(parts[i].second);
    JAX_EPILOG_CUDA(cudaMemcpyAsync(host[i].data(), parts[i].first, parts[i].second,
                                    cudaMemcpyDeviceToHost, stream), what);
  }
  JAX_EPILOG_CUDA(cudaStreamSynchronize(stream), what);
  sample->assign(parts.size(), {});
  for (size_t i = 0; i < parts.size(); ++i)
    for (size_t at = 0; at + elem <= host[i].size(); at += elem)
      (*sample)[i].push_back(ToFloat(p.dtype, host[i].data() + at));
  return ffi::Error::Success();
}

// Whether every value of `got` is within kCheckTolerance of `reference` (NaN never is).
bool Agrees(const Sample& reference, const Sample& got) {
  for (size_t part = 0; part < reference.size(); ++part) {
    float scale = 0.0f;
    for (float value : reference[part]) scale = std::max(scale, std::fabs(value));
    const float allowed = kCheckTolerance * scale;
    for (size_t i = 0; i < reference[part].size(); ++i)
      if (!(std::fabs(got[part][i] - reference[part][i]) <= allowed)) return false;
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

// The heuristic's candidates, the plan's current choice first; false when the
// heuristic gives none.
bool Candidates(Plan& plan, std::vector<cublasLtMatmulAlgo_t>* candidates) {
  std::vector<cublasLtMatmulHeuristicResult_t> results;
  if (!HeuristicCandidates(plan, kMaxCandidates, &results).success()) return false;
  *candidates = {plan.algo};
  for (const auto& result : results)
    if (std::memcmp(&result.algo, &plan.algo, sizeof(plan.algo)) != 0)
      candidates->push_back(result.algo);
  return true;
}

// One warm-up launch of each candidate; `ok` says which ran and computed what the first
// (the heuristic's choice) computed.
ffi::Error CheckCandidates(Plan& plan, const std::vector<cublasLtMatmulAlgo_t>& candidates,
                           const CallBuffers& buffers, cudaStream_t stream,
                           std::vector<bool>* ok) {
  ok->assign(candidates.size(), false);
  Sample reference;  // the heuristic's outputs
  for (size_t i = 0; i < candidates.size(); ++i) {
    (*ok)[i] = Enqueue(plan, buffers, candidates[i], stream) == CUBLAS_STATUS_SUCCESS;
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

}  // namespace

bool AutotuneEnabled() { return autotune_on.load(std::memory_order_relaxed); }

void SetAutotune(bool enabled) { autotune_on.store(enabled, std::memory_order_relaxed); }

void SetAutotuneLog(bool enabled) { autotune_log.store(enabled, std::memory_order_relaxed); }

bool ApplyStoredAlgo(Plan& plan) {
  if (IsFp8(plan.problem.dtype)) return false;  // never tuned (TunePlan)
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
  // FP8 plans keep the heuristic's choice: the scratch stand-ins, their pattern and the
  // output check speak one 16/32-bit type for every buffer (not yet a's, b's and y's).
  if (IsFp8(plan.problem.dtype)) {
    plan.tuned = true;
    return ffi::Error::Success();
  }
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
  if (!Candidates(plan, &candidates) || candidates.size() < 2 ||
      !scratch.Allocate(LayOut(plan.problem, 0).bytes))
    return ffi::Error::Success();
  const ScratchLayout layout = LayOut(plan.problem, scratch.base());
  std::vector<uint8_t> pattern;
  JAX_EPILOG_RETURN_IF_ERROR(
      FillInputs(plan.problem.dtype, scratch.base(), layout.input_bytes, stream, &pattern));
  std::array<float, 2> scalars;
  if (plan.problem.has_c)
    JAX_EPILOG_RETURN_IF_ERROR(SetScalars(plan.problem, layout.scalars, stream, &scalars));
  JAX_EPILOG_RETURN_IF_ERROR(SetCallPointers(plan, layout.buffers));

  std::vector<bool> ok;
  JAX_EPILOG_RETURN_IF_ERROR(CheckCandidates(plan, candidates, layout.buffers, stream, &ok));
  if (!ok[0]) return ffi::Error::Success();  // nothing to check the others against
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
