// MPMD programs: compile each mesh region as an executable of its own, and
// run an execution as those executions plus the moves between them.
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "server/coordinator.h"
#include "server/mpmd.h"
#include "server/reshard_planner.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

// Where an MPMD program's values are: as each part's executable takes and
// gives them, and where each parameter is first read.
struct MpmdLayouts {
  std::vector<std::vector<v1::Placement>> part_inputs, part_outputs;
  std::vector<std::vector<v1::TensorType>> part_output_types;
  std::vector<v1::Placement> parameter_placements;
};

struct Coordinator::MpmdProgram : MpmdLayouts {
  std::string name;
  MpmdSplit split;
  std::vector<std::string> part_ids;
};

namespace {

v1::Placement Sharded(const v1::Mesh& mesh, const v1::Sharding& s) {
  v1::Placement p;
  *p.mutable_sharded()->mutable_mesh() = mesh;
  *p.mutable_sharded()->mutable_sharding() = s;
  return p;
}

bool SamePlacement(const v1::Placement& a, const v1::Placement& b) {
  return a.has_sharded() && b.has_sharded() && SameMesh(a.sharded().mesh(), b.sharded().mesh()) &&
         SameSharding(a.sharded().sharding(), b.sharded().sharding());
}

ArrayRecord RecordOf(const v1::TensorType& type, const v1::Placement& p) {
  ArrayRecord r;
  r.type = type;
  r.sharded = true;
  r.mesh = p.sharded().mesh();
  r.sharding = p.sharded().sharding();
  r.block_type = LocalType(type, r.sharding, r.mesh);
  r.devices.assign(r.mesh.devices().begin(), r.mesh.devices().end());
  return r;
}

std::string Where(const v1::Placement& p) {
  return StrCat(ShardingString(p.sharded().sharding()), " on devices ",
                absl::StrJoin(p.sharded().mesh().devices(), ","));
}

uint64_t Fingerprint(absl::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// The moves every execution of the program makes, into `resp` and `plan`.
absl::Status PlanMpmdTransfers(const std::string& what, const MpmdSplit& split,
                               const MpmdLayouts& layouts, v1::CompileResponse& resp,
                               std::string& plan) {
  absl::StrAppend(&plan, "transfers (worker to worker, before the reader runs):\n");
  int transfers = 0;
  for (size_t q = 0; q < split.parts.size(); ++q) {
    for (size_t j = 0; j < split.parts[q].inputs.size(); ++j) {
      const MpmdRef r = split.parts[q].inputs[j];
      const v1::Placement& have = r.part < 0 ? layouts.parameter_placements[r.index]
                                             : layouts.part_outputs[r.part][r.index];
      const v1::Placement& want = layouts.part_inputs[q][j];
      if (SamePlacement(have, want)) continue;
      const v1::TensorType& type =
          r.part < 0 ? split.parameter_types[r.index] : layouts.part_output_types[r.part][r.index];
      auto moves = PlanReshard(RecordOf(type, have), RecordOf(type, want),
                               [](int) { return std::string(); });
      if (!moves.ok())
        return Annotate(moves.status(), StrCat(what, ": '", split.parts[q].input_names[j], "': "));
      v1::MpmdTransfer* t = resp.add_transfers();
      t->set_value(split.parts[q].input_names[j]);
      t->set_bytes(moves->bytes_moved);
      t->set_reason(StrCat(r.part < 0 ? StrCat("parameter '", split.parameter_names[r.index], "'")
                                      : StrCat("result ", r.index, " of part ", r.part, " '",
                                               split.parts[r.part].name, "'"),
                           ", made as ", Where(have), ", is read by part ", q, " '",
                           split.parts[q].name, "' as ", Where(want)));
      absl::StrAppend(&plan, "  %", t->value(), ": ", TypeString(type), ", ", t->bytes(),
                      " bytes cross devices: ", t->reason(), "\n");
      ++transfers;
    }
  }
  if (transfers == 0) absl::StrAppend(&plan, "  none\n");
  return absl::OkStatus();
}

}  // namespace

namespace {

// MPMD programs are kept by tenant and id: another tenant's id finds nothing.
std::string MpmdKey(const std::string& tenant, const std::string& id) {
  return StrCat(tenant, "\n", id);
}

}  // namespace

std::shared_ptr<const Coordinator::MpmdProgram> Coordinator::FindMpmd(const std::string& tenant,
                                                                      const std::string& id) const {
  const std::string key = MpmdKey(tenant, id);
  absl::MutexLock l(&mpmd_mu_);
  auto it = mpmd_.find(key);
  return it == mpmd_.end() ? nullptr : it->second;
}

absl::StatusOr<v1::CompileResponse> Coordinator::CompileMpmd(const v1::CompileRequest& req) {
  const std::string what = StrCat("MPMD graph '", req.graph().name(), "'");
  if (req.has_mesh() || req.parameter_shardings_size() > 0 || req.output_shardings_size() > 0) {
    return absl::InvalidArgumentError(
        StrCat(what,
               ": its mesh regions name their own meshes and shardings; "
               "compile it with none"));
  }
  if (req.donated_parameters_size() > 0) {
    return absl::InvalidArgumentError(
        StrCat(what, ": donation is not available in MPMD programs yet"));
  }
  TESSEL_ASSIGN_OR_RETURN(MpmdSplit split, SplitMpmd(req.graph()));
  auto program = std::make_shared<MpmdProgram>();
  program->name = req.graph().name();
  v1::CompileResponse resp;
  resp.set_cache_hit(true);
  std::string plan =
      StrCat("MPMD program '", req.graph().name(), "': ", split.parts.size(), " parts\n");
  std::string key;
  for (size_t q = 0; q < split.parts.size(); ++q) {
    const MpmdPart& part = split.parts[q];
    v1::CompileRequest sub;
    sub.set_session_id(req.session_id());
    *sub.mutable_graph() = part.graph;
    *sub.mutable_mesh() = part.mesh;
    for (const auto& s : part.in_shardings) *sub.add_parameter_shardings() = s;
    for (const auto& s : part.out_shardings) *sub.add_output_shardings() = s;
    sub.set_strict_donation(req.strict_donation());
    auto c = Compile(sub);
    if (!c.ok()) return Annotate(c.status(), StrCat(what, ": mesh region '", part.name, "': "));
    if (!c->cache_hit()) resp.set_cache_hit(false);
    program->part_ids.push_back(c->executable_id());
    absl::StrAppend(&key, c->executable_id(), ";");
    std::vector<v1::Placement> ins, outs;
    for (const auto& s : c->parameter_shardings()) ins.push_back(Sharded(c->mesh(), s));
    for (const auto& s : c->output_shardings()) outs.push_back(Sharded(c->mesh(), s));
    program->part_inputs.push_back(std::move(ins));
    program->part_outputs.push_back(std::move(outs));
    program->part_output_types.emplace_back(c->output_types().begin(), c->output_types().end());
    absl::StrAppend(&plan, "part ", q, " '", part.name, "' on ", MeshString(c->mesh()),
                    " (executable ", c->executable_id(), "):\n");
    for (absl::string_view line : absl::StrSplit(c->plan(), '\n')) {
      if (!line.empty()) absl::StrAppend(&plan, "  ", line, "\n");
    }
    for (const auto& d : c->diagnostics())
      resp.add_diagnostics(StrCat("mesh region '", part.name, "': ", d));
    resp.set_estimated_bytes(std::max(resp.estimated_bytes(), c->estimated_bytes()));
  }
  // Where each parameter is taken: where its first reader takes it.
  program->parameter_placements.resize(split.parameter_types.size());
  for (size_t q = 0; q < split.parts.size(); ++q) {
    for (size_t j = 0; j < split.parts[q].inputs.size(); ++j) {
      const MpmdRef r = split.parts[q].inputs[j];
      if (r.part < 0 && !program->parameter_placements[r.index].has_sharded()) {
        program->parameter_placements[r.index] = program->part_inputs[q][j];
      }
    }
  }
  for (size_t i = 0; i < split.parameter_types.size(); ++i) {
    if (!program->parameter_placements[i].has_sharded()) {
      return absl::InvalidArgumentError(StrCat(
          what, ": parameter ", i, " '", split.parameter_names[i], "' is read by no mesh region"));
    }
  }
  TESSEL_RETURN_IF_ERROR(PlanMpmdTransfers(what, split, *program, resp, plan));
  for (size_t i = 0; i < split.parameter_types.size(); ++i) {
    *resp.add_parameter_types() = split.parameter_types[i];
    *resp.add_parameter_placements() = program->parameter_placements[i];
  }
  for (const MpmdRef& r : split.outputs) {
    *resp.add_output_types() = program->part_output_types[r.part][r.index];
    *resp.add_output_placements() = program->part_outputs[r.part][r.index];
    absl::StrAppend(&key, r.part, ".", r.index, ";");
  }
  for (const MpmdPart& part : split.parts) {
    for (const MpmdRef& r : part.inputs) absl::StrAppend(&key, r.part, ".", r.index, ",");
    absl::StrAppend(&key, "|");
  }
  const std::string id = StrFormat("mpmd-%016x", Fingerprint(key));
  resp.set_executable_id(id);
  resp.set_plan(std::move(plan));
  program->split = std::move(split);
  std::string tenant;
  {
    ArrayRegistry::Transaction a(arrays_);
    if (const SessionRecord* sr = arrays_.FindSessionLocked(req.session_id())) tenant = sr->tenant;
  }
  {
    const std::string held = MpmdKey(tenant, id);
    absl::MutexLock l(&mpmd_mu_);
    if (mpmd_.try_emplace(held, std::move(program)).second) mpmd_order_.push_back(held);
    while (mpmd_order_.size() > kMaxMpmdPrograms) {  // its parts stay in the compile cache
      mpmd_.erase(mpmd_order_.front());
      mpmd_order_.pop_front();
    }
  }
  return resp;
}

absl::StatusOr<v1::ExecuteResponse> Coordinator::ExecuteMpmd(const v1::ExecuteRequest& req,
                                                             const MpmdProgram& p) {
  const std::string what = StrCat("execution of MPMD program '", p.name, "'");
  const MpmdSplit& split = p.split;
  if (req.donate_size() > 0) {
    return absl::InvalidArgumentError(
        StrCat(what, ": donation is not available in MPMD programs yet"));
  }
  if (req.arguments_size() != int(split.parameter_types.size()) ||
      req.outputs_size() != int(split.outputs.size())) {
    return absl::InvalidArgumentError(StrCat(what, ": it takes ", split.parameter_types.size(),
                                             " arguments and gives ", split.outputs.size(),
                                             " outputs; the request has ", req.arguments_size(),
                                             " and ", req.outputs_size()));
  }
  // Where each argument lies now.
  std::vector<v1::Placement> args(req.arguments_size());
  {
    ArrayRegistry::Transaction l(arrays_);
    TESSEL_RETURN_IF_ERROR(arrays_.CheckSessionLocked(req.session_id()));
    for (int i = 0; i < req.arguments_size(); ++i) {
      TESSEL_ASSIGN_OR_RETURN(const ArrayRecord* a,
                              arrays_.OwnedLocked(req.session_id(), req.arguments(i)));
      if (!SameType(a->type, split.parameter_types[i])) {
        return absl::InvalidArgumentError(
            StrFormat("%s: argument %d '%s' (array %#x) is %s; the program takes %s", what, i,
                      split.parameter_names[i], req.arguments(i), TypeString(a->type),
                      TypeString(split.parameter_types[i])));
      }
      if (a->sharded) args[i] = Sharded(a->mesh, a->sharding);
    }
  }
  auto fresh = [&]() {
    ArrayRegistry::Transaction l(arrays_);
    return FreshHandleLocked();
  };
  std::vector<uint64_t> temps;
  auto free_temps = [&] {
    if (temps.empty()) return;
    v1::DeleteRequest del;
    del.set_session_id(req.session_id());
    for (uint64_t h : temps) del.add_handles(h);
    if (absl::Status s = Delete(del); !s.ok())
      log_->warn("{}: freeing its intermediates: {}", what, s.ToString());
  };
  // A part's outputs that later parts read elsewhere move as soon as the
  // part is sent: a one-way move's senders run right behind it on their
  // devices, its receivers are sent just before the part that reads it
  // (Reshard's `deferred`). So a device goes on with its next part instead
  // of waiting for a reader to get to the value (a pipeline's stages
  // overlap). Receivers of one group are sent in the order of their senders,
  // whose lane on the worker sends in that order.
  struct EarlyMove {
    uint64_t handle = 0;
    ReshardSteps receivers;
  };
  std::vector<EarlyMove> early;
  absl::flat_hash_map<std::pair<size_t, size_t>, size_t>
      early_of;               // (part, input) -> index into `early`
  size_t receivers_sent = 0;  // early[0, receivers_sent) sent, and any other with empty receivers
  // Sends the receivers of early[upto] and of every earlier move in its
  // group; of every move when `upto` is early.size().
  auto send_receivers = [&](size_t upto) {
    for (size_t e = receivers_sent; e < early.size() && e <= upto; ++e) {
      if (upto < early.size() && early[e].receivers.group != early[upto].receivers.group) continue;
      SendReshardSteps(std::move(early[e].receivers));
      early[e].receivers.steps.clear();
    }
    while (receivers_sent < early.size() && early[receivers_sent].receivers.steps.empty())
      ++receivers_sent;
  };
  auto fail = [&](const absl::Status& s) {
    send_receivers(early.size());  // every pending target gets its steps, then its free
    free_temps();
    return s;
  };
  auto move = [&](uint64_t h, const v1::Placement& want, bool implicit, ReshardSteps* deferred) {
    v1::ReshardRequest m;
    m.set_session_id(req.session_id());
    m.set_handle(h);
    m.set_output(fresh());
    *m.mutable_placement() = want;
    *m.mutable_transfer_guard() = req.transfer_guard();
    m.set_implicit(implicit);  // an argument placed elsewhere than the program takes it
    auto moved = Reshard(m, deferred);
    if (!moved.ok()) return absl::StatusOr<uint64_t>(moved.status());
    temps.push_back(m.output());
    return absl::StatusOr<uint64_t>(m.output());
  };
  std::vector<std::vector<uint64_t>> made(split.parts.size());
  v1::ExecuteResponse resp;
  for (size_t q = 0; q < split.parts.size(); ++q) {
    const MpmdPart& part = split.parts[q];
    v1::ExecuteRequest sub;
    sub.set_session_id(req.session_id());
    sub.set_executable_id(p.part_ids[q]);
    *sub.mutable_transfer_guard() = req.transfer_guard();
    for (size_t j = 0; j < part.inputs.size(); ++j) {
      const MpmdRef r = part.inputs[j];
      uint64_t h = r.part < 0 ? req.arguments(r.index) : made[r.part][r.index];
      if (auto e = early_of.find({q, j}); e != early_of.end()) {
        send_receivers(e->second);
        h = early[e->second].handle;
      } else if (const v1::Placement& want = p.part_inputs[q][j]; !SamePlacement(
                     r.part < 0 ? args[r.index] : p.part_outputs[r.part][r.index], want)) {
        auto moved = move(h, want, r.part < 0, nullptr);
        if (!moved.ok()) {
          return fail(Annotate(moved.status(), StrCat(what, ": moving '", part.input_names[j],
                                                      "' to part '", part.name, "': ")));
        }
        h = *moved;
      }
      sub.add_arguments(h);
    }
    for (size_t k = 0; k < p.part_outputs[q].size(); ++k) {
      uint64_t h = 0;
      for (size_t i = 0; i < split.outputs.size(); ++i) {
        if (split.outputs[i] == MpmdRef{int(q), int(k)}) h = req.outputs(i);
      }
      if (h == 0) {
        h = fresh();
        temps.push_back(h);
      }
      made[q].push_back(h);
      sub.add_outputs(h);
    }
    auto r = Execute(sub);
    if (!r.ok()) return fail(Annotate(r.status(), StrCat(what, ": part '", part.name, "': ")));
    resp.set_execution_id(r->execution_id());
    for (size_t q2 = q + 1; q2 < split.parts.size(); ++q2) {
      const MpmdPart& reader = split.parts[q2];
      for (size_t j = 0; j < reader.inputs.size(); ++j) {
        const MpmdRef in = reader.inputs[j];
        if (in.part != int(q) || SamePlacement(p.part_outputs[q][in.index], p.part_inputs[q2][j]))
          continue;
        EarlyMove m;
        auto moved = move(made[q][in.index], p.part_inputs[q2][j], false, &m.receivers);
        if (!moved.ok()) {
          return fail(Annotate(moved.status(), StrCat(what, ": moving '", reader.input_names[j],
                                                      "' to part '", reader.name, "': ")));
        }
        m.handle = *moved;
        early_of[{q2, j}] = early.size();
        early.push_back(std::move(m));
      }
    }
  }
  send_receivers(early.size());
  free_temps();  // each free runs after the steps that read it
  if (req.wait()) TESSEL_RETURN_IF_ERROR(AwaitAll(req.session_id(), req.outputs(), what));
  return resp;
}

}  // namespace tessel::server
