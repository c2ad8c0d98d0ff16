#include "worker/worker_runtime.h"

#include <algorithm>

#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"
#include "core/trace.h"
#include "worker/collective_group.h"
#include "worker/collectives/group.h"
#include "worker/transfer.h"

namespace tessel::worker {

absl::StatusOr<std::unique_ptr<WorkerRuntime>> WorkerRuntime::Create(Options options) {
  if (options.devices.empty())
    return absl::InvalidArgumentError("a worker needs at least one device");
  if (!options.logger) return absl::InvalidArgumentError("WorkerRuntime needs a logger");
  return std::unique_ptr<WorkerRuntime>(new WorkerRuntime(std::move(options)));
}

WorkerRuntime::WorkerRuntime(Options options)
    : devices_(std::move(options.devices)),
      log_(std::move(options.logger)),
      collectives_(std::move(options.collectives)) {
  checkpoints_ = std::make_unique<CheckpointIO>(
      CheckpointIO::Options{.root = std::move(options.checkpoint_root),
                            .staging_bytes = options.checkpoint_staging_bytes,
                            .logger = log_});
  for (auto& d : devices_) {
    completions_.push_back(d->asynchronous()
                               ? std::make_unique<CompletionQueue>(d->name() + " completions")
                               : nullptr);
    queues_.push_back(std::make_unique<StepQueue>(d->name()));
  }
}

WorkerRuntime::~WorkerRuntime() {
  queues_.clear();
  completions_.clear();
  absl::flat_hash_map<std::string, std::unique_ptr<CompletionQueue>> lanes;
  std::vector<std::unique_ptr<CompletionQueue>> retired;
  {
    absl::MutexLock l(&mu_);
    lanes.swap(send_lanes_);
    retired.swap(retired_lanes_);
  }
  lanes.clear();  // each finishes its sends (or their peers' timeout) first
  retired.clear();
  checkpoints_.reset();  // writes out what it holds
}

namespace {

// A step's name in a trace: "run" (its program's id follows), or what else it runs.
const char* StepName(const v1::RunRequest& r) {
  if (r.has_transfer()) return "reshard";
  if (r.has_checkpoint())
    return r.checkpoint().restore() ? "checkpoint restore" : "checkpoint save";
  return "run";
}

// This device's part of a transfer (a reshard, an MPMD region's move, a
// detached send) as a span of the `transfers` track: what it moved, and
// with which devices. Left empty while tracing is off.
void BeginTransferSpan(std::optional<trace::Span>& span, const v1::RunRequest& r) {
  if (!trace::Enabled()) return;
  const TransferBytes b = BytesOf(r.transfer());
  const char* name = b.sent > 0 && b.received > 0 ? "exchange"
                     : b.sent > 0                 ? "send"
                     : b.received > 0             ? "receive"
                                                  : "copy";
  span.emplace("transfer", name, "transfers");
  if (!span->active()) return;
  const v1::Transfer& t = r.transfer();
  span->Detail(
      t.rank() >= 0 && t.rank() < t.rank_devices_size()
          ? absl::StrCat("device ", t.rank_devices(t.rank()))  // cluster-wide, as the peers
          : absl::StrCat("local device ", r.device()));
  span->Arg("execution", r.execution_id());
  span->Arg("bytes sent", b.sent);
  span->Arg("bytes received", b.received);
  span->Arg("bytes copied", b.copied);
  std::vector<int> peers;
  for (int i = 0; i < t.rank_devices_size(); ++i) {
    if (i != t.rank()) peers.push_back(t.rank_devices(i));
  }
  span->Text("peers", absl::StrJoin(peers, ","));
}

// "<incarnation>.<epoch>" of a collective epoch; epoch -1 when it is not one.
std::pair<std::string, int64_t> SplitEpoch(absl::string_view e) {
  const size_t dot = e.rfind('.');
  int64_t n = -1;
  if (dot == absl::string_view::npos || !absl::SimpleAtoi(e.substr(dot + 1), &n))
    return {std::string(e), -1};
  return {std::string(e.substr(0, dot)), n};
}

}  // namespace

void WorkerRuntime::QueueSend(const v1::RunRequest& r, std::function<void()> task) {
  const std::string group = TransferGroup(r).key;
  const std::string key = absl::StrCat(group, "#", r.transfer().rank());
  // Idle and out of reach (lanes are pushed to under the lock, found by
  // key): joined at once, outside the lock.
  std::vector<std::unique_ptr<CompletionQueue>> reaped;
  {
    absl::MutexLock l(&mu_);
    auto it = send_lanes_.find(key);
    if (it != send_lanes_.end()) return it->second->Push(std::move(task));
    // The same group's lane for this rank in an earlier epoch (the group
    // broke since) is retired: a rank's steps come in epoch order, so it
    // gets no more sends. It may still be waiting out its peers' timeout,
    // so it is joined only once idle, here or by the destructor.
    const auto [incarnation, epoch] = SplitEpoch(r.collective_epoch());
    const std::string devices = group.substr(0, group.rfind('@') + 1);
    const std::string rank = absl::StrCat("#", r.transfer().rank());
    for (auto old = send_lanes_.begin(); old != send_lanes_.end();) {
      const absl::string_view k = old->first;
      bool earlier = false;
      if (epoch >= 0 && absl::StartsWith(k, devices) && absl::EndsWith(k, rank)) {
        const auto [i, e] =
            SplitEpoch(k.substr(devices.size(), k.size() - devices.size() - rank.size()));
        earlier = i == incarnation && e >= 0 && e < epoch;
      }
      if (earlier) {
        retired_lanes_.push_back(std::move(old->second));
        send_lanes_.erase(old++);
      } else {
        ++old;
      }
    }
    for (auto& q : retired_lanes_) {
      if (q->idle()) reaped.push_back(std::move(q));
    }
    std::erase(retired_lanes_, nullptr);
    auto& made = send_lanes_[key];
    made = std::make_unique<CompletionQueue>(absl::StrCat("sends of ", key));
    made->Push(std::move(task));
  }
}

int WorkerRuntime::num_send_lanes() const {
  absl::MutexLock l(&mu_);
  return send_lanes_.size() + retired_lanes_.size();
}

absl::Status WorkerRuntime::CheckDevice(int device) const {
  if (device < 0 || device >= int(devices_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device, " out of range: this worker has ", devices_.size(), " devices"));
  }
  return absl::OkStatus();
}

absl::Status WorkerRuntime::LoadProgram(const v1::Program& program, uint64_t generation) {
  std::vector<size_t> missing;  // devices without it
  {
    absl::MutexLock l(&mu_);
    auto it = programs_.find(program.executable_id());
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (it == programs_.end() || it->second.on_device[d] == nullptr) missing.push_back(d);
    }
    if (missing.empty()) {
      it->second.generation =
          std::max(it->second.generation, generation);  // an older unload leaves it
      return absl::OkStatus();
    }
  }
  std::vector<std::shared_ptr<Executable>> loaded(devices_.size());
  for (size_t d : missing) {
    auto exe = devices_[d]->Load(program);
    if (!exe.ok())
      return Annotate(exe.status(), absl::StrCat("loading on ", devices_[d]->name(), ": "));
    loaded[d] = std::move(*exe);
  }
  absl::MutexLock l(&mu_);
  LoadedProgram& p = programs_[program.executable_id()];
  if (p.proto == nullptr) p.proto = std::make_shared<const v1::Program>(program);
  p.on_device.resize(devices_.size());
  for (size_t d : missing) {
    if (p.on_device[d] == nullptr) p.on_device[d] = std::move(loaded[d]);
  }
  p.generation = std::max(p.generation, generation);
  log_->info("loaded program {} ({} instructions, generation {})", program.executable_id(),
             program.instructions_size(), generation);
  return absl::OkStatus();
}

void WorkerRuntime::Unload(int device, const v1::ProgramUnload& unload) {
  std::shared_ptr<Executable> gone;
  {
    absl::MutexLock l(&mu_);
    auto it = programs_.find(unload.executable_id());
    if (it == programs_.end() || it->second.generation != unload.generation())
      return;  // loaded again since
    gone = std::move(it->second.on_device[device]);
    bool anywhere = false;
    for (const auto& e : it->second.on_device) anywhere |= e != nullptr;
    if (!anywhere) programs_.erase(it);
  }
  if (gone == nullptr) return;
  // An asynchronous device may still run the program's kernels.
  if (devices_[device]->asynchronous()) (void)devices_[device]->Fence()();
  log_->debug("dropped program {} from {}", unload.executable_id(), devices_[device]->name());
}

int64_t WorkerRuntime::ForgetPrograms() {
  absl::flat_hash_map<std::string, LoadedProgram> gone;  // released outside the lock
  absl::MutexLock l(&mu_);
  gone.swap(programs_);
  return gone.size();
}

int64_t WorkerRuntime::num_programs() const {
  absl::MutexLock l(&mu_);
  return programs_.size();
}

absl::StatusOr<v1::RunResponse> WorkerRuntime::RunStep(
    const v1::RunRequest& r, int* last_collective, const std::shared_ptr<Verdict>& verdict,
    std::vector<std::shared_ptr<const Verdict>>& inputs) {
  if (r.has_transfer()) return RunTransferStep(r, last_collective, verdict, inputs);
  if (r.has_checkpoint()) return RunCheckpointStep(r, verdict);
  std::shared_ptr<Executable> exe_held;  // held while the step runs: an unload may drop the program
  std::shared_ptr<const v1::Program> proto_held;
  Executable* exe = nullptr;
  const v1::Program* proto = nullptr;
  std::shared_ptr<CommunicatorRegistry> collectives;
  {
    absl::MutexLock l(&mu_);
    collectives = collectives_;
    auto it = programs_.find(r.executable_id());
    if (it == programs_.end() || it->second.on_device[r.device()] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("program ", r.executable_id(), " is not loaded"));
    }
    exe_held = it->second.on_device[r.device()];
    proto_held = it->second.proto;
  }
  exe = exe_held.get();
  proto = proto_held.get();
  if (r.arguments_size() != proto->parameters_size() || r.outputs_size() != proto->outputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("execution ", r.execution_id(), ": program takes ", proto->parameters_size(),
                     " arguments and gives ", proto->outputs_size(), " outputs; got ",
                     r.arguments_size(), " and ", r.outputs_size()));
  }
  std::vector<bool> donated(r.arguments_size(), false);
  for (int i : r.donated()) {
    if (i < 0 || i >= r.arguments_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("execution ", r.execution_id(), ": donated argument ", i, " out of range"));
    }
    donated[i] = true;
  }
  // Donated arrays are consumed whether or not the step succeeds.
  auto consume = [&] {
    for (int i = 0; i < r.arguments_size(); ++i) {
      if (donated[i]) store_.Erase(r.device(), r.arguments(i));
    }
  };
  std::vector<BufferPtr> args;
  for (int i = 0; i < r.arguments_size(); ++i) {
    auto a = store_.Get(r.device(), r.arguments(i));
    if (!a.ok()) {
      consume();
      return Annotate(a.status(), absl::StrCat("argument ", i, ": "));
    }
    if (!a->error.ok()) {
      consume();
      return DependentError(a->error, absl::StrCat("argument ", i));
    }
    const v1::TensorType& want = proto->parameters(i).type();
    if (!SameType(a->type, want)) {
      consume();
      return absl::InvalidArgumentError(absl::StrCat(
          "argument ", i, ": expected ", TypeString(want), ", got ", TypeString(a->type)));
    }
    if (a->verdict != nullptr) inputs.push_back(std::move(a->verdict));
    args.push_back(std::move(a->buffer));
  }
  consume();
  // A donated buffer may become an output's only if nothing but this step
  // holds it: no other handle (a pass-through or reshape shared it) and no
  // fetch in flight. Once out of the store, nobody can take a new reference.
  std::vector<BufferPtr> into(r.outputs_size());
  std::vector<std::pair<int, const Buffer*>> offered;  // argument, buffer
  for (const v1::RunAlias& al : r.aliases()) {
    if (al.argument() < 0 || al.argument() >= r.arguments_size() || !donated[al.argument()] ||
        al.output() < 0 || al.output() >= r.outputs_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("execution ", r.execution_id(), ": alias of argument ", al.argument(),
                       " to output ", al.output(), " is out of range"));
    }
    if (args[al.argument()].use_count() == 1 && !into[al.output()]) {
      into[al.output()] = args[al.argument()];
      offered.emplace_back(al.argument(), args[al.argument()].get());
    }
  }
  // Pass-throughs keep their buffer whatever holds it.
  for (const v1::RunAlias& al : r.aliases()) {
    if (!into[al.output()]) offered.emplace_back(al.argument(), args[al.argument()].get());
  }
  worker::StepContext ctx{.mesh_position = r.mesh_position(),
                          .collectives = collectives.get(),
                          .execution_id = r.execution_id(),
                          .collective_epoch = r.collective_epoch(),
                          .last_collective = last_collective};
  if (proto->has_mesh() &&
      (r.mesh_position() < 0 || r.mesh_position() >= proto->mesh().devices_size())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "execution ", r.execution_id(), ": mesh position ", r.mesh_position(), " out of range"));
  }
  TESSEL_ASSIGN_OR_RETURN(std::vector<BufferPtr> outs, exe->Run(args, into, ctx));
  into.clear();
  args.clear();
  v1::RunResponse resp;
  for (const v1::RunAlias& al : r.aliases()) {
    for (const auto& [arg, buf] : offered) {
      if (arg == al.argument() && outs[al.output()].get() == buf) {
        resp.add_reused(arg);
        break;
      }
    }
  }
  for (int i = 0; i < r.outputs_size(); ++i) {
    TESSEL_RETURN_IF_ERROR(
        store_.Insert(r.device(), r.outputs(i),
                      StoredArray{std::move(outs[i]), proto->output_types(i), {}, verdict}));
  }
  ++steps_run_;
  return resp;
}

absl::StatusOr<v1::RunResponse> WorkerRuntime::RunTransferStep(
    const v1::RunRequest& r, int* last_round, const std::shared_ptr<Verdict>& verdict,
    std::vector<std::shared_ptr<const Verdict>>& inputs) {
  std::shared_ptr<CommunicatorRegistry> collectives;
  {
    absl::MutexLock l(&mu_);
    collectives = collectives_;
  }
  BufferPtr source;
  if (r.arguments_size() == 1) {
    auto a = store_.Get(r.device(), r.arguments(0));
    if (!a.ok())
      return Annotate(a.status(),
                      absl::StrCat("execution ", r.execution_id(), " (reshard): source: "));
    if (!a->error.ok())
      return DependentError(a->error, absl::StrCat("execution ", r.execution_id(), ": the source"));
    if (a->verdict != nullptr) inputs.push_back(std::move(a->verdict));
    source = std::move(a->buffer);
  }
  if (IsDetachedSend(r)) {
    Device& device = *devices_[r.device()];
    TESSEL_RETURN_IF_ERROR(CheckTransfer(r, device, source));
    if (collectives == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "execution ", r.execution_id(), " (reshard): this worker has no collectives configured"));
    }
    // The lane holds the source until it has been sent: a later free or
    // donation of the array leaves these bytes alone.
    QueueSend(
        r, [this, r, &device, source = std::move(source), collectives = std::move(collectives)] {
          int last = -1;
          std::optional<trace::Span> span;
          BeginTransferSpan(span, r);
          absl::StatusOr<BufferPtr> sent = RunTransfer(r, device, source, collectives.get(), &last);
          if (sent.ok()) return;
          log_->warn("execution {} on device {}: its sends failed: {}", r.execution_id(),
                     r.device(), sent.status().ToString());
          AbandonTransfer(r, collectives.get(), last, sent.status());
        });
    *last_round = r.transfer().rounds() - 1;  // the lane answers for every round now
    ++steps_run_;
    return v1::RunResponse();
  }
  std::optional<trace::Span> span;
  BeginTransferSpan(span, r);
  TESSEL_ASSIGN_OR_RETURN(BufferPtr target, RunTransfer(r, *devices_[r.device()], source,
                                                        collectives.get(), last_round));
  span.reset();
  source.reset();
  if (r.outputs_size() == 1) {
    TESSEL_RETURN_IF_ERROR(
        store_.Insert(r.device(), r.outputs(0),
                      StoredArray{std::move(target), r.transfer().target_block(), {}, verdict}));
  }
  ++steps_run_;
  return v1::RunResponse();
}

absl::StatusOr<v1::RunResponse> WorkerRuntime::RunCheckpointStep(
    const v1::RunRequest& r, const std::shared_ptr<Verdict>& verdict) {
  const v1::CheckpointChunk& c = r.checkpoint();
  Device& device = *devices_[r.device()];
  if (!c.restore()) {
    if (r.arguments_size() != 1 || r.outputs_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "execution ", r.execution_id(), ": a checkpoint save takes one array and makes none"));
    }
    const std::string what = absl::StrCat("checkpoint save of array ", c.array_dir());
    auto a = store_.Get(r.device(), r.arguments(0));
    if (!a.ok()) return Annotate(a.status(), absl::StrCat(what, ": "));
    if (!a->error.ok()) return DependentError(a->error, what);
    if (a->verdict != nullptr) {
      // The snapshot reads the bytes now: the step that made them must be done.
      TESSEL_RETURN_IF_ERROR(a->verdict->Wait());
    }
    TESSEL_RETURN_IF_ERROR(checkpoints_->WriteChunk(c, device, std::move(a->buffer)));
    ++steps_run_;
    return v1::RunResponse();
  }
  if (r.arguments_size() != 0 || r.outputs_size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "execution ", r.execution_id(), ": a checkpoint restore makes one array and takes none"));
  }
  v1::TensorType block;
  block.set_dtype(c.global().dtype());
  for (int64_t n : c.block().sizes()) block.add_dims(n);
  TESSEL_ASSIGN_OR_RETURN(BufferPtr out, checkpoints_->ReadBlock(c, device, block));
  TESSEL_RETURN_IF_ERROR(
      store_.Insert(r.device(), r.outputs(0), StoredArray{std::move(out), block, {}, verdict}));
  ++steps_run_;
  return v1::RunResponse();
}

void WorkerRuntime::Run(v1::RunRequest request_in, RunDone done) {
  if (auto s = CheckDevice(request_in.device()); !s.ok()) return done(s);
  // One copy of the request, shared by the closures below (a step's
  // request is read by its work, its failure and its abandon).
  auto shared = std::make_shared<const v1::RunRequest>(std::move(request_in));
  const v1::RunRequest& request = *shared;
  // `last_collective`: the step's collectives after it are abandoned; none
  // when every one was already agreed with the peers.
  auto fail = [this, shared](const absl::Status& s, std::optional<int> last_collective) {
    const v1::RunRequest& request = *shared;
    log_->warn("execution {} on device {} failed: {}", request.execution_id(), request.device(),
               s.ToString());
    if (last_collective.has_value()) AbandonRest(request, *last_collective, s);
    // The outputs carry the error to whoever reads them.
    for (uint64_t h : request.outputs()) {
      store_.Erase(request.device(), h);
      (void)store_.Insert(request.device(), h, StoredArray{nullptr, {}, s});
    }
  };
  const int64_t queued_ns = trace::Enabled() ? trace::NowNs() : 0;
  auto work = [this, shared, done, fail, queued_ns] {
    const v1::RunRequest& request = *shared;
    trace::SetThreadDevice(request.device());
    trace::Span span("step", StepName(request));
    if (span.active()) {
      span.Detail(request.executable_id());
      span.Arg("execution", request.execution_id());
      span.Arg("seq", int64_t(request.seq()));
      if (queued_ns > 0) span.Arg("queued_us", (trace::NowNs() - queued_ns) / 1000);
    }
    int last_collective = -1;
    const bool timed =
        log_->should_log(spdlog::level::debug);  // a clock read per step only when logged
    const absl::Time start = timed ? absl::Now() : absl::InfinitePast();
    CompletionQueue* completions = completions_[request.device()].get();
    // On an asynchronous device the outputs are stored before the work is
    // known to have run: readers wait on this verdict.
    auto verdict = completions != nullptr ? std::make_shared<Verdict>() : nullptr;
    std::vector<std::shared_ptr<const Verdict>> inputs;
    absl::StatusOr<v1::RunResponse> result = RunStep(request, &last_collective, verdict, inputs);
    if (timed) {
      log_->debug("device {}: step {} (execution {}, {}) ran in {} us{}", request.device(),
                  request.seq(), request.execution_id(), request.executable_id(),
                  absl::ToInt64Microseconds(absl::Now() - start), result.ok() ? "" : ", failed");
    }
    if (!result.ok()) fail(result.status(), last_collective);
    if (span.active()) {
      if (!result.ok()) span.Text("error", result.status().message());
      trace::Counter("memory in use (bytes)", request.device(),
                     double(devices_[request.device()]->memory_stats().bytes_in_use));
    }
    if (completions == nullptr) return done(std::move(result));
    // The step's kernels may still be running: it is reported once they
    // have finished, and fails if they did, or if a step whose outputs it
    // read did (its kernels read what that step left). Reports stay in
    // step order.
    std::function<absl::Status()> wait =
        result.ok() ? devices_[request.device()]->Fence() : [] { return absl::OkStatus(); };
    completions->Push([shared, done, fail, verdict, inputs = std::move(inputs),
                       wait = std::move(wait), result = std::move(result)]() mutable {
      const v1::RunRequest& request = *shared;
      absl::Status s = wait();
      if (!s.ok()) {
        // Annotate keeps the payloads: a broken NCCL group moves the cluster to a new epoch.
        s = Annotate(s,
                     absl::StrCat("execution ", request.execution_id(), ": its kernels failed: "));
      }
      for (const auto& input : inputs) {
        if (!s.ok()) break;
        if (absl::Status v = input->Wait(); !v.ok()) {
          s = DependentError(v,
                             absl::StrCat("execution ", request.execution_id(), ": an argument"));
        }
      }
      if (!s.ok()) {
        fail(s, std::nullopt);  // Run returned: each of its collectives was agreed (queued) already
        result = s;
      }
      verdict->Set(result.status());
      done(std::move(result));
    });
  };
  queues_[request.device()]->Submit(request.queue_epoch(), request.seq(), std::move(work),
                                    [this, done, shared](absl::Status why) {
                                      // Peers waiting in its collectives learn at once.
                                      AbandonRest(*shared, -1, why);
                                      done(std::move(why));
                                    });
}

void WorkerRuntime::AbandonRest(const v1::RunRequest& r, int last_collective,
                                const absl::Status& cause) {
  std::shared_ptr<CommunicatorRegistry> collectives;
  std::shared_ptr<const v1::Program> proto_held;
  const v1::Program* proto = nullptr;
  {
    absl::MutexLock l(&mu_);
    collectives = collectives_;
    auto it = programs_.find(r.executable_id());
    if (it != programs_.end()) proto_held = it->second.proto;
  }
  proto = proto_held.get();
  if (r.has_transfer()) {
    const int device =
        r.transfer().rank() >= 0 && r.transfer().rank() < r.transfer().rank_devices_size()
            ? r.transfer().rank_devices(r.transfer().rank())
            : -1;
    absl::Status why = Annotate(cause, absl::StrCat("device ", device, ": "));
    if (!IsDetachedSend(r)) return AbandonTransfer(r, collectives.get(), last_collective, why);
    // Behind the rank's sends in flight: one thread per rank in a group.
    QueueSend(r, [r, collectives, last_collective, why = std::move(why)] {
      AbandonTransfer(r, collectives.get(), last_collective, why);
    });
    return;
  }
  if (proto == nullptr || collectives == nullptr || !proto->has_mesh()) return;
  if (r.mesh_position() < 0 || r.mesh_position() >= proto->mesh().devices_size()) return;
  const worker::StepContext ctx{.mesh_position = r.mesh_position(),
                                .collectives = collectives.get(),
                                .execution_id = r.execution_id(),
                                .collective_epoch = r.collective_epoch(),
                                .last_collective = &last_collective};
  AbandonCollectives(
      *proto, ctx,
      Annotate(cause, absl::StrCat("device ", proto->mesh().devices(r.mesh_position()), ": ")));
}

void WorkerRuntime::Free(const v1::FreeRequest& request, Done done) {
  if (auto s = CheckDevice(request.device()); !s.ok()) return done(s);
  auto work = [this, request, done] {
    for (uint64_t h : request.buffers()) store_.Retire(request.device(), h);
    for (const v1::ProgramUnload& u : request.unload()) Unload(request.device(), u);
    done(absl::OkStatus());
  };
  queues_[request.device()]->Submit(request.queue_epoch(), request.seq(), std::move(work),
                                    [this, done, request](absl::Status why) {
                                      // Out of its epoch (not a reused number), the free still
                                      // happens: the coordinator has let go of those arrays.
                                      if (!absl::IsInvalidArgument(why)) {
                                        for (uint64_t h : request.buffers())
                                          store_.Retire(request.device(), h);
                                        for (const v1::ProgramUnload& u : request.unload()) {
                                          Unload(request.device(), u);
                                        }
                                      }
                                      done(std::move(why));
                                    });
}

namespace {

class PutWriterImpl final : public WorkerRuntime::PutWriter {
 public:
  PutWriterImpl(BufferStore* store, std::vector<std::pair<int, Device*>> devices,
                std::vector<BufferPtr> buffers, uint64_t handle, v1::TensorType type, int64_t bytes,
                bool granted)
      : store_(store),
        devices_(std::move(devices)),
        buffers_(std::move(buffers)),
        handle_(handle),
        type_(std::move(type)),
        bytes_(bytes),
        granted_(granted) {}

  absl::Status Write(const std::string& bytes) override {
    if (written_ + int64_t(bytes.size()) > bytes_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("put of array %#x (%s): expected %d bytes, got more (%d)", handle_,
                          TypeString(type_), bytes_, written_ + bytes.size()));
    }
    for (size_t i = 0; i < devices_.size(); ++i) {
      TESSEL_RETURN_IF_ERROR(
          devices_[i].second->CopyFromHost(*buffers_[i], written_, bytes.data(), bytes.size()));
    }
    written_ += bytes.size();
    return absl::OkStatus();
  }

  absl::Status Finish() override {
    if (written_ != bytes_) {
      return absl::InvalidArgumentError(
          absl::StrFormat("put of array %#x (%s): expected %d bytes, got %d (truncated stream)",
                          handle_, TypeString(type_), bytes_, written_));
    }
    for (size_t i = 0; i < devices_.size(); ++i) {
      StoredArray a{buffers_[i], type_, {}};
      absl::Status s = granted_ ? store_->InsertGranted(devices_[i].first, handle_, std::move(a))
                                : store_->Insert(devices_[i].first, handle_, std::move(a));
      if (!s.ok()) {
        for (size_t j = 0; j < i; ++j) store_->Erase(devices_[j].first, handle_);
        return s;
      }
    }
    return absl::OkStatus();
  }

 private:
  BufferStore* const store_;
  const std::vector<std::pair<int, Device*>> devices_;
  const std::vector<BufferPtr> buffers_;
  const uint64_t handle_;
  const v1::TensorType type_;
  const int64_t bytes_;
  const bool granted_;  // a client's write, under a grant the coordinator opened
  int64_t written_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerRuntime::PutWriter>> WorkerRuntime::BeginPut(
    const v1::PutShardRequest::Header& h, bool granted) {
  TESSEL_ASSIGN_OR_RETURN(int64_t bytes, ByteSize(h.type()));
  if (h.devices().empty()) return absl::InvalidArgumentError("put names no device");
  if (granted) {
    const absl::Time now = absl::Now();
    for (int d : h.devices()) {
      TESSEL_RETURN_IF_ERROR(CheckDevice(d));
      TESSEL_RETURN_IF_ERROR(store_.BeginGrantedWrite(d, h.buffer(), now));
    }
  }
  std::vector<std::pair<int, Device*>> devices;
  std::vector<BufferPtr> buffers;
  for (int d : h.devices()) {
    TESSEL_RETURN_IF_ERROR(CheckDevice(d));
    if (store_.Get(d, h.buffer()).ok()) {
      return absl::AlreadyExistsError(
          absl::StrFormat("array %#x already exists on device %d", h.buffer(), d));
    }
    TESSEL_ASSIGN_OR_RETURN(BufferPtr b, devices_[d]->Allocate(bytes));
    devices.emplace_back(d, devices_[d].get());
    buffers.push_back(std::move(b));
  }
  return std::unique_ptr<PutWriter>(new PutWriterImpl(
      &store_, std::move(devices), std::move(buffers), h.buffer(), h.type(), bytes, granted));
}

absl::Status WorkerRuntime::OpenWrites(const v1::OpenWritesRequest& request) {
  if (request.devices().empty()) return absl::InvalidArgumentError("OpenWrites names no device");
  for (int d : request.devices()) TESSEL_RETURN_IF_ERROR(CheckDevice(d));
  const absl::Time expiry = absl::FromUnixMillis(request.expiry_unix_ms());
  for (int d : request.devices()) store_.OpenWrite(d, request.buffer(), expiry);
  return absl::OkStatus();
}

absl::StatusOr<StoredArray> WorkerRuntime::GetForFetch(int device, uint64_t handle) const {
  TESSEL_RETURN_IF_ERROR(CheckDevice(device));
  TESSEL_ASSIGN_OR_RETURN(StoredArray a, store_.Get(device, handle));
  if (!a.error.ok()) return a.error;
  if (a.verdict != nullptr)
    TESSEL_RETURN_IF_ERROR(a.verdict->Wait());  // its step's work has finished
  return a;
}

void WorkerRuntime::StartQueueEpoch(uint64_t epoch) {
  for (auto& q : queues_) q->StartEpoch(epoch);
}

void WorkerRuntime::SetCollectives(std::shared_ptr<CommunicatorRegistry> collectives) {
  absl::MutexLock l(&mu_);
  collectives_ = std::move(collectives);
}

v1::WorkerStatsResponse WorkerRuntime::Stats(absl::Span<const uint64_t> sequenced,
                                             absl::Duration wait, bool with_buffers) const {
  const absl::Time deadline = absl::Now() + wait;
  for (size_t d = 0; d < sequenced.size() && d < queues_.size(); ++d) {
    queues_[d]->AwaitCompleted(sequenced[d],
                               std::max(deadline - absl::Now(), absl::ZeroDuration()));
  }
  v1::WorkerStatsResponse r;
  for (const auto& d : devices_) {
    MemoryStats m = d->memory_stats();
    v1::DeviceMemoryStats* s = r.add_devices();
    s->set_device(d->local_index());
    s->set_bytes_in_use(m.bytes_in_use);
    s->set_peak_bytes_in_use(m.peak_bytes_in_use);
    s->set_num_buffers(m.num_buffers);
    s->set_bytes_cached(m.bytes_cached);
    s->set_bytes_limit(m.bytes_limit);
    s->set_largest_free_block(m.largest_free_block);
  }
  r.set_steps_run(steps_run_);
  const CollectiveTimes& times = ProcessCollectiveTimes();
  r.set_collectives(times.rounds.load(std::memory_order_relaxed));
  r.set_collective_wait_ns(times.wait_ns.load(std::memory_order_relaxed));
  r.set_collective_data_ns(times.data_ns.load(std::memory_order_relaxed));
  if (with_buffers) {
    for (const BufferStore::Held& h : store_.List()) {
      v1::StoredBuffer* b = r.add_buffers();
      b->set_device(h.device);
      b->set_handle(h.handle);
      b->set_bytes(h.bytes);
    }
  }
  return r;
}

}  // namespace tessel::worker
