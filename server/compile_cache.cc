#include "server/compile_cache.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"

namespace tessel::server {

using absl::StrCat;

void CompileCache::TouchLocked(Entry& e) { lru_.splice(lru_.begin(), lru_, e.lru); }

std::shared_ptr<const CachedExecutable> CompileCache::Lookup(const std::string& key) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  ++hits_;
  TouchLocked(it->second);
  return it->second.exe;
}

std::shared_ptr<const CachedExecutable> CompileCache::Find(const std::string& key) {
  absl::MutexLock l(&mu_);
  auto it = entries_.find(key);
  if (it == entries_.end()) return nullptr;
  TouchLocked(it->second);
  return it->second.exe;
}

bool CompileCache::WasEvicted(const std::string& key) const {
  absl::MutexLock l(&mu_);
  return evicted_.contains(key);
}

std::shared_ptr<const CachedExecutable> CompileCache::Insert(const std::string& key,
                                                             scheduler::CompiledProgram compiled, v1::Graph graph) {
  const int64_t bytes = int64_t(compiled.program.ByteSizeLong() + graph.ByteSizeLong() + compiled.plan_text.size());
  auto exe = std::make_shared<const CachedExecutable>(CachedExecutable{std::move(compiled), std::move(graph)});
  std::vector<std::shared_ptr<const CachedExecutable>> dropped;  // released once unlocked
  absl::MutexLock l(&mu_);
  ++compiles_;
  if (auto it = entries_.find(key); it != entries_.end()) {
    TouchLocked(it->second);
    return it->second.exe;
  }
  lru_.push_front(key);
  entries_.emplace(key, Entry{exe, bytes, lru_.begin()});
  bytes_ += bytes;
  evicted_.erase(key);
  while (bytes_ > max_bytes_ && lru_.size() > 1) {
    const std::string victim = lru_.back();
    lru_.pop_back();
    auto v = entries_.find(victim);
    bytes_ -= v->second.bytes;
    dropped.push_back(std::move(v->second.exe));
    entries_.erase(v);
    ++evictions_;
    if (evicted_.insert(victim).second) evicted_order_.push_back(victim);
    while (evicted_order_.size() > 4096) {
      evicted_.erase(evicted_order_.front());
      evicted_order_.pop_front();
    }
  }
  return exe;
}

int64_t CompileCache::bytes() const {
  absl::MutexLock l(&mu_);
  return bytes_;
}

int64_t CompileCache::evictions() const {
  absl::MutexLock l(&mu_);
  return evictions_;
}

int64_t CompileCache::compiles() const {
  absl::MutexLock l(&mu_);
  return compiles_;
}

int64_t CompileCache::hits() const {
  absl::MutexLock l(&mu_);
  return hits_;
}

int64_t CompileCache::size() const {
  absl::MutexLock l(&mu_);
  return entries_.size();
}

namespace {

// The differences between `graph` and one cached executable, most telling first.
std::vector<std::string> Differences(const v1::Graph& graph, const std::vector<int>& donated,
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
      diffs.push_back(StrCat("parameter ", i, " '", n->name(), "': ", TypeString(n->type()), " here, ",
                             TypeString(t->second->type()), " in the cached one (",
                             n->type().dtype() != t->second->type().dtype() ? "dtype" : "shape", ")"));
    }
  }
  if (theirs.size() > mine.size()) {
    diffs.push_back(StrCat(theirs.size() - mine.size(), " fewer parameters than the cached one"));
  }
  std::vector<int> want = donated, had = e.compiled.donated_parameters;
  std::sort(want.begin(), want.end());
  std::sort(had.begin(), had.end());
  if (want != had) {
    diffs.push_back(StrCat("donated parameters [", absl::StrJoin(want, ","), "] here, [", absl::StrJoin(had, ","),
                           "] in the cached one"));
  }
  if (graph.nodes_size() != e.graph.nodes_size()) {
    diffs.push_back(StrCat(graph.nodes_size(), " nodes here, ", e.graph.nodes_size(), " in the cached one"));
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
    diffs.push_back(StrCat(graph.outputs_size(), " outputs here, ", e.graph.outputs_size(), " in the cached one"));
  }
  return diffs;
}

}  // namespace

std::string CompileCache::ExplainMiss(const v1::Graph& graph, const std::vector<int>& donated) const {
  // The candidates are taken under the lock, most recently used first, and
  // compared outside it: a graph of many nodes against many executables of
  // its name holds up no Execute's lookup.
  std::vector<std::shared_ptr<const CachedExecutable>> same_name;
  size_t cached = 0;
  {
    absl::MutexLock l(&mu_);
    cached = entries_.size();
    for (const std::string& key : lru_) {
      const std::shared_ptr<const CachedExecutable>& e = entries_.at(key).exe;
      if (e->graph.name() == graph.name()) same_name.push_back(e);
    }
  }
  if (same_name.empty()) {
    return StrCat("no executable of graph '", graph.name(), "' was compiled before (", cached,
                  " executables in the cache)");
  }
  const size_t compared = std::min(same_name.size(), kMissCandidates);
  const CachedExecutable* nearest = nullptr;
  std::vector<std::string> best;
  for (size_t i = 0; i < compared; ++i) {
    const CachedExecutable* e = same_name[i].get();
    std::vector<std::string> diffs = Differences(graph, donated, *e);
    // Fewest differences wins; ties go to the earlier fingerprint, so the
    // explanation does not depend on the order of use.
    if (nearest == nullptr || diffs.size() < best.size() ||
        (diffs.size() == best.size() && e->compiled.fingerprint < nearest->compiled.fingerprint)) {
      nearest = e;
      best = std::move(diffs);
    }
  }
  if (best.empty()) best.push_back("they differ only in attributes outside nodes and parameters");
  const std::string of = compared == same_name.size() ? StrCat("one of ", same_name.size())
                                                      : StrCat("one of ", same_name.size(), "; the ", compared,
                                                               " most recently used compared");
  return StrCat("nearest cached executable of graph '", graph.name(), "' (", nearest->compiled.fingerprint, ", ",
                of, "): ", absl::StrJoin(best, "; "));
}

}  // namespace tessel::server
