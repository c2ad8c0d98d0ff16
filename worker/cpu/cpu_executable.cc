#include "worker/cpu/cpu_executable.h"

#include <algorithm>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "worker/cpu/dot.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/reduce.h"
#include "worker/cpu/spmd_ops.h"

namespace tessel::cpu {

using worker::BufferPtr;

namespace {
// Threads a large elementwise loop may use: the machine's cores.
int KernelThreads() {
  static const int n = std::max(1u, std::thread::hardware_concurrency());
  return n;
}
}  // namespace

absl::StatusOr<std::unique_ptr<worker::Executable>> CpuExecutable::Load(const v1::Program& program,
                                                                        worker::Device* device) {
  auto exe = std::unique_ptr<CpuExecutable>(new CpuExecutable());
  exe->program_ = program;
  exe->device_ = device;
  const v1::Program& p = exe->program_;
  absl::flat_hash_map<std::string, int> slot_of;
  absl::flat_hash_map<std::string, const v1::TensorType*> type_of;
  auto define = [&](const v1::Node& n) {
    slot_of[n.name()] = exe->num_slots_++;
    type_of[n.name()] = &n.type();
    return slot_of[n.name()];
  };
  auto lookup = [&](const std::string& name) -> absl::StatusOr<int> {
    auto it = slot_of.find(name);
    if (it == slot_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat("program ", p.executable_id(),
                                                     " reads undefined value '", name, "'"));
    }
    return it->second;
  };
  for (const v1::Node& prm : p.parameters()) exe->param_slots_.push_back(define(prm));
  for (const v1::Instruction& ins : p.instructions()) {
    Instr in;
    v1::Fusion single;
    const v1::Fusion* fusion = nullptr;
    if (ins.has_fusion()) {
      fusion = &ins.fusion();
    } else if (IsElementwise(ins.node().op())) {
      // A lone elementwise node runs as a one-node fusion.
      *single.add_nodes() = ins.node();
      for (const std::string& o : ins.node().operands()) {
        bool seen = false;
        for (const std::string& i : single.inputs()) seen |= i == o;
        if (!seen) single.add_inputs(o);
      }
      single.add_outputs(ins.node().name());
      fusion = &single;
    }
    if (fusion != nullptr) {
      std::vector<v1::TensorType> input_types;
      for (const std::string& i : fusion->inputs()) {
        TESSEL_ASSIGN_OR_RETURN(int slot, lookup(i));
        in.args.push_back(slot);
        input_types.push_back(*type_of[i]);
      }
      TESSEL_ASSIGN_OR_RETURN(FusedLoop loop, FusedLoop::Build(*fusion, input_types));
      in.fusion.emplace(std::move(loop));
      for (const std::string& o : fusion->outputs()) {
        in.results.push_back(slot_of[o] = exe->num_slots_++);
        type_of[o] = &in.fusion->output_types()[in.results.size() - 1];
      }
    } else {
      in.node = &ins.node();
      for (const std::string& o : in.node->operands()) {
        TESSEL_ASSIGN_OR_RETURN(int slot, lookup(o));
        in.args.push_back(slot);
        in.arg_types.push_back(type_of[o]);
      }
      in.results.push_back(define(*in.node));
      if (in.node->op() == v1::CONSTANT && in.node->constant().has_literal()) {
        TESSEL_ASSIGN_OR_RETURN(in.literal, device->Allocate(ByteSizeUnchecked(in.node->type())));
        MaterializeLiteral(*in.node, in.literal->opaque());
      }
    }
    for (const std::string& r : ins.release()) {
      TESSEL_ASSIGN_OR_RETURN(int slot, lookup(r));
      in.release.push_back(slot);
    }
    exe->instrs_.push_back(std::move(in));
  }
  // A reshape's value is its operand's buffer.
  absl::flat_hash_map<std::string, std::string> reshaped_from;
  for (const v1::Instruction& ins : p.instructions()) {
    if (ins.has_node() && ins.node().op() == v1::RESHAPE) reshaped_from[ins.node().name()] = ins.node().operands(0);
  }
  for (const std::string& o : p.outputs()) {
    TESSEL_ASSIGN_OR_RETURN(int slot, lookup(o));
    exe->output_slots_.push_back(slot);
    std::string root = o;
    for (auto it = reshaped_from.find(root); it != reshaped_from.end(); it = reshaped_from.find(root)) root = it->second;
    exe->output_buffer_slots_.push_back(slot_of.at(root));
  }
  return std::unique_ptr<worker::Executable>(std::move(exe));
}

absl::Status CpuExecutable::Execute(const Instr& in, std::vector<BufferPtr>& values,
                                    const std::vector<BufferPtr>& preset, const worker::StepContext& ctx) {
  auto alloc_slot = [&](int slot, const v1::TensorType& t) -> absl::StatusOr<BufferPtr> {
    const int64_t bytes = ByteSizeUnchecked(t);
    if (preset[slot] && preset[slot]->size() >= bytes) return preset[slot];
    return device_->Allocate(bytes);
  };
  if (in.fusion) {
    std::vector<const void*> ins;
    for (int a : in.args) ins.push_back(values[a]->opaque());
    std::vector<void*> outs;
    for (size_t i = 0; i < in.results.size(); ++i) {
      TESSEL_ASSIGN_OR_RETURN(BufferPtr b, alloc_slot(in.results[i], in.fusion->output_types()[i]));
      outs.push_back(b->opaque());
      values[in.results[i]] = std::move(b);
    }
    in.fusion->Run(ins, outs, KernelThreads());
    return absl::OkStatus();
  }
  const v1::Node& n = *in.node;
  const v1::TensorType& t = n.type();
  BufferPtr& result = values[in.results[0]];
  if (n.op() == v1::RESHAPE) {
    result = values[in.args[0]];  // same bytes, new shape: no copy
    return absl::OkStatus();
  }
  if (in.literal) {
    result = in.literal;
    return absl::OkStatus();
  }
  TESSEL_ASSIGN_OR_RETURN(result, alloc_slot(in.results[0], t));
  void* out = result->opaque();
  auto arg = [&](int k) -> const void* { return values[in.args[k]]->opaque(); };
  auto arg_type = [&](int k) -> const v1::TensorType& { return *in.arg_types[k]; };
  switch (n.op()) {
    case v1::CONSTANT:
      if (n.constant().has_fill()) {
        FillKernel(t.dtype(), n.constant().fill(), out, NumElementsUnchecked(t));
      } else if (n.constant().iota().sharded_axes_size() > 0) {
        TESSEL_RETURN_IF_ERROR(SplitIota(n, program_, out, ctx));
      } else {
        IotaKernel(t.dtype(), t.dims(), n.constant().iota().dimension(), 0, out, NumElementsUnchecked(t));
      }
      break;
    case v1::BROADCAST_IN_DIM: BroadcastInDim(arg_type(0), arg(0), n.broadcast_in_dim(), t, out); break;
    case v1::TRANSPOSE: Transpose(arg_type(0), arg(0), n.transpose(), t, out); break;
    case v1::SLICE: Slice(arg_type(0), arg(0), n.slice(), t, out); break;
    case v1::CONCATENATE: {
      std::vector<const void*> ins;
      for (size_t k = 0; k < in.args.size(); ++k) ins.push_back(arg(k));
      Concatenate(in.arg_types, ins, n.concatenate().dimension(), t, out);
      break;
    }
    case v1::PAD: Pad(arg_type(0), arg(0), arg(1), n.pad(), t, out); break;
    case v1::DOT_GENERAL:
      DotGeneral(arg_type(0), arg(0), arg_type(1), arg(1), n.dot_general(), t, out);
      break;
    case v1::REDUCE: Reduce(arg_type(0), arg(0), n.reduce(), t, out); break;
    case v1::ARGMAX:
    case v1::ARGMIN: ArgReduce(n.op() == v1::ARGMAX, arg_type(0), arg(0), n.arg_reduce(), t, out); break;
    case v1::ALL_REDUCE:
    case v1::ALL_GATHER:
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
    case v1::COLLECTIVE_PERMUTE:
    case v1::SHARD_SLICE:
      TESSEL_RETURN_IF_ERROR(RunSpmdOp(n, program_, arg_type(0), arg(0), out, ctx));
      break;
    case v1::AXIS_INDEX: TESSEL_RETURN_IF_ERROR(RunSpmdOp(n, program_, t, nullptr, out, ctx)); break;
    default:
      return absl::UnimplementedError(absl::StrCat("cpu device: op ", OpName(n.op()),
                                                   " of node '", n.name(), "' is not supported"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<BufferPtr>> CpuExecutable::Run(absl::Span<const BufferPtr> args,
                                                          absl::Span<const BufferPtr> into,
                                                          const worker::StepContext& ctx) {
  if (args.size() != param_slots_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("program ", program_.executable_id(), ": expected ",
                                                   param_slots_.size(), " arguments, got ", args.size()));
  }
  std::vector<BufferPtr> values(num_slots_);
  for (size_t i = 0; i < args.size(); ++i) values[param_slots_[i]] = args[i];
  std::vector<BufferPtr> preset(num_slots_);
  for (size_t i = 0; i < into.size() && i < output_buffer_slots_.size(); ++i) {
    if (into[i]) preset[output_buffer_slots_[i]] = into[i];
  }
  for (const Instr& in : instrs_) {
    TESSEL_RETURN_IF_ERROR(Execute(in, values, preset, ctx));
    for (int r : in.release) values[r].reset();
  }
  std::vector<BufferPtr> outs;
  for (int s : output_slots_) outs.push_back(values[s]);
  return outs;
}

}  // namespace tessel::cpu
