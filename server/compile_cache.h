// CompileCache: compiled executables by key (scheduler::ExecutableKey), and
// why a graph missed it. Entries are never evicted; a found entry stays
// valid for as long as the caller holds it.
//
// Thread-safety: its own lock, a leaf (nothing is called under it);
// compiling happens outside it, so two callers may compile the same graph at
// once and the first to Insert wins.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "scheduler/compiler.h"

namespace tessel::server {

struct CachedExecutable {
  scheduler::CompiledProgram compiled;
  v1::Graph graph;  // to explain later misses
};

class CompileCache {
 public:
  // The entry under `key`, or null. Counts a hit when found.
  std::shared_ptr<const CachedExecutable> Lookup(const std::string& key);
  // The entry under `key`, or null, for running it (not counted).
  std::shared_ptr<const CachedExecutable> Find(const std::string& key) const;
  // Stores a compile; returns the entry under `key` (an earlier one if
  // another caller inserted first). Counts a compile.
  std::shared_ptr<const CachedExecutable> Insert(const std::string& key, scheduler::CompiledProgram compiled,
                                                 v1::Graph graph);
  // What differs between `graph` (donating `donated`) and the nearest
  // cached executable of the same name: parameters by index and type,
  // donation, the first differing node, the number of outputs.
  std::string ExplainMiss(const v1::Graph& graph, const std::vector<int>& donated) const;

  int64_t compiles() const;
  int64_t hits() const;
  int64_t size() const;

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<const CachedExecutable>> entries_ ABSL_GUARDED_BY(mu_);
  int64_t compiles_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t hits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessel::server
