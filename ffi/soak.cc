// Test only: the plan cache under many distinct problems in one process
// (benchmarks/soak.py, issue 15). Compiling an XLA program per shape would take hours,
// so this drives what the handler's execute stage does, GetPlan then RunPlan, directly,
// on buffers allocated once per call for the largest problem.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <iterator>
#include <memory>
#include <numeric>
#include <string>

#include "epilogs.h"
#include "plan.h"
#include "plan_cache.h"
#include "status.h"

namespace jax_epilog {
namespace {

// Operand types drawn; both 2 bytes, so one set of buffers serves every problem.
constexpr DType kSoakTypes[] = {DType::kBF16, DType::kF16};
constexpr int64_t kEpilogCount = static_cast<int64_t>(std::size(kEpilogs));
constexpr int64_t kTypeCount = static_cast<int64_t>(std::size(kSoakTypes));
constexpr size_t kElementBytes = 2;
// Problems enqueued between two synchronisations: often enough that a failing kernel is
// reported near the problem that launched it, rarely enough that the GPU stays busy.
constexpr int64_t kSyncEvery = 256;

// Problem `index` of the soak's space: m, n, k in [1, max_dim], every epilog, both
// transposes, both types. An affine map with a multiplier coprime to the space's size is
// a permutation of it, so distinct indices (below that size) give distinct problems,
// whichever calls they come from, and `seed` picks where the walk starts.
class ProblemSpace {
 public:
  explicit ProblemSpace(int64_t max_dim, uint64_t seed) : dim_(static_cast<uint64_t>(max_dim)) {
    size_ = dim_ * dim_ * dim_ * kEpilogCount * 4 * kTypeCount;
    multiplier_ = 0x9E3779B97F4A7C15ull % size_;  // spreads neighbours apart
    while (std::gcd(multiplier_, size_) != 1) ++multiplier_;
    offset_ = seed % size_;
  }
  uint64_t size() const { return size_; }

  Problem At(int device, uint64_t index) const {
    uint64_t r = static_cast<uint64_t>(
        (static_cast<unsigned __int128>(multiplier_) * index + offset_) % size_);
    auto digit = [&r](uint64_t base) {
      const uint64_t d = r % base;
      r /= base;
      return d;
    };
    Problem p;
    p.device = device;
    p.m = 1 + static_cast<int64_t>(digit(dim_));
    p.n = 1 + static_cast<int64_t>(digit(dim_));
    p.k = 1 + static_cast<int64_t>(digit(dim_));
    p.epilog = kEpilogs[digit(kEpilogCount)].value;
    p.transpose_a = digit(2) != 0;
    p.transpose_b = digit(2) != 0;
    p.dtype = p.dtype_b = p.dtype_d = kSoakTypes[digit(kTypeCount)];
    return p;
  }

 private:
  uint64_t dim_, size_, multiplier_ = 1, offset_ = 0;
};

// Device buffers for the largest problem, freed on scope exit.
struct DeviceBuffer {
  void* data = nullptr;
  ~DeviceBuffer() {
    if (data != nullptr) cudaFree(data);
  }
  ffi::Error Allocate(size_t bytes, const char* what) {
    JAX_EPILOG_CUDA(cudaMalloc(&data, bytes), std::string("allocating the soak's ") + what);
    JAX_EPILOG_CUDA(cudaMemset(data, 0, bytes), std::string("zeroing the soak's ") + what);
    return ffi::Error::Success();
  }
};

struct Stream {
  cudaStream_t stream = nullptr;
  ~Stream() {
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

struct SoakCounts {
  int64_t ran = 0, unsupported = 0, most_cached = 0;
};

ffi::Error Soak(int device, uint64_t seed, int64_t first, int64_t count, int64_t max_dim,
                uint64_t workspace_bytes, SoakCounts* counts) {
  if (max_dim < 1 || first < 0 || count < 0)
    return ffi::Error::InvalidArgument(
        "soak: expected max_dim >= 1, first >= 0 and count >= 0, got max_dim=" +
        std::to_string(max_dim) + ", first=" + std::to_string(first) +
        ", count=" + std::to_string(count));
  const ProblemSpace space(max_dim, seed);
  if (static_cast<uint64_t>(first) + static_cast<uint64_t>(count) > space.size())
    return ffi::Error::InvalidArgument(
        "soak: problems " + std::to_string(first) + ".." + std::to_string(first + count) +
        " exceed the " + std::to_string(space.size()) + " distinct problems with max_dim=" +
        std::to_string(max_dim));
  ScopedDevice scoped;
  JAX_EPILOG_RETURN_IF_ERROR(scoped.Enter(device));

  const size_t dim = static_cast<size_t>(max_dim);
  const size_t matrix = dim * dim * kElementBytes;
  // Room for either aux matrix (the GELU one, 2-byte elements, is the larger).
  const size_t aux = dim * static_cast<size_t>(AuxRow(Aux::kGelu, max_dim)) *
                     AuxElementBytes(Aux::kGelu, kSoakTypes[0]);
  DeviceBuffer a, b, y, bias, aux_buffer, workspace;
  JAX_EPILOG_RETURN_IF_ERROR(a.Allocate(matrix, "a"));
  JAX_EPILOG_RETURN_IF_ERROR(b.Allocate(matrix, "b"));
  JAX_EPILOG_RETURN_IF_ERROR(y.Allocate(matrix, "y"));
  JAX_EPILOG_RETURN_IF_ERROR(bias.Allocate(dim * kElementBytes, "bias"));
  JAX_EPILOG_RETURN_IF_ERROR(aux_buffer.Allocate(aux, "aux"));
  JAX_EPILOG_RETURN_IF_ERROR(workspace.Allocate(workspace_bytes, "workspace"));
  CallBuffers buffers;
  buffers.a = a.data;
  buffers.b = b.data;
  buffers.y = y.data;
  buffers.bias = bias.data;
  buffers.aux = aux_buffer.data;
  buffers.workspace = workspace.data;
  buffers.workspace_bytes = workspace_bytes;

  Stream stream;
  JAX_EPILOG_CUDA(cudaStreamCreateWithFlags(&stream.stream, cudaStreamNonBlocking),
                  "creating the soak's stream");
  for (int64_t i = 0; i < count; ++i) {
    Problem problem = space.At(device, static_cast<uint64_t>(first + i));
    problem.workspace_bytes = workspace_bytes;
    // One batch: alignment is that of the (256-byte aligned) pointers, as in a call.
    problem.align_a = AlignmentLog2(a.data, 0);
    problem.align_b = AlignmentLog2(b.data, 0);
    problem.align_y = AlignmentLog2(y.data, 0);
    problem.align_bias = AlignmentLog2(bias.data, 0);
    problem.align_aux = AlignmentLog2(aux_buffer.data, 0);
    std::shared_ptr<Plan> plan;
    const ffi::Error planned = GetPlan(problem, &plan);
    if (planned.failure()) {
      // cuBLASLt has no kernel for some problems (e.g. a bias gradient with K = 1).
      if (planned.errc() != ffi::ErrorCode::kUnimplemented) return planned;
      ++counts->unsupported;
    } else {
      JAX_EPILOG_RETURN_IF_ERROR(RunPlan(*plan, buffers, stream.stream));
      ++counts->ran;
    }
    const int64_t cached = PlanCount();
    if (cached > counts->most_cached) counts->most_cached = cached;
    if ((i + 1) % kSyncEvery == 0 || i + 1 == count)
      JAX_EPILOG_CUDA(cudaStreamSynchronize(stream.stream),
                      "running the soak's problems up to " + problem.ToString());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_epilog

// Test only: plans and runs problems first .. first + count - 1 of the soak's space
// (m, n, k in [1, max_dim], every epilog, both transposes, bfloat16 and float16;
// `seed` orders it; distinct indices are distinct problems) on `device`, each through the
// plan cache as the handler's execute stage does, on one stream, with buffers allocated
// for the largest problem and `workspace_bytes` of workspace, all freed before returning.
// Writes how many problems ran, how many cuBLASLt has no kernel for, and the most plans
// the cache held after any problem. Returns 0, or -1 with `message` saying why. Never
// throws.
JAX_EPILOG_EXPORT int jax_epilog_soak_for_test(int device, uint64_t seed, int64_t first,
                                               int64_t count, int64_t max_dim,
                                               uint64_t workspace_bytes, int64_t* ran,
                                               int64_t* unsupported, int64_t* most_cached,
                                               char* message, size_t message_len) {
  bool failed = true;
  std::string text;
  jax_epilog::SoakCounts counts;
  try {
    const xla::ffi::Error error =
        jax_epilog::Soak(device, seed, first, count, max_dim, workspace_bytes, &counts);
    failed = error.failure();
    if (failed) text = error.message();
  } catch (const std::exception& e) {  // e.g. std::bad_alloc; must not cross into C
    text = std::string("internal error: ") + e.what();
  }
  if (ran != nullptr) *ran = counts.ran;
  if (unsupported != nullptr) *unsupported = counts.unsupported;
  if (most_cached != nullptr) *most_cached = counts.most_cached;
  if (message != nullptr && message_len > 0)
    std::snprintf(message, message_len, "%s", text.c_str());
  return failed ? -1 : 0;
}
