// The on-disk cache of autotuned algorithms: a text file, one line per problem,
//   <key> algo=<16 hex digits>,<...>,... (cublasLtMatmulAlgo_t's 8 uint64 words)
// where the key names the GPU, cuBLASLt's version and the full problem (autotune.cc).
//
// Bounded: at most `max_entries` problems are kept (the newest; a key's last line is
// its entry), in memory and in the file. A new entry is appended; when the file holds
// a quarter more lines than that, it is rewritten compacted (duplicates, malformed and
// oldest lines dropped) into a temporary file renamed over it.
//
// Shared by processes: every write (read, merge, append or rewrite) holds an exclusive
// flock on `<file>.lock` (not on the file itself, whose inode a rewrite replaces), so
// no entry another process wrote is lost. Readers take no lock: they see the file
// before or after a rename, and skip a line being appended (it does not parse yet). A
// missing, unreadable or partly corrupt file is never an error: bad lines are skipped,
// a failed write only means the problem is tuned again by the next process.
#ifndef JAX_EPILOG_FFI_ALGO_STORE_H_
#define JAX_EPILOG_FFI_ALGO_STORE_H_

#include <cublasLt.h>

#include <cstddef>
#include <deque>
#include <mutex>
#include <string>
#include <unordered_map>

namespace jax_epilog {

class AlgoStore {
 public:
  static constexpr size_t kDefaultMaxEntries = 10000;

  explicit AlgoStore(size_t max_entries = kDefaultMaxEntries) : max_entries_(max_entries) {}
  AlgoStore(const AlgoStore&) = delete;
  AlgoStore& operator=(const AlgoStore&) = delete;

  // The file; empty (the default) means none. Forgets the in-memory copy.
  void SetPath(const std::string& path);

  // The algorithm stored under `key` (the file is read on the first lookup).
  bool LookUp(const std::string& key, cublasLtMatmulAlgo_t* algo);

  // Remembers `algo` under `key` in memory and in the file; true when the file has it.
  bool Put(const std::string& key, const cublasLtMatmulAlgo_t& algo);

  // Drops the in-memory copy: the next lookup reads the file again.
  void Forget();

  // The number of entries held in memory (after reading the file if not yet read).
  size_t Size();

 private:
  void LoadLocked();
  void RememberLocked(const std::string& key, const cublasLtMatmulAlgo_t& algo);

  const size_t max_entries_;
  std::mutex mutex_;
  bool loaded_ = false;
  std::string path_;
  std::unordered_map<std::string, cublasLtMatmulAlgo_t> algos_;
  std::deque<std::string> order_;  // keys of algos_, oldest first
};

// The process's store (autotune.cc, controls.cc). Never destroyed.
AlgoStore& ProcessAlgoStore();

}  // namespace jax_epilog

#endif  // JAX_EPILOG_FFI_ALGO_STORE_H_
