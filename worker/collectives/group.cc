#include "worker/collectives/group.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/trace.h"
#include "worker/collectives/agreement.h"
#include "worker/collectives/reduce.h"

namespace tessel::worker {
namespace {

absl::Status Broken(absl::Status s) {
  s.SetPayload(kGroupBrokenPayload, absl::Cord("1"));
  return s;
}

// Whether this worker moves data before the headers are in: an all_reduce
// (the most frequent collective, and the one whose latency the header
// round trip would double at small sizes) that every local rank called.
bool Overlaps(const CollectiveCall& c, const absl::Status& local_failure) {
  return c.kind == CollectiveKind::kAllReduce && c.count > 0 && local_failure.ok();
}

// A peer's header saying it went ahead with an all_reduce (Overlaps), or null.
const CallHeader* FirstOverlapping(const std::vector<CallHeader>& headers, int self) {
  for (int w = 0; w < int(headers.size()); ++w) {
    const CallHeader& h = headers[w];
    if (w != self && h.magic == kCallHeaderMagic &&
        CollectiveKind(h.kind) == CollectiveKind::kAllReduce && h.code == 0 && h.count > 0)
      return &h;
  }
  return nullptr;
}

}  // namespace

CollectiveTimes& ProcessCollectiveTimes() {
  static CollectiveTimes* t = new CollectiveTimes();
  return *t;
}

GroupCommunicator::GroupCommunicator(GroupLayout layout, std::shared_ptr<const GlooEndpoint> gloo,
                                     absl::Duration timeout, std::shared_ptr<spdlog::logger> log)
    : l_(std::move(layout)),
      timeout_(timeout),
      log_(std::move(log)),
      meet_(l_.num_local(), timeout),
      exchange_(l_, std::move(gloo), timeout, log_) {}

absl::Status GroupCommunicator::AllReduce(int rank, const CollectiveId& id, void* data,
                                          int64_t count, v1::DType dtype, ReduceOp op) {
  return Collective(rank, id, Slot{{CollectiveKind::kAllReduce, count, dtype, op}, data, data});
}

absl::Status GroupCommunicator::AllGather(int rank, const CollectiveId& id, const void* in,
                                          void* out, int64_t count, v1::DType dtype) {
  return Collective(rank, id, Slot{{CollectiveKind::kAllGather, count, dtype}, in, out});
}

absl::Status GroupCommunicator::ReduceScatter(int rank, const CollectiveId& id, const void* in,
                                              void* out, int64_t count, v1::DType dtype,
                                              ReduceOp op) {
  return Collective(rank, id, Slot{{CollectiveKind::kReduceScatter, count, dtype, op}, in, out});
}

absl::Status GroupCommunicator::AllToAll(int rank, const CollectiveId& id, const void* in,
                                         void* out, int64_t count, v1::DType dtype) {
  return Collective(rank, id, Slot{{CollectiveKind::kAllToAll, count, dtype}, in, out});
}

absl::Status GroupCommunicator::Permute(int rank, const CollectiveId& id, const void* in, void* out,
                                        int64_t count, v1::DType dtype,
                                        const std::vector<std::pair<int, int>>& pairs) {
  return Collective(
      rank, id, Slot{{CollectiveKind::kPermute, count, dtype, ReduceOp::kSum, &pairs}, in, out});
}

absl::Status GroupCommunicator::Abandon(int rank, const CollectiveId& id,
                                        const absl::Status& cause) {
  Slot slot{{CollectiveKind::kAbandoned, 0}};
  slot.abandoned = cause.ok() ? absl::UnknownError("(no cause given)") : cause;
  return Collective(rank, id, std::move(slot));
}

absl::Status GroupCommunicator::Validate(int rank, const CollectiveCall& call, const void* in,
                                         void* out) const {
  auto what = [&] { return l_.Describe(call); };  // made only for an error
  if (rank < 0 || rank >= l_.size() || l_.local_index[rank] < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what(), ": rank ", rank, " is not held by worker '", l_.workers[l_.self_worker],
        "' (local ranks: [", absl::StrJoin(l_.local_ranks, ", "), "])"));
  }
  if (call.kind == CollectiveKind::kAbandoned) return absl::OkStatus();
  const int esize = DTypeSize(call.dtype);
  if (esize == 0) return absl::InvalidArgumentError(absl::StrCat(what(), ": invalid dtype"));
  if (call.count < 0) return absl::InvalidArgumentError(absl::StrCat(what(), ": negative count"));
  if (call.count > INT64_MAX / esize / l_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": byte size overflows"));
  }
  // A permute reads `in` only on sources and writes `out` only on targets.
  bool reads = true, writes = true;
  if (call.kind == CollectiveKind::kPermute) {
    reads = writes = false;
    for (const auto& [s, t] : *call.pairs) {
      reads |= s == rank;
      writes |= t == rank;
    }
  }
  if (call.count > 0 && ((reads && in == nullptr) || (writes && out == nullptr))) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": null buffer on rank ", rank));
  }
  if (Reduces(call.kind) && GetReduceFn(call.dtype, call.op) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what(), ": no such reduction"));
  }
  if (call.kind == CollectiveKind::kPermute) {
    if (call.pairs->size() > GlooExchange::kMaxPermutePairs) {
      return absl::InvalidArgumentError(absl::StrCat(what(), ": too many pairs"));
    }
    std::vector<bool> targeted(l_.size());
    for (const auto& [s, t] : *call.pairs) {
      if (s < 0 || s >= l_.size() || t < 0 || t >= l_.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what(), ": pair (", s, ", ", t, ") is outside ranks 0..", l_.size() - 1));
      }
      if (targeted[t]) {
        return absl::InvalidArgumentError(absl::StrCat(what(), ": rank ", t, " is targeted twice"));
      }
      targeted[t] = true;
    }
  }
  return absl::OkStatus();
}

// The in-memory meeting of the local ranks under `id`; see collectives.h.
absl::Status GroupCommunicator::Collective(int rank, const CollectiveId& id, Slot slot) {
  TESSEL_RETURN_IF_ERROR(Validate(rank, slot.call, slot.in, slot.out));
  const int li = l_.local_index[rank];
  auto what = [&] { return absl::StrCat(id.ToString(), ": "); };  // made only for an error
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) {
      return Broken(absl::Status(broken_.code(), absl::StrCat(what(), "group '", l_.key,
                                                              "' broke at an earlier collective (",
                                                              broken_.message(), ")")));
    }
  }
  const CollectiveCall call = slot.call;
  const bool takes_part = slot.abandoned.ok();
  trace::Span span("collective", KindName(call.kind));
  if (span.active()) {
    span.Text("id", id.ToString());
    span.Text("group", l_.key);
    span.Text("epoch", l_.key.substr(std::min(l_.key.size(), l_.key.rfind('@') + 1)));
    span.Arg("rank", rank);
    span.Text("peers", l_.rank_devices.empty() ? absl::StrCat(l_.size(), " ranks")
                                               : absl::StrJoin(l_.rank_devices, ","));
    span.Arg("bytes", call.count * int64_t(DTypeSize(call.dtype)));
    span.Text("call", DescribeCall(call));
  }
  auto run = [&](Slots slots) {
    absl::Status s = RunRound(id, slots);
    if (!s.ok()) {
      s = Annotate(s, what());
      if (s.GetPayload(kGroupBrokenPayload).has_value()) {
        absl::MutexLock lock(&mu_);
        broken_ = s;
        log_->error("{}", s.ToString());
      }
    }
    return s;
  };
  auto timed_out = [&](const std::vector<int>& missing_local, const Slot& arrived) {
    std::vector<int> missing;
    for (int i : missing_local) missing.push_back(l_.local_ranks[i]);
    const CollectiveCall& c = arrived.call.kind != CollectiveKind::kAbandoned ? arrived.call : call;
    absl::Status s = absl::DeadlineExceededError(
        absl::StrCat(what(), l_.Describe(c), ": ", l_.RankNames(missing), " did not arrive within ",
                     absl::FormatDuration(timeout_)));
    log_->error("{}", s.ToString());
    return s;
  };
  auto twice = [&] {
    return absl::FailedPreconditionError(
        absl::StrCat(what(), l_.Describe(call), ": ", l_.RankName(rank), " arrived twice"));
  };
  auto part = [&](Slots slots) {
    if (takes_part) CopyOut(slots, RoundCall(slots), li);
  };
  return meet_.Meet(id, li, std::move(slot), run, timed_out, twice, part);
}

// The round's call: the first local rank's that took part, else an abandoned one.
CollectiveCall GroupCommunicator::RoundCall(Slots slots) {
  for (const Slot& s : slots) {
    if (s.abandoned.ok()) return s.call;
  }
  return CollectiveCall{CollectiveKind::kAbandoned, 0};
}

// Why the local ranks cannot run the round together: one abandoned it, or
// they called different collectives.
absl::Status GroupCommunicator::LocalFailure(Slots slots) const {
  const CollectiveCall c = RoundCall(slots);
  for (int i = 0; i < int(slots.size()); ++i) {
    if (!slots[i].abandoned.ok()) {
      return absl::AbortedError(absl::StrCat(
          l_.RankName(l_.local_ranks[i]),
          " did not reach this collective: its step failed: ", slots[i].abandoned.ToString()));
    }
  }
  for (int i = 0; i < int(slots.size()); ++i) {
    if (!SameCall(c, slots[i].call)) {
      return absl::InvalidArgumentError(
          absl::StrCat("local ranks disagree: ", l_.RankName(l_.local_ranks[i]), " called ",
                       l_.Describe(slots[i].call), " while others called ", l_.Describe(c)));
    }
  }
  return absl::OkStatus();
}

absl::Status GroupCommunicator::RunRound(const CollectiveId& id, Slots slots) {
  const CollectiveCall c = RoundCall(slots);
  const absl::Status local_failure = LocalFailure(slots);
  absl::Status s = l_.num_workers() > 1 ? AgreeAndRun(id, slots, c, local_failure)
                   : local_failure.ok() ? RunData(slots, c)
                                        : local_failure;
  if (!s.ok() && l_.num_workers() > 1 && s.code() != absl::StatusCode::kAborted &&
      s.code() != absl::StatusCode::kInvalidArgument) {
    // A Gloo operation failed part way, or the workers are out of step:
    // what the peers hold is unknown. Close the connections (so peers still
    // in this round fail at once) and refuse later calls; the steps after
    // this one meet in a group of a new epoch.
    s = Broken(std::move(s));
    exchange_.Break();
  }
  return s;
}

// Every worker tells every other worker its header, then each decides
// alike (JudgeHeaders): a worker out of step breaks the group; a rank that
// abandoned the round, or arguments that differ, fail it on every worker.
// Only an all_reduce moves data before the verdict (Overlaps).
absl::Status GroupCommunicator::AgreeAndRun(const CollectiveId& id, Slots slots,
                                            const CollectiveCall& c,
                                            const absl::Status& local_failure) {
  // The trace shows the header exchange as the wait for the peers (the
  // headers are small: their time is the peers' arrival) and the data's as
  // moving it; an overlapped all_reduce does both at once.
  std::optional<trace::Span> waiting;
  waiting.emplace("collective", "wait for peers");
  CollectiveTimes& times = ProcessCollectiveTimes();
  times.rounds.fetch_add(1, std::memory_order_relaxed);
  const int64_t began = trace::NowNs();
  // The wait ends where the data moves (at once for an overlapped all_reduce).
  auto done_waiting = [&] {
    waiting.reset();
    times.wait_ns.fetch_add(trace::NowNs() - began, std::memory_order_relaxed);
  };
  TESSEL_RETURN_IF_ERROR(exchange_.Connect(c));
  GlooExchange::Headers x;
  TESSEL_RETURN_IF_ERROR(exchange_.PostHeaders(MakeHeader(id, c, local_failure), c, x));
  auto judge = [&] {
    return JudgeHeaders(
        id, x.all, [&] { return l_.Describe(c); }, [&](int w) { return l_.WorkerDevices(w); });
  };
  if (Overlaps(c, local_failure)) {
    // An all_reduce this worker can take part in moves its data while the
    // headers travel, and is judged once they are in: a verdict against it
    // fails the round, and what moved into this step's own output buffers
    // is never read. A worker that cannot take part joins with a dummy
    // block (below), so no peer waits out a timeout.
    done_waiting();
    absl::Status data, heard;
    {
      trace::Span moving("collective", "all_reduce beside the header exchange");
      data = RunData(slots, c);
      heard = exchange_.AwaitHeaders(c, x);
    }
    if (!data.ok()) {
      // A Gloo operation failed part way: the group breaks (the data's
      // code says so). Headers that disagree say why it failed.
      absl::Status verdict = heard.ok() ? judge() : absl::OkStatus();
      if (verdict.ok()) return data;
      return absl::Status(
          data.code(),
          absl::StrCat(verdict.message(), "; the data exchange failed: ", data.message()));
    }
    TESSEL_RETURN_IF_ERROR(heard);
    return judge();
  }
  TESSEL_RETURN_IF_ERROR(exchange_.AwaitHeaders(c, x));
  done_waiting();
  if (const CallHeader* peer = FirstOverlapping(x.all, l_.self_worker)) {
    // A peer went ahead with an all_reduce; this worker's ranks cannot take
    // part (one abandoned the round, or they called something else). Join
    // with zeros, then give the verdict every worker gives.
    const CollectiveCall dummy{CollectiveKind::kAllReduce, peer->count, v1::DType(peer->dtype),
                               ReduceOp(peer->reduce_op)};
    const size_t bytes = size_t(dummy.count) * DTypeSize(dummy.dtype);
    char* zeros = exchange_.Scratch(0, bytes);
    std::memset(zeros, 0, bytes);
    TESSEL_RETURN_IF_ERROR(MidExchange(exchange_.AllReduce(dummy, zeros, dummy.count)));
    absl::Status verdict = judge();
    if (verdict.ok())
      verdict = absl::InternalError(absl::StrCat(l_.Describe(c), ": joined a peer's all_reduce"));
    return verdict;
  }
  TESSEL_RETURN_IF_ERROR(judge());
  return RunData(slots, c);
}

absl::Status GroupCommunicator::RunData(Slots slots, const CollectiveCall& c) {
  if (c.count == 0) return absl::OkStatus();
  trace::Span moving("collective", "move data");
  const int64_t began = l_.num_workers() > 1 ? trace::NowNs() : 0;
  struct Count {
    int64_t began;
    ~Count() {
      if (began != 0) {
        ProcessCollectiveTimes().data_ns.fetch_add(trace::NowNs() - began,
                                                   std::memory_order_relaxed);
      }
    }
  } count{began};
  absl::Status s = absl::InternalError("unknown collective");
  switch (c.kind) {
    case CollectiveKind::kAllReduce: s = RunAllReduce(slots, c); break;
    case CollectiveKind::kAllGather: s = RunAllGather(slots, c); break;
    case CollectiveKind::kReduceScatter: s = RunReduceScatter(slots, c); break;
    case CollectiveKind::kAllToAll: s = RunAllToAll(slots, c); break;
    case CollectiveKind::kPermute: s = RunPermute(slots, c); break;
    case CollectiveKind::kAbandoned: break;
  }
  return MidExchange(std::move(s));
}

// Names the peers of a data exchange that failed part way.
absl::Status GroupCommunicator::MidExchange(absl::Status s) const {
  if (s.ok() || l_.num_workers() == 1) return s;
  std::vector<std::string> others;
  for (int w = 0; w < l_.num_workers(); ++w) {
    if (w != l_.self_worker) others.push_back(l_.WorkerDevices(w));
  }
  return Annotate(s, absl::StrCat("exchanging data with ", absl::StrJoin(others, ", "),
                                  " (a peer stalled or went away mid-exchange): "));
}

// Local reduce into local rank 0's buffer, Gloo across workers on that
// buffer, then the other local ranks copy it (CopyOut). With one local
// rank this is Gloo's allreduce on the caller's buffer and nothing else.
absl::Status GroupCommunicator::RunAllReduce(Slots slots, const CollectiveCall& c) {
  const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
  void* acc = slots[0].out;
  for (int i = 1; i < l_.num_local(); ++i) reduce(acc, acc, slots[i].out, c.count);
  if (l_.num_workers() > 1) TESSEL_RETURN_IF_ERROR(exchange_.AllReduce(c, acc, c.count));
  copy_src_ = static_cast<const char*>(acc);
  return absl::OkStatus();
}

// Blocks are gathered worker by worker (each worker's local blocks in rank
// order), which is rank order when every worker's ranks are contiguous and
// the workers come in order: then local rank 0's output is the gather
// buffer, else scratch is, and each local rank reorders from it.
absl::Status GroupCommunicator::RunAllGather(Slots slots, const CollectiveCall& c) {
  const size_t block = size_t(c.count) * DTypeSize(c.dtype);
  char* dst =
      l_.worker_major ? static_cast<char*>(slots[0].out) : exchange_.Scratch(0, block * l_.size());
  for (int i = 0; i < l_.num_local(); ++i) {
    char* to = dst + size_t(l_.grouped_pos[l_.local_ranks[i]]) * block;
    if (to != slots[i].in) std::memcpy(to, slots[i].in, block);
  }
  if (l_.num_workers() > 1) TESSEL_RETURN_IF_ERROR(exchange_.AllGather(c, dst));
  copy_src_ = dst;
  return absl::OkStatus();
}

// Within one worker each local rank reduces its own block (CopyOut).
// Across workers: the local reduction of all blocks, an allreduce of it,
// and each rank takes its block. That moves size() times the bytes of a
// ring reduce-scatter over the network; simple, and correct for uneven
// worker sizes.
absl::Status GroupCommunicator::RunReduceScatter(Slots slots, const CollectiveCall& c) {
  if (l_.num_workers() == 1) return absl::OkStatus();
  const ReduceFn reduce = GetReduceFn(c.dtype, c.op);
  const size_t total = size_t(c.count) * l_.size();
  char* acc = exchange_.Scratch(0, total * DTypeSize(c.dtype));
  if (l_.num_local() == 1) {
    std::memcpy(acc, slots[0].in, total * DTypeSize(c.dtype));
  } else {
    reduce(acc, slots[0].in, slots[1].in, total);
    for (int i = 2; i < l_.num_local(); ++i) reduce(acc, acc, slots[i].in, total);
  }
  TESSEL_RETURN_IF_ERROR(exchange_.AllReduce(c, acc, total));
  copy_src_ = acc;
  return absl::OkStatus();
}

// Local blocks go straight from `in` to `out`. Blocks for other workers
// are packed by destination worker (for each local source rank, for each
// destination rank of that worker), exchanged with Gloo's alltoallv, and
// unpacked into the local ranks' outputs in the same order.
absl::Status GroupCommunicator::RunAllToAll(Slots slots, const CollectiveCall& c) {
  const size_t block = size_t(c.count) * DTypeSize(c.dtype);
  const int n = l_.num_local();
  auto in = [&](int i) { return static_cast<const char*>(slots[i].in); };
  auto out = [&](int i) { return static_cast<char*>(slots[i].out); };
  for (int s = 0; s < n; ++s) {
    for (int t = 0; t < n; ++t) {
      std::memcpy(out(t) + size_t(l_.local_ranks[s]) * block,
                  in(s) + size_t(l_.local_ranks[t]) * block, block);
    }
  }
  if (l_.num_workers() == 1) return absl::OkStatus();
  std::vector<int64_t> send_elems(l_.num_workers()), recv_elems(l_.num_workers());
  size_t blocks = 0;
  for (int w = 0; w < l_.num_workers(); ++w) {
    if (w == l_.self_worker) continue;
    const size_t b = size_t(n) * l_.worker_ranks[w].size();
    send_elems[w] = recv_elems[w] = b * c.count;
    blocks += b;
  }
  char* send = exchange_.Scratch(0, blocks * block);
  char* recv = exchange_.Scratch(1, blocks * block);
  char* p = send;
  for (int w = 0; w < l_.num_workers(); ++w) {
    if (w == l_.self_worker) continue;
    for (int s = 0; s < n; ++s) {
      for (int t : l_.worker_ranks[w]) {
        std::memcpy(p, in(s) + size_t(t) * block, block);
        p += block;
      }
    }
  }
  TESSEL_RETURN_IF_ERROR(exchange_.AllToAll(c, send, send_elems, recv, recv_elems));
  const char* q = recv;
  for (int w = 0; w < l_.num_workers(); ++w) {
    if (w == l_.self_worker) continue;
    for (int s : l_.worker_ranks[w]) {
      for (int t = 0; t < n; ++t) {
        std::memcpy(out(t) + size_t(s) * block, q, block);
        q += block;
      }
    }
  }
  return absl::OkStatus();
}

// Pairs within this worker are copies; pairs across workers are messages
// (GlooExchange::Permute). A local rank no pair targets gets zeros.
absl::Status GroupCommunicator::RunPermute(Slots slots, const CollectiveCall& c) {
  const size_t bytes = size_t(c.count) * DTypeSize(c.dtype);
  const int n = l_.num_local();
  std::vector<bool> targeted(n);
  for (const auto& [s, t] : *c.pairs) {
    if (l_.local_index[t] >= 0) targeted[l_.local_index[t]] = true;
  }
  for (int i = 0; i < n; ++i) {
    if (!targeted[i] && slots[i].out != nullptr) std::memset(slots[i].out, 0, bytes);
  }
  std::vector<GlooExchange::Message> sends, recvs;
  for (size_t p = 0; p < c.pairs->size(); ++p) {
    const auto [s, t] = (*c.pairs)[p];
    const int ls = l_.local_index[s], lt = l_.local_index[t];
    if (ls >= 0 && lt >= 0) {
      std::memmove(slots[lt].out, slots[ls].in, bytes);
    } else if (ls >= 0) {
      sends.push_back({p, l_.worker_of_rank[t], const_cast<void*>(slots[ls].in)});
    } else if (lt >= 0) {
      recvs.push_back({p, l_.worker_of_rank[s], slots[lt].out});
    }
  }
  if (l_.num_workers() == 1) return absl::OkStatus();
  return exchange_.Permute(c, sends, recvs);
}

void GroupCommunicator::CopyOut(Slots slots, const CollectiveCall& c, int li) const {
  const size_t block = size_t(c.count) * DTypeSize(c.dtype);
  const int rank = l_.local_ranks[li];
  switch (c.kind) {
    case CollectiveKind::kAllReduce:
      if (slots[li].out != copy_src_) std::memcpy(slots[li].out, copy_src_, block);
      break;
    case CollectiveKind::kAllGather: {
      char* out = static_cast<char*>(slots[li].out);
      if (l_.worker_major) {
        if (out != copy_src_) std::memcpy(out, copy_src_, block * l_.size());
      } else {
        for (int k = 0; k < l_.size(); ++k) {
          std::memcpy(out + size_t(k) * block, copy_src_ + size_t(l_.grouped_pos[k]) * block,
                      block);
        }
      }
      break;
    }
    case CollectiveKind::kReduceScatter: {
      void* out = slots[li].out;
      if (l_.num_workers() > 1) {
        std::memcpy(out, copy_src_ + size_t(rank) * block, block);
        break;
      }
      auto block_of = [&](int i) {
        return static_cast<const char*>(slots[i].in) + size_t(rank) * block;
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
    case CollectiveKind::kAllToAll:
    case CollectiveKind::kPermute:
    case CollectiveKind::kAbandoned: break;  // the round wrote every output
  }
}

}  // namespace tessel::worker
