#include "server/execute_planner.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessel::server {

using absl::StrCat;
using absl::StrFormat;

namespace {

// "expected f32[4], got s32[4] (dtype differs)", for signature mismatches.
std::string TypeDifference(const v1::TensorType& want, const v1::TensorType& got) {
  return StrCat("expected ", TypeString(want), ", got ", TypeString(got), " (",
                want.dtype() != got.dtype() ? "dtype" : "shape", " differs)");
}

bool Holds(const ArrayRecord& rec, int device) {
  return std::find(rec.devices.begin(), rec.devices.end(), device) != rec.devices.end();
}

// The planner's phases share what they read of the request.
struct Planning {
  const ExecuteInput& in;
  const v1::ExecuteRequest& req;
  const scheduler::CompiledProgram& c;
  const std::string& exe_name;
  ExecutePlan& plan;
};

// 1. Where the step runs: the mesh's devices (each must be alive), or the placement.
absl::Status PlanDevices(const Planning& p) {
  if (!p.c.partitioned()) {
    p.plan.devices = p.in.placement;
    return absl::OkStatus();
  }
  const std::vector<DeviceRoute>& routes = *p.in.routes;
  p.plan.devices.assign(p.c.mesh.devices().begin(), p.c.mesh.devices().end());
  for (int d : p.plan.devices) {
    if (d < 0 || d >= int(routes.size())) {
      return absl::UnavailableError(StrCat("executable '", p.exe_name, "' runs on device ", d,
                                           ", which the cluster does not have (devices 0..",
                                           int(routes.size()) - 1, ")"));
    }
    const DeviceRoute& r = routes[d];
    if (!r.alive) {
      return absl::UnavailableError(
          StrCat("device ", d, " is on worker ", r.worker_id, " (", r.address, "), which is dead"));
    }
  }
  return absl::OkStatus();
}

// 2. The call's shape: as many arguments and outputs as the executable
// has; the donation set (the executable's declared parameters and the
// call's), by argument.
absl::StatusOr<std::vector<bool>> PlanDonations(const Planning& p) {
  const v1::ExecuteRequest& req = p.req;
  if (req.arguments_size() != int(p.c.parameter_types.size())) {
    return absl::InvalidArgumentError(StrCat("executable '", p.exe_name, "' (", req.executable_id(),
                                             ") takes ", p.c.parameter_types.size(),
                                             " arguments, got ", req.arguments_size()));
  }
  if (int(p.in.arguments.size()) != req.arguments_size()) {
    return absl::InternalError(StrCat("PlanExecute: ", p.in.arguments.size(),
                                      " argument records for ", req.arguments_size(),
                                      " arguments"));
  }
  if (req.outputs_size() != int(p.c.output_types.size())) {
    return absl::InvalidArgumentError(StrCat(
        "executable '", p.exe_name, "' (", req.executable_id(), ") has ", p.c.output_types.size(),
        " outputs; the request names ", req.outputs_size(), " output handles"));
  }
  std::vector<bool> donated(req.arguments_size(), false);
  for (int i : p.c.donated_parameters) donated[i] = true;
  for (int i : req.donate()) {
    if (i < 0 || i >= req.arguments_size()) {
      return absl::InvalidArgumentError(StrCat("donate: argument ", i,
                                               " does not exist; executable '", p.exe_name,
                                               "' takes ", req.arguments_size(), " arguments"));
    }
    donated[i] = true;
  }
  for (int i = 0; i < req.arguments_size(); ++i) {
    if (donated[i]) p.plan.donated.push_back(i);
  }
  return donated;
}

// Whether argument `i` has the layout the executable takes on every device
// of the step; INVALID_ARGUMENT naming both layouts if not.
absl::Status CheckLayout(const Planning& p, int i) {
  const bool partitioned = p.c.partitioned();
  const ArrayRecord& rec = *p.in.arguments[i];
  if (!partitioned && !rec.sharded) return absl::OkStatus();
  // Blocks are never moved implicitly: the layout must be the one compiled for.
  const v1::Sharding want =
      partitioned ? p.c.parameter_shardings[i] : Replicated(rec.type.dims_size());
  const bool same_mesh = !partitioned || !rec.sharded || SameMesh(rec.mesh, p.c.mesh);
  bool ok = same_mesh && (rec.sharded ? SameSharding(rec.sharding, want) : IsReplicated(want));
  for (int d : p.plan.devices) ok &= Holds(rec, d);
  if (ok) return absl::OkStatus();
  const std::string have =
      rec.sharded ? StrCat(ShardingString(rec.sharding), " on mesh ", MeshString(rec.mesh))
                  : StrCat("whole on device ", absl::StrJoin(rec.devices, ","));
  const std::string need = partitioned
                               ? StrCat(ShardingString(want), " on mesh ", MeshString(p.c.mesh))
                               : StrCat("whole on device ", absl::StrJoin(p.plan.devices, ","));
  return absl::InvalidArgumentError(
      StrFormat("argument %d '%s' (array %#x, %s) is laid out %s; executable '%s' takes it "
                "%s. Blocks are not moved "
                "implicitly: put the array with that sharding, or compile for its layout",
                i, p.c.program.parameters(i).name(), p.req.arguments(i), TypeString(rec.type), have,
                p.exe_name, need));
}

// The copies argument `i` needs on the step's devices that do not hold it.
absl::Status PlanMoves(const Planning& p, int i, bool donated) {
  const std::string& pname = p.c.program.parameters(i).name();
  const ArrayRecord& rec = *p.in.arguments[i];
  const uint64_t handle = p.req.arguments(i);
  const std::vector<DeviceRoute>& routes = *p.in.routes;
  for (int d : p.plan.devices) {
    if (Holds(rec, d)) continue;
    if (donated) {
      return absl::InvalidArgumentError(
          StrFormat("argument %d '%s' (array %#x) is donated but lives on device %s, not on "
                    "device %d where the step "
                    "runs; a donated buffer cannot change devices",
                    i, pname, handle, absl::StrJoin(rec.devices, ","), d));
    }
    PlannedMove m;
    m.argument = i;
    m.handle = handle;
    m.type = rec.type;
    m.to_device = d;
    for (int from : rec.devices) {
      if (from >= 0 && from < int(routes.size()) && routes[from].alive) {
        m.from_device = from;
        break;
      }
    }
    if (m.from_device < 0) {
      return absl::UnavailableError(
          StrFormat("argument %d '%s': array %#x: no live device holds it", i, pname, handle));
    }
    m.temp_handle = p.in.fresh_handle();
    m.what = StrFormat("argument %d '%s' (array %#x, %s) from device %s to device %d", i, pname,
                       handle, TypeString(rec.type), absl::StrJoin(rec.devices, ","), d);
    p.plan.moves.push_back(std::move(m));
  }
  return absl::OkStatus();
}

// 3. Each argument: its signature, its layout, its state (an upstream
// error passes on to the outputs), the moves it needs, and a donated one
// read twice.
absl::Status PlanArguments(const Planning& p, const std::vector<bool>& donated) {
  const v1::ExecuteRequest& req = p.req;
  for (int i = 0; i < req.arguments_size(); ++i) {
    const std::string& pname = p.c.program.parameters(i).name();
    const ArrayRecord& rec = *p.in.arguments[i];
    const uint64_t handle = req.arguments(i);
    if (!SameType(rec.type, p.c.global_parameter_types[i])) {
      return absl::InvalidArgumentError(StrFormat(
          "argument %d '%s' (array %#x) does not match the signature of executable '%s': %s. An "
          "executable runs "
          "only on the signature it was compiled for; compile the graph for this one",
          i, pname, handle, p.exe_name, TypeDifference(p.c.global_parameter_types[i], rec.type)));
    }
    TESSEL_RETURN_IF_ERROR(CheckLayout(p, i));
    if (rec.state == v1::LOST)
      return Annotate(rec.error, StrCat("argument ", i, " '", pname, "': "));
    if (rec.state == v1::ERROR && p.plan.upstream_error.ok()) {
      p.plan.upstream_error =
          DependentError(rec.error, StrFormat("argument %d '%s' (array %#x)", i, pname, handle));
    }
    TESSEL_RETURN_IF_ERROR(PlanMoves(p, i, donated[i]));
    if (!donated[i]) continue;
    for (int j = 0; j < req.arguments_size(); ++j) {
      if (j != i && req.arguments(j) == handle) {
        return absl::InvalidArgumentError(
            StrFormat("argument %d '%s' donates array %#x, which is also argument %d; an array "
                      "cannot be donated and "
                      "read in the same call",
                      i, pname, handle, j));
      }
    }
    p.plan.donated_bytes += rec.bytes();
  }
  return absl::OkStatus();
}

// 4. Which donated buffer each output takes (strict donation refuses a
// donation no output takes), and the outputs to register: new handles,
// pending on every device or carrying the upstream error.
absl::Status PlanOutputs(const Planning& p) {
  const v1::ExecuteRequest& req = p.req;
  ExecutePlan& plan = p.plan;
  plan.aliases = scheduler::AssignAliases(p.c.program, p.c.alias_candidates, plan.donated);
  if (p.in.strict_donation) {
    for (const scheduler::AliasDecision& d : plan.aliases) {
      if (d.output < 0) {
        return absl::InvalidArgumentError(
            StrFormat("strict donation: argument %d '%s' (array %#x) cannot give its buffer to any "
                      "output of '%s': %s",
                      d.parameter, p.c.program.parameters(d.parameter).name(),
                      req.arguments(d.parameter), p.exe_name, d.reason));
      }
    }
  }
  absl::flat_hash_set<uint64_t> seen;
  for (int i = 0; i < req.outputs_size(); ++i) {
    const uint64_t h = req.outputs(i);
    if (h == 0)
      return absl::InvalidArgumentError(
          StrCat("output handle ", i, " is 0; handles must be nonzero"));
    if (!seen.insert(h).second || p.in.handle_in_use(h)) {
      return absl::AlreadyExistsError(StrFormat("output handle %d (%#x) is already in use", i, h));
    }
    plan.output_bytes +=
        ByteSizeUnchecked(p.c.output_types[i]) * int64_t(plan.devices.size());  // per-device types
  }
  for (int i = 0; i < req.outputs_size(); ++i) {
    ArrayRecord a;
    a.type = p.c.global_output_types[i];
    a.devices = plan.devices;
    if (p.c.partitioned()) {
      a.sharded = true;
      a.mesh = p.c.mesh;
      a.sharding = p.c.output_shardings[i];
      a.block_type = p.c.output_types[i];
    }
    a.producer_name = p.exe_name;
    if (!plan.upstream_error.ok()) {
      a.state = v1::ERROR;
      a.error = plan.upstream_error;
    } else {
      a.state = v1::PENDING;
      a.pending = plan.devices.size();
    }
    plan.outputs.push_back(std::move(a));
  }
  return absl::OkStatus();
}

// 5. One step per device: the arguments (a moved copy where there is one,
// freed after the step), the outputs, the donations and the aliases.
void PlanSteps(const Planning& p) {
  const v1::ExecuteRequest& req = p.req;
  ExecutePlan& plan = p.plan;
  for (size_t pos = 0; pos < plan.devices.size(); ++pos) {
    const int d = plan.devices[pos];
    PlannedStep step;
    step.device = d;
    v1::RunRequest& run = step.run;
    run.set_mesh_position(pos);
    run.set_executable_id(req.executable_id());
    *run.mutable_arguments() = req.arguments();
    for (const PlannedMove& m : plan.moves) {
      if (m.to_device != d) continue;
      run.set_arguments(m.argument, m.temp_handle);
      if (!step.free_after) step.free_after.emplace();
      step.free_after->add_buffers(m.temp_handle);
    }
    *run.mutable_outputs() = req.outputs();
    for (int i : plan.donated) run.add_donated(i);
    for (const scheduler::AliasDecision& al : plan.aliases) {
      if (al.output < 0) continue;
      v1::RunAlias* ra = run.add_aliases();
      ra->set_argument(al.parameter);
      ra->set_output(al.output);
    }
    plan.steps.push_back(std::move(step));
  }
}

}  // namespace

absl::StatusOr<ExecutePlan> PlanExecute(const ExecuteInput& in) {
  ExecutePlan plan;
  const Planning p{in, *in.request, in.executable->compiled, in.executable->graph.name(), plan};
  TESSEL_RETURN_IF_ERROR(PlanDevices(p));
  TESSEL_ASSIGN_OR_RETURN(std::vector<bool> donated, PlanDonations(p));
  TESSEL_RETURN_IF_ERROR(PlanArguments(p, donated));
  TESSEL_RETURN_IF_ERROR(PlanOutputs(p));
  PlanSteps(p);
  return plan;
}

}  // namespace tessel::server
