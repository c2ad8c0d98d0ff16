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

class GraphBuilder::Impl {
 public:
  explicit Impl(std::string name) { graph.set_name(std::move(name)); }

  // Adds `node`, typed by the shared shape rules, or as `declared` when set
  // (the partitioned ops, whose types the builder works out itself).
  Value Add(v1::Node node, const std::vector<Value>& operands,
            const v1::TensorType* declared = nullptr) {
    if (!status.ok()) return Value();
    std::vector<const v1::TensorType*> types;
    for (size_t i = 0; i < operands.size(); ++i) {
      const Value& v = operands[i];
      if (!v.valid() || v.id_ >= graph.nodes_size() || graph.nodes(v.id_).name() != v.name()) {
        status = absl::InvalidArgumentError(absl::StrCat("graph '", graph.name(),
                                                         "': ", OpName(node.op()), ": operand ", i,
                                                         " is not a value of this builder"));
        return Value();
      }
      node.add_operands(v.name());
      types.push_back(&graph.nodes(v.id_).type());
    }
    const int id = graph.nodes_size();
    if (node.name().empty()) node.set_name(absl::StrCat(OpName(node.op()), "_", id));
    auto t =
        declared != nullptr ? absl::StatusOr<v1::TensorType>(*declared) : InferType(node, types);
    if (!t.ok()) {
      status =
          absl::InvalidArgumentError(absl::StrCat("graph '", graph.name(), "': ", OpName(node.op()),
                                                  " '", node.name(), "': ", t.status().message()));
      return Value();
    }
    *node.mutable_type() = *t;
    Value v;
    v.id_ = id;
    v.type_ = FromProto(*t);
    v.name_ = node.name();
    *graph.add_nodes() = std::move(node);
    return v;
  }

  using Function = GraphBuilder::Function;
  absl::StatusOr<std::vector<ArrayType>> AddFunction(const std::string& fn_name,
                                                     const std::vector<ArrayType>& types,
                                                     const Function& fn,
                                                     const std::vector<ArrayType>* want,
                                                     const std::string& want_what);
  std::vector<Value> ControlNode(v1::Node n, const std::vector<Value>& operands,
                                 const std::vector<ArrayType>& results);
  std::vector<Value> Derivative(
      v1::Op op, const Function& f, const std::vector<Value>& args, const std::vector<Value>& extra,
      const std::vector<int>& wrt,
      const std::function<std::vector<ArrayType>(const std::vector<ArrayType>& results,
                                                 const std::vector<ArrayType>& args)>& more);

  // The types of `args` into `types`; false (and the builder failed) where
  // one is not a value.
  bool ArgTypes(const std::vector<Value>& args, absl::string_view what,
                std::vector<ArrayType>& types) {
    for (const Value& v : args) {
      if (!v.valid()) return Fail(what, "an argument is not a value"), false;
      types.push_back(v.type());
    }
    return true;
  }

  Value Fail(absl::string_view what, absl::string_view why) {
    if (status.ok())
      status =
          absl::InvalidArgumentError(absl::StrCat("graph '", graph.name(), "': ", what, ": ", why));
    return Value();
  }

  // A collective over `axes`, typed by the coordinator's rules for
  // per-device blocks; `attrs` fills in the rest of its attributes.
  Value Collective(v1::Op op, std::vector<Value> operands, const std::vector<std::string>& axes,
                   const std::function<void(v1::CollectiveAttrs&)>& attrs) {
    const std::string what = OpName(op);
    if (!status.ok()) return Value();
    if (!mesh) return Fail(what, "collectives are explicit only inside a manual region's body");
    v1::Node n;
    n.set_op(op);
    v1::CollectiveAttrs& c = *n.mutable_collective();
    for (const std::string& a : axes) c.add_axes(a);
    attrs(c);
    std::vector<v1::TensorType> types;
    for (size_t i = 0; i < operands.size(); ++i) {
      if (!operands[i].valid())
        return Fail(what, absl::StrCat("operand ", i, " is not a value of this builder"));
      types.push_back(ToProto(operands[i].type()));
    }
    std::vector<const v1::TensorType*> ptrs;
    for (const v1::TensorType& t : types) ptrs.push_back(&t);
    absl::StatusOr<v1::TensorType> declared = InferCollectiveType(n, ptrs, ToProto(*mesh));
    if (!declared.ok()) return Fail(what, declared.status().message());
    return Add(std::move(n), operands, &*declared);
  }

  v1::Graph graph;
  int num_parameters = 0;
  absl::Status status;
  std::optional<Mesh> mesh;  // set in a manual region's body
};

namespace {
v1::Node NodeOf(v1::Op op) {
  v1::Node n;
  n.set_op(op);
  return n;
}
template <typename R>
void Assign(R* field, const std::vector<int64_t>& v) {
  for (int64_t x : v) field->Add(x);
}
}  // namespace

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

namespace {
std::string TypesText(const std::vector<Value>& vs) {
  std::vector<std::string> parts;
  for (const Value& v : vs) parts.push_back(TypeString(ToProto(v.type())));
  return absl::StrCat("(", absl::StrJoin(parts, ", "), ")");
}
}  // namespace

// Builds function `fn` of this graph over parameters of `types`; checks its
// results against `want` where given. Returns the results' types.
absl::StatusOr<std::vector<ArrayType>> GraphBuilder::Impl::AddFunction(
    const std::string& fn_name, const std::vector<ArrayType>& types, const Function& fn,
    const std::vector<ArrayType>* want, const std::string& want_what) {
  GraphBuilder inner(fn_name);
  inner.impl_->mesh = mesh;
  std::vector<Value> params;
  for (size_t i = 0; i < types.size(); ++i)
    params.push_back(inner.Parameter(types[i], absl::StrCat("p", i)));
  const std::vector<Value> out = fn(inner, params);
  absl::StatusOr<Graph> g = inner.Build(out);
  if (!g.ok()) return g.status();
  std::vector<ArrayType> got;
  for (const Value& v : out) got.push_back(v.type());
  if (want != nullptr) {
    bool same = got.size() == want->size();
    for (size_t i = 0; same && i < got.size(); ++i) same = got[i] == (*want)[i];
    if (!same) {
      std::vector<Value> wanted;
      for (const ArrayType& t : *want) {
        Value v;
        v.type_ = t;
        wanted.push_back(v);
      }
      return absl::InvalidArgumentError(absl::StrCat("function '", fn_name, "' returns ",
                                                     TypesText(out), "; expected ", want_what, " ",
                                                     TypesText(wanted)));
    }
  }
  v1::Graph proto = g->impl().proto;
  for (v1::Graph& nested : *proto.mutable_functions()) *graph.add_functions() = std::move(nested);
  proto.clear_functions();
  *graph.add_functions() = std::move(proto);
  return got;
}

std::vector<Value> GraphBuilder::Impl::ControlNode(v1::Node n, const std::vector<Value>& operands,
                                                   const std::vector<ArrayType>& results) {
  for (size_t i = 0; i < operands.size(); ++i) {
    const Value& v = operands[i];
    if (!v.valid() || v.id_ >= graph.nodes_size() || graph.nodes(v.id_).name() != v.name()) {
      Fail(absl::StrCat(OpName(n.op()), " '", n.name(), "'"),
           absl::StrCat("operand ", i, " is not a value of this builder"));
      return {};
    }
    n.add_operands(v.name());
  }
  for (const ArrayType& t : results) *n.add_results() = ToProto(t);
  Value node;
  node.id_ = graph.nodes_size();
  node.name_ = n.name();
  *graph.add_nodes() = n;
  std::vector<Value> out;
  for (size_t k = 0; k < results.size(); ++k) {
    v1::Node r = NodeOf(v1::TUPLE_ELEMENT);
    r.mutable_tuple_element()->set_index(int(k));
    const v1::TensorType declared = ToProto(results[k]);
    out.push_back(Add(std::move(r), {node}, &declared));
  }
  return out;
}

std::vector<Value> GraphBuilder::While(std::vector<Value> init, const Function& cond,
                                       const Function& body) {
  if (!impl_->status.ok()) return {};
  const int id = impl_->graph.nodes_size();
  const std::string name = absl::StrCat("while_", id);
  const std::string what = absl::StrCat("while '", name, "'");
  std::vector<ArrayType> types;
  for (const Value& v : init) {
    if (!v.valid()) return impl_->Fail(what, "a carry is not a value"), std::vector<Value>{};
    types.push_back(v.type());
  }
  const std::vector<ArrayType> pred = {ArrayType{DType::kPred, {}}};
  const std::string prefix = absl::StrCat(impl_->graph.name(), "/", name);
  auto c = impl_->AddFunction(prefix + "/cond", types, cond, &pred, "the loop predicate");
  if (!c.ok()) return impl_->Fail(what, c.status().message()), std::vector<Value>{};
  auto b = impl_->AddFunction(prefix + "/body", types, body, &types, "the carries");
  if (!b.ok()) return impl_->Fail(what, b.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::WHILE);
  n.set_name(name);
  n.mutable_control()->set_cond(prefix + "/cond");
  n.mutable_control()->set_body(prefix + "/body");
  return impl_->ControlNode(std::move(n), init, types);
}

std::vector<Value> GraphBuilder::Cond(Value index, std::vector<Value> operands,
                                      const std::vector<Function>& branches) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("conditional_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("conditional '", name, "'");
  if (branches.empty()) return impl_->Fail(what, "no branches"), std::vector<Value>{};
  std::vector<ArrayType> types;
  for (const Value& v : operands) {
    if (!v.valid()) return impl_->Fail(what, "an operand is not a value"), std::vector<Value>{};
    types.push_back(v.type());
  }
  const std::string prefix = absl::StrCat(impl_->graph.name(), "/", name);
  v1::Node n = NodeOf(v1::CONDITIONAL);
  n.set_name(name);
  std::vector<ArrayType> results;
  for (size_t k = 0; k < branches.size(); ++k) {
    const std::string fn = absl::StrCat(prefix, "/branch", k);
    auto r = impl_->AddFunction(fn, types, branches[k], k == 0 ? nullptr : &results,
                                "branch 0's results");
    if (!r.ok()) return impl_->Fail(what, r.status().message()), std::vector<Value>{};
    if (k == 0) results = *r;
    n.mutable_control()->add_branches(fn);
  }
  std::vector<Value> all = {index};
  all.insert(all.end(), operands.begin(), operands.end());
  return impl_->ControlNode(std::move(n), all, results);
}

std::vector<Value> GraphBuilder::Scan(std::vector<Value> init, std::vector<Value> xs,
                                      int64_t length, const Function& body, bool reverse) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("scan_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("scan '", name, "'");
  std::vector<ArrayType> carries, params;
  for (const Value& v : init) {
    if (!v.valid()) return impl_->Fail(what, "a carry is not a value"), std::vector<Value>{};
    carries.push_back(v.type());
  }
  params = carries;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (!xs[i].valid())
      return impl_->Fail(what, "a scanned operand is not a value"), std::vector<Value>{};
    ArrayType t = xs[i].type();
    if (t.dims.empty() || t.dims[0] != length) {
      return impl_->Fail(what,
                         absl::StrCat("scanned operand ", i, " is ", TypeString(ToProto(t)),
                                      "; expected a leading dimension of the length, ", length)),
             std::vector<Value>{};
    }
    t.dims.erase(t.dims.begin());
    params.push_back(t);
  }
  const std::string fn = absl::StrCat(impl_->graph.name(), "/", name, "/body");
  auto r = impl_->AddFunction(fn, params, body, nullptr, "");
  if (!r.ok()) return impl_->Fail(what, r.status().message()), std::vector<Value>{};
  bool same = r->size() >= carries.size();
  for (size_t i = 0; same && i < carries.size(); ++i) same = (*r)[i] == carries[i];
  if (!same) {
    return impl_->Fail(what, absl::StrCat("function '", fn, "' must return the carries ",
                                          TypesText(init), " first, each with its type")),
           std::vector<Value>{};
  }
  std::vector<ArrayType> results = carries;
  for (size_t i = carries.size(); i < r->size(); ++i) {
    ArrayType y = (*r)[i];
    y.dims.insert(y.dims.begin(), length);
    results.push_back(y);
  }
  v1::Node n = NodeOf(v1::SCAN);
  n.set_name(name);
  n.mutable_control()->set_body(fn);
  n.mutable_control()->set_length(length);
  n.mutable_control()->set_num_carry(int(init.size()));
  n.mutable_control()->set_reverse(reverse);
  std::vector<Value> all = init;
  all.insert(all.end(), xs.begin(), xs.end());
  return impl_->ControlNode(std::move(n), all, results);
}

namespace {
// The types `f` returns for parameters of `types`, by building it on a scratch builder.
absl::StatusOr<std::vector<ArrayType>> ResultTypes(const GraphBuilder::Function& f,
                                                   const std::vector<ArrayType>& types) {
  GraphBuilder scratch("scratch");
  std::vector<Value> params;
  for (size_t i = 0; i < types.size(); ++i) params.push_back(scratch.Parameter(types[i]));
  const std::vector<Value> out = f(scratch, params);
  TESSEL_RETURN_IF_ERROR(scratch.status());
  std::vector<ArrayType> got;
  for (const Value& v : out) got.push_back(v.type());
  return got;
}
}  // namespace

// A VJP or JVP node of f at `args` with `extra` operands (cotangents or
// tangents) after them; the results are f's, then those `more` gives from
// f's result and argument types.
std::vector<Value> GraphBuilder::Impl::Derivative(
    v1::Op op, const Function& f, const std::vector<Value>& args, const std::vector<Value>& extra,
    const std::vector<int>& wrt,
    const std::function<std::vector<ArrayType>(const std::vector<ArrayType>& results,
                                               const std::vector<ArrayType>& args)>& more) {
  if (!status.ok()) return {};
  const std::string name = absl::StrCat(OpName(op), "_", graph.nodes_size());
  const std::string what = absl::StrCat(OpName(op), " '", name, "'");
  std::vector<ArrayType> types;
  if (!ArgTypes(args, what, types)) return {};
  for (int p : wrt) {
    if (p < 0 || p >= int(types.size())) {
      return Fail(what,
                  absl::StrCat("wrt ", p, " is not an argument (", types.size(), " arguments)")),
             std::vector<Value>{};
    }
  }
  const std::string fn = absl::StrCat(graph.name(), "/", name, "/f");
  auto r = AddFunction(fn, types, f, nullptr, "");
  if (!r.ok()) return Fail(what, r.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(op);
  n.set_name(name);
  n.mutable_grad()->set_function(fn);
  for (int p : wrt) n.mutable_grad()->add_wrt(p);
  std::vector<ArrayType> results = *r;
  for (const ArrayType& t : more(*r, types)) results.push_back(t);
  std::vector<Value> all = args;
  all.insert(all.end(), extra.begin(), extra.end());
  return ControlNode(std::move(n), all, results);
}

std::vector<Value> GraphBuilder::Vjp(const Function& f, std::vector<Value> args,
                                     std::vector<Value> cotangents, std::vector<int> wrt) {
  return impl_->Derivative(v1::VJP, f, args, cotangents, wrt,
                           [&](const auto&, const std::vector<ArrayType>& types) {
                             std::vector<ArrayType> cts;
                             for (int p : wrt) cts.push_back(types[p]);
                             return cts;
                           });
}

std::vector<Value> GraphBuilder::ValueAndGrad(const Function& f, std::vector<Value> args,
                                              std::vector<int> wrt) {
  if (!impl_->status.ok()) return {};
  std::vector<ArrayType> types;
  for (const Value& v : args) types.push_back(v.type());
  auto r = ResultTypes(f, types);
  if (!r.ok()) return impl_->Fail("value_and_grad", r.status().message()), std::vector<Value>{};
  if (r->size() != 1 || !r->at(0).dims.empty()) {
    return impl_->Fail("value_and_grad", "the function must return one scalar"),
           std::vector<Value>{};
  }
  return Vjp(f, std::move(args), {Fill(r->at(0), 1.0)}, std::move(wrt));
}

std::vector<Value> GraphBuilder::Jvp(const Function& f, std::vector<Value> args,
                                     std::vector<Value> tangents, std::vector<int> wrt) {
  return impl_->Derivative(
      v1::JVP, f, args, tangents, wrt,
      [](const std::vector<ArrayType>& results, const auto&) { return results; });
}

std::vector<Value> GraphBuilder::Vmap(const Function& f, std::vector<Value> args,
                                      std::vector<int64_t> in_axes, std::vector<int64_t> out_axes) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("vmap_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("vmap '", name, "'");
  std::vector<ArrayType> types;
  if (!impl_->ArgTypes(args, what, types)) return {};
  if (in_axes.size() != args.size()) {
    return impl_->Fail(what,
                       absl::StrCat(args.size(), " arguments but ", in_axes.size(), " in_axes")),
           std::vector<Value>{};
  }
  int64_t size = -1;
  for (size_t i = 0; i < types.size(); ++i) {
    const int64_t a = in_axes[i];
    if (a == kNotMapped) continue;
    if (a < 0 || a >= int64_t(types[i].dims.size())) {
      return impl_->Fail(what,
                         absl::StrCat("in_axes[", i, "] = ", a,
                                      ": expected kNotMapped or an axis of ", types[i].ToString())),
             std::vector<Value>{};
    }
    if (size >= 0 && types[i].dims[a] != size) {
      return impl_->Fail(what, absl::StrCat("argument ", i, " maps ", types[i].dims[a],
                                            " elements; an earlier one ", size)),
             std::vector<Value>{};
    }
    size = types[i].dims[a];
    types[i].dims.erase(types[i].dims.begin() + a);
  }
  if (size < 0)
    return impl_->Fail(what, "no argument is mapped (every in_axes is kNotMapped)"),
           std::vector<Value>{};
  const std::string fn = absl::StrCat(impl_->graph.name(), "/", name, "/f");
  auto r = impl_->AddFunction(fn, types, f, nullptr, "");
  if (!r.ok()) return impl_->Fail(what, r.status().message()), std::vector<Value>{};
  if (out_axes.size() != r->size()) {
    return impl_->Fail(what, absl::StrCat("f has ", r->size(), " results but ", out_axes.size(),
                                          " out_axes")),
           std::vector<Value>{};
  }
  std::vector<ArrayType> results = *r;
  for (size_t k = 0; k < results.size(); ++k) {
    const int64_t a = out_axes[k];
    if (a == kNotMapped) continue;
    if (a < 0 || a > int64_t(results[k].dims.size())) {
      return impl_->Fail(
                 what,
                 absl::StrCat("out_axes[", k, "] = ", a, ": expected kNotMapped or an axis in [0, ",
                              results[k].dims.size(), "] of result ", results[k].ToString())),
             std::vector<Value>{};
    }
    results[k].dims.insert(results[k].dims.begin() + a, size);
  }
  v1::Node n = NodeOf(v1::VMAP);
  n.set_name(name);
  n.mutable_batch()->set_function(fn);
  for (int64_t a : in_axes) n.mutable_batch()->add_in_axes(a);
  for (int64_t a : out_axes) n.mutable_batch()->add_out_axes(a);
  n.mutable_batch()->set_size(size);
  return impl_->ControlNode(std::move(n), args, results);
}

std::vector<Value> GraphBuilder::CustomVjp(const Function& f, const Function& fwd,
                                           const Function& bwd, std::vector<Value> args) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("custom_vjp_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("custom_vjp '", name, "'"),
                    prefix = absl::StrCat(impl_->graph.name(), "/", name);
  std::vector<ArrayType> types;
  if (!impl_->ArgTypes(args, what, types)) return {};
  auto results = impl_->AddFunction(prefix + "/f", types, f, nullptr, "");
  if (!results.ok()) return impl_->Fail(what, results.status().message()), std::vector<Value>{};
  auto kept = impl_->AddFunction(prefix + "/fwd", types, fwd, nullptr, "");
  if (!kept.ok()) return impl_->Fail(what, kept.status().message()), std::vector<Value>{};
  if (kept->size() < results->size() ||
      !std::equal(results->begin(), results->end(), kept->begin())) {
    return impl_->Fail(what, absl::StrCat("fwd must return f's results ", results->size(),
                                          " first, then residuals")),
           std::vector<Value>{};
  }
  std::vector<ArrayType> bwd_params(kept->begin() + results->size(), kept->end());
  bwd_params.insert(bwd_params.end(), results->begin(), results->end());
  auto cts =
      impl_->AddFunction(prefix + "/bwd", bwd_params, bwd, &types, "a cotangent per argument");
  if (!cts.ok()) return impl_->Fail(what, cts.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::CUSTOM_VJP);
  n.set_name(name);
  n.mutable_custom_vjp()->set_function(prefix + "/f");
  n.mutable_custom_vjp()->set_fwd(prefix + "/fwd");
  n.mutable_custom_vjp()->set_bwd(prefix + "/bwd");
  return impl_->ControlNode(std::move(n), args, *results);
}

std::vector<Value> GraphBuilder::CustomJvp(const Function& f, const Function& jvp,
                                           std::vector<Value> args) {
  if (!impl_->status.ok()) return {};
  const std::string name = absl::StrCat("custom_jvp_", impl_->graph.nodes_size());
  const std::string what = absl::StrCat("custom_jvp '", name, "'"),
                    prefix = absl::StrCat(impl_->graph.name(), "/", name);
  std::vector<ArrayType> types;
  if (!impl_->ArgTypes(args, what, types)) return {};
  auto results = impl_->AddFunction(prefix + "/f", types, f, nullptr, "");
  if (!results.ok()) return impl_->Fail(what, results.status().message()), std::vector<Value>{};
  std::vector<ArrayType> twice = types, both = *results;
  twice.insert(twice.end(), types.begin(), types.end());
  both.insert(both.end(), results->begin(), results->end());
  auto rule = impl_->AddFunction(prefix + "/jvp", twice, jvp, &both,
                                 "f's results, then a tangent per result");
  if (!rule.ok()) return impl_->Fail(what, rule.status().message()), std::vector<Value>{};
  v1::Node n = NodeOf(v1::CUSTOM_JVP);
  n.set_name(name);
  n.mutable_custom_jvp()->set_function(prefix + "/f");
  n.mutable_custom_jvp()->set_jvp(prefix + "/jvp");
  return impl_->ControlNode(std::move(n), args, *results);
}

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
