// Data exchange between the workers of one group: the Gloo connections of
// the group (one Gloo context whose ranks are the group's distinct workers;
// with two workers, one more connection each way for all_reduce data), the
// call headers (collectives/agreement.h) and the data of each collective
// kind. What the local ranks of the group hold is not its business: it
// moves one combined buffer per worker (collectives/group.h combines them).
//
// Threads: used only by the thread running the group's current round; the
// rounds of one group never run at once.
#pragma once

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/buffer.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "spdlog/logger.h"
#include "worker/collectives/agreement.h"
#include "worker/collectives/call.h"
#include "worker/collectives/gloo_endpoint.h"
#include "worker/collectives/layout.h"

namespace tessel::worker {

class GlooExchange {
 public:
  // `layout` must outlive the exchange. `endpoint` is null where this worker
  // has no rendezvous store (then Connect fails, naming the workers).
  GlooExchange(const GroupLayout& layout, std::shared_ptr<const GlooEndpoint> endpoint,
               absl::Duration timeout, std::shared_ptr<spdlog::logger> log)
      : l_(layout), endpoint_(std::move(endpoint)), timeout_(timeout), log_(std::move(log)) {}

  // Connects to the group's other workers, once; `c` names the call in errors.
  absl::Status Connect(const CollectiveCall& c);

  // Closes every connection (peers still in a round fail at once) and says
  // in the store that this worker gave up on the group, so a peer not yet
  // connected learns at once rather than wait for it.
  void Break();

  // Headers in flight: every worker's (this worker's own at self_worker),
  // as sent and received. Not movable once posted: Gloo holds pointers into it.
  struct Headers {
    std::vector<CallHeader> all;
    std::unique_ptr<gloo::transport::UnboundBuffer> send;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recvs;
    // Two workers: the header goes down the exchange connections instead,
    // straight into the peer's buffer (no ready-to-receive round trip).
    std::unique_ptr<gloo::transport::Buffer> send_to_peer, recv_from_peer;
  };
  // Sends `mine` to every other worker and posts the receives of theirs.
  absl::Status PostHeaders(const CallHeader& mine, const CollectiveCall& c, Headers& x);
  // Waits for every other worker's header, and for this worker's to leave;
  // names the workers not heard from.
  absl::Status AwaitHeaders(const CollectiveCall& c, Headers& x);

  // All-reduce of `elements` elements of c.dtype under c.op in place: the
  // two-worker exchange for blocks up to kExchangeMaxBytes, else Gloo's ring.
  absl::Status AllReduce(const CollectiveCall& c, void* data, size_t elements);
  // Gathers each worker's blocks (c.count elements for each of its ranks)
  // in place into `dst`, worker by worker.
  absl::Status AllGather(const CollectiveCall& c, char* dst);
  // Gloo's alltoallv: `send_elems[w]` elements of `send` go to worker w,
  // `recv_elems[w]` of `recv` come from it.
  absl::Status AllToAll(const CollectiveCall& c, const char* send,
                        const std::vector<int64_t>& send_elems, char* recv,
                        const std::vector<int64_t>& recv_elems);
  // Point-to-point messages of one permute: `index` is the pair's place in
  // the call's pairs (the receiver posts the same index).
  struct Message {
    size_t index;
    int worker;
    void* data;
  };
  absl::Status Permute(const CollectiveCall& c, const std::vector<Message>& sends,
                       const std::vector<Message>& recvs);

  // Grow-only scratch; kept for the group's life so steady-state rounds
  // allocate (and fault in) nothing. Buffers 0 and 1 are the caller's;
  // 2 is the two-worker exchange's inbox.
  char* Scratch(int which, size_t bytes);

  // Two workers' all_reduce exchange: its connections' keys in a group's
  // rendezvous store, its segment, and the largest block it takes (its
  // inbox is kept for the group's life); larger blocks go through Gloo's
  // ring, which needs no inbox of their size.
  static constexpr size_t kExchangeSegmentBytes = size_t{1} << 20;
  static constexpr size_t kExchangeMaxBytes = size_t{16} << 20;
  static constexpr size_t kMaxPermutePairs = size_t{1} << 24;  // fits below the tag in a slot

 private:
  std::string AbandonedKey() const { return l_.key + "/abandoned"; }
  bool Abandoned() const { return KeyIsSet(endpoint_->store(), AbandonedKey()); }
  absl::Status JoinFailed(absl::Status s) const;
  std::chrono::milliseconds GlooTimeout() const { return absl::ToChronoMilliseconds(timeout_); }
  absl::Status ExchangeAllReduce(const CollectiveCall& c, uint32_t tag, void* data,
                                 size_t elements);
  template <typename F>
  void ClosingOutboundOnFailure(F&& f);

  const GroupLayout& l_;
  const std::shared_ptr<const GlooEndpoint> endpoint_;  // null: no store
  const absl::Duration timeout_;
  const std::shared_ptr<spdlog::logger> log_;

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

}  // namespace tessel::worker
