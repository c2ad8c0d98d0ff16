// Coordinator: Put and Fetch, the explicit host<->device transfers. Bytes
// are relayed chunk by chunk; nothing holds a whole array in the coordinator.
#include <optional>
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

#include "core/dtype.h"
#include "core/security.h"
#include "core/sharding.h"
#include "core/status.h"
#include "server/block_layout.h"
#include "server/coordinator.h"
#include "server/reshard_planner.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {
// Bytes routed to one block before they are sent on.
constexpr size_t kBlockChunk = 1 << 20;
}  // namespace

// Routes the array's bytes run by run to the streams of the block each run
// belongs to; a whole (unsharded) array passes straight through.
class Coordinator::PutSinkImpl final : public Coordinator::PutSink {
 public:
  struct Block {
    std::vector<std::unique_ptr<WorkerClient::PutStream>> streams;  // one per worker holding a copy
    std::string pending;
  };
  PutSinkImpl(Coordinator* c, uint64_t handle, std::string session, int64_t bytes,
              BlockLayout layout, std::vector<Block> blocks, std::vector<int> devices,
              int64_t device_bytes)
      : c_(c),
        handle_(handle),
        session_(std::move(session)),
        bytes_(bytes),
        layout_(std::move(layout)),
        blocks_(std::move(blocks)),
        devices_(std::move(devices)),
        device_bytes_(device_bytes) {}

  ~PutSinkImpl() override {
    if (finished_) return;
    for (Block& b : blocks_) {
      for (auto& s : b.streams) (void)s->Finish();
    }
    Abandon();
  }

  absl::Status Write(const std::string& bytes) override {
    if (received_ + int64_t(bytes.size()) > bytes_) {
      return absl::InvalidArgumentError(
          StrFormat("put of array %#x: expected %d bytes, got more (%d)", handle_, bytes_,
                    received_ + bytes.size()));
    }
    received_ += bytes.size();
    if (blocks_.size() == 1) {
      for (auto& s : blocks_[0].streams) TESSEL_RETURN_IF_ERROR(s->Write(bytes));
      return absl::OkStatus();
    }
    size_t off = 0;
    while (off < bytes.size()) {
      Block& b = blocks_[layout_.BlockOfRun(run_)];
      const size_t take = std::min<size_t>(layout_.run_bytes() - run_off_, bytes.size() - off);
      b.pending.append(bytes, off, take);
      off += take;
      run_off_ += take;
      if (run_off_ == layout_.run_bytes()) {
        run_off_ = 0;
        ++run_;
      }
      if (b.pending.size() >= kBlockChunk) TESSEL_RETURN_IF_ERROR(Flush(b));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> Finish() override {
    finished_ = true;
    absl::Status status;
    if (received_ != bytes_) {
      status = absl::InvalidArgumentError(
          StrFormat("put of array %#x: expected %d bytes, got %d (truncated stream)", handle_,
                    bytes_, received_));
    }
    for (Block& b : blocks_) {
      if (status.ok()) status = Flush(b);
      for (auto& s : b.streams) {
        absl::Status fs = s->Finish();
        if (status.ok() && !fs.ok()) status = fs;
      }
    }
    if (!status.ok()) {
      Abandon();
      return status;
    }
    if (c_->arrays_.MarkReady(handle_)) {
      for (int d : devices_)
        c_->arrays_.CountTransfer(session_, d, Direction::kHostToDevice, device_bytes_);
    }
    return bytes_;
  }

 private:
  absl::Status Flush(Block& b) {
    if (b.pending.empty()) return absl::OkStatus();
    for (auto& s : b.streams) TESSEL_RETURN_IF_ERROR(s->Write(b.pending));
    b.pending.clear();
    return absl::OkStatus();
  }

  void Abandon() { c_->AbandonPut(handle_); }

  Coordinator* const c_;
  const uint64_t handle_;
  const std::string session_;
  const int64_t bytes_;
  const BlockLayout layout_;
  std::vector<Block> blocks_;
  const std::vector<int> devices_;
  const int64_t device_bytes_;
  int64_t received_ = 0;
  int64_t run_ = 0, run_off_ = 0;
  bool finished_ = false;
};

absl::StatusOr<ArrayRecord> Coordinator::PlaceRecordLocked(const v1::TensorType& type,
                                                           const v1::Placement& p,
                                                           absl::string_view what) const {
  ArrayRecord a;
  a.type = type;
  a.state = v1::PENDING;
  if (!p.has_sharded()) {
    TESSEL_ASSIGN_OR_RETURN(a.devices, workers_.ResolvePlacement(p));
    return a;
  }
  TESSEL_ASSIGN_OR_RETURN(v1::Mesh mesh, NormalizeMesh(p.sharded().mesh(), workers_.num_devices()));
  const v1::Sharding sh = NormalizeSharding(p.sharded().sharding(), type.dims_size());
  TESSEL_RETURN_IF_ERROR(ValidateSharding(sh, mesh, type, what));
  if (IsPartial(sh)) {
    return absl::InvalidArgumentError(StrCat(what, ": sharding ", ShardingString(sh),
                                             " is partial; a placed array holds complete values"));
  }
  a.devices.assign(mesh.devices().begin(), mesh.devices().end());
  TESSEL_RETURN_IF_ERROR(workers_.CheckAlive(a.devices));
  a.block_type = LocalType(type, sh, mesh);
  a.sharded = true;
  a.mesh = std::move(mesh);
  a.sharding = sh;
  return a;
}

absl::StatusOr<v1::ReshardResponse> Coordinator::Reshard(const v1::ReshardRequest& req,
                                                         ReshardSteps* deferred) {
  const std::string what = StrFormat("reshard of array %#x", req.handle());
  v1::ReshardResponse resp;
  ReshardSteps now{.session = req.session_id(), .what = what, .output = req.output()};
  std::vector<SequencedStep> sends;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    TESSEL_ASSIGN_OR_RETURN(const ArrayRecord* src,
                            arrays_.OwnedLocked(req.session_id(), req.handle()));
    if (req.output() == 0)
      return absl::InvalidArgumentError(StrCat(what, ": output handle 0 is reserved"));
    if (arrays_.ContainsLocked(req.output())) {
      return absl::AlreadyExistsError(
          StrFormat("%s: output handle %#x is already in use", what, req.output()));
    }
    if (src->state == v1::LOST) return Annotate(src->error, StrCat(what, ": "));
    TESSEL_ASSIGN_OR_RETURN(ArrayRecord out, PlaceRecordLocked(src->type, req.placement(), what));
    out.producer_name = "reshard";
    const std::vector<DeviceRoute> routes = workers_.Routes();
    for (int d : src->devices) {
      if (d < 0 || d >= int(routes.size()) || !routes[d].alive) {
        return absl::UnavailableError(
            StrCat(what, ": device ", d, ", which holds a block of it, is not alive"));
      }
    }
    auto worker_of = [&routes](int d) { return routes[d].address; };
    TESSEL_ASSIGN_OR_RETURN(ReshardPlan plan, PlanReshard(*src, out, worker_of));
    const std::string text = StrFormat(
        "array %#x (%s) from %s to %s", req.handle(), TypeString(src->type),
        src->sharded ? StrCat(ShardingString(src->sharding), " on mesh ", MeshString(src->mesh))
                     : StrCat("device ", absl::StrJoin(src->devices, ",")),
        out.sharded ? StrCat(ShardingString(out.sharding), " on mesh ", MeshString(out.mesh))
                    : StrCat("device ", absl::StrJoin(out.devices, ",")));
    if (plan.bytes_moved > 0) {
      TESSEL_RETURN_IF_ERROR(GuardTransferLocked(req.session_id(), req.transfer_guard(),
                                                 Direction::kDeviceToDevice, req.implicit(), text,
                                                 plan.bytes_moved));
    }
    TESSEL_RETURN_IF_ERROR(arrays_.CheckQuotaLocked(req.session_id(), out.bytes(), what));

    // Accepted: from here on nothing fails.
    const int64_t execution_id = ++next_execution_;
    now.epoch = collective_epoch_.load();
    resp.set_execution_id(execution_id);
    resp.set_bytes_moved(plan.bytes_moved);
    resp.set_bytes_copied(plan.bytes_copied);
    for (std::string& p : plan.pieces) resp.add_pieces(std::move(p));
    out.producer = execution_id;
    if (src->state == v1::ERROR) {
      out.state = v1::ERROR;
      out.error = DependentError(src->error, StrFormat("the source, array %#x", req.handle()));
      arrays_.AddLocked(req.session_id(), req.output(), std::move(out));
      return resp;
    }
    out.pending = plan.steps.size();
    arrays_.AddLocked(req.session_id(), req.output(), std::move(out));
    for (const auto& [d, bytes] : plan.received) {
      arrays_.CountTransferLocked(req.session_id(), d, Direction::kDeviceToDevice, bytes);
    }
    if (deferred != nullptr)
      *deferred = ReshardSteps{now.session, what, now.output, now.epoch, {}, {}};
    std::vector<int> senders, receivers;
    for (ReshardPlan::Step& st : plan.steps) {
      (st.reads_source ? senders : receivers).push_back(st.device);
      v1::RunRequest run;
      run.set_execution_id(execution_id);
      run.set_collective_epoch(CollectiveEpoch(now.epoch));
      if (st.reads_source) run.add_arguments(req.handle());
      if (st.makes_target) run.add_outputs(req.output());
      *run.mutable_transfer() = std::move(st.transfer);
      const bool later = deferred != nullptr && plan.one_way && !st.reads_source;
      (later ? deferred->steps : now.steps).emplace_back(st.device, std::move(run));
    }
    if (deferred != nullptr && !deferred->steps.empty()) {
      deferred->group = StrCat(absl::StrJoin(senders, ","), " -> ", absl::StrJoin(receivers, ","));
    }
    log_->debug("session {}: execution {}: {}, {} bytes moved, {} copied, {} steps{}",
                req.session_id(), execution_id, text, plan.bytes_moved, plan.bytes_copied,
                plan.steps.size(),
                deferred != nullptr && !deferred->steps.empty() ? ", the receivers' deferred" : "");
    // Sequenced under the lock: a free of the source comes after its reads.
    sends = SequenceStepsLocked(now);
  }
  SendSequenced(now, std::move(sends));
  if (req.wait()) TESSEL_RETURN_IF_ERROR(AwaitAll(req.session_id(), {req.output()}, what));
  return resp;
}

void Coordinator::SendReshardSteps(ReshardSteps steps) {
  if (steps.steps.empty()) return;
  std::vector<SequencedStep> sends;
  {
    ArrayRegistry::Transaction l(arrays_);
    sends = SequenceStepsLocked(steps);
  }
  SendSequenced(steps, std::move(sends));
}

std::vector<Coordinator::SequencedStep> Coordinator::SequenceStepsLocked(ReshardSteps& steps) {
  std::vector<int> devices;
  for (const auto& [d, run] : steps.steps) devices.push_back(d);
  std::vector<QueueSlot> slots = workers_.Reserve(devices, std::vector<int>(devices.size(), 1));
  std::vector<SequencedStep> out;
  for (size_t i = 0; i < steps.steps.size(); ++i) {
    auto& [d, run] = steps.steps[i];
    run.set_device(slots[i].local_index);
    run.set_seq(slots[i].first_seq);
    run.set_queue_epoch(slots[i].queue_epoch);
    out.push_back(SequencedStep{std::move(slots[i].client), std::move(run), d});
  }
  steps.steps.clear();
  return out;
}

void Coordinator::SendSequenced(const ReshardSteps& steps, std::vector<SequencedStep> sequenced) {
  const std::vector<uint64_t> outputs = {steps.output};
  for (SequencedStep& s : sequenced) {
    if (s.client == nullptr) {
      OnStepDone(steps.session, outputs, steps.epoch,
                 absl::UnavailableError(StrCat(steps.what, ": device ", s.device,
                                               "'s worker died before the step was sent")));
      continue;
    }
    StepSent(s.device);
    s.client->Run(s.run,
                  [this, session = steps.session, outputs, epoch = steps.epoch, device = s.device,
                   what = steps.what, sent = absl::Now()](absl::StatusOr<v1::RunResponse> r) {
                    StepAnswered(device, absl::Now() - sent, r.ok());
                    if (!r.ok())
                      r = Annotate(r.status(), StrCat(what, " on device ", device, ": "));
                    OnStepDone(session, outputs, epoch, std::move(r));
                  });
  }
}

absl::StatusOr<Coordinator::PutPlan> Coordinator::PlanPut(const v1::PutRequest::Header& h) {
  if (log_->should_log(spdlog::level::debug)) {
    log_->debug("session {}: put of array {:#x}, {}, onto {}", h.session_id(), h.handle(),
                h.type().ShortDebugString(), h.placement().ShortDebugString());
  }
  PutPlan plan;
  ArrayRegistry::Transaction l(arrays_);
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(h.session_id()));
  if (h.handle() == 0)
    return absl::InvalidArgumentError("put: handle 0 is reserved; handles must be nonzero");
  if (arrays_.ContainsLocked(h.handle())) {
    return absl::AlreadyExistsError(StrFormat("put: handle %#x is already in use", h.handle()));
  }
  auto size = ByteSize(h.type());
  if (!size.ok()) return Annotate(size.status(), StrFormat("put of array %#x: ", h.handle()));
  plan.bytes = *size;
  TESSEL_ASSIGN_OR_RETURN(
      ArrayRecord a,
      PlaceRecordLocked(h.type(), h.placement(), StrFormat("put of array %#x", h.handle())));
  a.producer_name = "put";
  plan.devices = a.devices;
  const v1::TensorType block_type = a.sharded ? a.block_type : a.type;
  if (a.sharded) {
    plan.layout.emplace(h.type(), a.sharding, a.mesh);
  } else {
    plan.layout = BlockLayout::Whole(h.type(), plan.devices.size());
  }
  plan.device_bytes = ByteSizeUnchecked(block_type);
  const std::string what =
      StrFormat("array %#x (%s) to device%s %s", h.handle(), TypeString(h.type()),
                plan.devices.size() > 1 ? "s" : "", absl::StrJoin(plan.devices, ","));
  TESSEL_RETURN_IF_ERROR(GuardTransferLocked(h.session_id(), h.transfer_guard(),
                                             Direction::kHostToDevice, h.implicit(), what,
                                             plan.device_bytes * int64_t(plan.devices.size())));
  TESSEL_RETURN_IF_ERROR(arrays_.CheckQuotaLocked(
      h.session_id(), plan.device_bytes * int64_t(plan.devices.size()),
      StrFormat("put of array %#x (%s)", h.handle(), TypeString(h.type()))));
  const std::vector<DeviceRoute> routes = workers_.Routes();
  plan.targets.resize(plan.layout->num_blocks());
  for (int b = 0; b < plan.layout->num_blocks(); ++b) {
    absl::flat_hash_map<std::string, int> target_of;  // worker id -> index in targets[b]
    for (int pos : plan.layout->positions(b)) {
      const DeviceRoute& dev = routes.at(plan.devices[pos]);
      if (dev.client == nullptr)
        return absl::UnavailableError(StrCat("device ", dev.device, " is shutting down"));
      auto [it, fresh] = target_of.try_emplace(dev.worker_id, plan.targets[b].size());
      if (fresh) {
        PutTarget t;
        t.client = dev.client;
        t.header.set_buffer(h.handle());
        *t.header.mutable_type() = block_type;
        plan.targets[b].push_back(std::move(t));
      }
      PutTarget& t = plan.targets[b][it->second];
      t.header.add_devices(dev.local_index);
      t.global_devices.push_back(dev.device);
    }
  }
  a.devices = plan.devices;
  arrays_.AddLocked(h.session_id(), h.handle(), std::move(a));
  return plan;
}

void Coordinator::AbandonPut(uint64_t handle) {
  std::vector<PendingFree> frees;
  {
    ArrayRegistry::Transaction l(arrays_);
    frees = FreeArraysLocked({handle});
  }
  SendFrees(std::move(frees));
}

absl::StatusOr<std::unique_ptr<Coordinator::PutSink>> Coordinator::BeginPut(
    const v1::PutRequest::Header& h) {
  TESSEL_ASSIGN_OR_RETURN(PutPlan plan, PlanPut(h));
  std::vector<PutSinkImpl::Block> blocks(plan.targets.size());
  for (size_t b = 0; b < plan.targets.size(); ++b) {
    for (PutTarget& t : plan.targets[b]) {
      auto s = t.client->BeginPut(t.header);
      if (!s.ok()) {
        for (auto& blk : blocks) {
          for (auto& open : blk.streams) (void)open->Finish();
        }
        AbandonPut(h.handle());
        return s.status();
      }
      blocks[b].streams.push_back(std::move(*s));
    }
  }
  return std::unique_ptr<PutSink>(new PutSinkImpl(this, h.handle(), h.session_id(), plan.bytes,
                                                  std::move(*plan.layout), std::move(blocks),
                                                  std::move(plan.devices), plan.device_bytes));
}

// A put the client writes to the workers itself: the array stays pending
// until Commit, and is freed if that never comes.
class Coordinator::DirectPutImpl final : public Coordinator::DirectPut {
 public:
  DirectPutImpl(Coordinator* c, std::string session, uint64_t handle, int64_t bytes,
                std::vector<int> devices, int64_t device_bytes, std::vector<v1::DirectWrite> blocks)
      : c_(c),
        session_(std::move(session)),
        handle_(handle),
        bytes_(bytes),
        devices_(std::move(devices)),
        device_bytes_(device_bytes),
        blocks_(std::move(blocks)) {}
  ~DirectPutImpl() override {
    if (!done_) c_->AbandonPut(handle_);
  }
  const std::vector<v1::DirectWrite>& blocks() const override { return blocks_; }
  absl::StatusOr<int64_t> Commit(absl::string_view error,
                                 absl::Span<const std::string> receipts) override {
    done_ = true;
    if (!error.empty()) {
      c_->AbandonPut(handle_);
      return absl::AbortedError(StrFormat(
          "put of array %#x: the client could not write every block: %s", handle_, error));
    }
    // The client's word is not enough: each block's worker must have said
    // that the whole block landed.
    if (absl::Status s = CheckReceipts(receipts); !s.ok()) {
      c_->AbandonPut(handle_);
      return s;
    }
    if (c_->arrays_.MarkReady(handle_)) {
      for (int d : devices_)
        c_->arrays_.CountTransfer(session_, d, Direction::kHostToDevice, device_bytes_);
    }
    return bytes_;
  }

 private:
  Coordinator* const c_;
  const std::string session_;
  const uint64_t handle_;
  const int64_t bytes_;
  const std::vector<int> devices_;
  const int64_t device_bytes_;
  const std::vector<v1::DirectWrite> blocks_;
  bool done_ = false;

  absl::Status CheckReceipts(absl::Span<const std::string> receipts) const {
    if (receipts.size() != blocks_.size()) {
      return absl::AbortedError(
          StrFormat("put of array %#x: expected a receipt from the worker for each of its %d "
                    "blocks, got %d; the array is "
                    "freed",
                    handle_, blocks_.size(), receipts.size()));
    }
    const absl::Time now = absl::Now();
    for (size_t i = 0; i < blocks_.size(); ++i) {
      const v1::DirectWrite& w = blocks_[i];
      const std::string grant =
          WrittenGrant(w.buffer(), TypeString(w.type()),
                       std::vector<int>(w.devices().begin(), w.devices().end()));
      absl::Status s = receipts[i].empty() ? absl::PermissionDeniedError("none given")
                                           : c_->workers_.CheckReceipt(w.global_devices(0), grant,
                                                                       receipts[i], now);
      if (!s.ok()) {
        return absl::AbortedError(StrFormat(
            "put of array %#x: block %d (devices [%s] at worker %s) has no valid receipt from its "
            "worker (%s): the "
            "worker never said the whole block landed; the array is freed",
            handle_, i, absl::StrJoin(w.global_devices(), ","), w.address(), s.message()));
      }
    }
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<Coordinator::DirectPut>> Coordinator::BeginDirectPut(
    const v1::PutRequest::Header& h) {
  if (!options_.direct_transfers) return nullptr;
  TESSEL_ASSIGN_OR_RETURN(PutPlan plan, PlanPut(h));
  const absl::Time expiry = absl::Now() + options_.ticket_lifetime;
  // Each worker first opens the writes its tickets grant: it accepts a
  // client's bytes only for a put this coordinator holds open.
  for (const std::vector<PutTarget>& block : plan.targets) {
    for (const PutTarget& t : block) {
      v1::OpenWritesRequest open;
      open.set_buffer(h.handle());
      *open.mutable_devices() = t.header.devices();
      open.set_expiry_unix_ms(absl::ToUnixMillis(expiry));
      if (absl::Status s = t.client->OpenWrites(open); !s.ok()) {
        AbandonPut(h.handle());
        return Annotate(s, StrFormat("put of array %#x: opening its write on devices [%s]: ",
                                     h.handle(), absl::StrJoin(t.global_devices, ",")));
      }
    }
  }
  std::vector<v1::DirectWrite> writes;
  for (int b = 0; b < int(plan.targets.size()); ++b) {
    std::vector<int64_t> start, shape;
    plan.layout->Box(b, h.type(), &start, &shape);
    for (PutTarget& t : plan.targets[b]) {
      absl::StatusOr<WorkerTicket> ticket =
          workers_.Sign(t.global_devices.front(), WriteGrant(t.header), expiry);
      if (!ticket.ok()) {
        AbandonPut(h.handle());
        return ticket.status();
      }
      v1::DirectWrite& w = writes.emplace_back();
      w.set_address(std::move(ticket->address));
      w.set_buffer(h.handle());
      *w.mutable_type() = t.header.type();
      *w.mutable_devices() = t.header.devices();
      w.set_ticket(std::move(ticket->ticket));
      w.mutable_start()->Add(start.begin(), start.end());
      w.mutable_shape()->Add(shape.begin(), shape.end());
      w.mutable_global_devices()->Add(t.global_devices.begin(), t.global_devices.end());
    }
  }
  return std::unique_ptr<DirectPut>(new DirectPutImpl(this, h.session_id(), h.handle(), plan.bytes,
                                                      std::move(plan.devices), plan.device_bytes,
                                                      std::move(writes)));
}

// Reads one copy of every block and interleaves their runs into the
// array's row-major bytes; a whole array passes straight through.
class Coordinator::FetchSourceImpl final : public Coordinator::FetchSource {
 public:
  struct Block {
    int device = -1;  // global id it is read from
    std::unique_ptr<WorkerClient::FetchStream> stream;
    std::string buffer;
    size_t consumed = 0;
    int64_t received = 0;
  };
  FetchSourceImpl(Coordinator* c, std::string session, uint64_t handle, v1::TensorType type,
                  BlockLayout layout, std::vector<Block> blocks, int64_t block_bytes)
      : c_(c),
        session_(std::move(session)),
        handle_(handle),
        type_(std::move(type)),
        expected_(ByteSizeUnchecked(type_)),
        layout_(std::move(layout)),
        blocks_(std::move(blocks)),
        block_bytes_(block_bytes) {}

  const v1::TensorType& type() const override { return type_; }

  bool Read(std::string* bytes) override {
    if (blocks_.size() == 1) {
      if (!blocks_[0].stream->Read(bytes)) return false;
      blocks_[0].received += bytes->size();
      produced_ += bytes->size();
      return true;
    }
    bytes->clear();
    while (produced_ < expected_ && bytes->size() < kBlockChunk) {
      Block& b = blocks_[layout_.BlockOfRun(run_)];
      if (b.consumed == b.buffer.size()) {
        b.consumed = 0;
        if (!b.stream->Read(&b.buffer)) {
          b.buffer.clear();
          short_block_ = true;
          break;
        }
        b.received += b.buffer.size();
      }
      const size_t take =
          std::min<size_t>({layout_.run_bytes() - size_t(run_off_), b.buffer.size() - b.consumed,
                            kBlockChunk - bytes->size()});
      bytes->append(b.buffer, b.consumed, take);
      b.consumed += take;
      run_off_ += take;
      produced_ += take;
      if (run_off_ == layout_.run_bytes()) {
        run_off_ = 0;
        ++run_;
      }
    }
    return !bytes->empty();
  }

  absl::Status Finish() override {
    for (Block& b : blocks_) TESSEL_RETURN_IF_ERROR(b.stream->Finish());
    for (const Block& b : blocks_) {
      if (b.received != block_bytes_ || short_block_) {
        return absl::DataLossError(
            StrFormat("fetch of array %#x: expected %d bytes from device %d, got %d", handle_,
                      block_bytes_, b.device, b.received));
      }
    }
    for (const Block& b : blocks_)
      c_->arrays_.CountTransfer(session_, b.device, Direction::kDeviceToHost, b.received);
    return absl::OkStatus();
  }

 private:
  Coordinator* const c_;
  const std::string session_;
  const uint64_t handle_;
  const v1::TensorType type_;
  const int64_t expected_;
  const BlockLayout layout_;
  std::vector<Block> blocks_;
  const int64_t block_bytes_;
  int64_t produced_ = 0, run_ = 0, run_off_ = 0;
  bool short_block_ = false;
};

// A direct read granted: the client reads the blocks itself.
class Coordinator::DirectFetchSource final : public Coordinator::FetchSource {
 public:
  DirectFetchSource(v1::TensorType type, std::vector<v1::DirectBlock> plan)
      : type_(std::move(type)), plan_(std::move(plan)) {}
  const v1::TensorType& type() const override { return type_; }
  bool Read(std::string*) override { return false; }
  absl::Status Finish() override { return absl::OkStatus(); }
  const std::vector<v1::DirectBlock>* direct() const override { return &plan_; }

 private:
  const v1::TensorType type_;
  const std::vector<v1::DirectBlock> plan_;
};

absl::StatusOr<std::unique_ptr<Coordinator::FetchSource>> Coordinator::BeginFetch(
    const v1::FetchRequest& req) {
  log_->debug("session {}: fetch of array {:#x}", req.session_id(), req.handle());
  std::vector<std::pair<std::shared_ptr<WorkerClient>, v1::FetchShardRequest>> reads;
  std::vector<FetchSourceImpl::Block> blocks;
  std::optional<BlockLayout> layout;
  v1::TensorType type;
  int64_t block_bytes = 0;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    {
      TESSEL_ASSIGN_OR_RETURN(ArrayRecord * a, arrays_.OwnedLocked(req.session_id(), req.handle()));
      if (a->sharded && IsPartial(a->sharding)) {
        return absl::FailedPreconditionError(StrFormat(
            "fetch of array %#x (%s): it is laid out %s, an unreduced partial result; a fetch "
            "returns complete "
            "values, so reduce it first (an executable whose output sharding is not partial)",
            req.handle(), TypeString(a->type), ShardingString(a->sharding)));
      }
      TESSEL_RETURN_IF_ERROR(GuardTransferLocked(
          req.session_id(), req.transfer_guard(), Direction::kDeviceToHost, req.implicit(),
          StrFormat("array %#x (%s)", req.handle(), TypeString(a->type)),
          ByteSizeUnchecked(a->type)));
    }
    arrays_.AwaitNotPendingLocked({req.handle()}, absl::InfiniteDuration());
    TESSEL_ASSIGN_OR_RETURN(ArrayRecord * a, arrays_.OwnedLocked(req.session_id(), req.handle()));
    const std::vector<DeviceRoute> routes = workers_.Routes();
    if (a->state == v1::ERROR || a->state == v1::LOST) {
      return Annotate(a->error, StrFormat("fetch of array %#x: ", req.handle()));
    }
    layout = a->sharded ? BlockLayout(a->type, a->sharding, a->mesh)
                        : BlockLayout::Whole(a->type, a->devices.size());
    block_bytes = a->device_bytes();
    for (int b = 0; b < layout->num_blocks(); ++b) {
      FetchSourceImpl::Block blk;
      for (int pos : layout->positions(b)) {
        const int d = a->devices[pos];
        const DeviceRoute& w = routes.at(d);
        if (!w.alive || w.client == nullptr) continue;
        v1::FetchShardRequest fr;
        fr.set_device(w.local_index);
        fr.set_buffer(req.handle());
        reads.emplace_back(w.client, std::move(fr));
        blk.device = d;
        break;
      }
      if (blk.device < 0) {
        return absl::UnavailableError(
            StrFormat("fetch of array %#x: no live device holds block %d of it", req.handle(), b));
      }
      blocks.push_back(std::move(blk));
    }
    type = a->type;
  }
  if (req.direct() && options_.direct_transfers &&
      ByteSizeUnchecked(type) >= req.direct_min_bytes()) {
    // The client reads each block from its worker; the bytes are counted
    // as granted, since they no longer pass through here.
    const absl::Time expiry = absl::Now() + options_.ticket_lifetime;
    std::vector<v1::DirectBlock> plan(blocks.size());
    for (size_t b = 0; b < blocks.size(); ++b) {
      const int local = reads[b].second.device();
      TESSEL_ASSIGN_OR_RETURN(
          WorkerTicket g, workers_.Sign(blocks[b].device, ReadGrant(local, req.handle()), expiry));
      v1::DirectBlock& d = plan[b];
      d.set_address(std::move(g.address));
      d.set_device(local);
      d.set_buffer(req.handle());
      d.set_ticket(std::move(g.ticket));
      d.set_bytes(block_bytes);
      d.set_global_device(blocks[b].device);
      std::vector<int64_t> start, shape;
      layout->Box(int(b), type, &start, &shape);
      d.mutable_start()->Add(start.begin(), start.end());
      d.mutable_shape()->Add(shape.begin(), shape.end());
    }
    for (const v1::DirectBlock& d : plan) {
      arrays_.CountTransfer(req.session_id(), d.global_device(), Direction::kDeviceToHost,
                            d.bytes());
    }
    return std::unique_ptr<FetchSource>(new DirectFetchSource(std::move(type), std::move(plan)));
  }
  for (size_t b = 0; b < blocks.size(); ++b)
    blocks[b].stream = reads[b].first->BeginFetch(reads[b].second);
  return std::unique_ptr<FetchSource>(new FetchSourceImpl(this, req.session_id(), req.handle(),
                                                          type, std::move(*layout),
                                                          std::move(blocks), block_bytes));
}

}  // namespace tessel::server
