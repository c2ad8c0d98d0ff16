#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "tessel/v1/session.grpc.pb.h"

namespace tessel {

// The pipelined Execute stream: one per session, opened on first use. Calls
// queue in order; a writer thread sends whatever has queued as one batch, so
// a host loop that outpaces the wire coalesces its calls. Replies come back
// in order on a reader thread. Unary calls that name handles first wait until
// every call queued has been answered, so they never overtake the Execute
// that makes their arrays.
class Dispatcher {
 public:
  explicit Dispatcher(v1::Session::Stub* stub);
  ~Dispatcher();

  // Queues `req`; returns its sequence number. With `want_reply`, the reply
  // is kept for Reply().
  absl::StatusOr<int64_t> Send(v1::ExecuteRequest req, bool want_reply);

  absl::StatusOr<v1::DispatchReply> Reply(int64_t seq);

  // Waits until every call queued has been answered.
  absl::Status Flush();

 private:
  void WriteLoop();
  void ReadLoop();

  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DispatchBatch, v1::DispatchReplies>> stream_;
  absl::Mutex mu_;
  v1::DispatchBatch queue_ ABSL_GUARDED_BY(mu_);
  int64_t sent_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t acked_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int64_t, v1::DispatchReply> wanted_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool done_reading_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread writer_;
  std::thread reader_;
};

}  // namespace tessel
