#include "worker/kv_store_client.h"

#include <grpcpp/grpcpp.h>

#include <gloo/common/error.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/rpc_status.h"

namespace tessel::worker {
namespace {

// The coordinator answers a KvGet that times out itself; the call's own
// deadline only guards against a coordinator that does not answer at all.
constexpr absl::Duration kRpcMargin = absl::Seconds(5);

void SetDeadline(grpc::ClientContext& ctx, absl::Duration timeout) {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // A channel still connecting waits for the coordinator instead of failing
  // the rendezvous at once.
  ctx.set_wait_for_ready(true);
}

}  // namespace

KvStoreClient::KvStoreClient(std::shared_ptr<v1::Registry::StubInterface> stub, Options options)
    : stub_(std::move(stub)), options_(options) {}

void KvStoreClient::set(const std::string& key, const std::vector<char>& data) {
  grpc::ClientContext ctx;
  SetDeadline(ctx, options_.set_timeout);
  v1::KvSetRequest req;
  req.set_key(key);
  req.set_value(data.data(), data.size());
  req.set_worker_id(WorkerId());
  req.set_worker_secret(options_.worker_secret);
  v1::KvSetResponse resp;
  const absl::Status s = FromGrpc(stub_->KvSet(&ctx, req, &resp));
  if (!s.ok()) {
    throw gloo::IoException(absl::StrCat("rendezvous: setting key '", key,
                                         "' on the coordinator failed: ", s.ToString()));
  }
}

std::string KvStoreClient::Get(const std::string& key, absl::Duration timeout) {
  timeout = std::max(timeout, absl::ZeroDuration());
  grpc::ClientContext ctx;
  SetDeadline(ctx, timeout + kRpcMargin);
  v1::KvGetRequest req;
  req.set_key(key);
  req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  req.set_worker_id(WorkerId());
  req.set_worker_secret(options_.worker_secret);
  v1::KvGetResponse resp;
  const absl::Status s = FromGrpc(stub_->KvGet(&ctx, req, &resp));
  if (!s.ok()) {
    throw gloo::IoException(absl::StrCat("rendezvous: getting key '", key,
                                         "' from the coordinator failed: ", s.ToString()));
  }
  return std::move(*resp.mutable_value());
}

void KvStoreClient::SetWorkerId(std::string id) {
  absl::MutexLock l(&mu_);
  worker_id_ = std::move(id);
}

std::string KvStoreClient::WorkerId() const {
  absl::MutexLock l(&mu_);
  return worker_id_;
}

std::vector<char> KvStoreClient::get(const std::string& key) {
  const std::string value = Get(key, options_.timeout);
  return std::vector<char>(value.begin(), value.end());
}

void KvStoreClient::wait(const std::vector<std::string>& keys) {
  wait(keys, std::chrono::milliseconds::zero());
}

void KvStoreClient::wait(const std::vector<std::string>& keys,
                         const std::chrono::milliseconds& timeout) {
  const absl::Duration total = timeout.count() > 0 ? absl::FromChrono(timeout) : options_.timeout;
  const absl::Time deadline = absl::Now() + total;
  for (const std::string& key : keys) Get(key, deadline - absl::Now());
}

}  // namespace tessel::worker
