// Compile and Execute: the compile cache's misses and evictions, and an
// execution planned, committed and launched; its steps' results.
#include "scheduler/plan_dot.h"
#include "server/coordinator.h"
#include "server/mpmd.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/trace.h"
#include "server/ids.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

// ---------------------------------------------------------------- compile

absl::StatusOr<v1::PlanDotResponse> Coordinator::PlanDot(const v1::PlanDotRequest& req) {
  TESSEL_ASSIGN_OR_RETURN(const ArrayRegistry::SessionView session,
                          arrays_.ViewSession(req.session_id()));
  std::shared_ptr<const CachedExecutable> entry =
      cache_.Lookup(session.tenant, req.executable_id());
  if (entry == nullptr) {
    return absl::NotFoundError(StrCat("executable ", req.executable_id(),
                                      " is not in this tenant's compile cache (never compiled, "
                                      "evicted, or an MPMD program, which has no single plan)"));
  }
  v1::PlanDotResponse resp;
  resp.set_dot(scheduler::PlanDot(entry->compiled));
  return resp;
}

absl::StatusOr<v1::CompileResponse> Coordinator::Compile(const v1::CompileRequest& req) {
  if (IsMpmd(req.graph())) return CompileMpmd(req);
  const std::vector<int> donated(req.donated_parameters().begin(), req.donated_parameters().end());
  scheduler::CompileOptions options{.donated_parameters = donated};
  if (req.has_mesh()) {
    auto mesh = NormalizeMesh(req.mesh(), workers_.num_devices());
    if (!mesh.ok()) return Annotate(mesh.status(), StrCat("graph '", req.graph().name(), "': "));
    options.mesh = std::move(*mesh);
    options.parameter_shardings.assign(req.parameter_shardings().begin(),
                                       req.parameter_shardings().end());
    options.output_shardings.assign(req.output_shardings().begin(), req.output_shardings().end());
  } else if (req.parameter_shardings_size() > 0 || req.output_shardings_size() > 0) {
    return absl::InvalidArgumentError(
        StrCat("graph '", req.graph().name(), "': shardings need a mesh"));
  }
  v1::CompileResponse resp;
  trace::Span span("compile", "compile", "compile");
  if (span.active()) span.Detail(StrCat("'", req.graph().name(), "'"));
  TESSEL_ASSIGN_OR_RETURN(const ArrayRegistry::SessionView session,
                          arrays_.ViewSession(req.session_id()));
  const bool strict = req.strict_donation() || session.options.strict_donation();
  const bool forbid = session.options.forbid_compiles();
  options.owner = session.tenant;
  const std::string key = scheduler::ExecutableKey(req.graph(), options);
  const std::string& tenant = options.owner;
  std::shared_ptr<const CachedExecutable> entry = cache_.Lookup(tenant, key);
  if (entry != nullptr) {
    resp.set_cache_hit(true);
    log_->debug("session {}: compile of '{}' hit the cache ({})", req.session_id(),
                req.graph().name(), key);
  } else {
    resp.set_cache_miss_reason(cache_.ExplainMiss(tenant, req.graph(), donated, &options));
  }
  arrays_.CountCompile(req.session_id(), entry ? ArrayRegistry::CompileEvent::kCacheHit
                                               : ArrayRegistry::CompileEvent::kCacheMiss);
  if (entry == nullptr && forbid) {
    return absl::FailedPreconditionError(
        StrCat("session ", req.session_id(), " forbids new compiles, and graph '",
               req.graph().name(), "' is not in the compile cache: ", resp.cache_miss_reason()));
  }
  if (entry == nullptr) {
    options.strict_donation = strict;
    std::optional<trace::Span> planning;
    planning.emplace("compile", "partition, fuse and schedule", "compile");
    auto c = scheduler::Compile(req.graph(), options);
    planning.reset();
    if (!c.ok()) {
      log_->info("session {}: compile of '{}' failed: {}", req.session_id(), req.graph().name(),
                 c.status().ToString());
      return Annotate(c.status(), StrCat("graph '", req.graph().name(), "': "));
    }
    std::vector<std::string> evicted;
    entry = cache_.Insert(tenant, std::move(*c), req.graph(), options, TenantCacheBytes(tenant),
                          &evicted);
    UnloadEvicted(evicted);
    arrays_.CountCompile(req.session_id(), ArrayRegistry::CompileEvent::kCompiled);
    log_->info("session {}: compiled '{}' as {} ({})", req.session_id(), req.graph().name(), key,
               resp.cache_miss_reason());
  } else if (strict) {
    TESSEL_RETURN_IF_ERROR(scheduler::CheckStrictDonation(entry->compiled));
  }
  const scheduler::CompiledProgram* compiled = &entry->compiled;
  resp.set_executable_id(compiled->fingerprint);
  span.Text("executable", compiled->fingerprint);
  span.Text("cache", resp.cache_hit() ? "hit" : "miss");
  for (const auto& t : compiled->global_parameter_types) *resp.add_parameter_types() = t;
  for (const auto& t : compiled->global_output_types) *resp.add_output_types() = t;
  if (compiled->partitioned()) {
    *resp.mutable_mesh() = compiled->mesh;
    for (const auto& sh : compiled->parameter_shardings) *resp.add_parameter_shardings() = sh;
    for (const auto& sh : compiled->output_shardings) *resp.add_output_shardings() = sh;
    for (const scheduler::PlannedCollective& pc : compiled->collectives) {
      v1::CollectiveInfo* ci = resp.add_collectives();
      ci->set_value(pc.value);
      ci->set_op(OpName(pc.op));
      for (const std::string& a : pc.axes) ci->add_axes(a);
      ci->set_bytes_per_device(pc.bytes_per_device);
      ci->set_reason(pc.reason);
    }
  }
  resp.set_plan(compiled->plan_text);
  for (const auto& d : compiled->diagnostics) resp.add_diagnostics(d);
  resp.set_estimated_bytes(compiled->estimated_peak_bytes);
  for (const scheduler::AliasDecision& d : compiled->declared_aliases) {
    v1::Alias* a = resp.add_aliases();
    a->set_parameter(d.parameter);
    a->set_output(d.output);
    a->set_reason(d.reason);
  }
  return resp;
}

namespace {

// What an id neither compiled nor evicted here is told, and an id of another
// tenant's alike: nothing says it exists.
absl::Status NeverCompiled(const std::string& id) {
  return absl::NotFoundError(StrCat("executable '", id, "' was never compiled here"));
}

}  // namespace

void Coordinator::UnloadEvicted(const std::vector<std::string>& evicted) {
  for (const std::string& id : evicted) SendFrees(workers_.SequenceUnloads(id));
}

int64_t Coordinator::TenantCacheBytes(const std::string& tenant) const {
  const std::shared_ptr<const Tenants> t = tenants();
  if (int64_t own = t->LimitsOf(tenant).compile_cache_bytes; own > 0) return own;
  // An even share: no tenant's compiles can push out another's.
  return t->authenticating() ? cache_.max_bytes() / std::max<int64_t>(1, t->num_tenants()) : 0;
}

absl::StatusOr<std::shared_ptr<const CachedExecutable>> Coordinator::CompileEvicted(
    const std::string& session, const std::string& tenant, const std::string& id) {
  // Another tenant's executable is answered as one never compiled: nothing
  // says it exists.
  std::optional<ExecutableSource> source = cache_.EvictedSource(tenant, id);
  if (!source.has_value()) {
    if (cache_.WasEvicted(tenant, id)) {
      const int64_t bound = TenantCacheBytes(tenant);
      return absl::NotFoundError(StrCat(
          "executable '", id, "' was evicted from the compile cache (least recently used, over ",
          bound > 0 ? StrCat("tenant ", tenant, "'s ", bound >> 20)
                    : StrCat("its ", cache_.max_bytes() >> 20),
          " MiB), its graph too: compile it again"));
    }
    return NeverCompiled(id);
  }
  const std::string what = StrCat("executable '", id, "' of graph '", source->graph.name(), "'");
  TESSEL_ASSIGN_OR_RETURN(const ArrayRegistry::SessionView view, arrays_.ViewSession(session));
  arrays_.CountCompile(session, ArrayRegistry::CompileEvent::kCacheMiss);
  if (view.options.forbid_compiles()) {
    return absl::FailedPreconditionError(
        StrCat("session ", session, " forbids new compiles, and ", what,
               " was evicted from the compile cache (least "
               "recently used, over its bound): running it compiles it again"));
  }
  auto c = scheduler::Compile(source->graph, source->options);
  if (!c.ok()) return Annotate(c.status(), StrCat(what, ", compiled again after its eviction: "));
  std::vector<std::string> evicted;
  std::shared_ptr<const CachedExecutable> exe =
      cache_.Insert(tenant, std::move(*c), std::move(source->graph), std::move(source->options),
                    TenantCacheBytes(tenant), &evicted);
  UnloadEvicted(evicted);
  arrays_.CountCompile(session, ArrayRegistry::CompileEvent::kCompiled);
  log_->info("session {}: compiled {} again: it was evicted from the compile cache", session, what);
  return exe;
}

// ---------------------------------------------------------------- execute

// One device's step of an accepted execution, with its worker.
struct Coordinator::ExecuteLaunch {
  PlannedStep step;
  std::shared_ptr<WorkerClient> client;  // null: its worker died since the plan was made
  bool needs_load = false;
  uint64_t load_generation = 0;
};

// An execution the arrays took (CommitExecuteLocked): what is sent for it.
struct Coordinator::AcceptedExecution {
  int64_t execution_id = 0;
  int64_t epoch = 0;  // the collective epoch its steps run under
  v1::ExecuteResponse response;
  std::vector<DeviceRoute> routes;
  std::vector<ExecuteLaunch> launches;
  std::vector<PendingFree> early_frees;  // donated copies on devices the step does not run on
  std::vector<PlannedMove> moves;
  // Partitioned: the program with its workers' addresses, for the loads.
  std::shared_ptr<v1::Program> loaded_program;
};

absl::StatusOr<v1::ExecuteResponse> Coordinator::Execute(const v1::ExecuteRequest& req) {
  if (req.release_size() > 0) Release(req.session_id(), req.release());
  // Whoever's it is: the session's tenant is checked when planning, under
  // the lock that reads the session anyway (the common path takes it once).
  std::shared_ptr<const CachedExecutable> exe = cache_.FindAnyTenant(req.executable_id());
  if (exe == nullptr) {
    TESSEL_ASSIGN_OR_RETURN(const ArrayRegistry::SessionView session,
                            arrays_.ViewSession(req.session_id()));
    const std::string& tenant = session.tenant;
    if (auto mpmd = FindMpmd(tenant, req.executable_id())) return ExecuteMpmd(req, *mpmd);
    TESSEL_ASSIGN_OR_RETURN(exe, CompileEvicted(req.session_id(), tenant, req.executable_id()));
  }
  AcceptedExecution run;
  trace::Span span("dispatch", "dispatch", "dispatch");
  {
    // Checking the arguments, retiring the donated ones, registering the
    // outputs and numbering the steps are one change to the arrays.
    ArrayRegistry::Transaction t(arrays_);
    run.routes = workers_.Routes();
    TESSEL_ASSIGN_OR_RETURN(ExecutePlan plan, PlanExecuteLocked(req, *exe, run.routes));
    CommitExecuteLocked(req, *exe, std::move(plan), run);
  }
  span.Arg("execution", run.execution_id);
  LaunchExecute(req, *exe, run);
  if (req.wait())
    TESSEL_RETURN_IF_ERROR(
        AwaitAll(req.session_id(), req.outputs(), StrCat("execution ", run.execution_id)));
  return std::move(run.response);
}

absl::StatusOr<ExecutePlan> Coordinator::PlanExecuteLocked(const v1::ExecuteRequest& req,
                                                           const CachedExecutable& exe,
                                                           const std::vector<DeviceRoute>& routes) {
  const scheduler::CompiledProgram& c = exe.compiled;
  TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  const SessionRecord& session = arrays_.SessionLocked(req.session_id());
  if (exe.tenant != session.tenant) return NeverCompiled(req.executable_id());  // another tenant's
  ExecuteInput in;
  in.request = &req;
  in.executable = &exe;
  if (!c.partitioned()) {
    TESSEL_ASSIGN_OR_RETURN(in.placement, ResolvePlacement(routes, req.placement()));
  }
  if (req.arguments_size() == int(c.parameter_types.size())) {
    for (int i = 0; i < req.arguments_size(); ++i) {
      auto a = arrays_.OwnedLocked(req.session_id(), req.arguments(i));
      if (!a.ok()) {
        return Annotate(a.status(),
                        StrCat("argument ", i, " '", c.program.parameters(i).name(), "': "));
      }
      in.arguments.push_back(*a);
    }
  }  // else PlanExecute names the arity mismatch
  in.routes = &routes;
  in.strict_donation = req.strict_donation() || session.options.strict_donation();
  in.handle_in_use = [&](uint64_t h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock()) {
    return arrays_.ContainsLocked(h);
  };
  in.fresh_handle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(arrays_.lock()) {
    return FreshHandleLocked();
  };
  TESSEL_ASSIGN_OR_RETURN(ExecutePlan plan, PlanExecute(in));
  for (const PlannedMove& m : plan.moves) {
    TESSEL_RETURN_IF_ERROR(GuardTransferLocked(req.session_id(), req.transfer_guard(),
                                               Direction::kDeviceToDevice, true, m.what,
                                               ByteSizeUnchecked(m.type)));
  }
  TESSEL_RETURN_IF_ERROR(arrays_.CheckQuotaLocked(req.session_id(),
                                                  plan.output_bytes - plan.donated_bytes,
                                                  StrCat("execution of '", exe.graph.name(), "'")));
  return plan;
}

void Coordinator::CommitExecuteLocked(const v1::ExecuteRequest& req, const CachedExecutable& exe,
                                      ExecutePlan plan, AcceptedExecution& run) {
  // Accepted: from here on nothing fails.
  const scheduler::CompiledProgram& c = exe.compiled;
  const std::string& exe_name = exe.graph.name();
  run.execution_id = ++next_execution_;
  run.epoch = collective_epoch_.load();
  run.response.set_execution_id(run.execution_id);
  for (const scheduler::AliasDecision& d : plan.aliases) {
    v1::DonationReceipt* r = run.response.add_donations();
    r->set_argument(d.parameter);
    r->set_handle(req.arguments(d.parameter));
    r->set_reused(d.output >= 0);
    r->set_output(d.output);
    if (d.output >= 0) r->set_output_handle(req.outputs(d.output));
    r->set_reason(d.reason);
  }
  // Donated arrays are gone from now on; copies on devices the step does
  // not run on are freed in order after what reads them there.
  ArrayRegistry::ExecutionChanges changes{
      .execution = run.execution_id, .executable = exe_name, .devices = plan.devices};
  for (int i : plan.donated) changes.donated.push_back(req.arguments(i));
  for (int i = 0; i < req.outputs_size(); ++i)
    changes.outputs.emplace_back(req.outputs(i), std::move(plan.outputs[i]));
  absl::flat_hash_map<int, v1::FreeRequest> donated_elsewhere =
      arrays_.CommitExecutionLocked(req.session_id(), std::move(changes));
  if (!donated_elsewhere.empty())
    run.early_frees = workers_.SequenceFrees(std::move(donated_elsewhere));
  // Every device's step (and the free of its moved copies) is numbered at
  // once: no other step interleaves with this one on any of its devices.
  std::vector<int> counts;
  for (const PlannedStep& st : plan.steps) counts.push_back(st.free_after ? 2 : 1);
  std::vector<QueueSlot> slots = workers_.Reserve(plan.devices, counts, &req.executable_id());
  for (size_t pos = 0; pos < plan.steps.size(); ++pos) {
    PlannedStep& st = plan.steps[pos];
    QueueSlot& slot = slots[pos];
    ExecuteLaunch launch;
    launch.client = std::move(slot.client);
    launch.needs_load = slot.needs_load;
    launch.load_generation = slot.load_generation;
    if (c.partitioned() && launch.needs_load && !run.loaded_program) {
      // Workers find their peers for collectives by address.
      run.loaded_program = std::make_shared<v1::Program>(c.program);
      for (int md : c.mesh.devices())
        run.loaded_program->add_device_workers(run.routes[md].address);
    }
    st.run.set_device(slot.local_index);
    st.run.set_seq(slot.first_seq);
    st.run.set_queue_epoch(slot.queue_epoch);
    st.run.set_execution_id(run.execution_id);
    if (c.partitioned()) st.run.set_collective_epoch(CollectiveEpoch(run.epoch));
    if (st.free_after) {
      st.free_after->set_device(slot.local_index);
      st.free_after->set_seq(slot.first_seq + 1);
      st.free_after->set_queue_epoch(slot.queue_epoch);
    }
    launch.step = std::move(st);
    run.launches.push_back(std::move(launch));
  }
  run.moves = std::move(plan.moves);
}

void Coordinator::LaunchExecute(const v1::ExecuteRequest& req, const CachedExecutable& exe,
                                AcceptedExecution& run) {
  const int64_t execution_id = run.execution_id, epoch = run.epoch;
  const std::vector<uint64_t> outputs(req.outputs().begin(), req.outputs().end());
  SendFrees(std::move(run.early_frees));
  // Implicit moves (the guard allowed them) land before the step is sent;
  // the step reads the moved copies, freed right after it on their device.
  for (const PlannedMove& m : run.moves) {
    absl::Status s =
        RunMove(req.session_id(), m, run.routes[m.from_device], run.routes[m.to_device]);
    if (!s.ok()) log_->warn("execution {}: {}", execution_id, s.ToString());
  }
  if (log_->should_log(spdlog::level::debug)) {
    std::vector<int> on;
    for (const ExecuteLaunch& l : run.launches) on.push_back(l.step.device);
    log_->debug(
        "session {}: execution {} of '{}' ({}) on devices [{}], {} arguments, {} outputs, {} moves",
        req.session_id(), execution_id, exe.graph.name(), req.executable_id(),
        absl::StrJoin(on, ","), req.arguments_size(), outputs.size(), run.moves.size());
  }
  // The step still runs when an argument failed upstream: it consumes the
  // donated buffers and marks its outputs with the error on the workers.
  for (ExecuteLaunch& launch : run.launches) {
    const int device = launch.step.device;
    if (launch.client == nullptr) {
      OnStepDone(req.session_id(), outputs, epoch,
                 absl::UnavailableError(StrCat("execution ", execution_id, " on device ", device,
                                               ": its worker died before the step was sent")));
      continue;
    }
    absl::Status load;
    if (launch.needs_load) {
      HeldSteps::Release();  // what this thread holds need not wait for the load
      load = launch.client->LoadProgram(
          run.loaded_program ? *run.loaded_program : exe.compiled.program, launch.load_generation);
      if (!load.ok()) {
        // The sequence number must still be consumed: the step is sent and
        // fails on the worker, and its outputs carry the load's error rather
        // than the worker's "not loaded". The next step tries the load again.
        log_->error("execution {}: loading {} failed: {}", execution_id, req.executable_id(),
                    load.ToString());
        workers_.ForgetLoaded(launch.client.get(), req.executable_id());
      }
    }
    StepSent(device);
    launch.client->Run(launch.step.run, [this, session = req.session_id(), outputs, epoch,
                                         execution_id, device, load = std::move(load),
                                         sent = absl::Now()](absl::StatusOr<v1::RunResponse> r) {
      if (!load.ok()) r = load;
      const absl::Duration latency = absl::Now() - sent;
      StepAnswered(device, latency, r.ok());
      if (options_.on_step_done) options_.on_step_done(device, latency, r.ok());
      // Workers speak of their local devices; users know the global ids.
      if (!r.ok()) {
        r = Annotate(r.status(), StrCat("execution ", execution_id, " on device ", device, ": "));
        absl::MutexLock l(&errors_mu_);
        if (recent_errors_.size() == kRecentErrors) recent_errors_.pop_front();
        recent_errors_.push_back({absl::Now(), device, execution_id, session,
                                  std::string(BoundedMessage(r.status().message()))});
      }
      OnStepDone(session, outputs, epoch, std::move(r));
    });
    if (launch.step.free_after) {
      launch.client->Free(*launch.step.free_after, [log = log_](absl::Status s) {
        if (!s.ok()) log->warn("free of moved arguments failed: {}", s.ToString());
      });
    }
  }
}

absl::Status Coordinator::RunMove(const std::string& session, const PlannedMove& m,
                                  const DeviceRoute& from, const DeviceRoute& to) {
  arrays_.AwaitNotPending({m.handle}, absl::InfiniteDuration());
  absl::Status s;
  int64_t moved = 0;
  trace::Span span("transfer", "move", "transfers");
  span.Arg("from_device", m.from_device);
  span.Arg("to_device", m.to_device);
  span.Text("path", "relayed by the coordinator");
  struct Moved {  // the bytes, whichever way the move ends
    trace::Span& span;
    const int64_t& bytes;
    ~Moved() { span.Arg("bytes", bytes); }
  } report{span, moved};
  if (from.client == nullptr || to.client == nullptr) {
    s = absl::UnavailableError("a worker is gone");
  } else {
    v1::PutShardRequest::Header h;
    h.set_buffer(m.temp_handle);
    *h.mutable_type() = m.type;
    h.add_devices(to.local_index);
    TESSEL_ASSIGN_OR_RETURN(auto put, to.client->BeginPut(h));
    v1::FetchShardRequest fr;
    fr.set_device(from.local_index);
    fr.set_buffer(m.handle);
    auto fetch = from.client->BeginFetch(fr);
    std::string chunk;
    while (s.ok() && fetch->Read(&chunk)) {
      moved += chunk.size();
      s = put->Write(chunk);
    }
    absl::Status fs = fetch->Finish();
    absl::Status ps = put->Finish();
    if (s.ok()) s = fs.ok() ? ps : fs;
  }
  if (!s.ok()) {
    return Annotate(s, StrFormat("moving array %#x from device %d to device %d: ", m.handle,
                                 m.from_device, m.to_device));
  }
  arrays_.CountTransfer(session, m.to_device, Direction::kDeviceToDevice, moved);
  return absl::OkStatus();
}

void Coordinator::MarkRejectedOutputs(const v1::ExecuteRequest& req, const absl::Status& error) {
  arrays_.AddFailed(req.session_id(), {req.outputs().begin(), req.outputs().end()},
                    Annotate(error, "the execution that was to make this array was rejected: "),
                    "rejected execution");
}

void Coordinator::OnStepDone(const std::string& session, const std::vector<uint64_t>& outputs,
                             int64_t epoch, absl::StatusOr<v1::RunResponse> result) {
  if (!result.ok() && result.status().GetPayload(kGroupBrokenPayload).has_value()) {
    int64_t expected = epoch;
    if (collective_epoch_.compare_exchange_strong(expected, epoch + 1)) {
      log_->warn("a collective group broke ({}); steps from now on meet in groups of epoch {}",
                 result.status().ToString(), CollectiveEpoch(epoch + 1));
    }
  }
  const absl::Status status = result.status();
  const std::vector<uint64_t> failed =
      arrays_.StepDone(session, outputs, status, result.ok() ? result->reused_size() : 0);
  for (uint64_t h : failed)
    log_->warn("session {}: array {:#x} failed: {}", session, h, status.ToString());
}

}  // namespace tessel::server
