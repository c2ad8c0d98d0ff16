#include "worker/collectives.h"

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/types.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/dtype.h"
#include "core/half.h"
#include "spdlog/sinks/null_sink.h"

namespace tessel::worker {
namespace {

// ---- Element-wise reductions ----------------------------------------------
//
// Gloo's reduction signature: out[i] = a[i] op b[i] for n elements; `out`
// may alias `a`. One instance per (dtype, op), so every dtype reduces with
// the same code in memory and across workers.

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// Integer sums and products wrap (two's complement), as in the kernels.
struct AddOp {
  template <typename T>
  static T Apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return T(U(a) + U(b));
    } else {
      return a + b;
    }
  }
};
struct MulOp {
  template <typename T>
  static T Apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return T(U(a) * U(b));
    } else {
      return a * b;
    }
  }
};
// Floating max and min propagate NaN.
struct MaxOp {
  template <typename T>
  static T Apply(T a, T b) {
    return (a > b || a != a) ? a : b;
  }
};
struct MinOp {
  template <typename T>
  static T Apply(T a, T b) {
    return (a < b || a != a) ? a : b;
  }
};
// pred: sum and max are a logical or, prod and min a logical and.
struct OrOp {
  static uint8_t Apply(uint8_t a, uint8_t b) { return (a | b) != 0; }
};
struct AndOp {
  static uint8_t Apply(uint8_t a, uint8_t b) { return a != 0 && b != 0; }
};

template <typename T, typename Op>
void ReduceLoop(void* out, const void* a, const void* b, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = Op::Apply(x[i], y[i]);
}

// f16 and bf16 compute in float and round back to nearest even. One
// operation on two half values is exact in float or, where it is not, far
// from a tie, so the single rounding to the half type is correct.
inline f16 FromFloat(float f, f16) { return ToF16(f); }
inline bf16 FromFloat(float f, bf16) { return ToBf16(f); }

template <typename H, typename Op>
void HalfReduceLoop(void* out, const void* a, const void* b, size_t n) {
  H* o = static_cast<H*>(out);
  const H* x = static_cast<const H*>(a);
  const H* y = static_cast<const H*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = FromFloat(Op::Apply(ToFloat(x[i]), ToFloat(y[i])), H{});
}

template <typename T>
ReduceFn PickReduce(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &ReduceLoop<T, AddOp>;
    case ReduceOp::kProd: return &ReduceLoop<T, MulOp>;
    case ReduceOp::kMax: return &ReduceLoop<T, MaxOp>;
    case ReduceOp::kMin: return &ReduceLoop<T, MinOp>;
  }
  return nullptr;
}

template <typename H>
ReduceFn PickHalfReduce(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return &HalfReduceLoop<H, AddOp>;
    case ReduceOp::kProd: return &HalfReduceLoop<H, MulOp>;
    case ReduceOp::kMax: return &HalfReduceLoop<H, MaxOp>;
    case ReduceOp::kMin: return &HalfReduceLoop<H, MinOp>;
  }
  return nullptr;
}

ReduceFn GetReduceFn(v1::DType dtype, ReduceOp op) {
  switch (dtype) {
    case v1::F32: return PickReduce<float>(op);
    case v1::F64: return PickReduce<double>(op);
    case v1::F16: return PickHalfReduce<f16>(op);
    case v1::BF16: return PickHalfReduce<bf16>(op);
    case v1::S32: return PickReduce<int32_t>(op);
    case v1::S64: return PickReduce<int64_t>(op);
    case v1::U8: return PickReduce<uint8_t>(op);
    case v1::PRED:
      return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? &ReduceLoop<uint8_t, OrOp>
                                                            : &ReduceLoop<uint8_t, AndOp>;
    default: return nullptr;
  }
}

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

// Gloo's typed option setters only use sizeof(T): an unsigned type of the
// element's size stands for any dtype.
template <typename F>
void WithElementType(int element_size, F&& f) {
  switch (element_size) {
    case 1: f(uint8_t{}); break;
    case 2: f(uint16_t{}); break;
    case 4: f(uint32_t{}); break;
    case 8: f(uint64_t{}); break;
  }
}

// Slot prefix for Permute's point-to-point messages; Gloo's own collectives
// use prefixes 0x01..0x08.
constexpr uint8_t kPermuteSlotPrefix = 0x54;
constexpr size_t kMaxPermutePairs = size_t{1} << 24;  // fits below the tag in a slot

// ---- Gloo plumbing shared by the groups of one registry -------------------

// The rendezvous store and one TCP device (a listening socket and an event
// loop) for every group of this worker. Constant after construction;
// gloo's device is thread-safe.
struct GlooEndpoint {
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::shared_ptr<gloo::transport::Device> device;
};

// Maps an exception thrown by Gloo to a status: timeouts (Gloo says
// "timeout" or "Timed out"; the coordinator's store says DEADLINE_EXCEEDED)
// are DEADLINE_EXCEEDED; IO errors and peers gone are UNAVAILABLE; failed
// internal checks are INTERNAL.
absl::Status FromGlooException(const std::exception& e, bool gloo_error, absl::string_view context) {
  const std::string lower = absl::AsciiStrToLower(e.what());
  const std::string message = absl::StrCat(context, ": ", e.what());
  if (absl::StrContains(lower, "timeout") || absl::StrContains(lower, "timed out") ||
      absl::StrContains(lower, "deadline")) {
    return absl::DeadlineExceededError(message);
  }
  if (gloo_error) return absl::UnavailableError(message);
  return absl::InternalError(message);
}

template <typename F>
absl::Status CatchGloo(absl::string_view context, F&& f) {
  try {
    f();
    return absl::OkStatus();
  } catch (const gloo::Exception& e) {
    return FromGlooException(e, true, context);
  } catch (const std::exception& e) {
    return FromGlooException(e, false, context);
  }
}

// ---- One group --------------------------------------------------------------

// A group's ranks, as seen from this worker. Constant after construction.
struct GroupLayout {
  std::string key;
  std::vector<std::string> rank_workers;
  std::vector<std::string> workers;          // distinct, by first appearance
  int self_worker = -1;                      // index into `workers`
  std::vector<int> worker_of_rank;           // rank -> index into `workers`
  std::vector<std::vector<int>> worker_ranks;  // worker -> its ranks, ascending
  std::vector<int> local_ranks;              // == worker_ranks[self_worker]
  std::vector<int> local_index;              // rank -> index into local_ranks, or -1
  // Position of each rank when the ranks are listed worker by worker (the
  // order of Gloo's allgatherv); `worker_major` when that is rank order.
  std::vector<int> grouped_pos;
  bool worker_major = true;

  int size() const { return rank_workers.size(); }
  int num_workers() const { return workers.size(); }
  int num_local() const { return local_ranks.size(); }
};

absl::StatusOr<GroupLayout> MakeLayout(const GroupSpec& spec, const std::string& self) {
  GroupLayout l;
  l.key = spec.key;
  l.rank_workers = spec.rank_workers;
  if (spec.key.empty()) return absl::InvalidArgumentError("collective group: empty key");
  if (spec.rank_workers.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("collective group '", spec.key, "': no ranks"));
  }
  absl::flat_hash_map<std::string, int> index;
  for (int r = 0; r < l.size(); ++r) {
    auto [it, added] = index.try_emplace(spec.rank_workers[r], l.workers.size());
    if (added) {
      l.workers.push_back(spec.rank_workers[r]);
      l.worker_ranks.emplace_back();
    }
    l.worker_of_rank.push_back(it->second);
    l.worker_ranks[it->second].push_back(r);
  }
  auto self_it = index.find(self);
  if (self_it == index.end()) {
    return absl::InvalidArgumentError(absl::StrCat("collective group '", spec.key, "': worker '", self,
                                                   "' holds none of its ranks (rank workers: [",
                                                   absl::StrJoin(spec.rank_workers, ", "), "])"));
  }
  l.self_worker = self_it->second;
  l.local_ranks = l.worker_ranks[l.self_worker];
  l.local_index.assign(l.size(), -1);
  for (int i = 0; i < l.num_local(); ++i) l.local_index[l.local_ranks[i]] = i;
  l.grouped_pos.resize(l.size());
  int pos = 0;
  for (const auto& ranks : l.worker_ranks) {
    for (int r : ranks) {
      l.grouped_pos[r] = pos;
      if (r != pos) l.worker_major = false;
      ++pos;
    }
  }
  return l;
}

// See collectives.h for the algorithm. Thread-safety: each local rank calls
// from its own thread; the round state is guarded by mu_; the Gloo context,
// tags and scratch buffers belong to whichever thread runs the current round
// (rounds never overlap, as every local rank takes part in each).
class GroupCommunicator final : public Communicator {
 public:
  GroupCommunicator(GroupLayout layout, std::shared_ptr<const GlooEndpoint> gloo, absl::Duration timeout,
                    std::shared_ptr<spdlog::logger> log)
      : l_(std::move(layout)),
        endpoint_(std::move(gloo)),
        timeout_(timeout),
        log_(std::move(log)),
        slots_(l_.num_local()) {}

  const std::vector<std::string>& rank_workers() const { return l_.rank_workers; }

  int size() const override { return l_.size(); }
  const std::vector<int>& local_ranks() const override { return l_.local_ranks; }

  absl::Status AllReduce(int rank, void* data, int64_t count, v1::DType dtype, ReduceOp op) override {
    return Collective(rank, Call{Kind::kAllReduce, count, dtype, op, nullptr}, data, data);
  }
  absl::Status AllGather(int rank, const void* in, void* out, int64_t count, v1::DType dtype) override {
    return Collective(rank, Call{Kind::kAllGather, count, dtype, ReduceOp::kSum, nullptr}, in, out);
  }
  absl::Status ReduceScatter(int rank, const void* in, void* out, int64_t count, v1::DType dtype,
                             ReduceOp op) override {
    return Collective(rank, Call{Kind::kReduceScatter, count, dtype, op, nullptr}, in, out);
  }
  absl::Status AllToAll(int rank, const void* in, void* out, int64_t count, v1::DType dtype) override {
    return Collective(rank, Call{Kind::kAllToAll, count, dtype, ReduceOp::kSum, nullptr}, in, out);
  }
  absl::Status Permute(int rank, const void* in, void* out, int64_t count, v1::DType dtype,
                       const std::vector<std::pair<int, int>>& pairs) override {
    return Collective(rank, Call{Kind::kPermute, count, dtype, ReduceOp::kSum, &pairs}, in, out);
  }

 private:
  enum class Kind { kAllReduce, kAllGather, kReduceScatter, kAllToAll, kPermute };
  enum class Phase { kGathering, kRunning, kCopying };

  struct Call {
    Kind kind;
    int64_t count;
    v1::DType dtype;
    ReduceOp op;                                   // kAllReduce, kReduceScatter
    const std::vector<std::pair<int, int>>* pairs;  // kPermute
  };
  struct Slot {
    const void* in = nullptr;
    void* out = nullptr;
    bool arrived = false;
  };

  static const char* KindName(Kind k) {
    switch (k) {
      case Kind::kAllReduce: return "AllReduce";
      case Kind::kAllGather: return "AllGather";
      case Kind::kReduceScatter: return "ReduceScatter";
      case Kind::kAllToAll: return "AllToAll";
      case Kind::kPermute: return "Permute";
    }
    return "?";
  }
  static bool Reduces(Kind k) { return k == Kind::kAllReduce || k == Kind::kReduceScatter; }

  std::string Describe(const Call& c) const {
    std::string s = absl::StrCat("group '", l_.key, "' ", KindName(c.kind), "(", DTypeName(c.dtype), "[", c.count,
                                 "]");
    if (Reduces(c.kind)) absl::StrAppend(&s, ", ", ReduceOpName(c.op));
    if (c.kind == Kind::kPermute) absl::StrAppend(&s, ", ", c.pairs->size(), " pairs");
    return s + ")";
  }

  static bool SameCall(const Call& a, const Call& b) {
    if (a.kind != b.kind || a.count != b.count || a.dtype != b.dtype) return false;
    if (Reduces(a.kind) && a.op != b.op) return false;
    if (a.kind == Kind::kPermute && *a.pairs != *b.pairs) return false;
    return true;
  }

  absl::Status Validate(int rank, const Call& call, const void* in, void* out) const {
    if (rank < 0 || rank >= l_.size() || l_.local_index[rank] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": rank ", rank, " is not held by worker '",
                                                     l_.workers[l_.self_worker], "' (local ranks: [",
                                                     absl::StrJoin(l_.local_ranks, ", "), "])"));
    }
    const int esize = DTypeSize(call.dtype);
    if (esize == 0) return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": invalid dtype"));
    if (call.count < 0) return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": negative count"));
    if (call.count > INT64_MAX / esize / l_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": byte size overflows"));
    }
    if (call.count > 0 && (in == nullptr || out == nullptr)) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": null buffer on rank ", rank));
    }
    if (Reduces(call.kind) && GetReduceFn(call.dtype, call.op) == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": no such reduction"));
    }
    if (call.kind == Kind::kPermute) {
      if (call.pairs->size() > kMaxPermutePairs) {
        return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": too many pairs"));
      }
      std::vector<bool> targeted(l_.size());
      for (const auto& [s, t] : *call.pairs) {
        if (s < 0 || s >= l_.size() || t < 0 || t >= l_.size()) {
          return absl::InvalidArgumentError(
              absl::StrCat(Describe(call), ": pair (", s, ", ", t, ") is outside ranks 0..", l_.size() - 1));
        }
        if (targeted[t]) {
          return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": rank ", t, " is targeted twice"));
        }
        targeted[t] = true;
      }
    }
    return absl::OkStatus();
  }

  // The in-memory meeting of the local ranks; see collectives.h.
  absl::Status Collective(int rank, const Call& call, const void* in, void* out) {
    if (absl::Status s = Validate(rank, call, in, out); !s.ok()) return s;
    // Every rank passes the same count, so all skip an empty collective alike
    // (and the Gloo tags stay in step).
    if (call.count == 0) return absl::OkStatus();
    const int li = l_.local_index[rank];
    const int n = l_.num_local();

    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    if (slots_[li].arrived) {
      return absl::FailedPreconditionError(
          absl::StrCat(Describe(call), ": rank ", rank, " called while its previous call is in progress"));
    }
    if (arrived_ == 0) {
      call_ = call;
    } else if (!SameCall(call_, call)) {
      broken_ = absl::InvalidArgumentError(absl::StrCat("local ranks disagree: rank ", rank, " called ",
                                                        Describe(call), " while others called ", Describe(call_)));
      log_->error("{}", broken_.ToString());
      return broken_;
    }
    slots_[li] = Slot{in, out, true};
    ++arrived_;
    const uint64_t round = round_;

    if (arrived_ < n) {
      auto started = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return round_ != round || phase_ != Phase::kGathering || !broken_.ok();
      };
      if (!mu_.AwaitWithTimeout(absl::Condition(&started), timeout_)) {
        std::vector<int> missing;
        for (int i = 0; i < n; ++i) {
          if (!slots_[i].arrived) missing.push_back(l_.local_ranks[i]);
        }
        broken_ = absl::DeadlineExceededError(absl::StrCat(
            Describe(call), ": local ranks [", absl::StrJoin(missing, ", "), "] did not arrive within ",
            absl::FormatDuration(timeout_)));
        log_->error("{}", broken_.ToString());
        return broken_;
      }
      if (phase_ == Phase::kGathering) return broken_;  // another rank gave up waiting
      auto finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return phase_ == Phase::kCopying; };
      mu_.Await(absl::Condition(&finished));
    } else {
      phase_ = Phase::kRunning;
      const Call c = call_;
      mu_.Unlock();
      absl::Status s = RunRound(c);
      mu_.Lock();
      round_status_ = s;
      if (!s.ok()) {
        broken_ = s;
        log_->error("{}", s.ToString());
      }
      phase_ = Phase::kCopying;
    }

    const absl::Status result = round_status_;
    if (result.ok()) {
      const Call c = call_;
      mu_.Unlock();
      CopyOut(c, li);
      mu_.Lock();
    }
    // Leave together: results are read from other ranks' buffers until then.
    if (++departed_ == n) {
      arrived_ = departed_ = 0;
      for (Slot& slot : slots_) slot = Slot{};
      phase_ = Phase::kGathering;
      ++round_;
    } else {
      auto next = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return round_ != round; };
      mu_.Await(absl::Condition(&next));
    }
    return result;
  }

  // ---- The round, run by the last local rank to arrive ----------------------

  absl::Status RunRound(const Call& c) {
    if (l_.num_workers() > 1) {
      if (absl::Status s = ConnectGloo(c); !s.ok()) return s;
    }
    switch (c.kind) {
      case Kind::kAllReduce: return RunAllReduce(c);
      case Kind::kAllGather: return RunAllGather(c);
      case Kind::kReduceScatter: return RunReduceScatter(c);
      case Kind::kAllToAll: return RunAllToAll(c);
      case Kind::kPermute: return RunPermute(c);
    }
    return absl::InternalError("unknown collective");
  }

  std::chrono::milliseconds GlooTimeout() const { return absl::ToChronoMilliseconds(timeout_); }

  absl::Status ConnectGloo(const Call& c) {
    if (gloo_ != nullptr) return absl::OkStatus();
    if (endpoint_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(Describe(c), ": the group spans workers [",
                                                        absl::StrJoin(l_.workers, ", "),
                                                        "] but this worker has no rendezvous store"));
    }
    auto context = std::make_shared<gloo::rendezvous::Context>(l_.self_worker, l_.num_workers());
    context->setTimeout(GlooTimeout());
    prefix_store_ = std::make_unique<gloo::rendezvous::PrefixStore>(l_.key, *endpoint_->store);
    auto device = endpoint_->device;
    const absl::Time start = absl::Now();
    absl::Status s = CatchGloo(
        absl::StrCat(Describe(c), ": connecting to workers [", absl::StrJoin(l_.workers, ", "), "]"),
        [&] { context->connectFullMesh(*prefix_store_, device); });
    if (!s.ok()) return s;
    gloo_ = std::move(context);
    log_->debug("group '{}': connected to {} workers as worker {} in {}", l_.key, l_.num_workers(), l_.self_worker,
                absl::FormatDuration(absl::Now() - start));
    return absl::OkStatus();
  }

  // Grow-only scratch; kept for the group's life so steady-state rounds
  // allocate (and fault in) nothing.
  char* Scratch(int which, size_t bytes) {
    if (scratch_bytes_[which] < bytes) {
      scratch_[which].reset(new char[bytes]);
      scratch_bytes_[which] = bytes;
    }
    return scratch_[which].get();
  }

  absl::Status GlooAllReduce(const Call& c, void* data) {
    const uint32_t tag = next_tag_++;
    return CatchGloo(Describe(c), [&] {
      gloo::AllreduceOptions opts(gloo_);
      WithElementType(DTypeSize(c.dtype), [&](auto t) {
        opts.setOutput(static_cast<decltype(t)*>(data), size_t(c.count) * (c.kind == Kind::kAllReduce ? 1 : l_.size()));
      });
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setReduceFunction(GetReduceFn(c.dtype, c.op));
      opts.setTag(tag);
      opts.setTimeout(GlooTimeout());
      gloo::allreduce(opts);
    });
  }

  // Local reduce into local rank 0's buffer, Gloo across workers on that
  // buffer, then the other local ranks copy it (CopyOut). With one local
  // rank this is Gloo's allreduce on the caller's buffer and nothing else.
  absl::Status RunAllReduce(const Call& c) {
    const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
    void* acc = slots_[0].out;
    for (int i = 1; i < l_.num_local(); ++i) reduce(acc, acc, slots_[i].out, c.count);
    if (l_.num_workers() > 1) {
      if (absl::Status s = GlooAllReduce(c, acc); !s.ok()) return s;
    }
    copy_src_ = static_cast<const char*>(acc);
    return absl::OkStatus();
  }

  // Blocks are gathered worker by worker (each worker's local blocks in rank
  // order), which is rank order when every worker's ranks are contiguous and
  // the workers come in order: then local rank 0's output is the gather
  // buffer, else scratch is, and each local rank reorders from it.
  absl::Status RunAllGather(const Call& c) {
    const size_t block = size_t(c.count) * DTypeSize(c.dtype);
    char* dst = l_.worker_major ? static_cast<char*>(slots_[0].out) : Scratch(0, block * l_.size());
    for (int i = 0; i < l_.num_local(); ++i) {
      char* to = dst + size_t(l_.grouped_pos[l_.local_ranks[i]]) * block;
      if (to != slots_[i].in) std::memcpy(to, slots_[i].in, block);
    }
    if (l_.num_workers() > 1) {
      std::vector<size_t> elements;
      for (const auto& ranks : l_.worker_ranks) elements.push_back(ranks.size() * size_t(c.count));
      const uint32_t tag = next_tag_++;
      absl::Status s = CatchGloo(Describe(c), [&] {
        gloo::AllgathervOptions opts(gloo_);
        WithElementType(DTypeSize(c.dtype), [&](auto t) { opts.setOutput(reinterpret_cast<decltype(t)*>(dst), elements); });
        opts.setTag(tag);
        opts.setTimeout(GlooTimeout());
        gloo::allgatherv(opts);
      });
      if (!s.ok()) return s;
    }
    copy_src_ = dst;
    return absl::OkStatus();
  }

  // Within one worker each local rank reduces its own block (CopyOut).
  // Across workers: the local reduction of all blocks, an allreduce of it,
  // and each rank takes its block. That moves size() times the bytes of a
  // ring reduce-scatter over the network; simple, and correct for uneven
  // worker sizes.
  absl::Status RunReduceScatter(const Call& c) {
    if (l_.num_workers() == 1) return absl::OkStatus();
    const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
    const size_t total = size_t(c.count) * l_.size();
    char* acc = Scratch(0, total * DTypeSize(c.dtype));
    if (l_.num_local() == 1) {
      std::memcpy(acc, slots_[0].in, total * DTypeSize(c.dtype));
    } else {
      reduce(acc, slots_[0].in, slots_[1].in, total);
      for (int i = 2; i < l_.num_local(); ++i) reduce(acc, acc, slots_[i].in, total);
    }
    if (absl::Status s = GlooAllReduce(c, acc); !s.ok()) return s;
    copy_src_ = acc;
    return absl::OkStatus();
  }

  // Local blocks go straight from `in` to `out`. Blocks for other workers
  // are packed by destination worker (for each local source rank, for each
  // destination rank of that worker), exchanged with Gloo's alltoallv, and
  // unpacked into the local ranks' outputs in the same order.
  absl::Status RunAllToAll(const Call& c) {
    const size_t block = size_t(c.count) * DTypeSize(c.dtype);
    const int n = l_.num_local();
    for (int s = 0; s < n; ++s) {
      for (int t = 0; t < n; ++t) {
        std::memcpy(static_cast<char*>(slots_[t].out) + size_t(l_.local_ranks[s]) * block,
                    static_cast<const char*>(slots_[s].in) + size_t(l_.local_ranks[t]) * block, block);
      }
    }
    if (l_.num_workers() == 1) return absl::OkStatus();
    std::vector<int64_t> send_elems(l_.num_workers()), recv_elems(l_.num_workers());
    size_t send_blocks = 0, recv_blocks = 0;
    for (int w = 0; w < l_.num_workers(); ++w) {
      if (w == l_.self_worker) continue;
      const size_t blocks = size_t(n) * l_.worker_ranks[w].size();
      send_elems[w] = recv_elems[w] = blocks * c.count;
      send_blocks += blocks;
      recv_blocks += blocks;
    }
    char* send = Scratch(0, send_blocks * block);
    char* recv = Scratch(1, recv_blocks * block);
    char* p = send;
    for (int w = 0; w < l_.num_workers(); ++w) {
      if (w == l_.self_worker) continue;
      for (int s = 0; s < n; ++s) {
        for (int t : l_.worker_ranks[w]) {
          std::memcpy(p, static_cast<const char*>(slots_[s].in) + size_t(t) * block, block);
          p += block;
        }
      }
    }
    const uint32_t tag = next_tag_++;
    absl::Status st = CatchGloo(Describe(c), [&] {
      gloo::AlltoallvOptions opts(gloo_);
      WithElementType(DTypeSize(c.dtype), [&](auto t) {
        using T = decltype(t);
        opts.setInput(reinterpret_cast<T*>(send), send_elems);
        opts.setOutput(reinterpret_cast<T*>(recv), recv_elems);
      });
      opts.setTag(tag);
      opts.setTimeout(GlooTimeout());
      gloo::alltoallv(opts);
    });
    if (!st.ok()) return st;
    const char* q = recv;
    for (int w = 0; w < l_.num_workers(); ++w) {
      if (w == l_.self_worker) continue;
      for (int s : l_.worker_ranks[w]) {
        for (int t = 0; t < n; ++t) {
          std::memcpy(static_cast<char*>(slots_[t].out) + size_t(s) * block, q, block);
          q += block;
        }
      }
    }
    return absl::OkStatus();
  }

  // Pairs within this worker are copies; pairs across workers are one Gloo
  // message each, straight from the source's `in` to the target's `out`,
  // on a slot made of this round's tag and the pair's index.
  absl::Status RunPermute(const Call& c) {
    const size_t bytes = size_t(c.count) * DTypeSize(c.dtype);
    const int n = l_.num_local();
    std::vector<bool> targeted(n);
    for (const auto& [s, t] : *c.pairs) {
      if (l_.local_index[t] >= 0) targeted[l_.local_index[t]] = true;
    }
    for (int i = 0; i < n; ++i) {
      if (!targeted[i]) std::memset(slots_[i].out, 0, bytes);
    }
    const bool remote = l_.num_workers() > 1;
    const uint32_t tag = remote ? next_tag_++ : 0;
    return CatchGloo(Describe(c), [&] {
      std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> sends, recvs;
      const uint64_t base = remote ? uint64_t(gloo::Slot::build(kPermuteSlotPrefix, tag)) : 0;
      for (size_t p = 0; p < c.pairs->size(); ++p) {
        const auto [s, t] = (*c.pairs)[p];
        const int ls = l_.local_index[s], lt = l_.local_index[t];
        if (ls >= 0 && lt >= 0) {
          std::memmove(slots_[lt].out, slots_[ls].in, bytes);
        } else if (ls >= 0) {
          sends.push_back(gloo_->createUnboundBuffer(const_cast<void*>(slots_[ls].in), bytes));
          sends.back()->send(l_.worker_of_rank[t], base + p);
        } else if (lt >= 0) {
          recvs.push_back(gloo_->createUnboundBuffer(slots_[lt].out, bytes));
          recvs.back()->recv(l_.worker_of_rank[s], base + p);
        }
      }
      for (auto& b : recvs) {
        if (!b->waitRecv(GlooTimeout())) throw gloo::IoException("receive aborted");
      }
      for (auto& b : sends) {
        if (!b->waitSend(GlooTimeout())) throw gloo::IoException("send aborted");
      }
    });
  }

  // ---- Each local rank takes its result, in parallel ------------------------

  void CopyOut(const Call& c, int li) {
    const int esize = DTypeSize(c.dtype);
    const size_t block = size_t(c.count) * esize;
    const int rank = l_.local_ranks[li];
    switch (c.kind) {
      case Kind::kAllReduce:
        if (slots_[li].out != copy_src_) std::memcpy(slots_[li].out, copy_src_, block);
        break;
      case Kind::kAllGather: {
        char* out = static_cast<char*>(slots_[li].out);
        if (l_.worker_major) {
          if (out != copy_src_) std::memcpy(out, copy_src_, block * l_.size());
        } else {
          for (int r = 0; r < l_.size(); ++r) {
            std::memcpy(out + size_t(r) * block, copy_src_ + size_t(l_.grouped_pos[r]) * block, block);
          }
        }
        break;
      }
      case Kind::kReduceScatter: {
        void* out = slots_[li].out;
        if (l_.num_workers() > 1) {
          std::memcpy(out, copy_src_ + size_t(rank) * block, block);
          break;
        }
        auto block_of = [&](int i) { return static_cast<const char*>(slots_[i].in) + size_t(rank) * block; };
        if (l_.num_local() == 1) {
          std::memcpy(out, block_of(0), block);
          break;
        }
        const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
        reduce(out, block_of(0), block_of(1), c.count);
        for (int i = 2; i < l_.num_local(); ++i) reduce(out, out, block_of(i), c.count);
        break;
      }
      case Kind::kAllToAll:
      case Kind::kPermute:
        break;  // the round wrote every output
    }
  }

  const GroupLayout l_;
  const std::shared_ptr<const GlooEndpoint> endpoint_;  // null: no store
  const absl::Duration timeout_;
  const std::shared_ptr<spdlog::logger> log_;

  absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kGathering;
  uint64_t round_ ABSL_GUARDED_BY(mu_) = 0;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int departed_ ABSL_GUARDED_BY(mu_) = 0;
  // By local index. Written at arrival; read without the lock by the round's
  // runner and by CopyOut until every rank has left the round.
  std::vector<Slot> slots_;
  Call call_ ABSL_GUARDED_BY(mu_) = {};
  absl::Status round_status_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);

  // Owned by the thread running the current round.
  std::shared_ptr<gloo::rendezvous::Context> gloo_;
  std::unique_ptr<gloo::rendezvous::PrefixStore> prefix_store_;
  uint32_t next_tag_ = 0;
  std::unique_ptr<char[]> scratch_[2];
  size_t scratch_bytes_[2] = {0, 0};
  // Set by the round's runner for CopyOut (published by mu_).
  const char* copy_src_ = nullptr;
};

// ---- The registry -----------------------------------------------------------

class Registry final : public CommunicatorRegistry {
 public:
  Registry(CollectivesOptions options, std::shared_ptr<const GlooEndpoint> endpoint)
      : options_(std::move(options)), endpoint_(std::move(endpoint)) {}

  absl::StatusOr<Communicator*> Get(const GroupSpec& spec) override {
    absl::MutexLock l(&mu_);
    if (auto it = groups_.find(spec.key); it != groups_.end()) {
      if (it->second->rank_workers() != spec.rank_workers) {
        return absl::InvalidArgumentError(absl::StrCat(
            "collective group '", spec.key, "' was created with rank workers [",
            absl::StrJoin(it->second->rank_workers(), ", "), "], asked for again with [",
            absl::StrJoin(spec.rank_workers, ", "), "]"));
      }
      return it->second.get();
    }
    auto layout = MakeLayout(spec, options_.self);
    if (!layout.ok()) return layout.status();
    if (layout->num_workers() > 1 && endpoint_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("collective group '", spec.key, "' spans workers [",
                                                        absl::StrJoin(layout->workers, ", "),
                                                        "] but this worker has no rendezvous store"));
    }
    auto group = std::make_unique<GroupCommunicator>(std::move(*layout), endpoint_, options_.timeout,
                                                     options_.logger);
    Communicator* result = group.get();
    groups_.emplace(spec.key, std::move(group));
    return result;
  }

 private:
  const CollectivesOptions options_;
  const std::shared_ptr<const GlooEndpoint> endpoint_;  // null: no store
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<GroupCommunicator>> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CommunicatorRegistry>> NewCommunicatorRegistry(CollectivesOptions options) {
  if (options.self.empty()) return absl::InvalidArgumentError("collectives: `self` (this worker's address) is empty");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("collectives: timeout must be positive, got ", absl::FormatDuration(options.timeout)));
  }
  if (options.logger == nullptr) {
    options.logger = std::make_shared<spdlog::logger>("collectives", std::make_shared<spdlog::sinks::null_sink_mt>());
  }
  std::shared_ptr<GlooEndpoint> endpoint;
  if (options.store != nullptr) {
    endpoint = std::make_shared<GlooEndpoint>();
    endpoint->store = options.store;
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    absl::Status s = CatchGloo(absl::StrCat("collectives: opening a Gloo TCP device on '", options.hostname, "'"),
                               [&] { endpoint->device = gloo::transport::tcp::CreateDevice(attr); });
    if (!s.ok()) return s;
  }
  return std::make_unique<Registry>(std::move(options), std::move(endpoint));
}

}  // namespace tessel::worker
