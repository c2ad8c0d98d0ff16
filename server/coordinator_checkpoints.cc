// Coordinator: checkpoints (docs/checkpoints.md). The workers that hold an
// array's blocks write them, one chunk per distinct block, as sequenced
// steps: a save sees every array as the steps before it left it, and a
// later step may donate it at once. The coordinator plans, writes the
// small metadata files through one worker, and commits; no array byte
// passes through it.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/random/random.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "core/zarr.h"
#include "server/block_layout.h"
#include "server/coordinator.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;
using v1::CheckpointFilesRequest;

namespace {

// A JSON string literal.
std::string Quote(absl::string_view s) { return StrCat("\"", absl::CEscape(s), "\""); }

std::string ProtoJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

// Where an array's blocks lie, as the manifest records it (a Placement).
v1::Placement PlacementOf(const ArrayRecord& a) {
  v1::Placement p;
  if (a.sharded) {
    *p.mutable_sharded()->mutable_mesh() = a.mesh;
    v1::Sharding* s = p.mutable_sharded()->mutable_sharding();
    *s = a.sharding;
    if (s->partial().empty()) s->clear_partial_kind();  // as the client wrote it
  } else {
    p.set_device(a.devices.empty() ? 0 : a.devices.front());
  }
  return p;
}

// The manifest's parsed "arrays" entry of `name`, or null.
const google::protobuf::Struct* ManifestArray(const google::protobuf::Struct& manifest,
                                              const std::string& name) {
  auto arrays = manifest.fields().find("arrays");
  if (arrays == manifest.fields().end()) return nullptr;
  const auto& f = arrays->second.struct_value().fields();
  auto it = f.find(name);
  return it == f.end() ? nullptr : &it->second.struct_value();
}

}  // namespace

absl::StatusOr<Coordinator::CheckpointFiles> Coordinator::CheckpointFilesWorker(
    absl::string_view what) const {
  for (const DeviceRoute& r : workers_.Routes()) {
    if (r.alive && r.client != nullptr) return CheckpointFiles{r.client, r.address};
  }
  return absl::UnavailableError(StrCat(what, ": no live worker"));
}

absl::StatusOr<v1::CheckpointFilesResponse> Coordinator::CallCheckpointFiles(
    const CheckpointFiles& w, const CheckpointFilesRequest& req) const {
  auto r = w.client->CheckpointFiles(req);
  if (!r.ok()) return Annotate(r.status(), StrCat("worker ", w.address, ": "));
  return r;
}

absl::StatusOr<google::protobuf::Struct> Coordinator::ReadManifest(const std::string& session,
                                                                   const std::string& path) {
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath("/", path));
  {
    absl::MutexLock l(&checkpoints_mu_);
    for (const auto& [id, s] : saving_) {
      if (s.path == path) {
        return absl::FailedPreconditionError(
            StrCat("checkpoint ", path, " is still being written (save ", id, ")"));
      }
    }
  }
  std::string tenant;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(session));
    tenant = arrays_.SessionLocked(session).tenant;
  }
  TESSEL_ASSIGN_OR_RETURN(CheckpointFiles w, CheckpointFilesWorker(StrCat("checkpoint ", path)));
  CheckpointFilesRequest req;
  req.set_action(CheckpointFilesRequest::READ);
  req.set_path(path);
  req.add_files()->set_name(kManifest);
  TESSEL_ASSIGN_OR_RETURN(v1::CheckpointFilesResponse files, CallCheckpointFiles(w, req));
  google::protobuf::Struct manifest;
  if (files.files_size() != 1 ||
      !google::protobuf::util::JsonStringToMessage(files.files(0).contents(), &manifest).ok()) {
    return absl::DataLossError(StrCat("checkpoint ", path, ": ", kManifest, " is not valid JSON"));
  }
  if (JsonText(manifest, "format") != "tessel.checkpoint") {
    return absl::InvalidArgumentError(
        StrCat(path, "/", kManifest, " is not a Tessel checkpoint's manifest"));
  }
  if (const std::string owner = JsonText(manifest, "tenant"); owner != tenant) {
    return absl::PermissionDeniedError(
        StrCat("checkpoint ", path, " belongs to another tenant than this session's"));
  }
  return manifest;
}

absl::Status Coordinator::RunCheckpointSteps(std::vector<std::pair<int, v1::RunRequest>> steps,
                                             absl::string_view what) {
  std::vector<SequencedStep> sequenced;
  {
    ArrayRegistry::Transaction l(arrays_);
    ReshardSteps all{.steps = std::move(steps)};
    sequenced = SequenceStepsLocked(all);
  }
  struct Barrier {
    absl::Mutex mu;
    int left = 0;
    absl::Status first;
    absl::Notification done;
  };
  auto barrier = std::make_shared<Barrier>();
  barrier->left = sequenced.size();
  if (sequenced.empty()) return absl::OkStatus();
  auto finish = [barrier](absl::Status s) {
    absl::MutexLock l(&barrier->mu);
    if (!s.ok() && barrier->first.ok()) barrier->first = std::move(s);
    if (--barrier->left == 0) barrier->done.Notify();
  };
  for (SequencedStep& s : sequenced) {
    if (s.client == nullptr) {
      finish(absl::UnavailableError(
          StrCat(what, ": device ", s.device, "'s worker died before the step was sent")));
      continue;
    }
    StepSent(s.device);
    s.client->Run(s.run, [this, finish, device = s.device, what = std::string(what),
                          sent = absl::Now()](absl::StatusOr<v1::RunResponse> r) {
      StepAnswered(device, absl::Now() - sent, r.ok());
      finish(r.ok() ? absl::OkStatus()
                    : Annotate(r.status(), StrCat(what, " on device ", device, ": ")));
    });
  }
  HeldSteps::Release();
  barrier->done.WaitForNotification();
  absl::MutexLock l(&barrier->mu);
  return barrier->first;
}

absl::StatusOr<v1::SaveCheckpointResponse> Coordinator::SaveCheckpoint(
    const v1::SaveCheckpointRequest& req) {
  const std::string& path = req.path();
  const std::string what = StrCat("save of checkpoint ", path);
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath("/", path));
  if (req.arrays().empty()) return absl::InvalidArgumentError(StrCat(what, ": no arrays"));
  absl::flat_hash_set<std::string> names;
  for (const v1::CheckpointArray& a : req.arrays()) {
    TESSEL_RETURN_IF_ERROR(CheckArrayName(a.name()));
    if (!names.insert(a.name()).second) {
      return absl::InvalidArgumentError(StrCat(what, ": array name '", a.name(), "' repeats"));
    }
  }
  for (const auto& [name, contents] : req.files()) {
    TESSEL_RETURN_IF_ERROR(CheckArrayName(absl::StrCat("f", name)));  // plain characters
    if (names.contains(name) || contents.size() > (1 << 20)) {
      return absl::InvalidArgumentError(
          StrCat(what, ": file '", name, "' is an array's name or over 1 MiB"));
    }
  }
  if (!req.metadata().empty()) {
    google::protobuf::Struct check;
    if (!google::protobuf::util::JsonStringToMessage(req.metadata(), &check).ok()) {
      return absl::InvalidArgumentError(StrCat(what, ": metadata is not a JSON object"));
    }
  }
  const uint64_t n = ++next_checkpoint_;
  const std::string id = StrFormat("%s-%d", incarnation_, n);
  // Unique across coordinators too: a restarted one never reuses a
  // directory a save cut short by the old one left behind.
  const std::string temp = StrFormat("%s.tessel-tmp-%s-%d", path, incarnation_, n);
  std::string tenant;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    tenant = arrays_.SessionLocked(req.session_id()).tenant;
  }
  {
    absl::MutexLock l(&checkpoints_mu_);
    for (const auto& [other, s] : saving_) {
      if (s.path == path) {
        return absl::FailedPreconditionError(
            StrCat(what, ": a save to the same path is in progress (save ", other, ")"));
      }
    }
    saving_[id] = SavingCheckpoint{req.session_id(), path, temp, {}, {}};
  }
  auto forget = [this, &id] {
    absl::MutexLock l(&checkpoints_mu_);
    saving_.erase(id);
  };
  // Every live worker must see the directory: the one that makes it, and
  // every other, which may write a chunk now or read one at a restore.
  absl::StatusOr<CheckpointFiles> files = CheckpointFilesWorker(what);
  if (!files.ok()) {
    forget();
    return files.status();
  }
  const std::string token = absl::StrFormat("%016x", absl::Uniform<uint64_t>(absl::BitGen()));
  auto abandon = [&] {
    CheckpointFilesRequest rm;
    rm.set_action(CheckpointFilesRequest::ABANDON);
    rm.set_path(temp);
    rm.set_checkpoint(id);
    absl::flat_hash_set<std::string> seen;
    for (const DeviceRoute& r : workers_.Routes()) {
      if (r.alive && r.client != nullptr && seen.insert(r.address).second) {
        (void)r.client->CheckpointFiles(rm);  // waits for its writes; the files worker removes
      }
    }
    forget();
  };
  {
    CheckpointFilesRequest prepare;
    prepare.set_action(CheckpointFilesRequest::PREPARE);
    prepare.set_path(temp);
    prepare.set_final_path(path);
    prepare.set_token(token);
    if (auto r = CallCheckpointFiles(*files, prepare); !r.ok()) {
      forget();
      return Annotate(r.status(), StrCat(what, ": "));
    }
    CheckpointFilesRequest probe;
    probe.set_action(CheckpointFilesRequest::PROBE);
    probe.set_path(temp);
    probe.set_token(token);
    absl::flat_hash_set<std::string> seen = {files->address};
    for (const DeviceRoute& r : workers_.Routes()) {
      if (!r.alive || r.client == nullptr || !seen.insert(r.address).second) continue;
      if (auto p = CallCheckpointFiles(CheckpointFiles{r.client, r.address}, probe); !p.ok()) {
        abandon();
        return Annotate(p.status(), StrCat(what, ": "));
      }
    }
  }

  // The plan: per array, each distinct block once, written by the holder
  // on the worker with the fewest bytes to write so far.
  v1::SaveCheckpointResponse resp;
  std::vector<std::pair<int, v1::RunRequest>> steps;
  std::string arrays_json;
  CheckpointFilesRequest meta;
  meta.set_action(CheckpointFilesRequest::WRITE);
  meta.set_path(temp);
  {
    auto* root = meta.add_files();
    root->set_name("zarr.json");
    root->set_contents(
        "{\n  \"zarr_format\": 3,\n  \"node_type\": \"group\",\n  \"attributes\": {}\n}\n");
  }
  absl::flat_hash_set<std::string> writers;
  absl::Status planned = [&]() -> absl::Status {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    const std::vector<DeviceRoute> routes = workers_.Routes();
    absl::flat_hash_map<std::string, int64_t> load;  // bytes per worker address
    const int64_t execution_id = ++next_execution_;
    for (const v1::CheckpointArray& ca : req.arrays()) {
      TESSEL_ASSIGN_OR_RETURN(const ArrayRecord* a,
                              arrays_.OwnedLocked(req.session_id(), ca.handle()));
      const std::string of = StrFormat("%s: array '%s' (%#x)", what, ca.name(), ca.handle());
      if (a->state == v1::LOST || a->state == v1::ERROR)
        return Annotate(a->error, StrCat(of, ": "));
      const BlockLayout layout = a->sharded ? BlockLayout(a->type, a->sharding, a->mesh)
                                            : BlockLayout::Whole(a->type, a->devices.size());
      const v1::TensorType& chunk_type = a->sharded ? a->block_type : a->type;
      const std::vector<int64_t> chunk(chunk_type.dims().begin(), chunk_type.dims().end());
      for (int b = 0; b < layout.num_blocks(); ++b) {
        int best = -1;
        for (int pos : layout.positions(b)) {
          const int d = a->devices[pos];
          if (d < 0 || d >= int(routes.size()) || !routes[d].alive) continue;
          if (best < 0 || load[routes[d].address] < load[routes[best].address]) best = d;
        }
        if (best < 0) {
          return absl::UnavailableError(
              StrCat(of, ": no live device holds its block ", b, " (every copy's worker is dead)"));
        }
        std::vector<int64_t> start, shape;
        layout.Box(b, a->type, &start, &shape);
        load[routes[best].address] += ByteSizeUnchecked(chunk_type);
        writers.insert(routes[best].address);
        v1::RunRequest run;
        run.set_execution_id(execution_id);
        run.add_arguments(ca.handle());
        v1::CheckpointChunk* c = run.mutable_checkpoint();
        c->set_path(temp);
        c->set_array_dir(ca.name());
        c->set_checkpoint(id);
        *c->mutable_global() = a->type;
        c->mutable_chunk_shape()->Add(chunk.begin(), chunk.end());
        c->mutable_block()->mutable_starts()->Add(start.begin(), start.end());
        c->mutable_block()->mutable_sizes()->Add(shape.begin(), shape.end());
        steps.emplace_back(best, std::move(run));
        resp.set_bytes(resp.bytes() + ByteSizeUnchecked(chunk_type));
      }
      auto* f = meta.add_files();
      f->set_name(StrCat(ca.name(), "/zarr.json"));
      f->set_contents(ZarrArrayJson(a->type, chunk));
      absl::StrAppend(&arrays_json, arrays_json.empty() ? "" : ",\n", "    ", Quote(ca.name()),
                      ": {\"dtype\": ", Quote(ZarrDType(a->type.dtype())), ", \"shape\": [",
                      absl::StrJoin(a->type.dims(), ", "), "], \"chunk_shape\": [",
                      absl::StrJoin(chunk, ", "), "], \"placement\": ", ProtoJson(PlacementOf(*a)),
                      "}");
    }
    return absl::OkStatus();
  }();
  if (!planned.ok()) {
    abandon();
    return planned;
  }
  for (const auto& [name, contents] : req.files()) {
    auto* f = meta.add_files();
    f->set_name(name);
    f->set_contents(contents);
  }
  auto* manifest = meta.add_files();
  manifest->set_name(kManifest);
  manifest->set_contents(
      StrCat("{\n  \"format\": \"tessel.checkpoint\",\n  \"version\": 1,\n",
             "  \"tenant\": ", Quote(tenant), ",\n  \"arrays\": {\n", arrays_json,
             "\n  },\n  \"metadata\": ", req.metadata().empty() ? "{}" : req.metadata(), "\n}\n"));
  resp.set_chunks(steps.size());
  if (absl::Status s = RunCheckpointSteps(std::move(steps), what); !s.ok()) {
    abandon();
    return s;
  }
  {
    absl::MutexLock l(&checkpoints_mu_);
    SavingCheckpoint& s = saving_[id];
    s.writers.assign(writers.begin(), writers.end());
    s.files_worker = files->address;
    s.metadata = std::move(meta);  // written at the commit, off the save's path
  }
  resp.set_checkpoint(id);
  for (const std::string& w : writers) resp.add_workers(w);
  log_->info("session {}: checkpoint {}: {} chunks, {} bytes, snapshotted (save {})",
             req.session_id(), path, resp.chunks(), resp.bytes(), id);
  return resp;
}

absl::StatusOr<v1::CommitCheckpointResponse> Coordinator::CommitCheckpoint(
    const v1::CommitCheckpointRequest& req) {
  SavingCheckpoint s;
  {
    absl::MutexLock l(&checkpoints_mu_);
    auto it = saving_.find(req.checkpoint());
    if (it == saving_.end() || it->second.session != req.session_id() ||
        it->second.files_worker.empty()) {
      return absl::NotFoundError(
          StrCat("no save ", req.checkpoint(), " of this session to commit"));
    }
    s = it->second;
  }
  const std::string what = StrCat("save of checkpoint ", s.path);
  // Each worker by address: its client from the routes.
  absl::flat_hash_map<std::string, std::shared_ptr<WorkerClient>> clients;
  for (const DeviceRoute& r : workers_.Routes()) {
    if (r.alive && r.client != nullptr) clients[r.address] = r.client;
  }
  v1::CommitCheckpointResponse resp;
  absl::Status failed;
  CheckpointFilesRequest finish;
  finish.set_action(req.abandon() ? CheckpointFilesRequest::ABANDON
                                  : CheckpointFilesRequest::FINISH);
  finish.set_path(s.temp);
  finish.set_checkpoint(req.checkpoint());
  for (const std::string& w : s.writers) {
    auto c = clients.find(w);
    if (c == clients.end()) {
      if (failed.ok())
        failed = absl::UnavailableError(StrCat(what, ": worker ", w, " died while it wrote"));
      continue;
    }
    auto r = CallCheckpointFiles(CheckpointFiles{c->second, w}, finish);
    if (!r.ok() && failed.ok()) failed = Annotate(r.status(), StrCat(what, ": "));
    if (r.ok()) resp.set_bytes_written(resp.bytes_written() + r->bytes_written());
  }
  auto files = clients.find(s.files_worker);
  if (failed.ok() && files == clients.end()) {
    failed = absl::UnavailableError(StrCat(what, ": worker ", s.files_worker, " died"));
  }
  if (failed.ok() && !req.abandon()) {
    if (auto r = CallCheckpointFiles(CheckpointFiles{files->second, s.files_worker}, s.metadata);
        !r.ok()) {
      failed = Annotate(r.status(), StrCat(what, ": "));
    }
  }
  if (failed.ok() && !req.abandon()) {
    CheckpointFilesRequest commit;
    commit.set_action(CheckpointFilesRequest::COMMIT);
    commit.set_path(s.temp);
    commit.set_final_path(s.path);
    if (auto r = CallCheckpointFiles(CheckpointFiles{files->second, s.files_worker}, commit);
        !r.ok()) {
      failed = Annotate(r.status(), StrCat(what, ": "));
    }
  }
  if (!failed.ok() || req.abandon()) {
    // Nothing half-written stays behind: the temporary directory goes.
    for (const auto& [address, client] : clients) {
      CheckpointFilesRequest rm;
      rm.set_action(CheckpointFilesRequest::ABANDON);
      rm.set_path(s.temp);
      rm.set_checkpoint(req.checkpoint());
      (void)client->CheckpointFiles(rm);
    }
  }
  {
    absl::MutexLock l(&checkpoints_mu_);
    saving_.erase(req.checkpoint());
  }
  if (!failed.ok()) return failed;
  if (req.abandon()) return resp;
  resp.set_path(s.path);
  log_->info("session {}: checkpoint {} committed, {} bytes written", req.session_id(), s.path,
             resp.bytes_written());
  return resp;
}

absl::StatusOr<v1::ReadCheckpointResponse> Coordinator::ReadCheckpoint(
    const v1::ReadCheckpointRequest& req) {
  TESSEL_ASSIGN_OR_RETURN(google::protobuf::Struct manifest,
                          ReadManifest(req.session_id(), req.path()));
  v1::ReadCheckpointResponse resp;
  resp.set_manifest(ProtoJson(manifest));
  return resp;
}

absl::StatusOr<v1::RestoreCheckpointResponse> Coordinator::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& req) {
  const std::string what = StrCat("restore of checkpoint ", req.path());
  TESSEL_ASSIGN_OR_RETURN(google::protobuf::Struct manifest,
                          ReadManifest(req.session_id(), req.path()));
  v1::RestoreCheckpointResponse resp;
  std::vector<ReshardSteps> all;
  std::vector<std::vector<SequencedStep>> sends;
  std::vector<uint64_t> outputs;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    std::vector<std::pair<uint64_t, ArrayRecord>> made;
    int64_t added = 0;
    for (const v1::CheckpointArray& ca : req.arrays()) {
      const std::string of = StrFormat("%s: array '%s'", what, ca.name());
      const google::protobuf::Struct* saved = ManifestArray(manifest, ca.name());
      if (saved == nullptr)
        return absl::NotFoundError(StrCat(of, ": the checkpoint has no such array"));
      const std::vector<int64_t> shape = JsonInts(*saved, "shape");
      const std::vector<int64_t> chunk = JsonInts(*saved, "chunk_shape");
      const std::string dtype = JsonText(*saved, "dtype");
      if (dtype != ZarrDType(ca.type().dtype()) ||
          shape != std::vector<int64_t>(ca.type().dims().begin(), ca.type().dims().end())) {
        return absl::InvalidArgumentError(
            StrCat(of, ": saved as ", dtype, "[", absl::StrJoin(shape, ","), "]; the target is ",
                   ZarrDType(ca.type().dtype()), "[", absl::StrJoin(ca.type().dims(), ","), "]"));
      }
      if (ca.handle() == 0 || arrays_.ContainsLocked(ca.handle())) {
        return absl::AlreadyExistsError(
            StrFormat("%s: handle %#x is 0 or in use", of, ca.handle()));
      }
      TESSEL_ASSIGN_OR_RETURN(ArrayRecord out, PlaceRecordLocked(ca.type(), ca.placement(), of));
      out.producer_name = "restore";
      const BlockLayout layout = out.sharded ? BlockLayout(out.type, out.sharding, out.mesh)
                                             : BlockLayout::Whole(out.type, out.devices.size());
      ReshardSteps steps{.session = req.session_id(), .what = of, .output = ca.handle()};
      for (int b = 0; b < layout.num_blocks(); ++b) {
        std::vector<int64_t> start, size;
        layout.Box(b, out.type, &start, &size);
        for (int pos : layout.positions(b)) {
          v1::RunRequest run;
          run.add_outputs(ca.handle());
          v1::CheckpointChunk* c = run.mutable_checkpoint();
          c->set_restore(true);
          c->set_path(req.path());
          c->set_array_dir(ca.name());
          *c->mutable_global() = ca.type();
          c->mutable_chunk_shape()->Add(chunk.begin(), chunk.end());
          c->mutable_block()->mutable_starts()->Add(start.begin(), start.end());
          c->mutable_block()->mutable_sizes()->Add(size.begin(), size.end());
          steps.steps.emplace_back(out.devices[pos], std::move(run));
        }
      }
      out.pending = steps.steps.size();
      added += out.bytes();
      resp.set_bytes(resp.bytes() + out.bytes());
      made.emplace_back(ca.handle(), std::move(out));
      all.push_back(std::move(steps));
    }
    TESSEL_RETURN_IF_ERROR(arrays_.CheckQuotaLocked(req.session_id(), added, what));
    // Accepted: from here on nothing fails.
    const int64_t execution_id = ++next_execution_;
    resp.set_execution_id(execution_id);
    for (auto& [handle, out] : made) {
      out.producer = execution_id;
      arrays_.AddLocked(req.session_id(), handle, std::move(out));
      outputs.push_back(handle);
    }
    // Sequenced under the lock: a delete of a restored array comes after its steps.
    for (ReshardSteps& steps : all) {
      steps.epoch = collective_epoch_.load();
      for (auto& [d, run] : steps.steps) run.set_execution_id(execution_id);
      sends.push_back(SequenceStepsLocked(steps));
    }
  }
  for (size_t i = 0; i < all.size(); ++i) SendSequenced(all[i], std::move(sends[i]));
  if (req.wait()) TESSEL_RETURN_IF_ERROR(AwaitAll(req.session_id(), outputs, what));
  return resp;
}

absl::StatusOr<v1::ListCheckpointsResponse> Coordinator::ListCheckpoints(
    const v1::ListCheckpointsRequest& req) {
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath("/", req.directory()));
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
  }
  TESSEL_ASSIGN_OR_RETURN(CheckpointFiles w,
                          CheckpointFilesWorker(StrCat("listing of ", req.directory())));
  CheckpointFilesRequest list;
  list.set_action(CheckpointFilesRequest::LIST);
  list.set_path(req.directory());
  TESSEL_ASSIGN_OR_RETURN(v1::CheckpointFilesResponse r, CallCheckpointFiles(w, list));
  v1::ListCheckpointsResponse resp;
  for (const v1::CheckpointEntry& e : r.listed()) {
    if (!e.directory()) continue;
    *(e.committed() ? resp.add_committed() : resp.add_uncommitted()) = e.name();
  }
  return resp;
}

absl::Status Coordinator::RemoveCheckpoint(const v1::RemoveCheckpointRequest& req) {
  TESSEL_RETURN_IF_ERROR(ReadManifest(req.session_id(), req.path()).status());
  TESSEL_ASSIGN_OR_RETURN(CheckpointFiles w,
                          CheckpointFilesWorker(StrCat("removal of ", req.path())));
  CheckpointFilesRequest rm;
  rm.set_action(CheckpointFilesRequest::REMOVE);
  rm.set_path(req.path());
  return CallCheckpointFiles(w, rm).status();
}

absl::Status Coordinator::HoldCheckpoints(const v1::HoldCheckpointsRequest& req) {
  TESSEL_RETURN_IF_ERROR(CheckCheckpointPath("/", req.directory()));
  std::string dir = req.directory();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  absl::flat_hash_set<std::string> live;
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    absl::MutexLock m(&checkpoints_mu_);
    auto it = held_.find(dir);
    if (req.release()) {
      if (it != held_.end() && it->second == req.session_id()) held_.erase(it);
      return absl::OkStatus();
    }
    if (it != held_.end() && it->second != req.session_id() &&
        arrays_.FindSessionLocked(it->second) != nullptr) {
      return absl::FailedPreconditionError(
          StrCat("checkpoint directory ", dir,
                 " already has a CheckpointManager (of another session); two would delete each "
                 "other's checkpoints"));
    }
    held_[dir] = req.session_id();
  }
  return absl::OkStatus();
}

}  // namespace tessel::server
