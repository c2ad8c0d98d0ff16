// Session::Impl: the session's stubs, id, handles and background threads,
// shared by the files that implement Session (session.cc, checkpoints.cc).
#pragma once

#include <grpcpp/grpcpp.h>

#include <memory>
#include <random>
#include <string>
#include <thread>

#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/src/convert_internal.h"
#include "client/src/direct_transfer_internal.h"
#include "client/src/dispatcher_internal.h"
#include "core/rpc_status.h"
#include "core/status.h"
#include "tessel/session.h"
#include "tessel/v1/admin.grpc.pb.h"
#include "tessel/v1/session.grpc.pb.h"

namespace tessel {

class Session::Impl {
 public:
  Impl(std::shared_ptr<grpc::Channel> channel, ConnectOptions options,
       std::unique_ptr<WorkerChannels> workers)
      : options(std::move(options)),
        session(v1::Session::NewStub(channel)),
        admin(v1::Admin::NewStub(channel)),
        workers(std::move(workers)),
        rng(std::random_device{}()) {}

  // Puts `array` by writing its blocks to the workers directly. True when
  // done; false when the caller must put it through the coordinator instead:
  // the coordinator relays every transfer, or a write failed (then the
  // coordinator has freed the array, and the receipt says why). An error is
  // the put's own (the guard, the placement), which the relay would repeat.
  absl::StatusOr<bool> PutDirect(const v1::PutRequest::Header& h, const HostArray& array,
                                 TransferReceipt* receipt) {
    grpc::ClientContext ctx;
    auto stream = session->PutDirect(&ctx);
    v1::PutDirectRequest req;
    *req.mutable_header() = h;
    v1::PutDirectResponse plan;
    if (!stream->Write(req) || !stream->Read(&plan)) {
      const grpc::Status s = stream->Finish();
      if (s.error_code() == grpc::StatusCode::UNIMPLEMENTED)
        return false;  // a coordinator without PutDirect
      return s.ok()
                 ? absl::UnavailableError("put: the coordinator closed PutDirect without an answer")
                 : FromGrpc(s);
    }
    if (plan.relay()) {
      stream->WritesDone();
      (void)stream->Finish();
      return false;
    }
    const std::vector<v1::DirectWrite> blocks(plan.blocks().begin(), plan.blocks().end());
    std::vector<std::string> receipts;
    const absl::Status wrote =
        WriteDirectBlocks(*workers, blocks, options.chunk_bytes,
                          absl::Milliseconds(options.direct_connect_timeout_ms), array, &receipts);
    req.mutable_done()->set_error(wrote.ok() ? "" : wrote.ToString());
    if (wrote.ok()) req.mutable_done()->mutable_receipts()->Add(receipts.begin(), receipts.end());
    stream->Write(req);
    stream->WritesDone();
    while (stream->Read(&plan)) {
    }
    const grpc::Status s = stream->Finish();
    if (!wrote.ok()) {
      receipt->relayed_because = wrote.ToString();
      return false;
    }
    if (!s.ok()) return FromGrpc(s);
    receipt->direct = true;
    receipt->blocks = int(blocks.size());
    return true;
  }

  struct Fetched {
    HostArray array;
    std::vector<v1::DirectBlock> direct;  // granted instead of the bytes
  };
  // One Fetch call: the bytes through the coordinator, or the blocks to read.
  absl::StatusOr<Fetched> FetchOnce(const v1::FetchRequest& req) {
    grpc::ClientContext ctx;
    auto reader = session->Fetch(&ctx, req);
    v1::FetchResponse msg;
    Fetched out;
    int64_t offset = 0;
    bool first = true;
    while (reader->Read(&msg)) {
      if (first) {
        out.array = HostArray(FromProto(msg.type()));
        out.direct.assign(msg.direct_blocks().begin(), msg.direct_blocks().end());
        first = false;
      }
      const std::string& d = msg.data();
      if (offset + int64_t(d.size()) > out.array.size_bytes()) {
        ctx.TryCancel();
        return absl::DataLossError(
            absl::StrFormat("fetch of array %#x: more bytes than its type %s holds", req.handle(),
                            out.array.type().ToString()));
      }
      if (!d.empty()) std::memcpy(out.array.mutable_data() + offset, d.data(), d.size());
      offset += d.size();
    }
    if (auto s = reader->Finish(); !s.ok()) return FromGrpc(s);
    if (first || (out.direct.empty() && offset != out.array.size_bytes())) {
      return absl::DataLossError(absl::StrFormat("fetch of array %#x: expected %d bytes, got %d",
                                                 req.handle(), out.array.size_bytes(), offset));
    }
    return out;
  }

  Dispatcher& dispatcher() {
    absl::MutexLock l(&mu);
    if (!dispatch) dispatch = std::make_unique<Dispatcher>(session.get());
    return *dispatch;
  }

  // Before a unary call that names arrays: let every pipelined call land.
  absl::Status Flush() {
    Dispatcher* d;
    {
      absl::MutexLock l(&mu);
      d = dispatch.get();
    }
    return d == nullptr ? absl::OkStatus() : d->Flush();
  }

  uint64_t NewHandle() {
    absl::MutexLock l(&mu);
    uint64_t h;
    do {
      h = rng();
    } while (h == 0);
    return h;
  }

  // Renews the session's lease every third of it until Stop (the
  // coordinator ends sessions whose client has gone quiet).
  void StartKeepAlive(absl::Duration lease) {
    if (lease <= absl::ZeroDuration()) return;
    keepalive = std::thread([this, every = std::max(lease / 3, absl::Milliseconds(20))] {
      absl::MutexLock l(&keepalive_mu);
      while (!keepalive_stop) {
        if (keepalive_mu.AwaitWithTimeout(absl::Condition(&keepalive_stop), every)) break;
        keepalive_mu.Unlock();
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(std::max(every, absl::Seconds(1))));
        v1::KeepAliveRequest req;
        req.set_session_id(id);
        v1::KeepAliveResponse resp;
        const grpc::Status s = session->KeepAlive(&ctx, req, &resp);
        keepalive_mu.Lock();
        // An ended session stays ended: its calls say why; stop renewing.
        if (s.error_code() == grpc::StatusCode::NOT_FOUND) break;
      }
    });
  }
  void StopKeepAlive() {
    {
      absl::MutexLock l(&keepalive_mu);
      keepalive_stop = true;
    }
    if (keepalive.joinable()) keepalive.join();
  }

  ConnectOptions options;
  std::unique_ptr<v1::Session::Stub> session;
  std::unique_ptr<v1::Admin::Stub> admin;
  const std::unique_ptr<WorkerChannels> workers;  // for direct fetches
  std::string id;
  int version = 0;
  absl::Mutex mu;
  std::mt19937_64 rng ABSL_GUARDED_BY(mu);
  std::unique_ptr<Dispatcher> dispatch ABSL_GUARDED_BY(mu);
  SessionOptions session_options;
  absl::Mutex keepalive_mu;
  bool keepalive_stop ABSL_GUARDED_BY(keepalive_mu) = false;
  std::thread keepalive;
};

}  // namespace tessel
