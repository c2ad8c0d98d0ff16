// Building Tessel graphs in C++. GraphBuilder checks shapes and dtypes as
// each op is added (with the same rules the coordinator applies), so a
// mistake is reported where it is made; the first error sticks and Build()
// returns it. A builder is used by one thread at a time.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "tessel/sharding.h"
#include "tessel/types.h"

namespace tessel {

class GraphImpl;

// An immutable graph, ready to compile. Cheap to copy.
class Graph {
 public:
  static absl::StatusOr<Graph> FromTextProto(const std::string& text);
  static absl::StatusOr<Graph> FromFile(const std::string& path);  // text format
  std::string ToTextProto() const;
  const std::string& name() const;
  int num_nodes() const;
  std::vector<ArrayType> parameter_types() const;  // declared, by index
  std::vector<std::string> parameter_names() const;
  std::vector<std::string> output_names() const;
  const GraphImpl& impl() const { return *impl_; }

 private:
  explicit Graph(std::shared_ptr<const GraphImpl> impl) : impl_(std::move(impl)) {}
  friend class GraphBuilder;
  std::shared_ptr<const GraphImpl> impl_;
};

// A value in a graph under construction.
class Value {
 public:
  Value() = default;
  bool valid() const { return id_ >= 0; }
  const ArrayType& type() const { return type_; }
  const std::string& name() const { return name_; }

 private:
  friend class GraphBuilder;
  int id_ = -1;
  ArrayType type_;
  std::string name_;
};

enum class Comparison { kEq, kNe, kLt, kLe, kGt, kGe };

struct DotDims {
  std::vector<int64_t> lhs_batch, rhs_batch, lhs_contracting, rhs_contracting;
};

// Which mesh axes a custom kernel's result varies over, given its operands'.
struct ReplicationRule {
  enum class Kind { kUnion, kFollow, kExplicit };
  Kind kind = Kind::kUnion;
  int operand = 0;                // kFollow
  std::vector<std::string> axes;  // kExplicit
  static ReplicationRule Union() { return {}; }
  static ReplicationRule Follow(int operand) { return {Kind::kFollow, operand, {}}; }
  static ReplicationRule Explicit(std::vector<std::string> axes) {
    return {Kind::kExplicit, 0, std::move(axes)};
  }
};
class GraphBuilder {
 public:
  explicit GraphBuilder(std::string name);
  ~GraphBuilder();
  GraphBuilder(const GraphBuilder&) = delete;
  GraphBuilder& operator=(const GraphBuilder&) = delete;

  // Parameters are numbered in the order they are added.
  Value Parameter(ArrayType type, std::string name = "");
  Value Constant(const HostArray& literal);
  Value Fill(ArrayType type, double value);
  Value Iota(ArrayType type, int64_t dimension);
  Value Scalar(DType dtype, double value) { return Fill(ArrayType{dtype, {}}, value); }

  Value Neg(Value x);
  Value Abs(Value x);
  Value Exp(Value x);
  Value Log(Value x);
  Value Log1p(Value x);
  Value Tanh(Value x);
  Value Logistic(Value x);
  Value Sqrt(Value x);
  Value Rsqrt(Value x);
  Value Floor(Value x);
  Value Ceil(Value x);
  Value Round(Value x);
  Value Sign(Value x);
  Value Not(Value x);
  Value Sin(Value x);
  Value Cos(Value x);
  Value Tan(Value x);
  Value Asin(Value x);
  Value Acos(Value x);
  Value Atan(Value x);
  Value Sinh(Value x);
  Value Cosh(Value x);
  Value Asinh(Value x);
  Value Acosh(Value x);
  Value Atanh(Value x);
  Value Expm1(Value x);
  Value Erf(Value x);

  Value Add(Value a, Value b);
  Value Sub(Value a, Value b);
  Value Mul(Value a, Value b);
  Value Div(Value a, Value b);
  Value Rem(Value a, Value b);
  Value Pow(Value a, Value b);
  Value Max(Value a, Value b);
  Value Min(Value a, Value b);
  Value And(Value a, Value b);
  Value Or(Value a, Value b);
  Value Xor(Value a, Value b);
  Value Atan2(Value y, Value x);  // numpy.arctan2(y, x)

  Value Compare(Value a, Value b, Comparison c);
  Value Select(Value pred, Value on_true, Value on_false);
  Value Clamp(Value min, Value x, Value max);
  Value Convert(Value x, DType to);
  // x's bits read as `to`, which must be as wide (jax.lax.bitcast_convert_type).
  Value BitcastConvert(Value x, DType to);
  Value BroadcastInDim(Value x, std::vector<int64_t> dims,
                       std::vector<int64_t> broadcast_dimensions);
  // Broadcasts a scalar (or one-element value) to `dims`.
  Value Broadcast(Value x, std::vector<int64_t> dims);
  Value Reshape(Value x, std::vector<int64_t> dims);
  Value Transpose(Value x, std::vector<int64_t> permutation);
  Value Slice(Value x, std::vector<int64_t> start, std::vector<int64_t> limit,
              std::vector<int64_t> strides = {});
  // x with the order of its elements reversed along each of `dimensions`.
  Value Reverse(Value x, std::vector<int64_t> dimensions);
  // operands[result_operand] reordered along `dimension` by a stable sort
  // of operands[0] (ascending, NaN last; descending: NaN first). All
  // operands share their dimensions.
  Value Sort(std::vector<Value> operands, int64_t dimension, bool descending = false,
             int result_operand = 0);
  // x's slices along `axis` picked by the integer `indices` (clamped into
  // range): dimensions x[:axis] + indices + x[axis+1:].
  Value Gather(Value x, Value indices, int64_t axis);
  // x with `updates` (the shape Gather(x, indices, axis) has) put in at
  // `indices` along `axis`: replacing (no `combine`) or combined with what
  // is there. Out-of-range updates are dropped.
  Value Scatter(Value x, Value indices, Value updates, int64_t axis,
                std::optional<ReduceKind> combine = {});
  Value Concatenate(std::vector<Value> xs, int64_t dimension);
  Value Pad(Value x, Value padding_value, std::vector<int64_t> low, std::vector<int64_t> high,
            std::vector<int64_t> interior = {});
  Value DotGeneral(Value lhs, Value rhs, DotDims dims);
  // [m,k] x [k,n] -> [m,n]
  Value MatMul(Value lhs, Value rhs);
  Value Reduce(Value x, ReduceKind kind, std::vector<int64_t> dims);
  Value ArgMax(Value x, int64_t dimension, DType index_dtype = DType::kS32);
  Value ArgMin(Value x, int64_t dimension, DType index_dtype = DType::kS32);

  // ---- Partitioned programs (compiled with a mesh; see tessel/sharding.h).

  // `x` takes `sharding` from here on; the partitioner inserts what that
  // needs, with its reason.
  Value ShardingConstraint(Value x, const Sharding& sharding);

  // Builds a program from per-device pieces: the blocks it is given and the
  // values it returns are one device's.
  using Body = std::function<Value(GraphBuilder& body, const std::vector<Value>& operands)>;

  // shard_map: `body` runs on every device of `mesh` on its blocks of
  // `operands` (laid out by `in_specs`) and returns its block of the result,
  // laid out by `out_spec`. Inside it, collectives are explicit. A result
  // that varies over an axis `out_spec` replicates it over is a compile
  // error, unless `out_spec` marks that axis unreduced.
  Value ManualRegion(const Mesh& mesh, std::vector<Value> operands, std::vector<Sharding> in_specs,
                     Sharding out_spec, const Body& body, std::string name = "");

  // A part of an MPMD program: `body` runs on the devices of `mesh` only, as
  // a program of its own partitioned over `mesh`, on the global `operands`
  // laid out by `in_shardings`; its results are laid out by
  // `out_shardings`. A graph whose top level holds only parameters and mesh
  // regions is an MPMD program: compile it with no mesh; the coordinator
  // compiles each region for its devices and moves the values a region
  // reads from elsewhere worker to worker (the plan lists each move).
  using MultiBody =
      std::function<std::vector<Value>(GraphBuilder& body, const std::vector<Value>& operands)>;
  std::vector<Value> MeshRegion(const Mesh& mesh, std::vector<Value> operands,
                                std::vector<Sharding> in_shardings,
                                std::vector<Sharding> out_shardings, const MultiBody& body,
                                std::string name);

  // Collectives over the devices that differ only along `axes`; only inside
  // a manual region's body.
  Value AllReduce(Value x, std::vector<std::string> axes, ReduceKind kind = ReduceKind::kSum);
  Value AllGather(Value x, std::vector<std::string> axes, int64_t dimension);  // tiled
  Value ReduceScatter(Value x, std::vector<std::string> axes, int64_t dimension,
                      ReduceKind kind = ReduceKind::kSum);
  Value AllToAll(Value x, std::vector<std::string> axes, int64_t split_dimension,
                 int64_t concat_dimension);
  // (source, target) indices along `axes`.
  Value CollectivePermute(Value x, std::vector<std::string> axes,
                          std::vector<std::pair<int64_t, int64_t>> source_target_pairs);
  Value AxisIndex(std::vector<std::string> axes);  // s32 scalar

  // An op carrying user code: `cuda_source` (entry point `name`) for the CUDA
  // backend, and `decomposition` in Tessel ops, which runs everywhere else.
  Value CustomKernel(std::string name, std::vector<Value> operands, const Body& decomposition,
                     ReplicationRule replication = {}, std::string cuda_source = "");

  // ---- Control flow: loops and branches that run on the device. Each
  // function is built by a lambda on a builder of its own, from the
  // parameters it is given; values of the enclosing graph are not visible
  // there (pass them as operands or carries).
  using Function =
      std::function<std::vector<Value>(GraphBuilder& fn, const std::vector<Value>& params)>;

  // While cond(carry) (a pred[] scalar) holds, carry = body(carry), each
  // carry keeping its type. Returns the final carry.
  std::vector<Value> While(std::vector<Value> init, const Function& cond, const Function& body);
  // branches[index](operands...): `index` s32[] (out of range runs the last
  // branch, as XLA does) or pred[] (false: branch 0, true: branch 1). Every
  // branch returns the same types.
  std::vector<Value> Cond(Value index, std::vector<Value> operands,
                          const std::vector<Function>& branches);
  // jax.lax.scan: body(carry..., one slice of each xs...) -> (carry...,
  // one slice of each y...), `length` times over dimension 0 of `xs` (last
  // to first when `reverse`). Returns the final carry, then each y stacked.
  std::vector<Value> Scan(std::vector<Value> init, std::vector<Value> xs, int64_t length,
                          const Function& body, bool reverse = false);

  // ---- Derivatives (expanded by the compiler into the forward pass and
  // its transpose; see the README's "Gradients").

  // Reverse mode: f(args) and the cotangents of the parameters in `wrt`
  // (indices into args, floating-point) given one cotangent per result of f.
  // Returns f's results, then one cotangent per `wrt` entry.
  std::vector<Value> Vjp(const Function& f, std::vector<Value> args, std::vector<Value> cotangents,
                         std::vector<int> wrt);
  // The gradient of f's scalar result: {f(args), d f / d args[wrt[0]], ...}.
  std::vector<Value> ValueAndGrad(const Function& f, std::vector<Value> args, std::vector<int> wrt);
  // Forward mode: f(args), then each result's tangent, given a tangent for
  // each parameter in `wrt`.
  std::vector<Value> Jvp(const Function& f, std::vector<Value> args, std::vector<Value> tangents,
                         std::vector<int> wrt);

  // f(args) with a reverse-mode rule of one's own (jax.custom_vjp): under
  // Vjp the backward pass runs `bwd` (residuals, then a cotangent per
  // result -> a cotangent per argument) on what `fwd` (args -> f's results,
  // then residuals) kept, instead of transposing f.
  std::vector<Value> CustomVjp(const Function& f, const Function& fwd, const Function& bwd,
                               std::vector<Value> args);
  // f(args) with derivatives from `jvp` (args, then a tangent per argument
  // -> f's results, then a tangent per result; linear in the tangents), in
  // forward mode as written and in reverse mode transposed (jax.custom_jvp).
  std::vector<Value> CustomJvp(const Function& f, const Function& jvp, std::vector<Value> args);

  // ---- Batching (expanded by the compiler with jax.vmap's rules; see the
  // README's "vmap").

  // f mapped over a batch: args[i] carries the batch at in_axes[i]
  // (kNotMapped: the same for every element), f sees one element, and its
  // result k comes back with the batch at out_axes[k] (kNotMapped: a result
  // that must not depend on the batch).
  static constexpr int64_t kNotMapped = -1;
  std::vector<Value> Vmap(const Function& f, std::vector<Value> args, std::vector<int64_t> in_axes,
                          std::vector<int64_t> out_axes);

  // OK, or the first error (naming the op, the expected and the actual).
  absl::Status status() const;
  absl::StatusOr<Graph> Build(const std::vector<Value>& outputs);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel
