// CompileCache: compiled executables by (tenant, executable id), and why a
// graph missed it. Each tenant sees only its own entries: a lookup, a miss
// explanation or an eviction notice never names another tenant's
// executable, and ids themselves carry the tenant (CompileOptions::owner),
// so no program is shared between tenants, on the coordinator or on a
// worker.
//
// Bounded by bytes (the programs, graphs and plans it holds), per tenant and
// in all. An executable past its bound is evicted in two steps: first its
// compiled program goes and only its source stays (graph and options), so
// the next call recompiles it (Recompile); past the bound again, its source
// goes too, and the id is only remembered as evicted. A tenant's insert
// evicts that tenant's least recently used entries first (never the newest);
// only when the whole cache is still over its bound do other tenants'
// entries go. A found entry stays valid for as long as the caller holds it.
//
// Thread-safety: its own lock, a leaf (nothing is called under it);
// compiling happens outside it, so two callers may compile the same graph at
// once and the first to Insert wins.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "scheduler/compiler.h"

namespace tessel::server {

struct CachedExecutable {
  scheduler::CompiledProgram compiled;
  v1::Graph graph;     // to explain later misses
  std::string tenant;  // whose it is
};

// What an evicted executable is compiled again from.
struct ExecutableSource {
  v1::Graph graph;
  scheduler::CompileOptions options;
};

class CompileCache {
 public:
  // Every tenant's figures, or one tenant's.
  struct Counts {
    int64_t compiles = 0, hits = 0, size = 0, bytes = 0, evictions = 0;
  };

  // `max_bytes`: the whole cache's bound. Default: 1 GiB.
  explicit CompileCache(int64_t max_bytes = int64_t{1} << 30) : max_bytes_(max_bytes) {}

  // `tenant`'s entry `id`, or null (also when evicted). Counts a hit when found.
  std::shared_ptr<const CachedExecutable> Lookup(const std::string& tenant, const std::string& id);
  // Whoever's entry `id` is, for a caller that checks its `tenant` against
  // the session's before anything else (Execute, under the lock where it
  // reads the session anyway); ids carry their tenant, so at most one. Not
  // counted as a hit.
  std::shared_ptr<const CachedExecutable> FindAnyTenant(const std::string& id);
  // What `tenant`'s evicted executable `id` compiles again from, while its
  // source is kept; nullopt otherwise.
  std::optional<ExecutableSource> EvictedSource(const std::string& tenant,
                                                const std::string& id) const;
  // Whether `tenant`'s `id` was evicted altogether (of the last 4,096 per tenant).
  bool WasEvicted(const std::string& tenant, const std::string& id) const;
  // Stores `tenant`'s compile of `graph` with `options` (its id:
  // compiled.fingerprint); returns the entry (an earlier one if another
  // caller inserted first). Counts a compile. `tenant_max_bytes`: that
  // tenant's bound (0: none but the whole cache's). `evicted`, when given,
  // receives the ids whose programs this insert evicted (any tenant's),
  // for the workers to drop.
  std::shared_ptr<const CachedExecutable> Insert(const std::string& tenant,
                                                 scheduler::CompiledProgram compiled,
                                                 v1::Graph graph,
                                                 scheduler::CompileOptions options = {},
                                                 int64_t tenant_max_bytes = 0,
                                                 std::vector<std::string>* evicted = nullptr);
  // What differs between `graph` (donating `donated`) and the nearest of
  // `tenant`'s cached executables of the same name: parameters by index and
  // type, donation, the first differing node, the number of outputs.
  // Compares the kMissCandidates most recently used of that name.
  static constexpr size_t kMissCandidates = 16;
  // With `options`, layouts count too: the mesh, the parameters' and the
  // outputs' shardings asked for against each candidate's.
  std::string ExplainMiss(const std::string& tenant, const v1::Graph& graph,
                          const std::vector<int>& donated,
                          const scheduler::CompileOptions* options = nullptr) const;

  Counts counts() const;
  Counts counts(const std::string& tenant) const;
  int64_t compiles() const { return counts().compiles; }
  int64_t hits() const { return counts().hits; }
  int64_t size() const { return counts().size; }
  int64_t bytes() const { return counts().bytes; }
  int64_t evictions() const { return counts().evictions; }
  int64_t max_bytes() const { return max_bytes_; }

 private:
  struct Entry {
    std::shared_ptr<const CachedExecutable> exe;  // null once evicted to its source
    std::shared_ptr<const ExecutableSource> source;
    scheduler::CompileOptions options;  // what it was compiled with, for its source
    int64_t bytes = 0;                  // counted now: the whole entry, or its source
    int64_t source_bytes = 0;
    uint64_t used = 0;                     // the cache's clock at its last use
    std::list<std::string>::iterator lru;  // in its tenant's lru
  };
  struct TenantCache {
    absl::flat_hash_map<std::string, Entry> entries;
    std::list<std::string> lru;  // most recently used first
    int64_t bytes = 0;
    Counts counts;
    absl::flat_hash_set<std::string> evicted;
    std::deque<std::string> evicted_order;
  };
  void TouchLocked(TenantCache& t, Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One eviction step of `t`'s least recently used entry other than `keep`
  // (a compiled one loses its program, a source goes); false when none.
  bool EvictOneLocked(TenantCache& t, const std::string& keep,
                      std::vector<std::shared_ptr<const CachedExecutable>>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const TenantCache* FindTenantLocked(const std::string& tenant) const
      ABSL_SHARED_LOCKS_REQUIRED(mu_);

  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, TenantCache> tenants_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::string> owner_
      ABSL_GUARDED_BY(mu_);  // id -> tenant, every entry
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessel::server
