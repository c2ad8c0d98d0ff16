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

#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <exception>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/dtype.h"
#include "core/half.h"
#include "core/status.h"
#include "spdlog/sinks/null_sink.h"
#include "worker/gloo_guard.h"

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
      using U = std::make_unsigned_t<decltype(T() + T())>;  // no promotion to int
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
      using U = std::make_unsigned_t<decltype(T() + T())>;  // no promotion to int
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
    case v1::S8: return PickReduce<int8_t>(op);
    case v1::S16: return PickReduce<int16_t>(op);
    case v1::U16: return PickReduce<uint16_t>(op);
    case v1::U32: return PickReduce<uint32_t>(op);
    case v1::U64: return PickReduce<uint64_t>(op);
    case v1::PRED:
      return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? &ReduceLoop<uint8_t, OrOp>
                                                            : &ReduceLoop<uint8_t, AndOp>;
    default: return nullptr;
  }
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

// Slot prefixes for Permute's point-to-point messages and for the headers
// exchanged before each round; Gloo's own collectives use prefixes 0x01..0x08.
constexpr uint8_t kPermuteSlotPrefix = 0x54;
constexpr uint8_t kHeaderSlotPrefix = 0x55;
// Two workers' all_reduce exchange (see ExchangeAllReduce): its connections'
// keys in a group's rendezvous store, its segment, and the largest block it
// takes (its inbox is kept for the group's life); larger blocks go through
// Gloo's ring, which needs no inbox of their size.
constexpr char kExchangeMeshKey[] = "exchange_";
constexpr size_t kExchangeSegmentBytes = size_t{1} << 20;
constexpr size_t kExchangeMaxBytes = size_t{16} << 20;
constexpr size_t kMaxPermutePairs = size_t{1} << 24;  // fits below the tag in a slot

// ---- Gloo plumbing shared by the groups of one registry -------------------

// Maps an exception thrown by Gloo to a status: timeouts (Gloo says
// "timeout" or "Timed out"; the coordinator's store says DEADLINE_EXCEEDED)
// are DEADLINE_EXCEEDED; IO errors and peers gone are UNAVAILABLE; failed
// internal checks are INTERNAL.
absl::Status FromGlooException(const std::exception& e, bool gloo_error,
                               absl::string_view context) {
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

// The rendezvous store and one TCP device (its event loop and the
// connections' listening sockets) for every group of this worker. The
// device opens when the first group connects: an open device's event loop
// wakes every 10 ms (Gloo's epoll timeout), which a worker that runs no
// collective need not pay, and 64 idle workers sharing a machine's cores
// would. Thread-safe; gloo's device is too.
class GlooEndpoint {
 public:
  GlooEndpoint(std::shared_ptr<gloo::rendezvous::Store> store, gloo::transport::tcp::attr attr)
      : store_(std::move(store)), attr_(std::move(attr)) {}

  gloo::rendezvous::Store& store() const { return *store_; }

  // Opens a device and closes it again: the same checks (the hostname
  // resolves to an address of this machine) the first real one meets.
  absl::Status Probe() const { return Open().status(); }

  // The device, opened by the first call.
  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> Device() const {
    absl::MutexLock l(&mu_);
    if (device_ == nullptr) {
      TESSEL_ASSIGN_OR_RETURN(device_, Open());
    }
    return device_;
  }

  bool opened() const {
    absl::MutexLock l(&mu_);
    return device_ != nullptr;
  }

 private:
  std::string Opening() const {
    return absl::StrCat("collectives: opening a Gloo TCP device on '", attr_.hostname, "'");
  }

  absl::StatusOr<std::shared_ptr<gloo::transport::Device>> Open() const {
    TESSEL_RETURN_IF_ERROR(Resolvable());
    std::shared_ptr<gloo::transport::Device> opened;
    TESSEL_RETURN_IF_ERROR(
        CatchGloo(Opening(), [&] { opened = gloo::transport::tcp::CreateDevice(attr_); }));
    return opened;
  }

  // Gloo (Debian's 0.5) takes getaddrinfo's failure for success unless it
  // is -1, which it never is, and then walks an unset result list: a name
  // that does not resolve must never reach it.
  absl::Status Resolvable() const {
    addrinfo hints{};
    hints.ai_family = attr_.ai_family;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    const int rv = getaddrinfo(attr_.hostname.c_str(), nullptr, &hints, &found);
    if (rv != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(Opening(), ": the host name does not resolve: ", gai_strerror(rv)));
    }
    freeaddrinfo(found);
    return absl::OkStatus();
  }

  const std::shared_ptr<gloo::rendezvous::Store> store_;
  const gloo::transport::tcp::attr attr_;
  mutable absl::Mutex mu_;
  mutable std::shared_ptr<gloo::transport::Device> device_ ABSL_GUARDED_BY(mu_);
};

// Whether `key` is set in `store` now (a 1 ms wait: stores only wait).
bool KeyIsSet(gloo::rendezvous::Store& store, const std::string& key) {
  try {
    store.wait({key}, std::chrono::milliseconds(1));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// The rendezvous store as one group's join sees it: every wait is cut into
// short slices, and between them it looks for the group's "abandoned" key,
// so a worker joining a group never waits out the join timeout for a peer
// that has given up on it (and moved on to the group's next epoch).
class WatchfulStore final : public gloo::rendezvous::Store {
 public:
  WatchfulStore(gloo::rendezvous::Store& inner, std::string abandoned_key,
                std::chrono::milliseconds timeout)
      : inner_(inner), abandoned_key_(std::move(abandoned_key)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    inner_.set(key, data);
  }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    return inner_.get(key);
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    using Clock = std::chrono::steady_clock;
    // At most the join's own timeout, whatever the caller asks (Gloo's
    // PrefixStore asks for its 30 s default).
    const Clock::time_point deadline =
        Clock::now() + (timeout.count() > 0 ? std::min(timeout, timeout_) : timeout_);
    for (const std::string& key : keys) {
      while (true) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        bool present = false;
        try {
          inner_.wait({key}, std::clamp(left, std::chrono::milliseconds(1), kSlice));
          present = true;
        } catch (const std::exception&) {
          if (Clock::now() >= deadline) throw;  // the store's own words: which key, how long
        }
        if (present) break;
        if (KeyIsSet(inner_, abandoned_key_)) {
          throw gloo::IoException(
              "a peer gave up on this group while this worker was joining it; the group starts "
              "over");
        }
      }
    }
  }

 private:
  static constexpr std::chrono::milliseconds kSlice{100};

  gloo::rendezvous::Store& inner_;
  const std::string abandoned_key_;
  const std::chrono::milliseconds timeout_;
};

// ---- One group --------------------------------------------------------------

// A group's ranks, as seen from this worker. Constant after construction.
struct GroupLayout {
  std::string key;
  std::vector<std::string> rank_workers;
  std::vector<int> rank_devices;               // empty, or one cluster-wide device id per rank
  std::vector<std::string> workers;            // distinct, by first appearance
  int self_worker = -1;                        // index into `workers`
  std::vector<int> worker_of_rank;             // rank -> index into `workers`
  std::vector<std::vector<int>> worker_ranks;  // worker -> its ranks, ascending
  std::vector<int> local_ranks;                // == worker_ranks[self_worker]
  std::vector<int> local_index;                // rank -> index into local_ranks, or -1
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
  if (spec.rank_devices.size() == spec.rank_workers.size()) l.rank_devices = spec.rank_devices;
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
    return absl::InvalidArgumentError(absl::StrCat("collective group '", spec.key, "': worker '",
                                                   self,
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
// from its own thread; rounds are keyed by CollectiveId and guarded by mu_;
// the Gloo context, tags and scratch buffers belong to whichever thread runs
// the current round (rounds of one group never run at once: each needs every
// local rank, and a rank is in one call at a time).
class GroupCommunicator final : public Communicator {
 public:
  GroupCommunicator(GroupLayout layout, std::shared_ptr<const GlooEndpoint> gloo,
                    absl::Duration timeout, std::shared_ptr<spdlog::logger> log)
      : l_(std::move(layout)),
        endpoint_(std::move(gloo)),
        timeout_(timeout),
        log_(std::move(log)) {}

  const std::vector<std::string>& rank_workers() const { return l_.rank_workers; }

  int size() const override { return l_.size(); }
  const std::vector<int>& local_ranks() const override { return l_.local_ranks; }

  absl::Status AllReduce(int rank, const CollectiveId& id, void* data, int64_t count,
                         v1::DType dtype, ReduceOp op) override {
    return Collective(rank, id, Call{Kind::kAllReduce, count, dtype, op, nullptr}, data, data,
                      nullptr);
  }
  absl::Status AllGather(int rank, const CollectiveId& id, const void* in, void* out, int64_t count,
                         v1::DType dtype) override {
    return Collective(rank, id, Call{Kind::kAllGather, count, dtype, ReduceOp::kSum, nullptr}, in,
                      out, nullptr);
  }
  absl::Status ReduceScatter(int rank, const CollectiveId& id, const void* in, void* out,
                             int64_t count, v1::DType dtype, ReduceOp op) override {
    return Collective(rank, id, Call{Kind::kReduceScatter, count, dtype, op, nullptr}, in, out,
                      nullptr);
  }
  absl::Status AllToAll(int rank, const CollectiveId& id, const void* in, void* out, int64_t count,
                        v1::DType dtype) override {
    return Collective(rank, id, Call{Kind::kAllToAll, count, dtype, ReduceOp::kSum, nullptr}, in,
                      out, nullptr);
  }
  absl::Status Permute(int rank, const CollectiveId& id, const void* in, void* out, int64_t count,
                       v1::DType dtype, const std::vector<std::pair<int, int>>& pairs) override {
    return Collective(rank, id, Call{Kind::kPermute, count, dtype, ReduceOp::kSum, &pairs}, in, out,
                      nullptr);
  }
  absl::Status Abandon(int rank, const CollectiveId& id, const absl::Status& cause) override {
    const absl::Status why = cause.ok() ? absl::UnknownError("(no cause given)") : cause;
    return Collective(rank, id, Call{Kind::kAbandoned, 0, v1::F32, ReduceOp::kSum, nullptr},
                      nullptr, nullptr, &why);
  }

 private:
  enum class Kind : uint32_t {
    kAllReduce,
    kAllGather,
    kReduceScatter,
    kAllToAll,
    kPermute,
    kAbandoned
  };

  struct Call {
    Kind kind;
    int64_t count;
    v1::DType dtype;
    ReduceOp op;                                    // kAllReduce, kReduceScatter
    const std::vector<std::pair<int, int>>* pairs;  // kPermute
  };
  struct Slot {
    const void* in = nullptr;
    void* out = nullptr;
    bool arrived = false;
  };
  // One collective of one step, as the local ranks meet for it.
  struct Round {
    explicit Round(int n) : slots(n) {}
    std::vector<Slot> slots;  // by local index; read without mu_ by the runner and CopyOut
    Call call{};              // the first contributing rank's call
    bool has_call = false;
    int arrived = 0;
    int departed = 0;
    bool running = false;        // every local rank arrived; the last runs the round
    bool done = false;           // `result` is final
    absl::Status local_failure;  // a local rank abandoned it, or the local ranks disagree
    absl::Status result;
    const char* copy_src = nullptr;  // set by the runner for CopyOut (published by mu_)
  };

  static const char* KindName(Kind k) {
    switch (k) {
      case Kind::kAllReduce: return "AllReduce";
      case Kind::kAllGather: return "AllGather";
      case Kind::kReduceScatter: return "ReduceScatter";
      case Kind::kAllToAll: return "AllToAll";
      case Kind::kPermute: return "Permute";
      case Kind::kAbandoned: return "(abandoned)";
    }
    return "?";
  }
  static bool Reduces(Kind k) { return k == Kind::kAllReduce || k == Kind::kReduceScatter; }

  std::string Describe(const Call& c) const {
    std::string s = absl::StrCat("group '", l_.key, "' ", KindName(c.kind));
    if (c.kind == Kind::kAbandoned) return s;
    absl::StrAppend(&s, "(", DTypeName(c.dtype), "[", c.count, "]");
    if (Reduces(c.kind)) absl::StrAppend(&s, ", ", ReduceOpName(c.op));
    if (c.kind == Kind::kPermute) absl::StrAppend(&s, ", ", c.pairs->size(), " pairs");
    return s + ")";
  }
  // "device 3" when the group knows its devices, else "rank 1".
  std::string RankName(int rank) const {
    if (rank >= 0 && rank < int(l_.rank_devices.size()))
      return absl::StrCat("device ", l_.rank_devices[rank]);
    return absl::StrCat("rank ", rank);
  }
  std::string RankNames(const std::vector<int>& ranks) const {
    return absl::StrJoin(ranks, ", ", [&](std::string* out, int r) { out->append(RankName(r)); });
  }

  static bool SameCall(const Call& a, const Call& b) {
    if (a.kind != b.kind || a.count != b.count || a.dtype != b.dtype) return false;
    if (Reduces(a.kind) && a.op != b.op) return false;
    if (a.kind == Kind::kPermute && *a.pairs != *b.pairs) return false;
    return true;
  }

  absl::Status Validate(int rank, const Call& call, const void* in, void* out) const {
    if (rank < 0 || rank >= l_.size() || l_.local_index[rank] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Describe(call), ": rank ", rank, " is not held by worker '", l_.workers[l_.self_worker],
          "' (local ranks: [", absl::StrJoin(l_.local_ranks, ", "), "])"));
    }
    if (call.kind == Kind::kAbandoned) return absl::OkStatus();
    const int esize = DTypeSize(call.dtype);
    if (esize == 0)
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": invalid dtype"));
    if (call.count < 0)
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": negative count"));
    if (call.count > INT64_MAX / esize / l_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": byte size overflows"));
    }
    // A permute reads `in` only on sources and writes `out` only on targets.
    bool reads = true, writes = true;
    if (call.kind == Kind::kPermute) {
      reads = writes = false;
      for (const auto& [s, t] : *call.pairs) {
        reads |= s == rank;
        writes |= t == rank;
      }
    }
    if (call.count > 0 && ((reads && in == nullptr) || (writes && out == nullptr))) {
      return absl::InvalidArgumentError(
          absl::StrCat(Describe(call), ": null buffer on rank ", rank));
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
          return absl::InvalidArgumentError(absl::StrCat(Describe(call), ": pair (", s, ", ", t,
                                                         ") is outside ranks 0..", l_.size() - 1));
        }
        if (targeted[t]) {
          return absl::InvalidArgumentError(
              absl::StrCat(Describe(call), ": rank ", t, " is targeted twice"));
        }
        targeted[t] = true;
      }
    }
    return absl::OkStatus();
  }

  static absl::Status Broken(absl::Status s) {
    s.SetPayload(kGroupBrokenPayload, absl::Cord("1"));
    return s;
  }

  // Remembers the result of a round some local rank never reached, for
  // when it arrives late (bounded: a rank that late gets a timeout of its own).
  void RememberEnded(const CollectiveId& id, const absl::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ended_.emplace_back(id, s);
    if (ended_.size() > kRememberedRounds) ended_.pop_front();
  }
  static constexpr size_t kRememberedRounds = 256;

  // The in-memory meeting of the local ranks under `id`; see collectives.h.
  absl::Status Collective(int rank, const CollectiveId& id, const Call& call, const void* in,
                          void* out, const absl::Status* abandon) {
    if (absl::Status s = Validate(rank, call, in, out); !s.ok()) return s;
    const int li = l_.local_index[rank];
    const int n = l_.num_local();
    const std::string what = absl::StrCat(id.ToString(), ": ");

    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      absl::Status s(broken_.code(),
                     absl::StrCat(what, "group '", l_.key, "' broke at an earlier collective (",
                                  broken_.message(), ")"));
      s.SetPayload(kGroupBrokenPayload, absl::Cord("1"));
      return s;
    }
    for (const auto& [ended_id, status] : ended_) {
      if (ended_id == id) return status;
    }
    auto [it, created] = rounds_.try_emplace(id, nullptr);
    if (created) it->second = std::make_shared<Round>(n);
    const std::shared_ptr<Round> round = it->second;  // keeps it alive for this call
    Round& r = *round;
    if (r.slots[li].arrived) {
      return absl::FailedPreconditionError(
          absl::StrCat(what, Describe(call), ": ", RankName(rank), " arrived twice"));
    }
    r.slots[li] = Slot{in, out, true};
    if (abandon != nullptr) {
      if (r.local_failure.ok()) {
        r.local_failure = absl::AbortedError(
            absl::StrCat(RankName(rank),
                         " did not reach this collective: its step failed: ", abandon->ToString()));
      }
    } else if (!r.has_call) {
      r.call = call;
      r.has_call = true;
    } else if (!SameCall(r.call, call) && r.local_failure.ok()) {
      r.local_failure = absl::InvalidArgumentError(
          absl::StrCat("local ranks disagree: ", RankName(rank), " called ", Describe(call),
                       " while others called ", Describe(r.call)));
    }
    ++r.arrived;

    if (r.arrived < n) {
      auto started = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return r.running || r.done; };
      if (!mu_.AwaitWithTimeout(absl::Condition(&started), timeout_)) {
        std::vector<int> missing;
        for (int i = 0; i < n; ++i) {
          if (!r.slots[i].arrived) missing.push_back(l_.local_ranks[i]);
        }
        r.result = absl::DeadlineExceededError(
            absl::StrCat(what, Describe(r.has_call ? r.call : call), ": ", RankNames(missing),
                         " did not arrive within ", absl::FormatDuration(timeout_)));
        r.done = true;
        RememberEnded(id, r.result);
        log_->error("{}", r.result.ToString());
      }
      auto finished = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return r.done; };
      mu_.Await(absl::Condition(&finished));
    } else {
      r.running = true;
      mu_.Unlock();
      absl::Status s = RunRound(id, r);
      mu_.Lock();
      if (!s.ok()) {
        s = Annotate(s, what);
        if (s.GetPayload(kGroupBrokenPayload).has_value()) {
          broken_ = s;
          log_->error("{}", s.ToString());
        }
      }
      r.result = s;
      r.done = true;
    }

    const absl::Status result = r.result;
    if (result.ok() && abandon == nullptr) {
      const Call c = r.call;
      mu_.Unlock();
      CopyOut(r, c, li);
      mu_.Lock();
    }
    // Leave together: results are read from other ranks' buffers until then.
    ++r.departed;
    if (r.departed == r.arrived) {
      if (auto found = rounds_.find(id); found != rounds_.end() && found->second == round)
        rounds_.erase(found);
    } else if (r.running) {
      auto all_left = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return r.departed == r.arrived; };
      mu_.Await(absl::Condition(&all_left));
    }
    return result;
  }

  // ---- The round, run by the last local rank to arrive ----------------------

  absl::Status RunRound(const CollectiveId& id, Round& r) {
    const Call c =
        r.has_call ? r.call : Call{Kind::kAbandoned, 0, v1::F32, ReduceOp::kSum, nullptr};
    absl::Status s = RunRoundUnchecked(id, r, c);
    if (!s.ok() && l_.num_workers() > 1 && s.code() != absl::StatusCode::kAborted &&
        s.code() != absl::StatusCode::kInvalidArgument) {
      // A Gloo operation failed part way, or the workers are out of step:
      // what the peers hold is unknown. Close the connections (so peers
      // still in this round fail at once) and refuse later calls.
      s = Broken(std::move(s));
      inbound_.reset();
      outbound_.reset();
      gloo_.reset();
      prefix_store_.reset();
      watchful_store_.reset();
      // Peers not yet connected learn at once rather than wait for us; the
      // steps after this one meet in a group of a new epoch. Without this,
      // a late peer stuck connecting to a group we left would keep missing
      // the next epoch's window, and the next, as we would its.
      (void)CatchGloo("", [&] { endpoint_->store().set(AbandonedKey(), {'1'}); });
    }
    return s;
  }

  std::string AbandonedKey() const { return l_.key + "/abandoned"; }
  bool Abandoned() const { return KeyIsSet(endpoint_->store(), AbandonedKey()); }
  // Said by a worker that reached the group; see ConnectGloo.
  static std::string HereKey(int worker) { return absl::StrCat("here_", worker); }
  static constexpr int kConnectTimeoutFactor = 3;

  absl::Status RunRoundUnchecked(const CollectiveId& id, Round& r, const Call& c) {
    if (l_.num_workers() > 1) {
      if (absl::Status s = ConnectGloo(c); !s.ok()) return s;
      HeaderExchange x;
      TESSEL_RETURN_IF_ERROR(PostHeaders(id, r, c, x));
      if (Overlaps(c, r.local_failure)) {
        // An all_reduce this worker can take part in moves its data while
        // the headers travel, and is judged once they are in: a verdict
        // against it fails the round, and what moved into this step's own
        // output buffers is never read. A worker that cannot take part joins
        // with a dummy block (below), so no peer waits out a timeout.
        absl::Status data = RunData(r, c);
        absl::Status heard = AwaitHeaders(c, x);
        if (!data.ok()) {
          // A Gloo operation failed part way: the group breaks (the data's
          // code says so). Headers that disagree say why it failed.
          absl::Status verdict = heard.ok() ? JudgeHeaders(id, c, x) : absl::OkStatus();
          if (verdict.ok()) return data;
          return absl::Status(
              data.code(),
              absl::StrCat(verdict.message(), "; the data exchange failed: ", data.message()));
        }
        TESSEL_RETURN_IF_ERROR(heard);
        return JudgeHeaders(id, c, x);
      }
      TESSEL_RETURN_IF_ERROR(AwaitHeaders(c, x));
      if (const WireHeader* peer = FirstOverlapping(x)) {
        // A peer went ahead with an all_reduce; this worker's ranks cannot
        // take part (one abandoned the round, or they called something
        // else). Join with zeros, then give the verdict every worker gives.
        const Call dummy{Kind::kAllReduce, peer->count, v1::DType(peer->dtype),
                         ReduceOp(peer->reduce_op), nullptr};
        const size_t bytes = size_t(dummy.count) * DTypeSize(dummy.dtype);
        char* zeros = Scratch(0, bytes);
        std::memset(zeros, 0, bytes);
        TESSEL_RETURN_IF_ERROR(MidExchange(GlooAllReduce(dummy, zeros)));
        absl::Status verdict = JudgeHeaders(id, c, x);
        if (verdict.ok())
          verdict = absl::InternalError(absl::StrCat(Describe(c), ": joined a peer's all_reduce"));
        return verdict;
      }
      TESSEL_RETURN_IF_ERROR(JudgeHeaders(id, c, x));
    } else if (!r.local_failure.ok()) {
      return r.local_failure;
    }
    return RunData(r, c);
  }

  // Whether this worker moves data before the headers are in: an all_reduce
  // (the most frequent collective, and the one whose latency the header
  // round trip would double at small sizes) that every local rank called.
  static bool Overlaps(const Call& c, const absl::Status& local_failure) {
    return c.kind == Kind::kAllReduce && c.count > 0 && local_failure.ok();
  }

  absl::Status RunData(Round& r, const Call& c) {
    if (c.count == 0) return absl::OkStatus();
    absl::Status s = absl::InternalError("unknown collective");
    switch (c.kind) {
      case Kind::kAllReduce: s = RunAllReduce(r, c); break;
      case Kind::kAllGather: s = RunAllGather(r, c); break;
      case Kind::kReduceScatter: s = RunReduceScatter(r, c); break;
      case Kind::kAllToAll: s = RunAllToAll(r, c); break;
      case Kind::kPermute: s = RunPermute(r, c); break;
      case Kind::kAbandoned: break;
    }
    return MidExchange(std::move(s));
  }

  // Names the peers of a data exchange that failed part way.
  absl::Status MidExchange(absl::Status s) const {
    if (s.ok() || l_.num_workers() == 1) return s;
    std::vector<std::string> others;
    for (int w = 0; w < l_.num_workers(); ++w) {
      if (w != l_.self_worker) others.push_back(WorkerDevices(w));
    }
    return Annotate(s, absl::StrCat("exchanging data with ", absl::StrJoin(others, ", "),
                                    " (a peer stalled or went away mid-exchange): "));
  }

  // What one worker says of a round before any data moves: which collective
  // it is at, with which arguments, and whether its ranks can take part.
  struct WireHeader {
    uint64_t magic;
    int64_t execution;
    int32_t op;
    uint32_t kind;
    uint64_t scope;
    int64_t count;
    int32_t dtype;
    int32_t reduce_op;
    uint64_t pairs_hash;
    int32_t code;  // 0: every local rank is ready; else why one is not
    int32_t message_len;
    char message[200];
  };
  static constexpr uint64_t kHeaderMagic = 0x54534c4852444831;  // "TSLHRDH1"

  // Headers in flight: ours being sent, theirs being received. Not movable
  // once posted: Gloo holds pointers into it.
  struct HeaderExchange {
    WireHeader mine{};
    std::vector<WireHeader> theirs;
    std::unique_ptr<gloo::transport::UnboundBuffer> send;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recvs;
    // Two workers: the header goes down the exchange connections instead,
    // straight into the peer's buffer (no ready-to-receive round trip).
    std::unique_ptr<gloo::transport::Buffer> send_to_peer, recv_from_peer;
  };

  static uint64_t PairsHash(const Call& c) {
    if (c.kind != Kind::kPermute) return 0;
    uint64_t h = 1469598103934665603ull;
    for (const auto& [s, t] : *c.pairs)
      h = (h ^ uint64_t(uint32_t(s)) << 32 ^ uint32_t(t)) * 1099511628211ull;
    return h;
  }

  static WireHeader MakeHeader(const CollectiveId& id, const Call& c, const absl::Status& failure) {
    WireHeader h{};
    h.magic = kHeaderMagic;
    h.execution = id.execution;
    h.op = id.op;
    h.scope = id.scope;
    h.kind = uint32_t(c.kind);
    h.count = c.count;
    h.dtype = c.dtype;
    h.reduce_op = int32_t(c.op);
    h.pairs_hash = PairsHash(c);
    h.code = int32_t(failure.code());
    const std::string m(failure.message().substr(0, sizeof(h.message)));
    h.message_len = m.size();
    std::memcpy(h.message, m.data(), m.size());
    return h;
  }

  std::string WorkerDevices(int w) const {
    std::vector<int> ranks = l_.worker_ranks[w];
    return absl::StrCat("worker '", l_.workers[w], "' (", RankNames(ranks), ")");
  }

  // Every worker tells every other worker its header (PostHeaders, then
  // AwaitHeaders). Then each worker decides alike (JudgeHeaders): a worker
  // out of step breaks the group; a rank that abandoned the round, or
  // arguments that differ, fail it on every worker. Only an all_reduce moves
  // data before the verdict (Overlaps).
  absl::Status PostHeaders(const CollectiveId& id, const Round& r, const Call& c,
                           HeaderExchange& x) {
    const int nw = l_.num_workers(), self = l_.self_worker;
    x.mine = MakeHeader(id, c, r.local_failure);
    x.theirs.assign(nw, WireHeader{});
    x.recvs.resize(nw);
    const uint32_t tag = next_tag_++;
    if (inbound_ != nullptr) {
      const int peer = 1 - self;
      return CatchGloo(absl::StrCat(Describe(c), ": exchanging headers"), [&] {
        ClosingOutboundOnFailure([&] {
          const int slot = ExchangeSlot(tag, kHeaderSlotBit);
          x.recv_from_peer =
              inbound_->getPair(peer)->createRecvBuffer(slot, &x.theirs[peer], sizeof(WireHeader));
          x.send_to_peer =
              outbound_->getPair(peer)->createSendBuffer(slot, &x.mine, sizeof(WireHeader));
          x.send_to_peer->send(0, sizeof(WireHeader));
        });
      });
    }
    const uint64_t slot = uint64_t(gloo::Slot::build(kHeaderSlotPrefix, tag));
    return CatchGloo(absl::StrCat(Describe(c), ": exchanging headers"), [&] {
      x.send = gloo_->createUnboundBuffer(&x.mine, sizeof(WireHeader));
      for (int w = 0; w < nw; ++w) {
        if (w == self) continue;
        x.recvs[w] = gloo_->createUnboundBuffer(&x.theirs[w], sizeof(WireHeader));
        x.recvs[w]->recv(w, slot);
        x.send->send(w, slot);
      }
    });
  }

  absl::Status AwaitHeaders(const Call& c, HeaderExchange& x) {
    const int nw = l_.num_workers(), self = l_.self_worker;
    std::vector<int> missing;
    absl::Status first_error;
    const auto deadline = std::chrono::steady_clock::now() + GlooTimeout();
    auto remaining = [&] {
      return std::max(std::chrono::milliseconds(1),
                      std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now()));
    };
    for (int w = 0; w < nw; ++w) {
      if (w == self) continue;
      absl::Status s = CatchGloo(absl::StrCat(Describe(c), ": ", WorkerDevices(w)), [&] {
        if (x.recv_from_peer != nullptr) {
          // Read on this thread; a read times out after the collective timeout.
          ClosingOutboundOnFailure([&] { x.recv_from_peer->waitRecv(); });
        } else if (!x.recvs[w]->waitRecv(remaining())) {
          throw gloo::IoException("receive aborted");
        }
      });
      if (!s.ok()) {
        missing.push_back(w);
        if (first_error.ok()) first_error = s;
      }
    }
    for (int w = 0; w < nw - 1 && missing.empty(); ++w) {
      absl::Status s = CatchGloo("sending the header", [&] {
        if (x.send_to_peer != nullptr) {
          ClosingOutboundOnFailure([&] { x.send_to_peer->waitSend(); });
        } else if (!x.send->waitSend(remaining())) {
          throw gloo::IoException("send aborted");
        }
      });
      if (!s.ok() && first_error.ok()) first_error = s;
    }
    if (!missing.empty()) {
      const std::string who = absl::StrJoin(
          missing, ", ", [&](std::string* out, int w) { out->append(WorkerDevices(w)); });
      return absl::Status(first_error.code(), absl::StrCat("no word from ", who, " within ",
                                                           absl::FormatDuration(timeout_), ": ",
                                                           first_error.message()));
    }
    return first_error;
  }

  absl::Status JudgeHeaders(const CollectiveId& id, const Call& c, const HeaderExchange& x) const {
    const int nw = l_.num_workers(), self = l_.self_worker;
    const WireHeader& mine = x.mine;
    for (int w = 0; w < nw; ++w) {
      if (w == self) continue;
      const WireHeader& h = x.theirs[w];
      if (h.magic != kHeaderMagic || h.execution != id.execution || h.op != id.op ||
          h.scope != id.scope) {
        return absl::FailedPreconditionError(absl::StrCat(
            Describe(c), ": workers out of step: ", WorkerDevices(w), " is at execution ",
            h.execution, ", op ", h.op, h.scope == 0 ? "" : absl::StrCat(", scope ", h.scope),
            "; this device is at ", id.ToString(), "; the group must start over"));
      }
    }
    // Every worker sees the same headers, so every worker returns the same error.
    for (int w = 0; w < nw; ++w) {
      const WireHeader& h = w == self ? mine : x.theirs[w];
      if (h.code != 0) {
        return absl::AbortedError(
            std::string(h.message, std::min<size_t>(h.message_len, sizeof(h.message))));
      }
    }
    for (int w = 0; w < nw; ++w) {
      const WireHeader& h = x.theirs[w];
      if (w == self) continue;
      if (h.kind != mine.kind || h.count != mine.count || h.dtype != mine.dtype ||
          (Reduces(c.kind) && h.reduce_op != mine.reduce_op) || h.pairs_hash != mine.pairs_hash) {
        return absl::InvalidArgumentError(absl::StrCat(
            Describe(c), ": ", WorkerDevices(w), " called ", KindName(Kind(h.kind)), "(",
            DTypeName(v1::DType(h.dtype)), "[", h.count, "]) for the same collective"));
      }
    }
    return absl::OkStatus();
  }

  // A peer's header saying it went ahead with an all_reduce (Overlaps), or null.
  const WireHeader* FirstOverlapping(const HeaderExchange& x) const {
    for (int w = 0; w < l_.num_workers(); ++w) {
      if (w == l_.self_worker) continue;
      const WireHeader& h = x.theirs[w];
      if (h.magic == kHeaderMagic && Kind(h.kind) == Kind::kAllReduce && h.code == 0 && h.count > 0)
        return &h;
    }
    return nullptr;
  }

  std::chrono::milliseconds GlooTimeout() const { return absl::ToChronoMilliseconds(timeout_); }

  absl::Status ConnectGloo(const Call& c) {
    if (gloo_ != nullptr) return absl::OkStatus();
    if (endpoint_ == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(Describe(c), ": the group spans workers [", absl::StrJoin(l_.workers, ", "),
                       "] but this worker has no rendezvous store"));
    }
    // A worker that gave up on this group (its epoch) said so in the store:
    // connecting now would wait out the timeout for a peer that has left.
    if (Abandoned()) {
      return absl::FailedPreconditionError(absl::StrCat(
          Describe(c),
          ": a peer gave up on this group before this worker joined it; the group starts over"));
    }
    auto context = std::make_shared<gloo::rendezvous::Context>(l_.self_worker, l_.num_workers());
    // Joining waits longer than a collective: after a failure the peers
    // reach a group's new epoch only once they have drained the steps that
    // failed before it.
    const std::chrono::milliseconds join_timeout = GlooTimeout() * kConnectTimeoutFactor;
    context->setTimeout(join_timeout);
    watchful_store_ =
        std::make_unique<WatchfulStore>(endpoint_->store(), AbandonedKey(), join_timeout);
    prefix_store_ = std::make_unique<gloo::rendezvous::PrefixStore>(l_.key, *watchful_store_);
    std::shared_ptr<gloo::transport::Device> device;
    TESSEL_ASSIGN_OR_RETURN(device, endpoint_->Device());
    const absl::Time start = absl::Now();
    const std::string connecting = absl::StrCat(Describe(c), ": connecting to workers [",
                                                absl::StrJoin(l_.workers, ", "), "]");
    // Two steps. First every worker says it is here and waits until all
    // are; only then does it publish its address (Gloo's "rank_<worker>")
    // and connect. A worker that gives up waiting has published no address,
    // so a peer that arrives just after never connects to a listener that
    // has gone: it waits for the missing address, sees that the group was
    // abandoned, and moves on at once, in step with the peer.
    absl::Status s = CatchGloo(connecting, [&] {
      prefix_store_->set(HereKey(l_.self_worker), {'1'});
      for (int w = 0; w < l_.num_workers(); ++w) {
        if (w != l_.self_worker) prefix_store_->wait({HereKey(w)}, join_timeout);
      }
    });
    if (s.ok())
      s = CatchGloo(connecting, [&] { context->connectFullMesh(*prefix_store_, device); });
    // Two workers: one connection each way for all_reduce data, where
    // worker w reads connection w synchronously. Both workers are here once
    // the first mesh is up: these wait no longer than a collective, and
    // their reads and writes time out as one.
    std::shared_ptr<gloo::rendezvous::Context> way[2];
    for (int w = 0; s.ok() && l_.num_workers() == 2 && w < 2; ++w) {
      way[w] = std::make_shared<gloo::rendezvous::Context>(l_.self_worker, 2);
      way[w]->setTimeout(GlooTimeout());
      s = CatchGloo(connecting, [&] {
        gloo::rendezvous::PrefixStore store(absl::StrCat(kExchangeMeshKey, w), *prefix_store_);
        way[w]->connectFullMesh(store, device);
        if (w == l_.self_worker) way[w]->getPair(1 - w)->setSync(true, /*busyPoll=*/false);
      });
    }
    if (!s.ok()) {
      if (Abandoned()) return s;  // it says so
      // Name the workers that never said they were here, not just the group.
      std::vector<int> absent;
      for (int w = 0; w < l_.num_workers(); ++w) {
        const std::string here = absl::StrCat(l_.key, "/", HereKey(w));
        if (w != l_.self_worker && !KeyIsSet(endpoint_->store(), here)) absent.push_back(w);
      }
      if (!absent.empty()) {
        const std::string who = absl::StrJoin(
            absent, ", ", [&](std::string* out, int w) { out->append(WorkerDevices(w)); });
        return Annotate(s, absl::StrCat(who, " never joined the group: "));
      }
      return s;
    }
    gloo_ = std::move(context);
    if (way[0] != nullptr) {
      inbound_ = std::move(way[l_.self_worker]);
      outbound_ = std::move(way[1 - l_.self_worker]);
    }
    log_->debug("group '{}': connected to {} workers as worker {} in {}", l_.key, l_.num_workers(),
                l_.self_worker, absl::FormatDuration(absl::Now() - start));
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
    const size_t elements = size_t(c.count) * (c.kind == Kind::kAllReduce ? 1 : l_.size());
    if (inbound_ != nullptr && elements * DTypeSize(c.dtype) <= kExchangeMaxBytes) {
      return ExchangeAllReduce(c, tag, data, elements);
    }
    return CatchGloo(Describe(c), [&] {
      gloo::AllreduceOptions opts(gloo_);
      WithElementType(DTypeSize(c.dtype),
                      [&](auto t) { opts.setOutput(static_cast<decltype(t)*>(data), elements); });
      opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
      opts.setReduceFunction(GetReduceFn(c.dtype, c.op));
      opts.setTag(tag);
      opts.setTimeout(GlooTimeout());
      gloo::allreduce(opts);
    });
  }

  // An all_reduce between two workers: each sends its whole block to the
  // other and reduces the peer's block into its own. The same bytes cross
  // the wire as in a ring (a reduce-scatter half and an all-gather half),
  // in one pass instead of two. Each way has a connection of its own: the
  // sender writes it asynchronously (Gloo's event loop finishes a write the
  // socket could not take at once), the receiver reads it on the step's own
  // thread (Gloo's synchronous mode). No write waits on a read of the same
  // worker, so neither side can block the other, whatever the socket
  // buffers hold; and no event loop polls (on a busy machine, spins) for
  // data the step's thread is waiting to read.
  //
  // The block goes in segments, each reduced as it arrives while the next
  // is in flight, and only once its own send is done (the peer needs this
  // worker's values). Both workers reduce in worker order (worker 0's block
  // first), so both hold the same bits. A round's slot comes from its tag:
  // a message left over from another round meets no buffer and fails the
  // round it lands in, and never fills this round's inbox.
  absl::Status ExchangeAllReduce(const Call& c, uint32_t tag, void* data, size_t elements) {
    const size_t esize = DTypeSize(c.dtype);
    const size_t bytes = elements * esize;
    const size_t segment = std::max<size_t>(1, kExchangeSegmentBytes / esize) * esize;
    const size_t segments = (bytes + segment - 1) / segment;
    const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
    char* const inbox = Scratch(2, bytes);
    char* const mine = static_cast<char*>(data);
    const bool first = l_.self_worker == 0;
    const int slot = ExchangeSlot(tag, 0);
    const int peer = 1 - l_.self_worker;
    return CatchGloo(absl::StrCat(Describe(c), ": exchanging data"), [&] {
      ClosingOutboundOnFailure([&] {
        auto in = inbound_->getPair(peer)->createRecvBuffer(slot, inbox, bytes);
        auto out = outbound_->getPair(peer)->createSendBuffer(slot, mine, bytes);
        auto length = [&](size_t k) { return std::min(segment, bytes - k * segment); };
        for (size_t k = 0; k < segments; ++k) out->send(k * segment, length(k), k * segment);
        for (size_t k = 0; k < segments; ++k) {
          in->waitRecv();
          out->waitSend();  // sends complete in order: segment k has left
          char* at = mine + k * segment;
          const char* theirs = inbox + k * segment;
          const size_t n = length(k) / esize;
          if (first) {
            reduce(at, at, theirs, n);
          } else {
            reduce(at, theirs, at, n);
          }
        }
      });
    });
  }

  // A slot on the exchange connections (Gloo's bound buffers take int
  // slots): a round's tag, and whether it is the header.
  static constexpr int kHeaderSlotBit = 1 << 30;
  static int ExchangeSlot(uint32_t tag, int header_bit) {
    return int(tag & 0x3FFFFFFFu) | header_bit;
  }

  // Runs `f`, which uses the exchange connections. If it throws, the
  // outbound connection closes before the buffers `f` made go away: Gloo's
  // event loop would otherwise finish a queued write from a buffer that no
  // longer exists. (The group is broken then: its connections close anyway.)
  // A message of another round on the inbound connection is one Gloo cannot
  // place: named here, as what it means.
  template <typename F>
  void ClosingOutboundOnFailure(F&& f) {
    try {
      f();
    } catch (const gloo::EnforceNotMet& e) {
      outbound_->getPair(1 - l_.self_worker)->close();
      if (absl::StrContains(e.what(), "read() returned false")) {
        throw gloo::IoException(absl::StrCat(
            "a message of another round arrived from the peer: the workers are out of step (",
            e.what(), ")"));
      }
      throw;
    } catch (...) {
      outbound_->getPair(1 - l_.self_worker)->close();
      throw;
    }
  }

  // Local reduce into local rank 0's buffer, Gloo across workers on that
  // buffer, then the other local ranks copy it (CopyOut). With one local
  // rank this is Gloo's allreduce on the caller's buffer and nothing else.
  absl::Status RunAllReduce(Round& r, const Call& c) {
    const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
    void* acc = r.slots[0].out;
    for (int i = 1; i < l_.num_local(); ++i) reduce(acc, acc, r.slots[i].out, c.count);
    if (l_.num_workers() > 1) {
      if (absl::Status s = GlooAllReduce(c, acc); !s.ok()) return s;
    }
    r.copy_src = static_cast<const char*>(acc);
    return absl::OkStatus();
  }

  // Blocks are gathered worker by worker (each worker's local blocks in rank
  // order), which is rank order when every worker's ranks are contiguous and
  // the workers come in order: then local rank 0's output is the gather
  // buffer, else scratch is, and each local rank reorders from it.
  absl::Status RunAllGather(Round& r, const Call& c) {
    const size_t block = size_t(c.count) * DTypeSize(c.dtype);
    char* dst =
        l_.worker_major ? static_cast<char*>(r.slots[0].out) : Scratch(0, block * l_.size());
    for (int i = 0; i < l_.num_local(); ++i) {
      char* to = dst + size_t(l_.grouped_pos[l_.local_ranks[i]]) * block;
      if (to != r.slots[i].in) std::memcpy(to, r.slots[i].in, block);
    }
    if (l_.num_workers() > 1) {
      std::vector<size_t> elements;
      for (const auto& ranks : l_.worker_ranks) elements.push_back(ranks.size() * size_t(c.count));
      const uint32_t tag = next_tag_++;
      absl::Status s = CatchGloo(Describe(c), [&] {
        gloo::AllgathervOptions opts(gloo_);
        WithElementType(DTypeSize(c.dtype), [&](auto t) {
          opts.setOutput(reinterpret_cast<decltype(t)*>(dst), elements);
        });
        opts.setTag(tag);
        opts.setTimeout(GlooTimeout());
        gloo::allgatherv(opts);
      });
      if (!s.ok()) return s;
    }
    r.copy_src = dst;
    return absl::OkStatus();
  }

  // Within one worker each local rank reduces its own block (CopyOut).
  // Across workers: the local reduction of all blocks, an allreduce of it,
  // and each rank takes its block. That moves size() times the bytes of a
  // ring reduce-scatter over the network; simple, and correct for uneven
  // worker sizes.
  absl::Status RunReduceScatter(Round& r, const Call& c) {
    if (l_.num_workers() == 1) return absl::OkStatus();
    const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
    const size_t total = size_t(c.count) * l_.size();
    char* acc = Scratch(0, total * DTypeSize(c.dtype));
    if (l_.num_local() == 1) {
      std::memcpy(acc, r.slots[0].in, total * DTypeSize(c.dtype));
    } else {
      reduce(acc, r.slots[0].in, r.slots[1].in, total);
      for (int i = 2; i < l_.num_local(); ++i) reduce(acc, acc, r.slots[i].in, total);
    }
    if (absl::Status s = GlooAllReduce(c, acc); !s.ok()) return s;
    r.copy_src = acc;
    return absl::OkStatus();
  }

  // Local blocks go straight from `in` to `out`. Blocks for other workers
  // are packed by destination worker (for each local source rank, for each
  // destination rank of that worker), exchanged with Gloo's alltoallv, and
  // unpacked into the local ranks' outputs in the same order.
  absl::Status RunAllToAll(Round& r, const Call& c) {
    const size_t block = size_t(c.count) * DTypeSize(c.dtype);
    const int n = l_.num_local();
    for (int s = 0; s < n; ++s) {
      for (int t = 0; t < n; ++t) {
        std::memcpy(static_cast<char*>(r.slots[t].out) + size_t(l_.local_ranks[s]) * block,
                    static_cast<const char*>(r.slots[s].in) + size_t(l_.local_ranks[t]) * block,
                    block);
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
          std::memcpy(p, static_cast<const char*>(r.slots[s].in) + size_t(t) * block, block);
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
          std::memcpy(static_cast<char*>(r.slots[t].out) + size_t(s) * block, q, block);
          q += block;
        }
      }
    }
    return absl::OkStatus();
  }

  // Pairs within this worker are copies; pairs across workers are one Gloo
  // message each, straight from the source's `in` to the target's `out`,
  // on a slot made of this round's tag and the pair's index.
  absl::Status RunPermute(Round& r, const Call& c) {
    const size_t bytes = size_t(c.count) * DTypeSize(c.dtype);
    const int n = l_.num_local();
    std::vector<bool> targeted(n);
    for (const auto& [s, t] : *c.pairs) {
      if (l_.local_index[t] >= 0) targeted[l_.local_index[t]] = true;
    }
    for (int i = 0; i < n; ++i) {
      if (!targeted[i] && r.slots[i].out != nullptr) std::memset(r.slots[i].out, 0, bytes);
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
          std::memmove(r.slots[lt].out, r.slots[ls].in, bytes);
        } else if (ls >= 0) {
          sends.push_back(gloo_->createUnboundBuffer(const_cast<void*>(r.slots[ls].in), bytes));
          sends.back()->send(l_.worker_of_rank[t], base + p);
        } else if (lt >= 0) {
          recvs.push_back(gloo_->createUnboundBuffer(r.slots[lt].out, bytes));
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

  void CopyOut(Round& r, const Call& c, int li) {
    const int esize = DTypeSize(c.dtype);
    const size_t block = size_t(c.count) * esize;
    const int rank = l_.local_ranks[li];
    switch (c.kind) {
      case Kind::kAllReduce:
        if (r.slots[li].out != r.copy_src) std::memcpy(r.slots[li].out, r.copy_src, block);
        break;
      case Kind::kAllGather: {
        char* out = static_cast<char*>(r.slots[li].out);
        if (l_.worker_major) {
          if (out != r.copy_src) std::memcpy(out, r.copy_src, block * l_.size());
        } else {
          for (int k = 0; k < l_.size(); ++k) {
            std::memcpy(out + size_t(k) * block, r.copy_src + size_t(l_.grouped_pos[k]) * block,
                        block);
          }
        }
        break;
      }
      case Kind::kReduceScatter: {
        void* out = r.slots[li].out;
        if (l_.num_workers() > 1) {
          std::memcpy(out, r.copy_src + size_t(rank) * block, block);
          break;
        }
        auto block_of = [&](int i) {
          return static_cast<const char*>(r.slots[i].in) + size_t(rank) * block;
        };
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
      case Kind::kAbandoned: break;  // the round wrote every output
    }
  }

  const GroupLayout l_;
  const std::shared_ptr<const GlooEndpoint> endpoint_;  // null: no store
  const absl::Duration timeout_;
  const std::shared_ptr<spdlog::logger> log_;

  absl::Mutex mu_;
  absl::flat_hash_map<CollectiveId, std::shared_ptr<Round>> rounds_ ABSL_GUARDED_BY(mu_);
  std::deque<std::pair<CollectiveId, absl::Status>> ended_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);

  // Owned by the thread running the current round.
  std::shared_ptr<gloo::rendezvous::Context> gloo_;
  std::unique_ptr<WatchfulStore> watchful_store_;  // under prefix_store_
  std::unique_ptr<gloo::rendezvous::PrefixStore> prefix_store_;
  uint32_t next_tag_ = 0;
  // Two workers: two more connections, one each way, that carry the data
  // of all_reduces (ExchangeAllReduce). This worker reads `inbound_` in
  // Gloo's synchronous mode and writes `outbound_` asynchronously. Null
  // with more workers.
  std::shared_ptr<gloo::rendezvous::Context> inbound_, outbound_;
  std::unique_ptr<char[]> scratch_[3];
  size_t scratch_bytes_[3] = {0, 0, 0};
};

// ---- The registry -----------------------------------------------------------

class Registry final : public CommunicatorRegistry {
 public:
  Registry(CollectivesOptions options, std::shared_ptr<const GlooEndpoint> endpoint)
      : options_(std::move(options)), endpoint_(std::move(endpoint)) {}

  absl::StatusOr<std::shared_ptr<Communicator>> Get(const GroupSpec& spec) override {
    absl::MutexLock l(&mu_);
    if (auto it = groups_.find(spec.key); it != groups_.end()) {
      if (it->second->rank_workers() != spec.rank_workers) {
        return absl::InvalidArgumentError(
            absl::StrCat("collective group '", spec.key, "' was created with rank workers [",
                         absl::StrJoin(it->second->rank_workers(), ", "),
                         "], asked for again with [", absl::StrJoin(spec.rank_workers, ", "), "]"));
      }
      return it->second;
    }
    const EpochKey ek = ParseEpochKey(spec.key);
    if (ek.valid) {
      auto cur = current_.find(ek.devices);
      if (cur != current_.end()) {
        const EpochKey& now = cur->second;
        if (now.incarnation == ek.incarnation && ek.epoch < now.epoch) {
          return absl::FailedPreconditionError(
              absl::StrCat("collective group '", spec.key, "': its epoch ", ek.epoch,
                           " is over (this worker meets in epoch ", now.epoch,
                           " now); a step sent before a group broke cannot run its collectives"));
        }
      }
    }
    auto layout = MakeLayout(spec, options_.self);
    if (!layout.ok()) return layout.status();
    if (layout->num_workers() > 1 && endpoint_ == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "collective group '", spec.key, "' spans workers [", absl::StrJoin(layout->workers, ", "),
          "] but this worker has no rendezvous store"));
    }
    auto group = std::make_shared<GroupCommunicator>(std::move(*layout), endpoint_,
                                                     options_.timeout, options_.logger);
    if (ek.valid) {
      // Earlier epochs of these devices (and other coordinators') are over.
      for (auto it = groups_.begin(); it != groups_.end();) {
        const EpochKey old = ParseEpochKey(it->first);
        if (old.valid && old.devices == ek.devices) {
          options_.logger->info("collective group '{}' dropped: superseded by '{}'", it->first,
                                spec.key);
          groups_.erase(it++);
        } else {
          ++it;
        }
      }
      current_[ek.devices] = ek;
    }
    groups_.emplace(spec.key, group);
    return std::shared_ptr<Communicator>(std::move(group));
  }

  int num_groups() const override {
    absl::MutexLock l(&mu_);
    return groups_.size();
  }
  gloo::rendezvous::Store* rendezvous_store() const override { return options_.store.get(); }
  bool transport_open() const override { return endpoint_ != nullptr && endpoint_->opened(); }

 private:
  // "<devices>@<incarnation>.<epoch>"; other keys (tests') are not epoch keys.
  struct EpochKey {
    bool valid = false;
    std::string devices, incarnation;
    int64_t epoch = 0;
  };
  static EpochKey ParseEpochKey(const std::string& key) {
    EpochKey k;
    const size_t at = key.rfind('@');
    if (at == std::string::npos) return k;
    const size_t dot = key.rfind('.');
    if (dot == std::string::npos || dot < at) return k;
    if (!absl::SimpleAtoi(absl::string_view(key).substr(dot + 1), &k.epoch)) return k;
    k.devices = key.substr(0, at);
    k.incarnation = key.substr(at + 1, dot - at - 1);
    k.valid = true;
    return k;
  }

 private:
  const CollectivesOptions options_;
  const std::shared_ptr<const GlooEndpoint> endpoint_;  // null: no store
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<GroupCommunicator>> groups_ ABSL_GUARDED_BY(mu_);
  // The newest epoch key seen for each set of devices.
  absl::flat_hash_map<std::string, EpochKey> current_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CommunicatorRegistry>> NewCommunicatorRegistry(
    CollectivesOptions options) {
  if (options.self.empty())
    return absl::InvalidArgumentError("collectives: `self` (this worker's address) is empty");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("collectives: timeout must be positive, got ",
                                                   absl::FormatDuration(options.timeout)));
  }
  if (options.logger == nullptr) {
    options.logger = std::make_shared<spdlog::logger>(
        "collectives", std::make_shared<spdlog::sinks::null_sink_mt>());
  }
  std::shared_ptr<GlooEndpoint> endpoint;
  if (options.store != nullptr) {
    if (!GlooPeerNameGuardActive()) {
      options.logger->warn(
          "this executable does not export the guard for Gloo's connect (worker/gloo_guard.h): a "
          "peer that resets a connection while it is set up will terminate this process");
    }
    SetGlooGuardLogger(options.logger);
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    endpoint = std::make_shared<GlooEndpoint>(options.store, std::move(attr));
    // A hostname Gloo cannot use fails the worker's start, not its first collective.
    TESSEL_RETURN_IF_ERROR(endpoint->Probe());
  }
  return std::make_unique<Registry>(std::move(options), std::move(endpoint));
}

}  // namespace tessel::worker
