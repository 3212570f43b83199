// Autotuning: choosing a plan's cuBLASLt algorithm by timing the heuristic's top
// candidates once, on scratch buffers with defined contents, and remembering the winner
// in the plan and on disk (algo_store.h). See README.md, "Autotuning".
#ifndef JAX_EPILOG_FFI_AUTOTUNE_H_
#define JAX_EPILOG_FFI_AUTOTUNE_H_

#include <cuda_runtime_api.h>

#include "plan.h"
#include "status.h"

namespace jax_epilog {

// The switch, set from Python (jax_epilog.config, through controls.cc); on until set.
// It decides for plans not yet tuned; a tuned plan keeps its algorithm.
bool AutotuneEnabled();
void SetAutotune(bool enabled);
// Whether each tuning is logged to stderr (candidate times and choice); off until set.
void SetAutotuneLog(bool enabled);

// Takes the algorithm stored on disk for the plan's problem on this GPU model and
// cuBLASLt version, if there is one and cuBLASLt accepts it, and marks the plan
// tuned. Host-only. The caller holds plan.mutex (or has not shared the plan yet) and
// has made plan.device current.
bool ApplyStoredAlgo(Plan& plan);

// For the FFI initialize stage only (it may allocate and synchronise): unless the plan
// is tuned or `stream` is capturing a CUDA graph, times up to 8 heuristic candidates (32
// for FP8 operands, enumerated when the heuristic offers fewer than 2) on `stream` and
// keeps the fastest. The candidates run on scratch memory of their own (inputs filled
// with a fixed pseudo-random pattern, scalars, outputs, workspace): never on the
// call's buffers, whose contents XLA does not define at this stage and whose outputs
// may lie over a donated input still to be read. Candidates cuBLASLt rejects and a
// failed scratch allocation leave the heuristic's choice in place; only CUDA failures
// (a broken context) are errors.
ffi::Error TunePlan(Plan& plan, cudaStream_t stream);

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_AUTOTUNE_H_
