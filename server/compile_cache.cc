#include "server/compile_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"

namespace tessel::server {

using absl::StrCat;

void CompileCache::TouchLocked(TenantCache& t, Entry& e) {
  t.lru.splice(t.lru.begin(), t.lru, e.lru);
  e.used = ++clock_;
}

const CompileCache::TenantCache* CompileCache::FindTenantLocked(const std::string& tenant) const {
  auto it = tenants_.find(tenant);
  return it == tenants_.end() ? nullptr : &it->second;
}

std::shared_ptr<const CachedExecutable> CompileCache::Lookup(const std::string& tenant,
                                                             const std::string& id) {
  absl::MutexLock l(&mu_);
  auto t = tenants_.find(tenant);
  if (t == tenants_.end()) return nullptr;
  auto it = t->second.entries.find(id);
  if (it == t->second.entries.end() || it->second.exe == nullptr) return nullptr;
  ++t->second.counts.hits;
  TouchLocked(t->second, it->second);
  return it->second.exe;
}

std::shared_ptr<const CachedExecutable> CompileCache::FindAnyTenant(const std::string& id) {
  absl::MutexLock l(&mu_);
  auto o = owner_.find(id);
  if (o == owner_.end()) return nullptr;
  TenantCache& t = tenants_.at(o->second);
  Entry& e = t.entries.at(id);
  if (e.exe == nullptr) return nullptr;
  TouchLocked(t, e);
  return e.exe;
}

std::optional<ExecutableSource> CompileCache::EvictedSource(const std::string& tenant,
                                                            const std::string& id) const {
  absl::MutexLock l(&mu_);
  const TenantCache* t = FindTenantLocked(tenant);
  if (t == nullptr) return std::nullopt;
  auto it = t->entries.find(id);
  if (it == t->entries.end() || it->second.source == nullptr) return std::nullopt;
  return *it->second.source;
}

bool CompileCache::WasEvicted(const std::string& tenant, const std::string& id) const {
  absl::MutexLock l(&mu_);
  const TenantCache* t = FindTenantLocked(tenant);
  return t != nullptr && t->evicted.contains(id);
}

bool CompileCache::EvictOneLocked(TenantCache& t, const std::string& keep,
                                  std::vector<std::shared_ptr<const CachedExecutable>>& dropped) {
  // The least recently used compiled entry loses its program (its source,
  // far smaller, stays); only when none is left does the least recently
  // used source go whole.
  Entry* cold = nullptr;
  for (auto it = t.lru.rbegin(); it != t.lru.rend(); ++it) {
    if (*it == keep) continue;
    Entry& e = t.entries.at(*it);
    if (e.exe == nullptr) {
      if (cold == nullptr) cold = &e;
      continue;
    }
    e.source = std::make_shared<const ExecutableSource>(ExecutableSource{e.exe->graph, e.options});
    dropped.push_back(std::move(e.exe));
    e.exe = nullptr;
    t.bytes += e.source_bytes - e.bytes;
    bytes_ += e.source_bytes - e.bytes;
    e.bytes = e.source_bytes;
    ++t.counts.evictions;
    return true;
  }
  if (cold == nullptr) return false;
  const std::string id = *cold->lru;
  t.bytes -= cold->bytes;
  bytes_ -= cold->bytes;
  t.lru.erase(cold->lru);
  t.entries.erase(id);
  owner_.erase(id);
  if (t.evicted.insert(id).second) t.evicted_order.push_back(id);
  while (t.evicted_order.size() > 4096) {
    t.evicted.erase(t.evicted_order.front());
    t.evicted_order.pop_front();
  }
  return true;
}

std::shared_ptr<const CachedExecutable> CompileCache::Insert(const std::string& tenant,
                                                             scheduler::CompiledProgram compiled,
                                                             v1::Graph graph,
                                                             scheduler::CompileOptions options,
                                                             int64_t tenant_max_bytes,
                                                             std::vector<std::string>* evicted) {
  const std::string id = compiled.fingerprint;
  int64_t source_bytes = int64_t(graph.ByteSizeLong() + options.mesh.ByteSizeLong());
  for (const v1::Sharding& s : options.parameter_shardings) source_bytes += s.ByteSizeLong();
  for (const v1::Sharding& s : options.output_shardings) source_bytes += s.ByteSizeLong();
  const int64_t bytes =
      int64_t(compiled.program.ByteSizeLong() + compiled.plan_text.size()) + source_bytes;
  auto exe = std::make_shared<const CachedExecutable>(
      CachedExecutable{std::move(compiled), std::move(graph), tenant});
  std::vector<std::shared_ptr<const CachedExecutable>> dropped;  // released once unlocked
  absl::MutexLock l(&mu_);
  TenantCache& t = tenants_[tenant];
  ++t.counts.compiles;
  auto [it, fresh] = t.entries.try_emplace(id);
  Entry& e = it->second;
  if (!fresh && e.exe != nullptr) {
    TouchLocked(t, e);
    return e.exe;
  }
  if (fresh) {
    t.lru.push_front(id);
    e.lru = t.lru.begin();
    owner_[id] = tenant;
  }
  t.bytes += bytes - e.bytes;
  bytes_ += bytes - e.bytes;
  e.exe = exe;
  e.source = nullptr;
  e.options = std::move(options);
  e.bytes = bytes;
  e.source_bytes = source_bytes;
  TouchLocked(t, e);
  t.evicted.erase(id);
  // The tenant's own bound, then the whole cache's: the tenant's own entries first.
  while (tenant_max_bytes > 0 && t.bytes > tenant_max_bytes && EvictOneLocked(t, id, dropped)) {
  }
  while (bytes_ > max_bytes_ && EvictOneLocked(t, id, dropped)) {
  }
  while (bytes_ > max_bytes_) {
    // Another tenant's least recently used entry.
    TenantCache* oldest = nullptr;
    uint64_t oldest_use = 0;
    for (auto& [name, other] : tenants_) {
      if (&other == &t || other.lru.empty()) continue;
      const uint64_t use = other.entries.at(other.lru.back()).used;
      if (oldest == nullptr || use < oldest_use) {
        oldest = &other;
        oldest_use = use;
      }
    }
    if (oldest == nullptr || !EvictOneLocked(*oldest, "", dropped)) break;
  }
  if (evicted != nullptr) {
    for (const auto& gone : dropped) evicted->push_back(gone->compiled.fingerprint);
  }
  return exe;
}

CompileCache::Counts CompileCache::counts() const {
  absl::MutexLock l(&mu_);
  Counts all;
  for (const auto& [name, t] : tenants_) {
    all.compiles += t.counts.compiles;
    all.hits += t.counts.hits;
    all.evictions += t.counts.evictions;
    for (const auto& [id, e] : t.entries) all.size += e.exe != nullptr;
  }
  all.bytes = bytes_;
  return all;
}

CompileCache::Counts CompileCache::counts(const std::string& tenant) const {
  absl::MutexLock l(&mu_);
  const TenantCache* t = FindTenantLocked(tenant);
  if (t == nullptr) return {};
  Counts c = t->counts;
  for (const auto& [id, e] : t->entries) c.size += e.exe != nullptr;
  c.bytes = t->bytes;
  return c;
}

namespace {

// Where the layouts asked for differ from a cached executable's: its mesh,
// a parameter's sharding, an output's (where one was asked for).
void LayoutDifferences(const v1::Graph& graph,
                       const absl::flat_hash_map<int, const v1::Node*>& params,
                       const scheduler::CompileOptions& options,
                       const scheduler::CompiledProgram& c, std::vector<std::string>& diffs) {
  auto with_devices = [](v1::Mesh m) {  // no devices listed: 0..n-1
    if (m.devices_size() == 0 && m.axis_names_size() > 0) {
      int64_t n = 1;
      for (int64_t size : m.axis_sizes()) n *= size;
      for (int64_t d = 0; d < n; ++d) m.add_devices(static_cast<int32_t>(d));
    }
    return m.SerializeAsString();
  };
  if (with_devices(options.mesh) != with_devices(c.mesh)) {
    auto mesh = [](const v1::Mesh& m) {
      return m.axis_names_size() > 0 ? StrCat("mesh ", MeshString(m)) : std::string("no mesh");
    };
    diffs.push_back(StrCat(mesh(options.mesh), " here, ", mesh(c.mesh), " in the cached one"));
    return;
  }
  for (size_t i = 0; i < options.parameter_shardings.size() && i < c.parameter_shardings.size();
       ++i) {
    auto p = params.find(static_cast<int>(i));
    if (p == params.end() || options.parameter_shardings[i].unspecified()) continue;
    const v1::Sharding want =
        NormalizeSharding(options.parameter_shardings[i], p->second->type().dims_size());
    if (!SameSharding(want, c.parameter_shardings[i])) {
      diffs.push_back(StrCat("parameter ", i, " '", p->second->name(), "': laid out ",
                             ShardingString(want), " here, ",
                             ShardingString(c.parameter_shardings[i]), " in the cached one"));
    }
  }
  for (int i = 0;
       i < graph.outputs_size() && i < static_cast<int>(options.output_shardings.size()) &&
       i < static_cast<int>(c.output_shardings.size());
       ++i) {
    const v1::Sharding& asked = options.output_shardings[i];
    if (asked.unspecified()) continue;
    const v1::Sharding want = NormalizeSharding(asked, c.output_shardings[i].dims_size());
    if (!SameSharding(want, c.output_shardings[i])) {
      diffs.push_back(StrCat("output ", i, ": laid out ", ShardingString(want), " here, ",
                             ShardingString(c.output_shardings[i]), " in the cached one"));
    }
  }
}

// The differences between `graph` and one cached executable, most telling first.
std::vector<std::string> Differences(const v1::Graph& graph, const std::vector<int>& donated,
                                     const scheduler::CompileOptions* options,
                                     const CachedExecutable& e) {
  std::vector<std::string> diffs;
  absl::flat_hash_map<int, const v1::Node*> mine, theirs;
  for (const v1::Node& n : graph.nodes()) {
    if (n.op() == v1::PARAMETER) mine[n.parameter().index()] = &n;
  }
  for (const v1::Node& n : e.graph.nodes()) {
    if (n.op() == v1::PARAMETER) theirs[n.parameter().index()] = &n;
  }
  std::vector<int> indices;
  for (const auto& [i, n] : mine) indices.push_back(i);
  std::sort(indices.begin(), indices.end());
  for (int i : indices) {
    const v1::Node* n = mine.at(i);
    auto t = theirs.find(i);
    if (t == theirs.end()) {
      diffs.push_back(StrCat("parameter ", i, " '", n->name(), "' is new"));
    } else if (!SameType(n->type(), t->second->type())) {
      diffs.push_back(StrCat("parameter ", i, " '", n->name(), "': ", TypeString(n->type()),
                             " here, ", TypeString(t->second->type()), " in the cached one (",
                             n->type().dtype() != t->second->type().dtype() ? "dtype" : "shape",
                             ")"));
    }
  }
  if (options != nullptr) LayoutDifferences(graph, mine, *options, e.compiled, diffs);
  if (theirs.size() > mine.size()) {
    diffs.push_back(StrCat(theirs.size() - mine.size(), " fewer parameters than the cached one"));
  }
  std::vector<int> want = donated, had = e.compiled.donated_parameters;
  std::sort(want.begin(), want.end());
  std::sort(had.begin(), had.end());
  if (want != had) {
    diffs.push_back(StrCat("donated parameters [", absl::StrJoin(want, ","), "] here, [",
                           absl::StrJoin(had, ","), "] in the cached one"));
  }
  if (graph.nodes_size() != e.graph.nodes_size()) {
    diffs.push_back(
        StrCat(graph.nodes_size(), " nodes here, ", e.graph.nodes_size(), " in the cached one"));
  } else {
    for (int i = 0; i < graph.nodes_size(); ++i) {
      const v1::Node& a = graph.nodes(i);
      if (a.op() == v1::PARAMETER) continue;
      if (a.SerializeAsString() != e.graph.nodes(i).SerializeAsString()) {
        diffs.push_back(StrCat("node ", i, " '", a.name(), "' (", OpName(a.op()), ") differs"));
        break;
      }
    }
  }
  if (graph.outputs_size() != e.graph.outputs_size()) {
    diffs.push_back(StrCat(graph.outputs_size(), " outputs here, ", e.graph.outputs_size(),
                           " in the cached one"));
  }
  return diffs;
}

}  // namespace

std::string CompileCache::ExplainMiss(const std::string& tenant, const v1::Graph& graph,
                                      const std::vector<int>& donated,
                                      const scheduler::CompileOptions* options) const {
  // The candidates are taken under the lock, most recently used first, and
  // compared outside it: a graph of many nodes against many executables of
  // its name holds up no Execute's lookup.
  std::vector<std::shared_ptr<const CachedExecutable>> same_name;
  size_t cached = 0;
  {
    absl::MutexLock l(&mu_);
    if (const TenantCache* t = FindTenantLocked(tenant)) {
      for (const std::string& key : t->lru) {
        const std::shared_ptr<const CachedExecutable>& e = t->entries.at(key).exe;
        if (e == nullptr) continue;
        ++cached;
        if (e->graph.name() == graph.name()) same_name.push_back(e);
      }
    }
  }
  if (same_name.empty()) {
    return StrCat("no executable of graph '", graph.name(), "' was compiled before (", cached,
                  " executables of this tenant in the cache)");
  }
  const size_t compared = std::min(same_name.size(), kMissCandidates);
  const CachedExecutable* nearest = nullptr;
  std::vector<std::string> best;
  for (size_t i = 0; i < compared; ++i) {
    const CachedExecutable* e = same_name[i].get();
    std::vector<std::string> diffs = Differences(graph, donated, options, *e);
    // Fewest differences wins; ties go to the earlier fingerprint, so the
    // explanation does not depend on the order of use.
    if (nearest == nullptr || diffs.size() < best.size() ||
        (diffs.size() == best.size() && e->compiled.fingerprint < nearest->compiled.fingerprint)) {
      nearest = e;
      best = std::move(diffs);
    }
  }
  if (best.empty()) best.push_back("they differ only in attributes outside nodes and parameters");
  const std::string of =
      compared == same_name.size()
          ? StrCat("one of ", same_name.size())
          : StrCat("one of ", same_name.size(), "; the ", compared, " most recently used compared");
  return StrCat("nearest cached executable of graph '", graph.name(), "' (",
                nearest->compiled.fingerprint, ", ", of, "): ", absl::StrJoin(best, "; "));
}

}  // namespace tessel::server
