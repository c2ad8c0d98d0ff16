#include "worker/collectives/exchange.h"

#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoallv.h>
#include <gloo/common/error.h>
#include <gloo/types.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/dtype.h"
#include "core/status.h"
#include "worker/collectives/reduce.h"

namespace tessel::worker {
namespace {

// Slot prefixes for Permute's point-to-point messages and for the headers
// exchanged before each round; Gloo's own collectives use prefixes 0x01..0x08.
constexpr uint8_t kPermuteSlotPrefix = 0x54;
constexpr uint8_t kHeaderSlotPrefix = 0x55;
constexpr char kExchangeMeshKey[] = "exchange_";
// Joining waits longer than a collective: after a failure the peers reach
// a group's new epoch only once they have drained the steps that failed
// before it.
constexpr int kConnectTimeoutFactor = 3;

// A slot on the exchange connections (Gloo's bound buffers take int
// slots): a round's tag, and whether it is the header.
constexpr int kHeaderSlotBit = 1 << 30;
int ExchangeSlot(uint32_t tag, int header_bit) { return int(tag & 0x3FFFFFFFu) | header_bit; }

// Said by a worker that reached the group; see Connect.
std::string HereKey(int worker) { return absl::StrCat("here_", worker); }

}  // namespace

// Runs `f`, which uses the exchange connections. If it throws, the
// outbound connection closes before the buffers `f` made go away: Gloo's
// event loop would otherwise finish a queued write from a buffer that no
// longer exists. (The group is broken then: its connections close anyway.)
// A message of another round on the inbound connection is one Gloo cannot
// place: named here, as what it means.
template <typename F>
void GlooExchange::ClosingOutboundOnFailure(F&& f) {
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

absl::Status GlooExchange::Connect(const CollectiveCall& c) {
  if (gloo_ != nullptr) return absl::OkStatus();
  if (endpoint_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(l_.Describe(c), ": the group spans workers [",
                                                      absl::StrJoin(l_.workers, ", "),
                                                      "] but this worker has no rendezvous store"));
  }
  // A worker that gave up on this group (its epoch) said so in the store:
  // connecting now would wait out the timeout for a peer that has left.
  if (Abandoned()) {
    return absl::FailedPreconditionError(absl::StrCat(
        l_.Describe(c),
        ": a peer gave up on this group before this worker joined it; the group starts over"));
  }
  auto context = std::make_shared<gloo::rendezvous::Context>(l_.self_worker, l_.num_workers());
  const std::chrono::milliseconds join_timeout = GlooTimeout() * kConnectTimeoutFactor;
  context->setTimeout(join_timeout);
  watchful_store_ =
      std::make_unique<WatchfulStore>(endpoint_->store(), AbandonedKey(), join_timeout);
  prefix_store_ = std::make_unique<gloo::rendezvous::PrefixStore>(l_.key, *watchful_store_);
  std::shared_ptr<gloo::transport::Device> device;
  TESSEL_ASSIGN_OR_RETURN(device, endpoint_->Device());
  const absl::Time start = absl::Now();
  const std::string connecting = absl::StrCat(l_.Describe(c), ": connecting to workers [",
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
  if (s.ok()) s = CatchGloo(connecting, [&] { context->connectFullMesh(*prefix_store_, device); });
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
  if (!s.ok()) return JoinFailed(std::move(s));
  gloo_ = std::move(context);
  if (way[0] != nullptr) {
    inbound_ = std::move(way[l_.self_worker]);
    outbound_ = std::move(way[1 - l_.self_worker]);
  }
  log_->debug("group '{}': connected to {} workers as worker {} in {}", l_.key, l_.num_workers(),
              l_.self_worker, absl::FormatDuration(absl::Now() - start));
  return absl::OkStatus();
}

// Names the workers that never said they were here, not just the group.
absl::Status GlooExchange::JoinFailed(absl::Status s) const {
  if (Abandoned()) return s;  // it says so
  std::vector<int> absent;
  for (int w = 0; w < l_.num_workers(); ++w) {
    const std::string here = absl::StrCat(l_.key, "/", HereKey(w));
    if (w != l_.self_worker && !KeyIsSet(endpoint_->store(), here)) absent.push_back(w);
  }
  if (absent.empty()) return s;
  const std::string who = absl::StrJoin(
      absent, ", ", [&](std::string* out, int w) { out->append(l_.WorkerDevices(w)); });
  return Annotate(s, absl::StrCat(who, " never joined the group: "));
}

void GlooExchange::Break() {
  inbound_.reset();
  outbound_.reset();
  gloo_.reset();
  prefix_store_.reset();
  watchful_store_.reset();
  // Peers not yet connected learn at once rather than wait for us; the
  // steps after this one meet in a group of a new epoch. Without this, a
  // late peer stuck connecting to a group we left would keep missing the
  // next epoch's window, and the next, as we would its.
  if (endpoint_ != nullptr)
    (void)CatchGloo("", [&] { endpoint_->store().set(AbandonedKey(), {'1'}); });
}

absl::Status GlooExchange::PostHeaders(const CallHeader& mine, const CollectiveCall& c,
                                       Headers& x) {
  const int nw = l_.num_workers(), self = l_.self_worker;
  x.all.assign(nw, CallHeader{});
  x.all[self] = mine;
  x.recvs.resize(nw);
  const uint32_t tag = next_tag_++;
  const std::string what = absl::StrCat(l_.Describe(c), ": exchanging headers");
  if (inbound_ != nullptr) {
    const int peer = 1 - self;
    return CatchGloo(what, [&] {
      ClosingOutboundOnFailure([&] {
        const int slot = ExchangeSlot(tag, kHeaderSlotBit);
        x.recv_from_peer =
            inbound_->getPair(peer)->createRecvBuffer(slot, &x.all[peer], sizeof(CallHeader));
        x.send_to_peer =
            outbound_->getPair(peer)->createSendBuffer(slot, &x.all[self], sizeof(CallHeader));
        x.send_to_peer->send(0, sizeof(CallHeader));
      });
    });
  }
  const uint64_t slot = uint64_t(gloo::Slot::build(kHeaderSlotPrefix, tag));
  return CatchGloo(what, [&] {
    x.send = gloo_->createUnboundBuffer(&x.all[self], sizeof(CallHeader));
    for (int w = 0; w < nw; ++w) {
      if (w == self) continue;
      x.recvs[w] = gloo_->createUnboundBuffer(&x.all[w], sizeof(CallHeader));
      x.recvs[w]->recv(w, slot);
      x.send->send(w, slot);
    }
  });
}

absl::Status GlooExchange::AwaitHeaders(const CollectiveCall& c, Headers& x) {
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
    absl::Status s = CatchGloo(absl::StrCat(l_.Describe(c), ": ", l_.WorkerDevices(w)), [&] {
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
        missing, ", ", [&](std::string* out, int w) { out->append(l_.WorkerDevices(w)); });
    return absl::Status(first_error.code(),
                        absl::StrCat("no word from ", who, " within ",
                                     absl::FormatDuration(timeout_), ": ", first_error.message()));
  }
  return first_error;
}

char* GlooExchange::Scratch(int which, size_t bytes) {
  if (scratch_bytes_[which] < bytes) {
    scratch_[which].reset(new char[bytes]);
    scratch_bytes_[which] = bytes;
  }
  return scratch_[which].get();
}

absl::Status GlooExchange::AllReduce(const CollectiveCall& c, void* data, size_t elements) {
  const uint32_t tag = next_tag_++;
  if (inbound_ != nullptr && elements * DTypeSize(c.dtype) <= kExchangeMaxBytes) {
    return ExchangeAllReduce(c, tag, data, elements);
  }
  return CatchGloo(l_.Describe(c), [&] {
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
absl::Status GlooExchange::ExchangeAllReduce(const CollectiveCall& c, uint32_t tag, void* data,
                                             size_t elements) {
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
  return CatchGloo(absl::StrCat(l_.Describe(c), ": exchanging data"), [&] {
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

absl::Status GlooExchange::AllGather(const CollectiveCall& c, char* dst) {
  std::vector<size_t> elements;
  for (const auto& ranks : l_.worker_ranks) elements.push_back(ranks.size() * size_t(c.count));
  const uint32_t tag = next_tag_++;
  return CatchGloo(l_.Describe(c), [&] {
    gloo::AllgathervOptions opts(gloo_);
    WithElementType(DTypeSize(c.dtype),
                    [&](auto t) { opts.setOutput(reinterpret_cast<decltype(t)*>(dst), elements); });
    opts.setTag(tag);
    opts.setTimeout(GlooTimeout());
    gloo::allgatherv(opts);
  });
}

absl::Status GlooExchange::AllToAll(const CollectiveCall& c, const char* send,
                                    const std::vector<int64_t>& send_elems, char* recv,
                                    const std::vector<int64_t>& recv_elems) {
  const uint32_t tag = next_tag_++;
  return CatchGloo(l_.Describe(c), [&] {
    gloo::AlltoallvOptions opts(gloo_);
    WithElementType(DTypeSize(c.dtype), [&](auto t) {
      using T = decltype(t);
      opts.setInput(reinterpret_cast<T*>(const_cast<char*>(send)), send_elems);
      opts.setOutput(reinterpret_cast<T*>(recv), recv_elems);
    });
    opts.setTag(tag);
    opts.setTimeout(GlooTimeout());
    gloo::alltoallv(opts);
  });
}

// One Gloo message per pair across workers, straight from the source's
// buffer to the target's, on a slot made of this round's tag and the
// pair's index.
absl::Status GlooExchange::Permute(const CollectiveCall& c, const std::vector<Message>& sends,
                                   const std::vector<Message>& recvs) {
  const size_t bytes = size_t(c.count) * DTypeSize(c.dtype);
  const uint32_t tag = next_tag_++;
  return CatchGloo(l_.Describe(c), [&] {
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> out, in;
    const uint64_t base = uint64_t(gloo::Slot::build(kPermuteSlotPrefix, tag));
    for (const Message& m : sends) {
      out.push_back(gloo_->createUnboundBuffer(m.data, bytes));
      out.back()->send(m.worker, base + m.index);
    }
    for (const Message& m : recvs) {
      in.push_back(gloo_->createUnboundBuffer(m.data, bytes));
      in.back()->recv(m.worker, base + m.index);
    }
    for (auto& b : in) {
      if (!b->waitRecv(GlooTimeout())) throw gloo::IoException("receive aborted");
    }
    for (auto& b : out) {
      if (!b->waitSend(GlooTimeout())) throw gloo::IoException("send aborted");
    }
  });
}

}  // namespace tessel::worker
