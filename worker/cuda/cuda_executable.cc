#include "worker/cuda/cuda_executable.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "worker/collective_group.h"
#include "worker/cpu/dot.h"
#include "worker/cpu/fused_loop.h"

namespace tessel::cuda {
namespace {

using absl::StrCat;
using worker::BufferPtr;

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kBlasWorkspace = int64_t{32} << 20;

absl::Status BlasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      StrCat("cuBLASLt error ", int(s), " (", cublasLtGetStatusString(s), ") in ", what));
}

cudaDataType_t CudaType(v1::DType dt) {
  switch (dt) {
    case v1::F64: return CUDA_R_64F;
    case v1::F16: return CUDA_R_16F;
    case v1::BF16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

std::vector<std::string> Axes(const google::protobuf::RepeatedPtrField<std::string>& axes) {
  return {axes.begin(), axes.end()};
}

// The TRANSPOSE node that lays `t` out as `perm` says.
v1::Node TransposeNode(const v1::TensorType& t, const std::vector<int64_t>& perm) {
  v1::Node n;
  n.set_name("dot_operand");
  n.set_op(v1::TRANSPOSE);
  n.mutable_type()->set_dtype(t.dtype());
  for (int64_t p : perm) {
    n.mutable_transpose()->add_permutation(p);
    n.mutable_type()->add_dims(t.dims(p));
  }
  return n;
}

}  // namespace

absl::StatusOr<std::unique_ptr<worker::Executable>> CudaExecutable::Load(const v1::Program& program,
                                                                         CudaDevice* device) {
  TESSEL_ASSIGN_OR_RETURN(worker::SlotProgram slots, worker::SlotProgram::Build(program));
  auto exe = std::unique_ptr<CudaExecutable>(new CudaExecutable(std::move(slots), device));
  TESSEL_RETURN_IF_ERROR(exe->Prepare());
  return std::unique_ptr<worker::Executable>(std::move(exe));
}

CudaExecutable::~CudaExecutable() {
  device_->Activate().IgnoreError();
  device_->Synchronize().IgnoreError();  // nothing queued may outlive the module or the plans
  for (Prepared& p : prepared_) {
    if (DotPlan* d = p.dot.get()) {
      if (d->a != nullptr) cublasLtMatrixLayoutDestroy(d->a);
      if (d->b != nullptr) cublasLtMatrixLayoutDestroy(d->b);
      if (d->c != nullptr) cublasLtMatrixLayoutDestroy(d->c);
      if (d->desc != nullptr) cublasLtMatmulDescDestroy(d->desc);
    }
  }
  if (blas_ != nullptr) cublasLtDestroy(blas_);
  if (library_ != nullptr) cudaLibraryUnload(library_);
}

absl::Status CudaExecutable::Prepare() {
  ModuleSource module;
  const v1::Program& program = slots_.program();
  for (const worker::SlotProgram::Instr& in : slots_.instrs()) {
    Prepared prep;
    if (in.fusion != nullptr) {
      TESSEL_ASSIGN_OR_RETURN(KernelLaunch l, module.AddFusion(*in.fusion, in.arg_types));
      prep.kernels.push_back(l);
      prepared_.push_back(std::move(prep));
      continue;
    }
    const v1::Node& n = *in.node;
    switch (n.op()) {
      case v1::RESHAPE: break;
      case v1::CONSTANT:
        if (n.constant().has_literal()) {
          std::vector<char> host(ByteSizeUnchecked(n.type()));
          cpu::MaterializeLiteral(n, host.data());
          TESSEL_ASSIGN_OR_RETURN(prep.literal, device_->Allocate(host.size()));
          TESSEL_RETURN_IF_ERROR(device_->CopyFromHost(*prep.literal, 0, host.data(), host.size()));
        } else {
          prep.constant = std::make_unique<v1::Fusion>();
          *prep.constant->add_nodes() = n;
          prep.constant->add_outputs(n.name());
          TESSEL_ASSIGN_OR_RETURN(KernelLaunch l, module.AddFusion(*prep.constant, {}));
          prep.kernels.push_back(l);
        }
        break;
      case v1::BROADCAST_IN_DIM:
      case v1::TRANSPOSE:
      case v1::SLICE:
      case v1::REVERSE:
      case v1::CONCATENATE:
      case v1::PAD: {
        TESSEL_ASSIGN_OR_RETURN(KernelLaunch l, module.AddLayout(n, in.arg_types));
        prep.kernels.push_back(l);
        break;
      }
      case v1::REDUCE: {
        TESSEL_ASSIGN_OR_RETURN(ReducePlan r, module.AddReduce(n, in.arg_types[0]));
        prep.reduce = std::move(r);
        break;
      }
      case v1::SORT: {
        TESSEL_ASSIGN_OR_RETURN(
            KernelLaunch l,
            module.AddSort(n, in.arg_types[0], in.arg_types[n.sort().result_operand()]));
        prep.kernels.push_back(l);
        break;
      }
      case v1::GATHER:
      case v1::SCATTER: {
        TESSEL_ASSIGN_OR_RETURN(KernelLaunch l,
                                n.op() == v1::GATHER
                                    ? module.AddGather(n, in.arg_types[0], in.arg_types[1])
                                    : module.AddScatter(n, in.arg_types[0], in.arg_types[1]));
        prep.kernels.push_back(l);
        break;
      }
      case v1::CONVOLUTION: {
        TESSEL_ASSIGN_OR_RETURN(KernelLaunch l,
                                module.AddConvolution(n, in.arg_types[0], in.arg_types[1]));
        prep.kernels.push_back(l);
        break;
      }
      case v1::ARGMAX:
      case v1::ARGMIN: {
        TESSEL_ASSIGN_OR_RETURN(KernelLaunch l, module.AddArgReduce(n, in.arg_types[0]));
        prep.kernels.push_back(l);
        break;
      }
      case v1::DOT_GENERAL: TESSEL_RETURN_IF_ERROR(PlanDot(in, module, prep)); break;
      case v1::SHARD_SLICE: {
        TESSEL_ASSIGN_OR_RETURN(
            KernelLaunch l, module.AddShardSlice(n, in.arg_types[0],
                                                 AxesSize(program.mesh(), n.collective().axes())));
        prep.kernels.push_back(l);
        break;
      }
      case v1::AXIS_INDEX: prep.kernels.push_back(module.AddScalarS32()); break;
      case v1::ALL_REDUCE:
      case v1::ALL_GATHER:
      case v1::REDUCE_SCATTER:
      case v1::ALL_TO_ALL:
      case v1::COLLECTIVE_PERMUTE:
        prep.collective = PlanCollective(n, in.arg_types[0],
                                         AxesSize(program.mesh(), n.collective().axes()), module);
        break;
      case v1::WHILE:
      case v1::CONDITIONAL:
      case v1::SCAN:
        break;  // SlotProgram::Run drives it from the host; its functions' kernels are prepared
                // here too
      default:
        return absl::UnimplementedError(StrCat("cuda device: op ", OpName(n.op()), " of node '",
                                               n.name(), "' is not supported"));
    }
    prepared_.push_back(std::move(prep));
  }
  if (module.num_kernels() == 0) return absl::OkStatus();
  TESSEL_ASSIGN_OR_RETURN(std::shared_ptr<const std::string> code,
                          device_->compiler().Compile(module.source()));
  TESSEL_RETURN_IF_ERROR(CudaStatus(
      cudaLibraryLoadData(&library_, code->data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
      "cudaLibraryLoadData"));
  for (int i = 0; i < module.num_kernels(); ++i) {
    cudaKernel_t k = nullptr;
    TESSEL_RETURN_IF_ERROR(CudaStatus(cudaLibraryGetKernel(&k, library_, KernelName(i).c_str()),
                                      "cudaLibraryGetKernel"));
    kernels_.push_back(k);
  }
  return absl::OkStatus();
}

absl::Status CudaExecutable::PlanDot(const worker::SlotProgram::Instr& in, ModuleSource& module,
                                     Prepared& prep) {
  const v1::DotGeneralAttrs& a = in.node->dot_general();
  const v1::TensorType &lt = in.arg_types[0], &rt = in.arg_types[1];
  const cpu::DotOperandLayout l =
      cpu::CanonicalizeDotOperand(lt, a.lhs_batch(), a.lhs_contracting(), true);
  const cpu::DotOperandLayout r =
      cpu::CanonicalizeDotOperand(rt, a.rhs_batch(), a.rhs_contracting(), false);
  auto d = std::make_unique<DotPlan>();
  d->batch = l.batch;
  d->m = l.rows;
  d->k = l.cols;
  d->n = r.cols;
  const v1::DType dt = lt.dtype();
  const bool blas = dt == v1::F32 || dt == v1::F64 || dt == v1::F16 || dt == v1::BF16;
  const size_t nb = a.lhs_batch_size();
  const bool lt_trans =
      blas && !cpu::IsIdentityPermutation(l.perm) &&
      cpu::IsTransposedLayout(l, nb, lt.dims_size() - nb - a.lhs_contracting_size());
  const bool rt_trans = blas && !cpu::IsIdentityPermutation(r.perm) &&
                        cpu::IsTransposedLayout(r, nb, a.rhs_contracting_size());
  if (!cpu::IsIdentityPermutation(l.perm) && !lt_trans) {
    TESSEL_ASSIGN_OR_RETURN(KernelLaunch t, module.AddLayout(TransposeNode(lt, l.perm), {lt}));
    d->lhs_transpose = t;
    d->lhs_bytes = ByteSizeUnchecked(lt);
  }
  if (!cpu::IsIdentityPermutation(r.perm) && !rt_trans) {
    TESSEL_ASSIGN_OR_RETURN(KernelLaunch t, module.AddLayout(TransposeNode(rt, r.perm), {rt}));
    d->rhs_transpose = t;
    d->rhs_bytes = ByteSizeUnchecked(rt);
  }
  if (!blas) {
    d->gemm_kernel = module.AddGemm(dt, d->batch, d->m, d->n, d->k);
    prep.dot = std::move(d);
    return absl::OkStatus();
  }
  prep.dot = std::move(d);
  DotPlan& p = *prep.dot;
  if (p.batch == 0 || p.m == 0 || p.n == 0 || p.k == 0)
    return absl::OkStatus();  // nothing to multiply
  if (blas_ == nullptr)
    TESSEL_RETURN_IF_ERROR(BlasStatus(cublasLtCreate(&blas_), "cublasLtCreate"));
  // Row-major C[m,n] = L[m,k] R[k,n] is column-major C'[n,m] = R'[n,k] L'[k,m]:
  // cuBLASLt's A is the rhs and its B the lhs.
  p.f64 = dt == v1::F64;
  const cudaDataType_t type = CudaType(dt);
  TESSEL_RETURN_IF_ERROR(
      BlasStatus(cublasLtMatmulDescCreate(&p.desc, p.f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
                                          p.f64 ? CUDA_R_64F : CUDA_R_32F),
                 "cublasLtMatmulDescCreate"));
  const cublasOperation_t op_a = rt_trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                          op_b = lt_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  TESSEL_RETURN_IF_ERROR(BlasStatus(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)),
      "set TRANSA"));
  TESSEL_RETURN_IF_ERROR(BlasStatus(
      cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)),
      "set TRANSB"));
  auto layout = [&](cublasLtMatrixLayout_t* out, int64_t rows, int64_t cols) -> absl::Status {
    TESSEL_RETURN_IF_ERROR(BlasStatus(cublasLtMatrixLayoutCreate(out, type, rows, cols, rows),
                                      "cublasLtMatrixLayoutCreate"));
    if (p.batch > 1) {
      const int32_t count = int32_t(p.batch);
      const int64_t stride = rows * cols;
      TESSEL_RETURN_IF_ERROR(
          BlasStatus(cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                      &count, sizeof(count)),
                     "batch count"));
      TESSEL_RETURN_IF_ERROR(BlasStatus(
          cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                           &stride, sizeof(stride)),
          "batch stride"));
    }
    return absl::OkStatus();
  };
  TESSEL_RETURN_IF_ERROR(rt_trans ? layout(&p.a, p.k, p.n) : layout(&p.a, p.n, p.k));
  TESSEL_RETURN_IF_ERROR(lt_trans ? layout(&p.b, p.m, p.k) : layout(&p.b, p.k, p.m));
  TESSEL_RETURN_IF_ERROR(layout(&p.c, p.n, p.m));
  cublasLtMatmulPreference_t pref = nullptr;
  TESSEL_RETURN_IF_ERROR(
      BlasStatus(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate"));
  const uint64_t ws = kBlasWorkspace;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s =
      cublasLtMatmulAlgoGetHeuristic(blas_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  TESSEL_RETURN_IF_ERROR(BlasStatus(s, "cublasLtMatmulAlgoGetHeuristic"));
  if (found == 0) {
    return absl::UnimplementedError(StrCat("cuBLASLt has no algorithm for dot_general '",
                                           in.node->name(), "' (", TypeString(lt), " x ",
                                           TypeString(rt), ")"));
  }
  p.algo = result.algo;
  return absl::OkStatus();
}

absl::Status CudaExecutable::Launch(const KernelLaunch& l, const KernelParams& params) {
  if (l.elements <= 0) return absl::OkStatus();
  if (l.index < 0 || l.index >= int(kernels_.size())) {
    return absl::InternalError(StrCat("cuda device: no kernel ", l.kernel));
  }
  const int64_t blocks = std::min<int64_t>((l.elements + kThreadsPerBlock - 1) / kThreadsPerBlock,
                                           int64_t(device_->multiprocessors()) * 16);
  void* args[] = {const_cast<KernelParams*>(&params)};
  return CudaStatus(cudaLaunchKernel(reinterpret_cast<const void*>(kernels_[l.index]),
                                     dim3(unsigned(std::max<int64_t>(blocks, 1))),
                                     dim3(kThreadsPerBlock), args, 0, device_->stream()),
                    "cudaLaunchKernel");
}

absl::Status CudaExecutable::RunDot(const DotPlan& d, const void* lhs, const void* rhs, void* out) {
  BufferPtr lt, rt;
  if (d.lhs_transpose) {
    TESSEL_ASSIGN_OR_RETURN(lt, device_->Allocate(d.lhs_bytes));
    KernelParams p;
    p.p[0] = const_cast<void*>(lhs);
    p.p[1] = lt->opaque();
    TESSEL_RETURN_IF_ERROR(Launch(*d.lhs_transpose, p));
    lhs = lt->opaque();
  }
  if (d.rhs_transpose) {
    TESSEL_ASSIGN_OR_RETURN(rt, device_->Allocate(d.rhs_bytes));
    KernelParams p;
    p.p[0] = const_cast<void*>(rhs);
    p.p[1] = rt->opaque();
    TESSEL_RETURN_IF_ERROR(Launch(*d.rhs_transpose, p));
    rhs = rt->opaque();
  }
  if (d.gemm_kernel) {
    KernelParams p;
    p.p[0] = const_cast<void*>(lhs);
    p.p[1] = const_cast<void*>(rhs);
    p.p[2] = out;
    return Launch(*d.gemm_kernel, p);
  }
  if (d.desc == nullptr) return absl::OkStatus();  // an empty product: the caller zeroed the output
  TESSEL_ASSIGN_OR_RETURN(BufferPtr ws, device_->Allocate(kBlasWorkspace));
  const float alpha32 = 1, beta32 = 0;
  const double alpha64 = 1, beta64 = 0;
  const void* alpha = d.f64 ? static_cast<const void*>(&alpha64) : &alpha32;
  const void* beta = d.f64 ? static_cast<const void*>(&beta64) : &beta32;
  return BlasStatus(cublasLtMatmul(blas_, d.desc, alpha, rhs, d.a, lhs, d.b, beta, out, d.c, out,
                                   d.c, &d.algo, ws->opaque(), kBlasWorkspace, device_->stream()),
                    "cublasLtMatmul");
}

absl::Status CudaExecutable::RunCollective(int i, const v1::Node& n, const v1::TensorType& in_type,
                                           const void* in, void* out,
                                           const worker::StepContext& ctx) {
  const v1::CollectiveAttrs& c = n.collective();
  const std::string what =
      StrCat(OpName(n.op()), " '", n.name(), "' over ", absl::StrJoin(c.axes(), ","));
  TESSEL_ASSIGN_OR_RETURN(worker::ResolvedGroup g,
                          worker::ResolveGroup(slots_.program(), n, ctx, what));
  const int64_t in_bytes = ByteSizeUnchecked(in_type), out_bytes = ByteSizeUnchecked(n.type());
  if (g.size == 1) {  // a group of one: every collective is a copy
    if (in == out) return absl::OkStatus();
    return CudaStatus(cudaMemcpyAsync(out, in, std::min(in_bytes, out_bytes),
                                      cudaMemcpyDeviceToDevice, device_->stream()),
                      "cudaMemcpyAsync (collective of one)");
  }
  if (device_->nccl() == nullptr) {
    return absl::FailedPreconditionError(
        StrCat(what, ": this cuda device has no NCCL communicators"));
  }
  const CollectivePlan& plan = *prepared_[i].collective;
  const int64_t esize = DTypeSize(n.type().dtype());
  NcclCall call;
  call.in = in;
  call.out = out;
  call.dtype = n.type().dtype();
  call.op = worker::ReduceOpOf(c.kind());
  worker::BufferPtr before, after;  // stream order: freeing them after queueing is safe
  if (plan.before) {
    TESSEL_ASSIGN_OR_RETURN(before, device_->Allocate(plan.staged_bytes));
    KernelParams p;
    p.p[0] = const_cast<void*>(in);
    p.p[1] = before->opaque();
    TESSEL_RETURN_IF_ERROR(Launch(*plan.before, p));
    call.in = before->opaque();
  }
  if (plan.after) {
    TESSEL_ASSIGN_OR_RETURN(after, device_->Allocate(plan.staged_bytes));
    call.out = after->opaque();
  }
  switch (n.op()) {
    case v1::ALL_REDUCE:
      call.kind = NcclCall::Kind::kAllReduce;
      call.count = in_bytes / esize;
      break;
    case v1::ALL_GATHER:
      call.kind = NcclCall::Kind::kAllGather;
      call.count = in_bytes / esize;
      break;
    case v1::REDUCE_SCATTER:
      call.kind = NcclCall::Kind::kReduceScatter;
      call.count = out_bytes / esize;
      break;
    case v1::ALL_TO_ALL:
      call.kind = NcclCall::Kind::kAllToAll;
      call.count = in_bytes / esize / g.size;
      break;
    default:
      call.kind = NcclCall::Kind::kPermute;
      call.count = in_bytes / esize;
      for (int k = 0; k + 1 < c.source_target_pairs_size(); k += 2) {
        call.pairs.emplace_back(int(c.source_target_pairs(k)), int(c.source_target_pairs(k + 1)));
      }
  }
  TESSEL_ASSIGN_OR_RETURN(
      NcclGroups::Check check,
      device_->nccl()->Run(g, worker::IdOf(ctx, i), call, device_->nccl_device(),
                           ctx.collectives->rendezvous_store()));
  device_->AddFenceCheck(std::move(check));
  if (plan.after) {
    KernelParams p;
    p.p[0] = after->opaque();
    p.p[1] = out;
    TESSEL_RETURN_IF_ERROR(Launch(*plan.after, p));
  }
  return absl::OkStatus();
}

std::optional<CudaExecutable::CollectivePlan> CudaExecutable::PlanCollective(
    const v1::Node& n, const v1::TensorType& in_type, int64_t k, ModuleSource& module) {
  if (k <= 1) return std::nullopt;
  CollectivePlan plan;
  const v1::CollectiveAttrs& c = n.collective();
  const v1::DType dt = n.type().dtype();
  switch (n.op()) {
    case v1::ALL_GATHER: {
      const worker::AxisSplit s = worker::SplitAround(in_type, c.dimension());
      if (s.outer > 1)
        plan.after =
            module.AddSwapMajor(dt, s.outer, k, s.extent * s.inner, /*to_rank_major=*/false);
      plan.staged_bytes = ByteSizeUnchecked(n.type());
      break;
    }
    case v1::REDUCE_SCATTER: {
      const worker::AxisSplit s = worker::SplitAround(in_type, c.dimension());
      if (s.outer > 1)
        plan.before =
            module.AddSwapMajor(dt, s.outer, k, s.extent / k * s.inner, /*to_rank_major=*/true);
      plan.staged_bytes = ByteSizeUnchecked(in_type);
      break;
    }
    case v1::ALL_TO_ALL: {
      const worker::AxisSplit s = worker::SplitAround(in_type, c.dimension());
      if (s.outer > 1)
        plan.before =
            module.AddSwapMajor(dt, s.outer, k, s.extent / k * s.inner, /*to_rank_major=*/true);
      // Block i (from rank i) takes position i along the concat dimension.
      v1::TensorType block = in_type;
      block.set_dims(c.dimension(), in_type.dims(c.dimension()) / k);
      const worker::AxisSplit cs = worker::SplitAround(block, c.concat_dimension());
      if (cs.outer > 1)
        plan.after =
            module.AddSwapMajor(dt, cs.outer, k, cs.extent * cs.inner, /*to_rank_major=*/false);
      plan.staged_bytes = ByteSizeUnchecked(in_type);
      break;
    }
    default: break;
  }
  return plan;
}

absl::Status CudaExecutable::Execute(int i, std::vector<BufferPtr>& values,
                                     const std::vector<BufferPtr>& preset,
                                     const worker::StepContext& ctx) {
  const worker::SlotProgram::Instr& in = slots_.instrs()[i];
  const Prepared& prep = prepared_[i];
  KernelParams params;
  for (size_t k = 0; k < in.args.size(); ++k) params.p[k] = values[in.args[k]]->opaque();
  std::vector<BufferPtr> results;
  const bool aliases = in.node != nullptr && (in.node->op() == v1::RESHAPE || prep.literal);
  if (!aliases) {
    for (size_t k = 0; k < in.results.size(); ++k) {
      TESSEL_ASSIGN_OR_RETURN(
          BufferPtr b, worker::SlotProgram::ResultBuffer(*device_, preset, in.results[k],
                                                         ByteSizeUnchecked(in.result_types[k])));
      params.p[in.args.size() + k] = b->opaque();
      results.push_back(std::move(b));
    }
  }
  auto store = [&] {
    for (size_t k = 0; k < results.size(); ++k) values[in.results[k]] = std::move(results[k]);
    return absl::OkStatus();
  };
  if (in.fusion != nullptr) {
    TESSEL_RETURN_IF_ERROR(Launch(prep.kernels[0], params));
    return store();
  }
  const v1::Node& n = *in.node;
  const v1::Program& program = slots_.program();
  switch (n.op()) {
    case v1::RESHAPE: values[in.results[0]] = values[in.args[0]]; return absl::OkStatus();
    case v1::CONSTANT:
      if (prep.literal) {
        values[in.results[0]] = prep.literal;
        return absl::OkStatus();
      }
      if (n.constant().has_iota() && n.constant().iota().sharded_axes_size() > 0) {
        const v1::Iota& iota = n.constant().iota();
        params.s[0] = IndexAlong(program.mesh(), ctx.mesh_position, Axes(iota.sharded_axes())) *
                      n.type().dims(iota.dimension());
      }
      TESSEL_RETURN_IF_ERROR(Launch(prep.kernels[0], params));
      break;
    case v1::REDUCE: {
      const ReducePlan& plan = *prep.reduce;
      BufferPtr prev;
      for (size_t k = 0; k < plan.passes.size(); ++k) {
        KernelParams p;
        p.p[0] = k == 0 ? params.p[0] : prev->opaque();
        BufferPtr next;
        if (k + 1 < plan.passes.size()) {
          TESSEL_ASSIGN_OR_RETURN(
              next, device_->Allocate(plan.partial_elements[k] * plan.accumulator_bytes));
          p.p[1] = next->opaque();
        } else {
          p.p[1] = params.p[1];
        }
        TESSEL_RETURN_IF_ERROR(Launch(plan.passes[k], p));
        prev = std::move(next);  // stream order: freeing after queueing is safe
      }
      break;
    }
    case v1::DOT_GENERAL: {
      const DotPlan& d = *prep.dot;
      if (d.k == 0 || (!d.gemm_kernel && d.desc == nullptr)) {
        TESSEL_RETURN_IF_ERROR(CudaStatus(
            cudaMemsetAsync(params.p[2], 0, ByteSizeUnchecked(n.type()), device_->stream()),
            "cudaMemsetAsync"));
      }
      if (d.k > 0) TESSEL_RETURN_IF_ERROR(RunDot(d, params.p[0], params.p[1], params.p[2]));
      break;
    }
    case v1::SHARD_SLICE:
    case v1::AXIS_INDEX:
      params.s[0] = IndexAlong(program.mesh(), ctx.mesh_position, Axes(n.collective().axes()));
      TESSEL_RETURN_IF_ERROR(Launch(prep.kernels[0], params));
      break;
    case v1::ALL_REDUCE:
    case v1::ALL_GATHER:
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
    case v1::COLLECTIVE_PERMUTE:
      if (ctx.last_collective != nullptr)
        *ctx.last_collective = i;  // a failure abandons only the later ones
      TESSEL_RETURN_IF_ERROR(RunCollective(i, n, in.arg_types[0], params.p[0], params.p[1], ctx));
      break;
    case v1::SORT: {  // keys, the operand it moves, the result
      KernelParams p;
      p.p[0] = params.p[0];
      p.p[1] = params.p[n.sort().result_operand()];
      p.p[2] = params.p[in.args.size()];
      TESSEL_RETURN_IF_ERROR(Launch(prep.kernels[0], p));
      break;
    }
    default:  // layout ops, arg reductions, gather, scatter, convolution
      TESSEL_RETURN_IF_ERROR(Launch(prep.kernels[0], params));
  }
  return store();
}

absl::StatusOr<std::vector<BufferPtr>> CudaExecutable::Run(absl::Span<const BufferPtr> args,
                                                           absl::Span<const BufferPtr> into,
                                                           const worker::StepContext& ctx) {
  TESSEL_RETURN_IF_ERROR(device_->Activate());
  // Inside a function the context takes the call's scope; copied once, and
  // only by a program that runs functions.
  std::optional<worker::StepContext> inner;
  return slots_.Run(args, into, *device_,
                    [&](int i, std::vector<BufferPtr>& values, const std::vector<BufferPtr>& preset,
                        uint64_t scope) {
                      if (scope == ctx.scope) return Execute(i, values, preset, ctx);
                      if (!inner) inner.emplace(ctx);
                      inner->scope = scope;
                      return Execute(i, values, preset, *inner);
                    });
}

}  // namespace tessel::cuda
