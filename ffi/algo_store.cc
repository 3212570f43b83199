#include "algo_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <utility>
#include <vector>

namespace jax_epilog {
namespace {

constexpr char kAlgoField[] = " algo=";
constexpr size_t kWords = sizeof(cublasLtMatmulAlgo_t::data) / sizeof(uint64_t);

struct Entry {
  std::string key;
  cublasLtMatmulAlgo_t algo;
};

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

std::string FormatLine(const std::string& key, const cublasLtMatmulAlgo_t& algo) {
  return key + kAlgoField + FormatAlgo(algo) + "\n";
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

// The entries of a file's text, oldest first, one per key (its last line), at most the
// newest `max_entries`; lines that do not parse (torn, foreign, comments) are skipped.
// `lines` gets the number of lines, parsed or not.
std::vector<Entry> ParseEntries(const std::string& text, size_t max_entries, size_t* lines) {
  std::vector<Entry> entries;
  std::unordered_map<std::string, size_t> latest;  // key -> index in entries
  std::istringstream stream(text);
  std::string line;
  *lines = 0;
  while (std::getline(stream, line)) {
    ++*lines;
    const size_t at = line.rfind(kAlgoField);
    cublasLtMatmulAlgo_t algo{};
    if (line.empty() || line[0] == '#' || at == std::string::npos || at == 0 ||
        !ParseAlgo(line.substr(at + sizeof(kAlgoField) - 1), &algo))
      continue;
    std::string key = line.substr(0, at);
    latest[key] = entries.size();
    entries.push_back({std::move(key), algo});
  }
  std::vector<Entry> newest;  // the last line of each key, oldest first
  for (size_t i = 0; i < entries.size(); ++i)
    if (latest[entries[i].key] == i) newest.push_back(std::move(entries[i]));
  if (newest.size() > max_entries)
    newest.erase(newest.begin(), newest.end() - static_cast<std::ptrdiff_t>(max_entries));
  return newest;
}

std::string ReadText(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
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

// Writes `text` to `path` (O_APPEND or O_TRUNC in `mode`); false on any failure.
bool WriteFile(const std::string& path, int mode, const std::string& text, bool sync) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | mode, 0644);
  if (fd < 0) return false;
  bool ok = WriteAll(fd, text) && (!sync || fsync(fd) == 0);
  ok = close(fd) == 0 && ok;
  return ok;
}

// An exclusive flock on `<path>.lock`, held for the object's life; the lock file is
// never removed (removing it would let two writers lock different inodes).
class FileLock {
 public:
  explicit FileLock(const std::string& path) {
    fd_ = open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ >= 0 && flock(fd_, LOCK_EX) != 0) {
      close(fd_);
      fd_ = -1;
    }
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock() {
    if (fd_ >= 0) close(fd_);  // releases the flock
  }
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

// Adds `entry` to the file under its lock: appended, or the file
// rewritten compacted when it would exceed the bound. `merged` gets the file's entries
// with the new one, at most `max_entries`. False when the file could not be written.
bool AddToFile(const std::string& path, const Entry& entry, size_t max_entries,
               std::vector<Entry>* merged) {
  MakeParentFolders(path);
  FileLock lock(path);
  if (!lock.held()) return false;
  const std::string text = ReadText(path);
  // A torn last line (a writer that died mid-line) must not swallow ours.
  const bool torn = !text.empty() && text.back() != '\n';
  const std::string line = (torn ? "\n" : "") + FormatLine(entry.key, entry.algo);
  size_t lines = 0;
  *merged = ParseEntries(text + line, max_entries, &lines);
  if (lines <= max_entries + max_entries / 4) return WriteFile(path, O_APPEND, line, false);
  std::string compacted;
  for (const Entry& kept : *merged) compacted += FormatLine(kept.key, kept.algo);
  const std::string temporary = path + ".tmp";
  if (WriteFile(temporary, O_TRUNC, compacted, true) &&
      std::rename(temporary.c_str(), path.c_str()) == 0)
    return true;
  unlink(temporary.c_str());
  return false;
}

}  // namespace

void AlgoStore::SetPath(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  path_ = path;
  loaded_ = false;
  algos_.clear();
  order_.clear();
}

void AlgoStore::LoadLocked() {
  if (loaded_) return;
  loaded_ = true;
  algos_.clear();
  order_.clear();
  if (path_.empty()) return;
  size_t lines = 0;
  for (const Entry& entry : ParseEntries(ReadText(path_), max_entries_, &lines))
    RememberLocked(entry.key, entry.algo);
}

void AlgoStore::RememberLocked(const std::string& key, const cublasLtMatmulAlgo_t& algo) {
  if (algos_.insert_or_assign(key, algo).second) order_.push_back(key);
  while (algos_.size() > max_entries_) {
    algos_.erase(order_.front());
    order_.pop_front();
  }
}

bool AlgoStore::LookUp(const std::string& key, cublasLtMatmulAlgo_t* algo) {
  std::lock_guard<std::mutex> lock(mutex_);
  LoadLocked();
  const auto it = algos_.find(key);
  if (it == algos_.end()) return false;
  *algo = it->second;
  return true;
}

bool AlgoStore::Put(const std::string& key, const cublasLtMatmulAlgo_t& algo) {
  std::lock_guard<std::mutex> lock(mutex_);
  LoadLocked();
  RememberLocked(key, algo);
  // A key is one line of text with something before its algo field.
  if (path_.empty() || key.empty() || key.find('\n') != std::string::npos) return false;
  std::vector<Entry> merged;
  if (!AddToFile(path_, {key, algo}, max_entries_, &merged)) return false;
  // Now also what other processes stored meanwhile.
  algos_.clear();
  order_.clear();
  for (const Entry& entry : merged) RememberLocked(entry.key, entry.algo);
  return true;
}

void AlgoStore::Forget() {
  std::lock_guard<std::mutex> lock(mutex_);
  loaded_ = false;
  algos_.clear();
  order_.clear();
}

size_t AlgoStore::Size() {
  std::lock_guard<std::mutex> lock(mutex_);
  LoadLocked();
  return algos_.size();
}

AlgoStore& ProcessAlgoStore() {
  static AlgoStore* store = new AlgoStore;  // never destroyed: used until the process ends
  return *store;
}

}  // namespace jax_epilog
