#include "worker/cuda/nccl_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "core/dtype.h"
#include "core/status.h"
#include "gloo/rendezvous/store.h"
#include "worker/collectives/agreement.h"

namespace tessel::cuda {

using absl::StrCat;

namespace {

// What each rank tells the others before anything is queued: the call
// (collectives/agreement.h) and which GPU it is, so two ranks on one GPU
// are refused before NCCL would hang on them.
struct NcclHeader {
  worker::CallHeader call;
  char uuid[16];
  int64_t ordinal;
};
static_assert(sizeof(NcclHeader) % sizeof(int64_t) == 0, "NcclHeader travels as s64 words");
constexpr int64_t kHeaderWords = sizeof(NcclHeader) / sizeof(int64_t);

worker::CollectiveCall CallOf(const NcclCall& call) {
  return worker::CollectiveCall{call.kind, call.count, call.dtype, call.op, &call.pairs};
}

ncclRedOp_t NcclOp(worker::ReduceOp op, v1::DType dt) {
  if (dt == v1::PRED)
    return op == worker::ReduceOp::kSum || op == worker::ReduceOp::kMax ? ncclMax : ncclMin;
  switch (op) {
    case worker::ReduceOp::kSum: return ncclSum;
    case worker::ReduceOp::kProd: return ncclProd;
    case worker::ReduceOp::kMax: return ncclMax;
    case worker::ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

}  // namespace

absl::StatusOr<std::pair<ncclDataType_t, int64_t>> NcclType(v1::DType dt, bool reduce,
                                                            int64_t count) {
  switch (dt) {
    case v1::F32: return std::pair{ncclFloat32, count};
    case v1::F64: return std::pair{ncclFloat64, count};
    case v1::F16: return std::pair{ncclFloat16, count};
    case v1::BF16: return std::pair{ncclBfloat16, count};
    case v1::S32: return std::pair{ncclInt32, count};
    case v1::S64: return std::pair{ncclInt64, count};
    case v1::U32: return std::pair{ncclUint32, count};
    case v1::U64: return std::pair{ncclUint64, count};
    case v1::S8: return std::pair{ncclInt8, count};
    case v1::U8:
    case v1::PRED:
      return std::pair{ncclUint8, count};  // PRED: 0 or 1, reduced as max (or) or min (and)
    case v1::S16:
    case v1::U16:
      if (reduce) {
        return absl::UnimplementedError(
            StrCat("NCCL has no 16-bit integer type: a reduction of ", DTypeName(dt),
                   " does not run on cuda devices; convert to s32 first"));
      }
      return std::pair{ncclUint8, count * 2};  // moved as bytes
    default: return absl::InvalidArgumentError(StrCat("NCCL: unsupported dtype ", DTypeName(dt)));
  }
}

struct NcclGroups::Group {
  std::string key;      // "devices:…@<incarnation>.<epoch>"
  std::string devices;  // the key before '@'
  int size = 0;
  absl::flat_hash_map<int, ncclComm_t> comms;  // local rank -> communicator; guarded by State::mu
  absl::Status broken;                         // guarded by State::mu
};

struct NcclGroups::InFlight {
  std::shared_ptr<Group> group;
  int rank = 0;
  std::string what;
  cudaEvent_t started = nullptr, finished = nullptr;
  // Guarded by State::mu.
  absl::Time deadline = absl::InfiniteFuture();  // set once `started` has passed
  bool done = false;
  absl::Status status;
};

struct NcclGroups::State {
  explicit State(Options o) : options(std::move(o)) {}
  const Options options;
  mutable absl::Mutex mu;
  absl::flat_hash_map<std::string, std::shared_ptr<Group>> groups ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<InFlight>> in_flight ABSL_GUARDED_BY(mu);
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::thread watchdog;

  absl::Status NcclStatus(ncclResult_t r, absl::string_view what) const {
    if (r == ncclSuccess) return absl::OkStatus();
    const absl::StatusCode code =
        r == ncclInvalidArgument || r == ncclInvalidUsage ? absl::StatusCode::kInvalidArgument
        : r == ncclSystemError || r == ncclRemoteError    ? absl::StatusCode::kUnavailable
                                                          : absl::StatusCode::kInternal;
    return absl::Status(
        code, StrCat(what, ": NCCL error ", int(r), " (", options.api.error_string(r), ")"));
  }
  absl::Status CudaError(cudaError_t e, absl::string_view what) const {
    if (e == cudaSuccess) return absl::OkStatus();
    return absl::InternalError(StrCat(what, ": CUDA error ", int(e)));
  }

  // Aborts every communicator of `g` held here and fails its calls in
  // flight with `why`; later calls on `g` fail with it at once.
  void Break(Group& g, absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    why.SetPayload(kGroupBrokenPayload, absl::Cord("1"));
    if (g.broken.ok()) g.broken = why;
    for (auto& [rank, comm] : g.comms) (void)options.api.comm_abort(comm);
    g.comms.clear();
    for (auto& f : in_flight) {
      if (f->group.get() == &g && !f->done) {
        f->done = true;
        f->status = f->status.ok() ? why : f->status;
      }
    }
  }

  void Watch() {
    absl::MutexLock l(&mu);
    while (!stop) {
      if (in_flight.empty()) {
        mu.Await(absl::Condition(
            +[](State* s)
                 ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->stop || !s->in_flight.empty(); },
            this));
        continue;
      }
      const absl::Time now = absl::Now();
      for (size_t i = 0; i < in_flight.size(); ++i) {
        InFlight& f = *in_flight[i];
        if (f.done) continue;
        if (options.api.event_query(f.finished) == cudaSuccess) {
          f.done = true;
          continue;
        }
        if (f.deadline == absl::InfiniteFuture() &&
            options.api.event_query(f.started) == cudaSuccess) {
          f.deadline = now + options.timeout;
        }
        ncclResult_t async = ncclSuccess;
        auto it = f.group->comms.find(f.rank);
        if (it != f.group->comms.end()) (void)options.api.comm_get_async_error(it->second, &async);
        if (async != ncclSuccess && async != ncclInProgress) {
          Break(*f.group, NcclStatus(async, StrCat(f.what, ": the communicator reported")));
        } else if (now > f.deadline) {
          Break(*f.group, absl::DeadlineExceededError(StrCat(
                              f.what, ": not finished ", absl::FormatDuration(options.timeout),
                              " after it started on the GPU: a peer stalled or went away "
                              "mid-exchange; the group's "
                              "communicators on this worker were aborted")));
        }
      }
      std::erase_if(in_flight, [&](const std::shared_ptr<InFlight>& f) {
        if (!f->done) return false;
        (void)options.api.event_destroy(f->started);
        (void)options.api.event_destroy(f->finished);
        return true;
      });
      mu.AwaitWithTimeout(absl::Condition(&stop), options.poll);
    }
  }
};

NcclGroups::NcclGroups(Options options) : state_(std::make_shared<State>(std::move(options))) {
  state_->watchdog = std::thread([s = state_.get()] { s->Watch(); });
}

NcclGroups::~NcclGroups() {
  {
    absl::MutexLock l(&state_->mu);
    state_->stop = true;
    for (auto& [key, g] : state_->groups) {
      for (auto& [rank, comm] : g->comms) {
        // A call still in flight cannot finish cleanly: abort, else destroy.
        const bool busy = std::any_of(state_->in_flight.begin(), state_->in_flight.end(),
                                      [&](const auto& f) { return f->group == g && !f->done; });
        (void)(busy ? state_->options.api.comm_abort(comm)
                    : state_->options.api.comm_destroy(comm));
      }
      g->comms.clear();
    }
  }
  state_->watchdog.join();
}

int NcclGroups::num_groups() const {
  absl::MutexLock l(&state_->mu);
  return int(state_->groups.size());
}

absl::StatusOr<NcclGroups::Check> NcclGroups::Run(const worker::ResolvedGroup& g,
                                                  const worker::CollectiveId& id,
                                                  const NcclCall& call, const NcclDevice& dev,
                                                  gloo::rendezvous::Store* store) {
  State& s = *state_;
  const NcclApi& api = s.options.api;
  const std::string what = StrCat("NCCL ", worker::KindName(call.kind), " (", id.ToString(),
                                  ") on rank ", g.rank, " of ", g.size, " in group ", g.spec.key);
  if (g.size < 1 || (g.comm == nullptr) != (g.size == 1)) {
    return absl::InternalError(StrCat(what, ": a group of several needs its host communicator"));
  }
  if (call.kind == NcclCall::Kind::kAbandoned)
    return absl::InvalidArgumentError(StrCat(what, ": not a collective to queue"));
  const bool reduces = worker::Reduces(call.kind);
  TESSEL_ASSIGN_OR_RETURN(auto type, NcclType(call.dtype, reduces, call.count));
  // 1. Identity and agreement, through the host communicator.
  NcclHeader mine{};
  mine.call = worker::MakeHeader(id, CallOf(call), absl::OkStatus());
  static_assert(sizeof(mine.uuid) == sizeof(dev.uuid));
  std::memcpy(mine.uuid, dev.uuid.data(), sizeof(mine.uuid));
  mine.ordinal = dev.ordinal;
  std::vector<NcclHeader> all(g.size);
  if (g.comm == nullptr) {
    all[0] = mine;
  } else {
    TESSEL_RETURN_IF_ERROR(
        Annotate(g.comm->AllGather(g.rank, id, &mine, all.data(), kHeaderWords, v1::S64),
                 StrCat(what, ": agreeing on the call: ")));
  }
  const auto device_of = [&](int r) {
    return r < int(g.spec.rank_devices.size()) ? StrCat("device ", g.spec.rank_devices[r])
                                               : StrCat("rank ", r);
  };
  std::vector<worker::CallHeader> calls;
  for (const NcclHeader& h : all) calls.push_back(h.call);
  if (absl::Status s = worker::JudgeHeaders(
          id, calls, [&] { return what; }, device_of);
      !s.ok())
    return absl::Status(s.code(), StrCat(s.message(), "; nothing was queued"));
  for (int r = 0; r < g.size; ++r) {
    for (int q = r + 1; q < g.size; ++q) {
      if (std::memcmp(all[r].uuid, all[q].uuid, sizeof(all[r].uuid)) == 0) {
        return absl::FailedPreconditionError(
            StrCat(what, ": ", device_of(r), " and ", device_of(q),
                   " are the same GPU (CUDA ordinal ", all[r].ordinal,
                   " of their workers); NCCL needs one GPU per rank: give each worker "
                   "its own GPUs"));
      }
    }
  }
  // 2. The group's communicator for this rank, joined on first use.
  std::shared_ptr<Group> group;
  ncclComm_t comm = nullptr;
  {
    absl::MutexLock l(&s.mu);
    auto& slot = s.groups[g.spec.key];
    if (slot == nullptr) {
      slot = std::make_shared<Group>();
      slot->key = g.spec.key;
      slot->devices = g.spec.key.substr(0, g.spec.key.find('@'));
      slot->size = g.size;
      // A new epoch of the same devices supersedes the old group.
      std::vector<std::string> stale;
      for (auto& [k, other] : s.groups) {
        if (other != slot && other->devices == slot->devices) stale.push_back(k);
      }
      for (const std::string& k : stale) {
        s.Break(*s.groups[k],
                absl::AbortedError(StrCat("NCCL group ", k, " was superseded by ", g.spec.key)));
        s.groups.erase(k);
      }
    }
    group = slot;
    if (!group->broken.ok()) return group->broken;
    if (auto it = group->comms.find(g.rank); it != group->comms.end()) comm = it->second;
  }
  if (comm == nullptr) {
    if (store == nullptr) {
      return absl::FailedPreconditionError(
          StrCat(what, ": no rendezvous store to publish the NCCL unique id in"));
    }
    const std::string key = g.spec.key + "/nccl-unique-id";
    ncclUniqueId uid;
    try {
      if (g.rank == 0) {
        TESSEL_RETURN_IF_ERROR(
            s.NcclStatus(api.get_unique_id(&uid), StrCat(what, ": ncclGetUniqueId")));
        store->set(key, std::vector<char>(uid.internal, uid.internal + sizeof(uid.internal)));
      } else {
        store->wait({key}, std::chrono::milliseconds(absl::ToInt64Milliseconds(s.options.timeout)));
        const std::vector<char> bytes = store->get(key);
        if (bytes.size() != sizeof(uid.internal)) {
          return absl::InternalError(StrCat(what, ": the unique id under ", key, " has ",
                                            bytes.size(), " bytes; expected ",
                                            sizeof(uid.internal)));
        }
        std::memcpy(uid.internal, bytes.data(), bytes.size());
      }
    } catch (const std::exception& e) {
      return absl::DeadlineExceededError(
          StrCat(what, ": reading the NCCL unique id ", key, " from the store: ", e.what()));
    }
    TESSEL_RETURN_IF_ERROR(s.CudaError(api.set_device(dev.ordinal), "cudaSetDevice"));
    TESSEL_RETURN_IF_ERROR(s.NcclStatus(api.comm_init_rank(&comm, g.size, uid, g.rank),
                                        StrCat(what, ": ncclCommInitRank")));
    absl::MutexLock l(&s.mu);
    if (!group->broken.ok()) {
      (void)api.comm_abort(comm);
      return group->broken;
    }
    group->comms[g.rank] = comm;
  }
  // 3. The call, bracketed by markers the watchdog reads.
  auto f = std::make_shared<InFlight>();
  f->group = group;
  f->rank = g.rank;
  f->what = what;
  TESSEL_RETURN_IF_ERROR(
      s.CudaError(api.event_create(&f->started, cudaEventDisableTiming), "cudaEventCreate"));
  if (auto st =
          s.CudaError(api.event_create(&f->finished, cudaEventDisableTiming), "cudaEventCreate");
      !st.ok()) {
    (void)api.event_destroy(f->started);
    return st;
  }
  const auto [nt, n] = type;
  const int64_t esize = DTypeSize(call.dtype);
  const char* in = static_cast<const char*>(call.in);
  char* out = static_cast<char*>(call.out);
  absl::Status queued = s.CudaError(api.event_record(f->started, dev.stream), "cudaEventRecord");
  auto check = [&](ncclResult_t r, const char* fn) {
    if (queued.ok()) queued = s.NcclStatus(r, StrCat(what, ": ", fn));
  };
  if (queued.ok()) {
    switch (call.kind) {
      case NcclCall::Kind::kAllReduce:
        check(api.all_reduce(in, out, n, nt, NcclOp(call.op, call.dtype), comm, dev.stream),
              "ncclAllReduce");
        break;
      case NcclCall::Kind::kAllGather:
        check(api.all_gather(in, out, n, nt, comm, dev.stream), "ncclAllGather");
        break;
      case NcclCall::Kind::kReduceScatter:
        check(api.reduce_scatter(in, out, n, nt, NcclOp(call.op, call.dtype), comm, dev.stream),
              "ncclReduceScatter");
        break;
      case NcclCall::Kind::kAllToAll: {
        const int64_t block = call.count * esize;
        check(api.group_start(), "ncclGroupStart");
        for (int r = 0; r < g.size && queued.ok(); ++r) {
          check(api.send(in + r * block, n, nt, r, comm, dev.stream), "ncclSend");
          check(api.recv(out + r * block, n, nt, r, comm, dev.stream), "ncclRecv");
        }
        check(api.group_end(), "ncclGroupEnd");
        break;
      }
      case NcclCall::Kind::kPermute: {
        bool targeted = false;
        for (const auto& [src, dst] : call.pairs) targeted |= dst == g.rank;
        if (!targeted) {
          queued = s.CudaError(api.memset_async(out, 0, size_t(call.count * esize), dev.stream),
                               "cudaMemsetAsync");
        }
        check(api.group_start(), "ncclGroupStart");
        for (const auto& [src, dst] : call.pairs) {
          if (!queued.ok()) break;
          if (src == g.rank && dst == g.rank) {
            queued = s.CudaError(api.memcpy_async(out, in, size_t(call.count * esize),
                                                  cudaMemcpyDeviceToDevice, dev.stream),
                                 "cudaMemcpyAsync");
          } else if (src == g.rank) {
            check(api.send(in, n, nt, dst, comm, dev.stream), "ncclSend");
          } else if (dst == g.rank) {
            check(api.recv(out, n, nt, src, comm, dev.stream), "ncclRecv");
          }
        }
        check(api.group_end(), "ncclGroupEnd");
        break;
      }
      case NcclCall::Kind::kAbandoned: break;  // refused above
    }
  }
  if (queued.ok())
    queued = s.CudaError(api.event_record(f->finished, dev.stream), "cudaEventRecord");
  absl::MutexLock l(&s.mu);
  if (queued.ok() && !group->broken.ok())
    queued = group->broken;  // broken while this call was queued
  if (!queued.ok()) {
    // Peers may already wait in this call: the group cannot go on.
    s.Break(*group, queued);
    (void)api.event_destroy(f->started);
    (void)api.event_destroy(f->finished);
    return group->broken;
  }
  s.in_flight.push_back(f);
  return Check([state = state_, f] {
    absl::MutexLock l(&state->mu);
    // The fence has passed the call: it is done unless the watchdog failed it.
    if (!f->done && state->options.api.event_query(f->finished) == cudaSuccess) f->done = true;
    const absl::Duration wait = state->options.timeout + absl::Seconds(1);
    if (!state->mu.AwaitWithTimeout(absl::Condition(&f->done), wait)) {
      return absl::DeadlineExceededError(
          StrCat(f->what, ": no verdict within ", absl::FormatDuration(wait)));
    }
    return f->status;
  });
}

}  // namespace tessel::cuda
