#include "client/src/dispatcher_internal.h"

#include "core/rpc_status.h"

namespace tessel {

Dispatcher::Dispatcher(v1::Session::Stub* stub) {
  stream_ = stub->Dispatch(&ctx_);
  writer_ = std::thread([this] { WriteLoop(); });
  reader_ = std::thread([this] { ReadLoop(); });
}

Dispatcher::~Dispatcher() {
  {
    absl::MutexLock l(&mu_);
    closing_ = true;
  }
  writer_.join();
  reader_.join();
}

absl::StatusOr<int64_t> Dispatcher::Send(v1::ExecuteRequest req, bool want_reply) {
  absl::MutexLock l(&mu_);
  if (!broken_.ok()) return broken_;
  const int64_t seq = sent_++;
  if (want_reply) wanted_[seq];
  *queue_.add_calls() = std::move(req);
  return seq;
}

absl::StatusOr<v1::DispatchReply> Dispatcher::Reply(int64_t seq) {
  absl::MutexLock l(&mu_);
  auto answered = [this, seq]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return acked_ > seq || done_reading_; };
  mu_.Await(absl::Condition(&answered));
  auto it = wanted_.find(seq);
  if (acked_ <= seq || it == wanted_.end())
    return broken_.ok() ? absl::UnavailableError("no reply") : broken_;
  v1::DispatchReply r = std::move(it->second);
  wanted_.erase(it);
  return r;
}

absl::Status Dispatcher::Flush() {
  absl::MutexLock l(&mu_);
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return acked_ == sent_ || done_reading_;
  };
  mu_.Await(absl::Condition(&drained));
  return acked_ == sent_ ? absl::OkStatus() : broken_;
}

void Dispatcher::WriteLoop() {
  v1::DispatchBatch batch;
  while (true) {
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return queue_.calls_size() > 0 || closing_ || done_reading_;
      };
      mu_.Await(absl::Condition(&ready));
      if (queue_.calls_size() == 0) break;  // closing, or the stream ended
      batch.Clear();
      batch.Swap(&queue_);
    }
    if (!stream_->Write(batch)) break;  // the reader records why
  }
  stream_->WritesDone();
}

void Dispatcher::ReadLoop() {
  v1::DispatchReplies replies;
  while (stream_->Read(&replies)) {
    absl::MutexLock l(&mu_);
    for (v1::DispatchReply& r : *replies.mutable_replies()) {
      auto it = wanted_.find(acked_);
      if (it != wanted_.end()) it->second = std::move(r);
      ++acked_;
    }
  }
  grpc::Status s = stream_->Finish();
  absl::MutexLock l(&mu_);
  broken_ =
      s.ok() ? absl::UnavailableError("the execute stream to the coordinator closed") : FromGrpc(s);
  done_reading_ = true;
}

}  // namespace tessel
