// The on-disk cache of autotuned algorithms: a text file, one line per problem,
//   <key> algo=<16 hex digits>,<...>,... (cublasLtMatmulAlgo_t's 8 uint64 words)
// where the key names the GPU, cuBLASLt's version and the full problem (autotune.cc).
// The file is read once per process (again after ForgetStoredAlgos), and each newly
// tuned problem is appended under an exclusive flock, so processes can share it. A
// missing, unreadable or partly corrupt file is never an error: bad lines are skipped,
// a failed write only means the problem is tuned again by the next process.
#ifndef JAX_EPILOG_FFI_ALGO_STORE_H_
#define JAX_EPILOG_FFI_ALGO_STORE_H_

#include <cublasLt.h>

#include <string>

namespace jax_epilog {

// The file, set from Python (jax_epilog.config.autotune_cache_path, through
// controls.cc); empty, the default, means no file. Setting it forgets the in-memory copy.
void SetAlgoStorePath(const std::string& path);

// The algorithm stored under `key`; the file's last line for it wins.
bool LookUpStoredAlgo(const std::string& key, cublasLtMatmulAlgo_t* algo);

// Remembers `algo` under `key`, in memory and appended to the file.
void StoreAlgo(const std::string& key, const cublasLtMatmulAlgo_t& algo);

// Drops the in-memory copy: the next lookup re-reads the file.
void ForgetStoredAlgos();

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_ALGO_STORE_H_
