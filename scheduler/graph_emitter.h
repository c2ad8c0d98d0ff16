// Emitter: appends typed nodes to a graph under fresh names, for the
// graph-to-graph transformations (autodiff, batching). Not thread-safe: one
// per transformation in progress.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <numeric>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "scheduler/validator.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

inline std::vector<int64_t> Dims(const v1::TensorType& t) {
  return {t.dims().begin(), t.dims().end()};
}

// Appends typed nodes to a graph. The first error sticks (status()); after
// it every call returns an empty name.
class Emitter {
 public:
  Emitter(v1::Graph& out, absl::flat_hash_set<std::string>& used) : out_(out), used_(used) {}

  absl::Status status() const { return status_; }
  const v1::TensorType& type(const std::string& v) const { return types_.at(v); }
  void Declare(const std::string& name, const v1::TensorType& t) { types_[name] = t; }

  std::string Fresh(const std::string& base) {
    std::string name = base;
    for (int k = 1; !used_.insert(name).second; ++k) name = absl::StrCat(base, ".", k);
    return name;
  }

  // Appends `n` (named after `base`), typed from its operands.
  std::string Emit(v1::Node n, const std::string& base) {
    if (!status_.ok()) return "";
    n.set_name(Fresh(base));
    if (n.op() != v1::CONSTANT) {
      std::vector<const v1::TensorType*> ops;
      for (const std::string& o : n.operands()) {
        auto it = types_.find(o);
        if (it == types_.end()) {
          status_ = absl::InternalError(
              absl::StrCat("vjp: ", OpName(n.op()), " reads '", o, "', which has no type"));
          return "";
        }
        ops.push_back(&it->second);
      }
      n.clear_type();
      auto t = InferType(n, ops);
      if (!t.ok()) {
        status_ = Annotate(t.status(), absl::StrCat("internal: vjp node '", n.name(), "' (",
                                                    OpName(n.op()), "): "));
        return "";
      }
      *n.mutable_type() = *t;
    }
    types_[n.name()] = n.type();
    return Append(std::move(n));
  }

  v1::Node Op(v1::Op op, std::initializer_list<std::string> operands) {
    v1::Node n;
    n.set_op(op);
    for (const std::string& o : operands) n.add_operands(o);
    return n;
  }
  std::string Unary(v1::Op op, const std::string& a) { return Emit(Op(op, {a}), base_); }
  std::string Binary(v1::Op op, const std::string& a, const std::string& b) {
    return Emit(Op(op, {a, b}), base_);
  }
  std::string Compare(v1::CompareDirection d, const std::string& a, const std::string& b) {
    v1::Node n = Op(v1::COMPARE, {a, b});
    n.mutable_compare()->set_direction(d);
    return Emit(std::move(n), base_);
  }
  std::string Select(const std::string& p, const std::string& a, const std::string& b) {
    return Emit(Op(v1::SELECT, {p, a, b}), base_);
  }
  std::string Convert(const std::string& a, v1::DType d) {
    if (status_.ok() && type(a).dtype() == d) return a;
    v1::Node n = Op(v1::CONVERT, {a});
    n.mutable_convert()->set_dtype(d);
    return Emit(std::move(n), base_);
  }
  // Every element `v`, of type `t`.
  std::string Fill(const v1::TensorType& t, double v) {
    v1::Node n = Op(v1::CONSTANT, {});
    *n.mutable_type() = t;
    n.mutable_constant()->mutable_fill()->set_f(v);
    return Emit(std::move(n), base_);
  }
  std::string Like(const std::string& a, double v) { return status_.ok() ? Fill(type(a), v) : ""; }
  // Zeros of any dtype.
  std::string Zeros(const v1::TensorType& t) {
    v1::Node n = Op(v1::CONSTANT, {});
    *n.mutable_type() = t;
    if (IsFloat(t.dtype())) {
      n.mutable_constant()->mutable_fill()->set_f(0);
    } else {
      n.mutable_constant()->mutable_fill()->set_i(0);
    }
    return Emit(std::move(n), base_);
  }
  // Positions 0, 1, ... along `dim`, as s64, in the dimensions of `t`.
  std::string Iota(const v1::TensorType& t, int64_t dim) {
    v1::Node n = Op(v1::CONSTANT, {});
    n.mutable_type()->set_dtype(v1::S64);
    *n.mutable_type()->mutable_dims() = t.dims();
    n.mutable_constant()->mutable_iota()->set_dimension(dim);
    return Emit(std::move(n), base_);
  }
  // SORT with `attrs`' order, moving `moved` by the order of `keys`.
  std::string SortBy(const std::string& keys, const std::string& moved,
                     const v1::SortAttrs& attrs) {
    v1::Node n = Op(v1::SORT, {keys, moved});
    *n.mutable_sort() = attrs;
    n.mutable_sort()->set_result_operand(1);
    return Emit(std::move(n), base_);
  }
  // Every element `v`, of the integer type `t`.
  std::string FillInt(const v1::TensorType& t, int64_t v) {
    v1::Node n = Op(v1::CONSTANT, {});
    *n.mutable_type() = t;
    n.mutable_constant()->mutable_fill()->set_i(v);
    return Emit(std::move(n), base_);
  }
  std::string Gather(const std::string& x, const std::string& indices, int64_t axis,
                     int64_t batch_dims = 0) {
    v1::Node n = Op(v1::GATHER, {x, indices});
    n.mutable_gather()->set_axis(axis);
    n.mutable_gather()->set_batch_dims(batch_dims);
    return Emit(std::move(n), base_);
  }
  std::string Scatter(const std::string& x, const std::string& indices, const std::string& updates,
                      int64_t axis, v1::ReduceKind combine, int64_t batch_dims = 0) {
    v1::Node n = Op(v1::SCATTER, {x, indices, updates});
    n.mutable_scatter()->set_axis(axis);
    n.mutable_scatter()->set_combine(combine);
    n.mutable_scatter()->set_batch_dims(batch_dims);
    return Emit(std::move(n), base_);
  }
  // Result k of multi-result node `v`, of type `t`.
  std::string Element(const std::string& v, int k, const v1::TensorType& t) {
    if (!status_.ok()) return "";
    v1::Node n = Op(v1::TUPLE_ELEMENT, {v});
    n.mutable_tuple_element()->set_index(k);
    n.set_name(Fresh(absl::StrCat(v, "#", k)));
    *n.mutable_type() = t;
    types_[n.name()] = t;
    return Append(std::move(n));
  }
  // `n` appended as given (types set), under a fresh name after `base`.
  std::string Copy(v1::Node n, const std::string& base) {
    if (!status_.ok()) return "";
    n.set_name(Fresh(base));
    types_[n.name()] = n.type();
    return Append(std::move(n));
  }
  // A multi-result node, appended as given (its `results` set).
  std::string Multi(v1::Node n, const std::string& base) {
    if (!status_.ok()) return "";
    n.set_name(Fresh(base));
    return Append(std::move(n));
  }
  std::string Broadcast(const std::string& a, const std::vector<int64_t>& dims,
                        const std::vector<int64_t>& bdims) {
    v1::Node n = Op(v1::BROADCAST_IN_DIM, {a});
    n.mutable_broadcast_in_dim();
    for (int64_t d : dims) n.mutable_broadcast_in_dim()->add_dims(d);
    for (int64_t d : bdims) n.mutable_broadcast_in_dim()->add_broadcast_dimensions(d);
    return Emit(std::move(n), base_);
  }
  std::string Reduce(const std::string& a, v1::ReduceKind k, const std::vector<int64_t>& dims) {
    if (dims.empty()) return a;
    v1::Node n = Op(v1::REDUCE, {a});
    n.mutable_reduce()->set_kind(k);
    for (int64_t d : dims) n.mutable_reduce()->add_dims(d);
    return Emit(std::move(n), base_);
  }
  std::string SumAll(const std::string& a) {
    if (!status_.ok()) return "";
    std::vector<int64_t> all(type(a).dims_size());
    std::iota(all.begin(), all.end(), 0);
    return Reduce(a, v1::SUM, all);
  }
  std::string Reshape(const std::string& a, const std::vector<int64_t>& dims) {
    if (status_.ok() && Dims(type(a)) == dims) return a;
    v1::Node n = Op(v1::RESHAPE, {a});
    n.mutable_reshape();
    for (int64_t d : dims) n.mutable_reshape()->add_dims(d);
    return Emit(std::move(n), base_);
  }
  std::string Transpose(const std::string& a, const std::vector<int64_t>& perm) {
    bool identity = true;
    for (size_t i = 0; i < perm.size(); ++i) identity &= perm[i] == int64_t(i);
    if (identity) return a;
    v1::Node n = Op(v1::TRANSPOSE, {a});
    for (int64_t p : perm) n.mutable_transpose()->add_permutation(p);
    return Emit(std::move(n), base_);
  }
  std::string Slice(const std::string& a, const std::vector<int64_t>& start,
                    const std::vector<int64_t>& limit, const std::vector<int64_t>& strides) {
    v1::Node n = Op(v1::SLICE, {a});
    n.mutable_slice();
    for (size_t i = 0; i < start.size(); ++i) {
      n.mutable_slice()->add_start(start[i]);
      n.mutable_slice()->add_limit(limit[i]);
      n.mutable_slice()->add_strides(strides[i]);
    }
    return Emit(std::move(n), base_);
  }
  std::string Reverse(const std::string& a, const google::protobuf::RepeatedField<int64_t>& dims) {
    v1::Node n = Op(v1::REVERSE, {a});
    *n.mutable_reverse()->mutable_dimensions() = dims;
    return Emit(std::move(n), base_);
  }
  std::string Pad(const std::string& a, const std::string& value, const std::vector<int64_t>& low,
                  const std::vector<int64_t>& high, const std::vector<int64_t>& interior) {
    v1::Node n = Op(v1::PAD, {a, value});
    n.mutable_pad();
    for (size_t i = 0; i < low.size(); ++i) {
      n.mutable_pad()->add_low(low[i]);
      n.mutable_pad()->add_high(high[i]);
      n.mutable_pad()->add_interior(interior[i]);
    }
    return Emit(std::move(n), base_);
  }
  std::string Dot(const std::string& a, const std::string& b, const std::vector<int64_t>& ab,
                  const std::vector<int64_t>& bb, const std::vector<int64_t>& ac,
                  const std::vector<int64_t>& bc) {
    v1::Node n = Op(v1::DOT_GENERAL, {a, b});
    v1::DotGeneralAttrs& d = *n.mutable_dot_general();
    for (int64_t x : ab) d.add_lhs_batch(x);
    for (int64_t x : bb) d.add_rhs_batch(x);
    for (int64_t x : ac) d.add_lhs_contracting(x);
    for (int64_t x : bc) d.add_rhs_contracting(x);
    return Emit(std::move(n), base_);
  }

  std::string Convolution(const std::string& a, const std::string& b,
                          const v1::ConvolutionAttrs& attrs) {
    v1::Node n = Op(v1::CONVOLUTION, {a, b});
    *n.mutable_convolution() = attrs;
    return Emit(std::move(n), base_);
  }

  void set_base(std::string b) { base_ = std::move(b); }
  void Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }

  // Called with every node appended (varying-axis tracking in manual regions).
  std::function<void(const v1::Node&)> on_emit;

  absl::flat_hash_set<std::string>& used() { return used_; }
  // `n` appended under its own (fresh) name: a node another emitter built.
  void Adopt(v1::Node n) {
    if (!status_.ok()) return;
    if (!IsMultiResult(n)) types_[n.name()] = n.type();
    Append(std::move(n));
  }

 private:
  std::string Append(v1::Node n) {
    if (on_emit) on_emit(n);
    const std::string name = n.name();
    *out_.add_nodes() = std::move(n);
    return name;
  }

  v1::Graph& out_;
  absl::flat_hash_set<std::string>& used_;
  absl::flat_hash_map<std::string, v1::TensorType> types_;
  absl::Status status_;
  std::string base_;
};

}  // namespace tessel::scheduler
