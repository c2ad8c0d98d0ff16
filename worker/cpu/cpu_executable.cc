#include "worker/cpu/cpu_executable.h"

#include <algorithm>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "core/trace.h"
#include "spdlog/spdlog.h"
#include "worker/cpu/convolution.h"
#include "worker/cpu/dot.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/gather.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/linalg.h"
#include "worker/cpu/reduce.h"
#include "worker/cpu/sort.h"
#include "worker/cpu/spmd_ops.h"

namespace tessel::cpu {

using worker::BufferPtr;

namespace {

// An instruction's name in a trace: "fusion of 3 (add, exp, mul)" or "dot_general d".
std::string KernelName(const worker::SlotProgram::Instr& in) {
  if (in.fusion != nullptr) {
    std::string ops;
    for (int k = 0; k < in.fusion->nodes_size() && k < 4; ++k) {
      absl::StrAppend(&ops, k > 0 ? ", " : "", OpName(in.fusion->nodes(k).op()));
    }
    if (in.fusion->nodes_size() > 4) ops += ", ...";
    return absl::StrCat("fusion of ", in.fusion->nodes_size(), " (", ops, ")");
  }
  return absl::StrCat(OpName(in.node->op()), " ", in.node->name());
}

}  // namespace

absl::StatusOr<std::unique_ptr<worker::Executable>> CpuExecutable::Load(const v1::Program& program,
                                                                        worker::Device* device) {
  TESSEL_ASSIGN_OR_RETURN(worker::SlotProgram slots, worker::SlotProgram::Build(program));
  auto exe = std::unique_ptr<CpuExecutable>(new CpuExecutable(std::move(slots)));
  exe->device_ = device;
  for (const worker::SlotProgram::Instr& in : exe->slots_.instrs()) {
    Prepared prep;
    if (in.fusion != nullptr) {
      TESSEL_ASSIGN_OR_RETURN(FusedLoop loop, FusedLoop::Build(*in.fusion, in.arg_types));
      prep.fusion.emplace(std::move(loop));
      // Large enough that registers beat the interpreter's passes over a
      // block per node; streamed outputs stay with the interpreter's
      // non-temporal stores.
      if (prep.fusion->elements() >= kCompiledFusionElements && !prep.fusion->streams()) {
        std::string why;
        prep.compiled = NativeFusion::Start(*in.fusion, in.arg_types, &why);
      }
    } else if (in.node->op() == v1::CONSTANT && in.node->constant().has_literal()) {
      TESSEL_ASSIGN_OR_RETURN(prep.literal, device->Allocate(ByteSizeUnchecked(in.node->type())));
      MaterializeLiteral(*in.node, prep.literal->opaque());
    }
    exe->prepared_.push_back(std::move(prep));
  }
  exe->kernel_names_.assign(exe->slots_.instrs().size(), 0);
  std::vector<const FusedLoop*> fusions;
  for (const Prepared& p : exe->prepared_) fusions.push_back(p.fusion ? &*p.fusion : nullptr);
  for (size_t i = 0; i < exe->prepared_.size(); ++i) {
    if (exe->slots_.instrs()[i].calls.empty()) continue;
    Prepared& prep = exe->prepared_[i];
    std::string why;
    prep.native = NativeLoop::Build(exe->slots_, int(i), &why);
    if (!prep.native) prep.loop = DeviceLoop::Build(exe->slots_, int(i), fusions);
    if (prep.native || prep.loop) exe->slots_.SetRunByBackend(int(i));
    if (auto log = spdlog::get("worker")) {
      const v1::Node& n = *exe->slots_.instrs()[i].node;
      if (prep.native) {
        log->info("{} '{}' of program {} runs as native code", OpName(n.op()), n.name(),
                  program.executable_id());
      } else {
        log->info("{} '{}' of program {} is interpreted ({}): {}", OpName(n.op()), n.name(),
                  program.executable_id(),
                  prep.loop ? "bound fusions" : "instruction by instruction", why);
      }
    }
  }
  return std::unique_ptr<worker::Executable>(std::move(exe));
}

absl::Status CpuExecutable::Execute(int i, std::vector<BufferPtr>& values,
                                    const std::vector<BufferPtr>& preset,
                                    const worker::StepContext& ctx) {
  const worker::SlotProgram::Instr& in = slots_.instrs()[i];
  const Prepared& prep = prepared_[i];
  auto alloc_slot = [&](int slot, const v1::TensorType& t) {
    return worker::SlotProgram::ResultBuffer(*device_, preset, slot, ByteSizeUnchecked(t));
  };
  if (prep.native) return prep.native->Run(values, preset, *device_);
  if (prep.loop) return prep.loop->Run(values, preset, *device_);
  if (prep.fusion) {
    absl::InlinedVector<const void*, 8> ins;
    for (int a : in.args) ins.push_back(values[a]->opaque());
    absl::InlinedVector<void*, 4> outs;
    for (size_t k = 0; k < in.results.size(); ++k) {
      TESSEL_ASSIGN_OR_RETURN(BufferPtr b, alloc_slot(in.results[k], in.result_types[k]));
      outs.push_back(b->opaque());
      values[in.results[k]] = std::move(b);
    }
    if (NativeFusion::Fn fn = prep.compiled ? prep.compiled->fn() : nullptr) {
      prep.fusion->RunRanges(fn, ins, outs, KernelThreads());
    } else {
      prep.fusion->Run(ins, outs, KernelThreads());
    }
    return absl::OkStatus();
  }
  const v1::Node& n = *in.node;
  const v1::TensorType& t = n.type();
  BufferPtr& result = values[in.results[0]];
  if (n.op() == v1::RESHAPE) {
    result = values[in.args[0]];  // same bytes, new shape: no copy
    return absl::OkStatus();
  }
  if (prep.literal) {
    result = prep.literal;
    return absl::OkStatus();
  }
  TESSEL_ASSIGN_OR_RETURN(result, alloc_slot(in.results[0], t));
  void* out = result->opaque();
  auto arg = [&](int k) -> const void* { return values[in.args[k]]->opaque(); };
  auto arg_type = [&](int k) -> const v1::TensorType& { return in.arg_types[k]; };
  switch (n.op()) {
    case v1::CONSTANT:
      if (n.constant().has_fill()) {
        FillKernel(t.dtype(), n.constant().fill(), out, NumElementsUnchecked(t));
      } else if (n.constant().iota().sharded_axes_size() > 0) {
        TESSEL_RETURN_IF_ERROR(SplitIota(n, slots_.program(), out, ctx));
      } else {
        IotaKernel(t.dtype(), t.dims(), n.constant().iota().dimension(), 0, out,
                   NumElementsUnchecked(t));
      }
      break;
    case v1::BROADCAST_IN_DIM:
      BroadcastInDim(arg_type(0), arg(0), n.broadcast_in_dim(), t, out);
      break;
    case v1::TRANSPOSE: Transpose(arg_type(0), arg(0), n.transpose(), t, out); break;
    case v1::SLICE: Slice(arg_type(0), arg(0), n.slice(), t, out); break;
    case v1::CONCATENATE: {
      std::vector<const void*> ins;
      std::vector<const v1::TensorType*> types;
      for (size_t k = 0; k < in.args.size(); ++k) {
        ins.push_back(arg(k));
        types.push_back(&in.arg_types[k]);
      }
      Concatenate(types, ins, n.concatenate().dimension(), t, out);
      break;
    }
    case v1::REVERSE: Reverse(t, arg(0), n.reverse(), out); break;
    case v1::SORT:
      Sort(arg_type(0), arg(0), t, arg(n.sort().result_operand()), n.sort(), out);
      break;
    case v1::GATHER: Gather(arg_type(0), arg(0), arg_type(1), arg(1), n.gather(), out); break;
    case v1::SCATTER:
      Scatter(arg_type(0), arg(0), arg_type(1), arg(1), arg(2), n.scatter(), out);
      break;
    case v1::PAD: Pad(arg_type(0), arg(0), arg(1), n.pad(), t, out); break;
    case v1::DOT_GENERAL:
      DotGeneral(arg_type(0), arg(0), arg_type(1), arg(1), n.dot_general(), t, out);
      break;
    case v1::CONVOLUTION:
      Convolution(arg_type(0), arg(0), arg_type(1), arg(1), n.convolution(), t, out);
      break;
    case v1::CHOLESKY: Cholesky(arg_type(0), arg(0), n.linalg().lower(), out); break;
    case v1::TRIANGULAR_SOLVE:
      TriangularSolve(arg_type(0), arg(0), arg_type(1), arg(1), n.linalg(), out);
      break;
    case v1::LU: Lu(arg_type(0), arg(0), out); break;
    case v1::EIGH: Eigh(arg_type(0), arg(0), n.linalg().lower(), out); break;
    case v1::QR: Qr(arg_type(0), arg(0), out); break;
    case v1::SVD: Svd(arg_type(0), arg(0), out); break;
    case v1::REDUCE: Reduce(arg_type(0), arg(0), n.reduce(), t, out); break;
    case v1::ARGMAX:
    case v1::ARGMIN:
      ArgReduce(n.op() == v1::ARGMAX, arg_type(0), arg(0), n.arg_reduce(), t, out);
      break;
    case v1::ALL_REDUCE:
    case v1::ALL_GATHER:
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
    case v1::COLLECTIVE_PERMUTE:
    case v1::SHARD_SLICE:
      TESSEL_RETURN_IF_ERROR(RunSpmdOp(n, i, slots_.program(), arg_type(0), arg(0), out, ctx));
      break;
    case v1::AXIS_INDEX:
      TESSEL_RETURN_IF_ERROR(RunSpmdOp(n, i, slots_.program(), t, nullptr, out, ctx));
      break;
    default:
      return absl::UnimplementedError(absl::StrCat("cpu device: op ", OpName(n.op()), " of node '",
                                                   n.name(), "' is not supported"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<BufferPtr>> CpuExecutable::Run(absl::Span<const BufferPtr> args,
                                                          absl::Span<const BufferPtr> into,
                                                          const worker::StepContext& ctx) {
  // Inside a function the context takes the call's scope; copied once, and
  // only by a program that runs functions.
  std::optional<worker::StepContext> inner;
  return slots_.Run(args, into, *device_,
                    [&](int i, std::vector<BufferPtr>& values, const std::vector<BufferPtr>& preset,
                        uint64_t scope) {
                      trace::Span span("kernel", "");
                      if (span.active()) {
                        // Named once per instruction, at its first traced run.
                        trace::Name& name = kernel_names_[i];
                        if (name == 0) name = trace::Intern(KernelName(slots_.instrs()[i]));
                        span.Detail(name);
                      }
                      if (scope == ctx.scope) return Execute(i, values, preset, ctx);
                      if (!inner) inner.emplace(ctx);
                      inner->scope = scope;
                      return Execute(i, values, preset, *inner);
                    });
}

}  // namespace tessel::cpu
