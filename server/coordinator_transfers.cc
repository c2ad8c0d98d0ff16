// Coordinator: Put and Fetch, the explicit host<->device transfers. Bytes
// are relayed chunk by chunk; nothing holds a whole array in the coordinator.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"
#include "server/coordinator.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

class Coordinator::PutSinkImpl final : public Coordinator::PutSink {
 public:
  PutSinkImpl(Coordinator* c, uint64_t handle, std::string session, int64_t bytes,
              std::vector<std::unique_ptr<WorkerClient::PutStream>> streams)
      : c_(c), handle_(handle), session_(std::move(session)), bytes_(bytes), streams_(std::move(streams)) {}

  ~PutSinkImpl() override {
    if (finished_) return;
    for (auto& s : streams_) (void)s->Finish();
    Abandon();
  }

  absl::Status Write(const std::string& bytes) override {
    if (received_ + int64_t(bytes.size()) > bytes_) {
      return absl::InvalidArgumentError(StrFormat("put of array %#x: expected %d bytes, got more (%d)", handle_,
                                                  bytes_, received_ + bytes.size()));
    }
    received_ += bytes.size();
    for (auto& s : streams_) TESSEL_RETURN_IF_ERROR(s->Write(bytes));
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Finish() override {
    finished_ = true;
    absl::Status status;
    if (received_ != bytes_) {
      status = absl::InvalidArgumentError(StrFormat(
          "put of array %#x: expected %d bytes, got %d (truncated stream)", handle_, bytes_, received_));
    }
    for (auto& s : streams_) {
      absl::Status fs = s->Finish();
      if (status.ok() && !fs.ok()) status = fs;
    }
    if (!status.ok()) {
      Abandon();
      return status;
    }
    absl::MutexLock l(&c_->mu_);
    auto it = c_->arrays_.find(handle_);
    if (it != c_->arrays_.end() && it->second.state == v1::PENDING) {
      it->second.state = v1::READY;
      for (int d : it->second.devices) c_->CountTransfer(session_, d, Direction::kHostToDevice, bytes_);
    }
    return bytes_;
  }

 private:
  void Abandon() {
    absl::MutexLock l(&c_->mu_);
    c_->FreeArraysLocked({handle_});
  }

  Coordinator* const c_;
  const uint64_t handle_;
  const std::string session_;
  const int64_t bytes_;
  std::vector<std::unique_ptr<WorkerClient::PutStream>> streams_;
  int64_t received_ = 0;
  bool finished_ = false;
};

absl::StatusOr<std::unique_ptr<Coordinator::PutSink>> Coordinator::BeginPut(const v1::PutRequest::Header& h) {
  std::vector<std::pair<std::shared_ptr<WorkerClient>, v1::PutShardRequest::Header>> targets;
  int64_t bytes = 0;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(h.session_id()));
    if (h.handle() == 0) return absl::InvalidArgumentError("put: handle 0 is reserved; handles must be nonzero");
    if (arrays_.contains(h.handle())) {
      return absl::AlreadyExistsError(StrFormat("put: handle %#x is already in use", h.handle()));
    }
    auto size = ByteSize(h.type());
    if (!size.ok()) return Annotate(size.status(), StrFormat("put of array %#x: ", h.handle()));
    bytes = *size;
    TESSEL_ASSIGN_OR_RETURN(std::vector<int> devices, ResolvePlacement(h.placement()));
    const std::string what = StrFormat("array %#x (%s) to device%s %s", h.handle(), TypeString(h.type()),
                                       devices.size() > 1 ? "s" : "", absl::StrJoin(devices, ","));
    TESSEL_RETURN_IF_ERROR(GuardTransfer(h.session_id(), h.transfer_guard(), Direction::kHostToDevice, h.implicit(),
                                         what, bytes * int64_t(devices.size())));
    TESSEL_RETURN_IF_ERROR(CheckQuota(h.session_id(), bytes * int64_t(devices.size()),
                                      StrFormat("put of array %#x (%s)", h.handle(), TypeString(h.type()))));
    absl::flat_hash_map<std::string, int> target_of;  // worker id -> index in targets
    for (int d : devices) {
      const DeviceRecord& dev = devices_[d];
      auto [it, fresh] = target_of.try_emplace(dev.worker_id, targets.size());
      if (fresh) {
        v1::PutShardRequest::Header wh;
        wh.set_buffer(h.handle());
        *wh.mutable_type() = h.type();
        targets.emplace_back(workers_.at(dev.worker_id).client, std::move(wh));
      }
      targets[it->second].second.add_devices(dev.local_index);
    }
    ArrayRecord a;
    a.type = h.type();
    a.devices = devices;
    a.state = v1::PENDING;
    a.producer_name = "put";
    AddArray(h.session_id(), h.handle(), std::move(a));
  }
  std::vector<std::unique_ptr<WorkerClient::PutStream>> streams;
  for (auto& [client, wh] : targets) {
    auto s = client->BeginPut(wh);
    if (!s.ok()) {
      for (auto& open : streams) (void)open->Finish();
      absl::MutexLock l(&mu_);
      FreeArraysLocked({h.handle()});
      return s.status();
    }
    streams.push_back(std::move(*s));
  }
  return std::unique_ptr<PutSink>(
      new PutSinkImpl(this, h.handle(), h.session_id(), bytes, std::move(streams)));
}

class Coordinator::FetchSourceImpl final : public Coordinator::FetchSource {
 public:
  FetchSourceImpl(Coordinator* c, std::string session, uint64_t handle, int device, v1::TensorType type,
                  std::unique_ptr<WorkerClient::FetchStream> stream)
      : c_(c), session_(std::move(session)), handle_(handle), device_(device), type_(std::move(type)),
        expected_(ByteSizeUnchecked(type_)), stream_(std::move(stream)) {}

  const v1::TensorType& type() const override { return type_; }

  bool Read(std::string* bytes) override {
    if (!stream_->Read(bytes)) return false;
    received_ += bytes->size();
    return true;
  }

  absl::Status Finish() override {
    TESSEL_RETURN_IF_ERROR(stream_->Finish());
    if (received_ != expected_) {
      return absl::DataLossError(StrFormat("fetch of array %#x: expected %d bytes from the worker, got %d",
                                           handle_, expected_, received_));
    }
    absl::MutexLock l(&c_->mu_);
    c_->CountTransfer(session_, device_, Direction::kDeviceToHost, received_);
    return absl::OkStatus();
  }

 private:
  Coordinator* const c_;
  const std::string session_;
  const uint64_t handle_;
  const int device_;
  const v1::TensorType type_;
  const int64_t expected_;
  std::unique_ptr<WorkerClient::FetchStream> stream_;
  int64_t received_ = 0;
};

absl::StatusOr<std::unique_ptr<Coordinator::FetchSource>> Coordinator::BeginFetch(const v1::FetchRequest& req) {
  std::shared_ptr<WorkerClient> client;
  v1::FetchShardRequest fr;
  v1::TensorType type;
  int device = -1;
  {
    absl::MutexLock l(&mu_);
    TESSEL_RETURN_IF_ERROR(CheckSession(req.session_id()));
    {
      TESSEL_ASSIGN_OR_RETURN(ArrayRecord * a, OwnedArray(req.session_id(), req.handle()));
      TESSEL_RETURN_IF_ERROR(GuardTransfer(req.session_id(), req.transfer_guard(), Direction::kDeviceToHost,
                                           req.implicit(), StrFormat("array %#x (%s)", req.handle(),
                                                                     TypeString(a->type)),
                                           ByteSizeUnchecked(a->type)));
    }
    std::vector<uint64_t> handles{req.handle()};
    AwaitNotPending(handles, absl::InfiniteDuration());
    TESSEL_ASSIGN_OR_RETURN(ArrayRecord * a, OwnedArray(req.session_id(), req.handle()));
    if (a->state == v1::ERROR || a->state == v1::LOST) {
      return Annotate(a->error, StrFormat("fetch of array %#x: ", req.handle()));
    }
    for (int d : a->devices) {
      const WorkerRecord& w = workers_.at(devices_[d].worker_id);
      if (!w.alive) continue;
      client = w.client;
      device = d;
      fr.set_device(devices_[d].local_index);
      break;
    }
    if (!client) return absl::UnavailableError(StrFormat("fetch of array %#x: no live device holds it", req.handle()));
    fr.set_buffer(req.handle());
    type = a->type;
  }
  return std::unique_ptr<FetchSource>(
      new FetchSourceImpl(this, req.session_id(), req.handle(), device, type, client->BeginFetch(fr)));
}

}  // namespace tessel::server
