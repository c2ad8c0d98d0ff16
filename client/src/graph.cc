#include "tessel/graph.h"

#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/src/convert_internal.h"
#include "client/src/graph_internal.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessel {

absl::StatusOr<Graph> Graph::FromTextProto(const std::string& text) {
  auto impl = std::make_shared<GraphImpl>();
  struct Collector : google::protobuf::io::ErrorCollector {
    std::string first;
    void AddError(int line, int column, const std::string& message) override {
      if (first.empty())
        first = absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message);
    }
  } errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &impl->proto)) {
    return absl::InvalidArgumentError(absl::StrCat("graph text does not parse: ", errors.first));
  }
  return Graph(std::move(impl));
}

absl::StatusOr<Graph> Graph::FromFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open graph file '", path, "'"));
  std::stringstream ss;
  ss << in.rdbuf();
  auto g = FromTextProto(ss.str());
  if (!g.ok())
    return absl::Status(g.status().code(), absl::StrCat(path, ": ", g.status().message()));
  return g;
}

std::string Graph::ToTextProto() const {
  std::string s;
  google::protobuf::TextFormat::PrintToString(impl_->proto, &s);
  return s;
}

const std::string& Graph::name() const { return impl_->proto.name(); }
int Graph::num_nodes() const { return impl_->proto.nodes_size(); }

std::vector<ArrayType> Graph::parameter_types() const {
  std::vector<ArrayType> out;
  for (const v1::Node& n : impl_->proto.nodes()) {
    if (n.op() != v1::PARAMETER) continue;
    size_t i = n.parameter().index();
    if (i >= out.size()) out.resize(i + 1);
    out[i] = FromProto(n.type());
  }
  return out;
}

std::vector<std::string> Graph::parameter_names() const {
  std::vector<std::string> out;
  for (const v1::Node& n : impl_->proto.nodes()) {
    if (n.op() != v1::PARAMETER) continue;
    size_t i = n.parameter().index();
    if (i >= out.size()) out.resize(i + 1);
    out[i] = n.name();
  }
  return out;
}

std::vector<std::string> Graph::output_names() const {
  return std::vector<std::string>(impl_->proto.outputs().begin(), impl_->proto.outputs().end());
}

// ------------------------------------------------------------------ builder

GraphBuilder::GraphBuilder(std::string name) : impl_(std::make_unique<Impl>(std::move(name))) {}
GraphBuilder::~GraphBuilder() = default;

Value GraphBuilder::Parameter(ArrayType type, std::string name) {
  v1::Node n = NodeOf(v1::PARAMETER);
  n.set_name(name);
  n.mutable_parameter()->set_index(impl_->num_parameters);
  *n.mutable_type() = ToProto(type);
  Value v = impl_->Add(std::move(n), {});
  if (v.valid()) ++impl_->num_parameters;
  return v;
}

Value GraphBuilder::Constant(const HostArray& literal) {
  v1::Node n = NodeOf(v1::CONSTANT);
  *n.mutable_type() = ToProto(literal.type());
  n.mutable_constant()->mutable_literal()->set_data(literal.data(), literal.size_bytes());
  return impl_->Add(std::move(n), {});
}

Value GraphBuilder::Fill(ArrayType type, double value) {
  v1::Node n = NodeOf(v1::CONSTANT);
  *n.mutable_type() = ToProto(type);
  if (IsInteger(ToProto(type.dtype))) {
    // A uint64 fill past int64 travels as its bit pattern (the kernel wraps it back).
    const int64_t i = value >= 0x1p63 ? int64_t(uint64_t(value)) : static_cast<int64_t>(value);
    n.mutable_constant()->mutable_fill()->set_i(i);
  } else {
    n.mutable_constant()->mutable_fill()->set_f(value);
  }
  return impl_->Add(std::move(n), {});
}

Value GraphBuilder::Iota(ArrayType type, int64_t dimension) {
  v1::Node n = NodeOf(v1::CONSTANT);
  *n.mutable_type() = ToProto(type);
  n.mutable_constant()->mutable_iota()->set_dimension(dimension);
  return impl_->Add(std::move(n), {});
}

#define TESSEL_UNARY(Name, OP) \
  Value GraphBuilder::Name(Value x) { return impl_->Add(NodeOf(v1::OP), {x}); }
TESSEL_UNARY(Neg, NEG)
TESSEL_UNARY(Abs, ABS)
TESSEL_UNARY(Exp, EXP)
TESSEL_UNARY(Log, LOG)
TESSEL_UNARY(Log1p, LOG1P)
TESSEL_UNARY(Tanh, TANH)
TESSEL_UNARY(Logistic, LOGISTIC)
TESSEL_UNARY(Sqrt, SQRT)
TESSEL_UNARY(Rsqrt, RSQRT)
TESSEL_UNARY(Floor, FLOOR)
TESSEL_UNARY(Ceil, CEIL)
TESSEL_UNARY(Round, ROUND)
TESSEL_UNARY(Sign, SIGN)
TESSEL_UNARY(Not, NOT)
TESSEL_UNARY(Sin, SIN)
TESSEL_UNARY(Cos, COS)
TESSEL_UNARY(Tan, TAN)
TESSEL_UNARY(Asin, ASIN)
TESSEL_UNARY(Acos, ACOS)
TESSEL_UNARY(Atan, ATAN)
TESSEL_UNARY(Sinh, SINH)
TESSEL_UNARY(Cosh, COSH)
TESSEL_UNARY(Asinh, ASINH)
TESSEL_UNARY(Acosh, ACOSH)
TESSEL_UNARY(Atanh, ATANH)
TESSEL_UNARY(Expm1, EXPM1)
TESSEL_UNARY(Erf, ERF)
#undef TESSEL_UNARY

#define TESSEL_BINARY(Name, OP) \
  Value GraphBuilder::Name(Value a, Value b) { return impl_->Add(NodeOf(v1::OP), {a, b}); }
TESSEL_BINARY(Add, ADD)
TESSEL_BINARY(Sub, SUB)
TESSEL_BINARY(Mul, MUL)
TESSEL_BINARY(Div, DIV)
TESSEL_BINARY(Rem, REM)
TESSEL_BINARY(Pow, POW)
TESSEL_BINARY(Max, MAX)
TESSEL_BINARY(Min, MIN)
TESSEL_BINARY(And, AND)
TESSEL_BINARY(Or, OR)
TESSEL_BINARY(Xor, XOR)
TESSEL_BINARY(Atan2, ATAN2)
#undef TESSEL_BINARY

Value GraphBuilder::Compare(Value a, Value b, Comparison c) {
  v1::Node n = NodeOf(v1::COMPARE);
  n.mutable_compare()->set_direction(static_cast<v1::CompareDirection>(static_cast<int>(c) + 1));
  return impl_->Add(std::move(n), {a, b});
}

Value GraphBuilder::Select(Value p, Value t, Value f) {
  return impl_->Add(NodeOf(v1::SELECT), {p, t, f});
}
Value GraphBuilder::Clamp(Value lo, Value x, Value hi) {
  return impl_->Add(NodeOf(v1::CLAMP), {lo, x, hi});
}

Value GraphBuilder::Convert(Value x, DType to) {
  v1::Node n = NodeOf(v1::CONVERT);
  n.mutable_convert()->set_dtype(ToProto(to));
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::BitcastConvert(Value x, DType to) {
  v1::Node n = NodeOf(v1::CONVERT);
  n.mutable_convert()->set_dtype(ToProto(to));
  n.mutable_convert()->set_bitcast(true);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::BroadcastInDim(Value x, std::vector<int64_t> dims, std::vector<int64_t> bd) {
  v1::Node n = NodeOf(v1::BROADCAST_IN_DIM);
  Assign(n.mutable_broadcast_in_dim()->mutable_dims(), dims);
  Assign(n.mutable_broadcast_in_dim()->mutable_broadcast_dimensions(), bd);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::Broadcast(Value x, std::vector<int64_t> dims) {
  if (x.valid() && !x.type().dims.empty()) x = Reshape(x, {});
  return BroadcastInDim(x, std::move(dims), {});
}

Value GraphBuilder::Reshape(Value x, std::vector<int64_t> dims) {
  v1::Node n = NodeOf(v1::RESHAPE);
  Assign(n.mutable_reshape()->mutable_dims(), dims);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::Transpose(Value x, std::vector<int64_t> perm) {
  v1::Node n = NodeOf(v1::TRANSPOSE);
  Assign(n.mutable_transpose()->mutable_permutation(), perm);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::Slice(Value x, std::vector<int64_t> start, std::vector<int64_t> limit,
                          std::vector<int64_t> strides) {
  v1::Node n = NodeOf(v1::SLICE);
  Assign(n.mutable_slice()->mutable_start(), start);
  Assign(n.mutable_slice()->mutable_limit(), limit);
  Assign(n.mutable_slice()->mutable_strides(), strides);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::Reverse(Value x, std::vector<int64_t> dimensions) {
  v1::Node n = NodeOf(v1::REVERSE);
  Assign(n.mutable_reverse()->mutable_dimensions(), dimensions);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::Sort(std::vector<Value> operands, int64_t dimension, bool descending,
                         int result_operand) {
  v1::Node n = NodeOf(v1::SORT);
  n.mutable_sort()->set_dimension(dimension);
  n.mutable_sort()->set_descending(descending);
  n.mutable_sort()->set_result_operand(result_operand);
  return impl_->Add(std::move(n), operands);
}

Value GraphBuilder::Gather(Value x, Value indices, int64_t axis) {
  v1::Node n = NodeOf(v1::GATHER);
  n.mutable_gather()->set_axis(axis);
  return impl_->Add(std::move(n), {x, indices});
}

Value GraphBuilder::Scatter(Value x, Value indices, Value updates, int64_t axis,
                            std::optional<ReduceKind> combine) {
  v1::Node n = NodeOf(v1::SCATTER);
  n.mutable_scatter()->set_axis(axis);
  if (combine)
    n.mutable_scatter()->set_combine(static_cast<v1::ReduceKind>(static_cast<int>(*combine) + 1));
  return impl_->Add(std::move(n), {x, indices, updates});
}

Value GraphBuilder::Concatenate(std::vector<Value> xs, int64_t dimension) {
  v1::Node n = NodeOf(v1::CONCATENATE);
  n.mutable_concatenate()->set_dimension(dimension);
  return impl_->Add(std::move(n), xs);
}

Value GraphBuilder::Pad(Value x, Value pv, std::vector<int64_t> low, std::vector<int64_t> high,
                        std::vector<int64_t> interior) {
  v1::Node n = NodeOf(v1::PAD);
  Assign(n.mutable_pad()->mutable_low(), low);
  Assign(n.mutable_pad()->mutable_high(), high);
  Assign(n.mutable_pad()->mutable_interior(), interior);
  return impl_->Add(std::move(n), {x, pv});
}

Value GraphBuilder::DotGeneral(Value lhs, Value rhs, DotDims d) {
  v1::Node n = NodeOf(v1::DOT_GENERAL);
  auto* a = n.mutable_dot_general();
  Assign(a->mutable_lhs_batch(), d.lhs_batch);
  Assign(a->mutable_rhs_batch(), d.rhs_batch);
  Assign(a->mutable_lhs_contracting(), d.lhs_contracting);
  Assign(a->mutable_rhs_contracting(), d.rhs_contracting);
  return impl_->Add(std::move(n), {lhs, rhs});
}

Value GraphBuilder::MatMul(Value lhs, Value rhs) {
  return DotGeneral(lhs, rhs, DotDims{{}, {}, {1}, {0}});
}

Value GraphBuilder::Reduce(Value x, ReduceKind kind, std::vector<int64_t> dims) {
  v1::Node n = NodeOf(v1::REDUCE);
  n.mutable_reduce()->set_kind(static_cast<v1::ReduceKind>(static_cast<int>(kind) + 1));
  Assign(n.mutable_reduce()->mutable_dims(), dims);
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::ArgMax(Value x, int64_t dimension, DType index_dtype) {
  v1::Node n = NodeOf(v1::ARGMAX);
  n.mutable_arg_reduce()->set_dimension(dimension);
  n.mutable_arg_reduce()->set_index_dtype(ToProto(index_dtype));
  return impl_->Add(std::move(n), {x});
}

Value GraphBuilder::ArgMin(Value x, int64_t dimension, DType index_dtype) {
  v1::Node n = NodeOf(v1::ARGMIN);
  n.mutable_arg_reduce()->set_dimension(dimension);
  n.mutable_arg_reduce()->set_index_dtype(ToProto(index_dtype));
  return impl_->Add(std::move(n), {x});
}

// ---------------------------------------------------------- partitioned ops

Value GraphBuilder::ShardingConstraint(Value x, const Sharding& sharding) {
  v1::Node n = NodeOf(v1::SHARDING_CONSTRAINT);
  *n.mutable_sharding()->mutable_sharding() = ToProto(sharding);
  const v1::TensorType declared = ToProto(x.type());
  return impl_->Add(std::move(n), {x}, &declared);
}

Value GraphBuilder::ManualRegion(const Mesh& mesh, std::vector<Value> operands,
                                 std::vector<Sharding> in_specs, Sharding out_spec,
                                 const Body& body, std::string name) {
  if (!impl_->status.ok()) return Value();
  const std::string what = absl::StrCat("manual region '", name.empty() ? "(unnamed)" : name, "'");
  if (in_specs.size() != operands.size()) {
    return impl_->Fail(
        what, absl::StrCat(operands.size(), " operands but ", in_specs.size(), " in_specs"));
  }
  GraphBuilder inner(name.empty() ? "region" : name);
  inner.impl_->mesh = mesh;
  std::vector<Value> blocks;
  for (size_t i = 0; i < operands.size(); ++i) {
    if (!operands[i].valid())
      return impl_->Fail(what, absl::StrCat("operand ", i, " is not a value of this builder"));
    ArrayType t = operands[i].type();
    t.dims = in_specs[i].BlockDims(mesh, t.dims);
    blocks.push_back(inner.Parameter(t, absl::StrCat("x", i)));
  }
  const Value out = body(inner, blocks);
  absl::StatusOr<Graph> g = inner.Build({out});
  if (!g.ok()) return impl_->Fail(what, g.status().message());
  ArrayType global = out.type();
  for (size_t d = 0; d < out_spec.dims.size() && d < global.dims.size(); ++d) {
    global.dims[d] *= mesh.axes_size(out_spec.dims[d]);
  }
  v1::Node n = NodeOf(v1::MANUAL_REGION);
  n.set_name(name);
  v1::ManualRegionAttrs& m = *n.mutable_manual_region();
  *m.mutable_body() = g->impl().proto;
  for (const Sharding& s : in_specs) *m.add_in_specs() = ToProto(s);
  *m.mutable_out_spec() = ToProto(out_spec);
  const v1::TensorType declared = ToProto(global);
  return impl_->Add(std::move(n), operands, &declared);
}

std::vector<Value> GraphBuilder::MeshRegion(const Mesh& mesh, std::vector<Value> operands,
                                            std::vector<Sharding> in_shardings,
                                            std::vector<Sharding> out_shardings,
                                            const MultiBody& body, std::string name) {
  if (!impl_->status.ok()) return {};
  const std::string what = absl::StrCat("mesh region '", name, "'");
  if (in_shardings.size() != operands.size()) {
    return impl_->Fail(what, absl::StrCat(operands.size(), " operands but ", in_shardings.size(),
                                          " in_shardings")),
           std::vector<Value>{};
  }
  GraphBuilder inner(name);
  inner.impl_->mesh = mesh;
  std::vector<Value> params;
  for (size_t i = 0; i < operands.size(); ++i) {
    if (!operands[i].valid()) {
      return impl_->Fail(what, absl::StrCat("operand ", i, " is not a value")),
             std::vector<Value>{};
    }
    params.push_back(inner.Parameter(operands[i].type(), absl::StrCat("x", i)));
  }
  const std::vector<Value> outs = body(inner, params);
  if (outs.size() != out_shardings.size()) {
    return impl_->Fail(what, absl::StrCat(outs.size(), " results but ", out_shardings.size(),
                                          " out_shardings")),
           std::vector<Value>{};
  }
  absl::StatusOr<Graph> g = inner.Build(outs);
  if (!g.ok()) return impl_->Fail(what, g.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::MESH_REGION);
  n.set_name(name);
  v1::MeshRegionAttrs& m = *n.mutable_mesh_region();
  *m.mutable_body() = g->impl().proto;
  // Functions the body's control flow runs are listed at the top level.
  for (v1::Graph& nested : *m.mutable_body()->mutable_functions())
    *impl_->graph.add_functions() = std::move(nested);
  m.mutable_body()->clear_functions();
  *m.mutable_mesh() = ToProto(mesh);
  for (const Sharding& s : in_shardings) *m.add_in_shardings() = ToProto(s);
  for (const Sharding& s : out_shardings) *m.add_out_shardings() = ToProto(s);
  std::vector<ArrayType> types;
  for (const Value& v : outs) types.push_back(v.type());
  return impl_->ControlNode(std::move(n), operands, types);
}

Value GraphBuilder::AllReduce(Value x, std::vector<std::string> axes, ReduceKind kind) {
  return impl_->Collective(v1::ALL_REDUCE, {x}, axes,
                           [&](v1::CollectiveAttrs& c) { c.set_kind(ToProto(kind)); });
}

Value GraphBuilder::AllGather(Value x, std::vector<std::string> axes, int64_t dimension) {
  return impl_->Collective(v1::ALL_GATHER, {x}, axes,
                           [&](v1::CollectiveAttrs& c) { c.set_dimension(dimension); });
}

Value GraphBuilder::ReduceScatter(Value x, std::vector<std::string> axes, int64_t dimension,
                                  ReduceKind kind) {
  return impl_->Collective(v1::REDUCE_SCATTER, {x}, axes, [&](v1::CollectiveAttrs& c) {
    c.set_dimension(dimension);
    c.set_kind(ToProto(kind));
  });
}

Value GraphBuilder::AllToAll(Value x, std::vector<std::string> axes, int64_t split_dimension,
                             int64_t concat_dimension) {
  return impl_->Collective(v1::ALL_TO_ALL, {x}, axes, [&](v1::CollectiveAttrs& c) {
    c.set_dimension(split_dimension);
    c.set_concat_dimension(concat_dimension);
  });
}

Value GraphBuilder::CollectivePermute(Value x, std::vector<std::string> axes,
                                      std::vector<std::pair<int64_t, int64_t>> pairs) {
  return impl_->Collective(v1::COLLECTIVE_PERMUTE, {x}, axes, [&](v1::CollectiveAttrs& c) {
    for (auto [src, dst] : pairs) {
      c.add_source_target_pairs(src);
      c.add_source_target_pairs(dst);
    }
  });
}

Value GraphBuilder::AxisIndex(std::vector<std::string> axes) {
  return impl_->Collective(v1::AXIS_INDEX, {}, axes, [](v1::CollectiveAttrs&) {});
}

Value GraphBuilder::CustomKernel(std::string name, std::vector<Value> operands,
                                 const Body& decomposition, ReplicationRule replication,
                                 std::string cuda_source) {
  if (!impl_->status.ok()) return Value();
  const std::string what = absl::StrCat("custom kernel '", name, "'");
  GraphBuilder inner(name);
  std::vector<Value> params;
  for (size_t i = 0; i < operands.size(); ++i) {
    if (!operands[i].valid())
      return impl_->Fail(what, absl::StrCat("operand ", i, " is not a value of this builder"));
    params.push_back(inner.Parameter(operands[i].type(), absl::StrCat("x", i)));
  }
  const Value out = decomposition(inner, params);
  absl::StatusOr<Graph> g = inner.Build({out});
  if (!g.ok()) return impl_->Fail(what, g.status().message());
  v1::Node n = NodeOf(v1::CUSTOM_KERNEL);
  v1::CustomKernelAttrs& k = *n.mutable_custom_kernel();
  k.set_name(name);
  k.set_cuda_source(cuda_source);
  *k.mutable_decomposition() = g->impl().proto;
  v1::ReplicationRule& r = *k.mutable_replication();
  r.set_kind(static_cast<v1::ReplicationRule::Kind>(static_cast<int>(replication.kind)));
  r.set_operand(replication.operand);
  for (const std::string& a : replication.axes) r.add_axes(a);
  const v1::TensorType declared = ToProto(out.type());
  return impl_->Add(std::move(n), operands, &declared);
}

absl::Status GraphBuilder::status() const { return impl_->status; }

absl::StatusOr<Graph> GraphBuilder::Build(const std::vector<Value>& outputs) {
  if (!impl_->status.ok()) return impl_->status;
  if (outputs.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("graph '", impl_->graph.name(), "' has no outputs"));
  auto impl = std::make_shared<GraphImpl>();
  impl->proto = impl_->graph;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat("graph '", impl_->graph.name(), "': output ", i, " is not a value"));
    }
    impl->proto.add_outputs(outputs[i].name());
  }
  return Graph(std::move(impl));
}

}  // namespace tessel
