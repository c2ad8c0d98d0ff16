// Building Tessel graphs in C++. GraphBuilder checks shapes and dtypes as
// each op is added (with the same rules the coordinator applies), so a
// mistake is reported where it is made; the first error sticks and Build()
// returns it. A builder is used by one thread at a time.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
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
enum class ReduceKind { kSum, kProd, kMax, kMin };

struct DotDims {
  std::vector<int64_t> lhs_batch, rhs_batch, lhs_contracting, rhs_contracting;
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

  Value Neg(Value x); Value Abs(Value x); Value Exp(Value x); Value Log(Value x);
  Value Log1p(Value x); Value Tanh(Value x); Value Logistic(Value x); Value Sqrt(Value x);
  Value Rsqrt(Value x); Value Floor(Value x); Value Ceil(Value x); Value Round(Value x);
  Value Sign(Value x); Value Not(Value x);

  Value Add(Value a, Value b); Value Sub(Value a, Value b); Value Mul(Value a, Value b);
  Value Div(Value a, Value b); Value Rem(Value a, Value b); Value Pow(Value a, Value b);
  Value Max(Value a, Value b); Value Min(Value a, Value b); Value And(Value a, Value b);
  Value Or(Value a, Value b); Value Xor(Value a, Value b);

  Value Compare(Value a, Value b, Comparison c);
  Value Select(Value pred, Value on_true, Value on_false);
  Value Clamp(Value min, Value x, Value max);
  Value Convert(Value x, DType to);
  Value BroadcastInDim(Value x, std::vector<int64_t> dims, std::vector<int64_t> broadcast_dimensions);
  // Broadcasts a scalar (or one-element value) to `dims`.
  Value Broadcast(Value x, std::vector<int64_t> dims);
  Value Reshape(Value x, std::vector<int64_t> dims);
  Value Transpose(Value x, std::vector<int64_t> permutation);
  Value Slice(Value x, std::vector<int64_t> start, std::vector<int64_t> limit, std::vector<int64_t> strides = {});
  Value Concatenate(std::vector<Value> xs, int64_t dimension);
  Value Pad(Value x, Value padding_value, std::vector<int64_t> low, std::vector<int64_t> high,
            std::vector<int64_t> interior = {});
  Value DotGeneral(Value lhs, Value rhs, DotDims dims);
  // [m,k] x [k,n] -> [m,n]
  Value MatMul(Value lhs, Value rhs);
  Value Reduce(Value x, ReduceKind kind, std::vector<int64_t> dims);
  Value ArgMax(Value x, int64_t dimension, DType index_dtype = DType::kS32);
  Value ArgMin(Value x, int64_t dimension, DType index_dtype = DType::kS32);

  // OK, or the first error (naming the op, the expected and the actual).
  absl::Status status() const;
  absl::StatusOr<Graph> Build(const std::vector<Value>& outputs);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessel
