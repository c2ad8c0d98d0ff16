// CompileCache: compiled executables by key (scheduler::ExecutableKey), and
// why a graph missed it. Bounded by bytes (the programs, graphs and plans
// it holds): the least recently used entries go first, never the newest. A
// found entry stays valid for as long as the caller holds it.
//
// Thread-safety: its own lock, a leaf (nothing is called under it);
// compiling happens outside it, so two callers may compile the same graph at
// once and the first to Insert wins.
#pragma once

#include <deque>
#include <list>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "scheduler/compiler.h"

namespace tessel::server {

struct CachedExecutable {
  scheduler::CompiledProgram compiled;
  v1::Graph graph;  // to explain later misses
};

class CompileCache {
 public:
  // Default: 1 GiB.
  explicit CompileCache(int64_t max_bytes = int64_t{1} << 30) : max_bytes_(max_bytes) {}

  // The entry under `key`, or null. Counts a hit when found.
  std::shared_ptr<const CachedExecutable> Lookup(const std::string& key);
  // The entry under `key`, or null, for running it (not counted).
  std::shared_ptr<const CachedExecutable> Find(const std::string& key);
  // Whether `key` was evicted (of the last 4,096 evictions).
  bool WasEvicted(const std::string& key) const;
  // Stores a compile; returns the entry under `key` (an earlier one if
  // another caller inserted first). Counts a compile.
  std::shared_ptr<const CachedExecutable> Insert(const std::string& key, scheduler::CompiledProgram compiled,
                                                 v1::Graph graph);
  // What differs between `graph` (donating `donated`) and the nearest
  // cached executable of the same name: parameters by index and type,
  // donation, the first differing node, the number of outputs. Compares
  // the kMissCandidates most recently used of that name.
  static constexpr size_t kMissCandidates = 16;
  std::string ExplainMiss(const v1::Graph& graph, const std::vector<int>& donated) const;

  int64_t compiles() const;
  int64_t hits() const;
  int64_t size() const;
  int64_t bytes() const;
  int64_t evictions() const;
  int64_t max_bytes() const { return max_bytes_; }

 private:
  struct Entry {
    std::shared_ptr<const CachedExecutable> exe;
    int64_t bytes = 0;
    std::list<std::string>::iterator lru;  // in lru_
  };
  void TouchLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // most recently used first
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<std::string> evicted_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> evicted_order_ ABSL_GUARDED_BY(mu_);
  int64_t compiles_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessel::server
