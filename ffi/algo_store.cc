#include "algo_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <unordered_map>

namespace jax_epilog {
namespace {

constexpr char kAlgoField[] = " algo=";
constexpr size_t kWords = sizeof(cublasLtMatmulAlgo_t::data) / sizeof(uint64_t);

struct Store {
  std::mutex mutex;
  bool loaded = false;
  std::string path;  // empty: no file
  std::unordered_map<std::string, cublasLtMatmulAlgo_t> algos;
};

Store& TheStore() {
  static Store* store = new Store;  // never destroyed: used until the process ends
  return *store;
}

std::string FormatAlgo(const cublasLtMatmulAlgo_t& algo) {
  std::string text;
  for (size_t i = 0; i < kWords; ++i) {
    char word[17];
    std::snprintf(word, sizeof(word), "%016llx",
                  static_cast<unsigned long long>(algo.data[i]));
    text += (i ? "," : "") + std::string(word);
  }
  return text;
}

// False unless `text` is exactly kWords comma-separated words of 16 hex digits.
bool ParseAlgo(const std::string& text, cublasLtMatmulAlgo_t* algo) {
  if (text.size() != kWords * 17 - 1) return false;
  for (size_t i = 0; i < kWords; ++i) {
    const std::string word = text.substr(i * 17, 16);
    if (i + 1 < kWords && text[i * 17 + 16] != ',') return false;
    for (const char c : word)
      if (!std::isxdigit(static_cast<unsigned char>(c))) return false;
    algo->data[i] = std::strtoull(word.c_str(), nullptr, 16);
  }
  return true;
}

void LoadLocked(Store& store) {
  if (store.loaded) return;
  store.loaded = true;
  if (store.path.empty()) return;
  std::ifstream file(store.path);
  std::string line;
  while (std::getline(file, line)) {
    const size_t at = line.rfind(kAlgoField);
    cublasLtMatmulAlgo_t algo{};
    if (line.empty() || line[0] == '#' || at == std::string::npos ||
        !ParseAlgo(line.substr(at + sizeof(kAlgoField) - 1), &algo))
      continue;
    store.algos[line.substr(0, at)] = algo;
  }
}

void MakeParentFolders(const std::string& path) {
  for (size_t slash = path.find('/', 1); slash != std::string::npos;
       slash = path.find('/', slash + 1))
    mkdir(path.substr(0, slash).c_str(), 0755);  // EEXIST is fine; open() reports the rest
}

bool WriteAll(int fd, const std::string& text) {
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

void AppendLine(const std::string& path, std::string line) {
  MakeParentFolders(path);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (flock(fd, LOCK_EX) == 0) {
    // A torn last line (a writer that died) must not swallow ours.
    struct stat info {};
    char last = '\n';
    if (fstat(fd, &info) == 0 && info.st_size > 0) {
      const int reader = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (reader >= 0) {
        if (pread(reader, &last, 1, info.st_size - 1) != 1) last = '\n';
        close(reader);
      }
    }
    if (last != '\n') line.insert(0, "\n");
    WriteAll(fd, line);
    flock(fd, LOCK_UN);
  }
  close(fd);
}

}  // namespace

void SetAlgoStorePath(const std::string& path) {
  Store& store = TheStore();
  std::lock_guard<std::mutex> lock(store.mutex);
  store.path = path;
  store.loaded = false;
  store.algos.clear();
}

bool LookUpStoredAlgo(const std::string& key, cublasLtMatmulAlgo_t* algo) {
  Store& store = TheStore();
  std::lock_guard<std::mutex> lock(store.mutex);
  LoadLocked(store);
  const auto it = store.algos.find(key);
  if (it == store.algos.end()) return false;
  *algo = it->second;
  return true;
}

void StoreAlgo(const std::string& key, const cublasLtMatmulAlgo_t& algo) {
  Store& store = TheStore();
  std::lock_guard<std::mutex> lock(store.mutex);
  LoadLocked(store);
  store.algos[key] = algo;
  if (!store.path.empty()) AppendLine(store.path, key + kAlgoField + FormatAlgo(algo) + "\n");
}

void ForgetStoredAlgos() {
  Store& store = TheStore();
  std::lock_guard<std::mutex> lock(store.mutex);
  store.loaded = false;
  store.algos.clear();
}

}  // namespace jax_epilog
