#include "scheduler/generated.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/shape_inference.h"

namespace tessel::scheduler {
namespace {

using absl::StrCat;

bool IsLayout(v1::Op op) {
  return op == v1::SLICE || op == v1::RESHAPE || op == v1::TRANSPOSE || op == v1::BROADCAST_IN_DIM;
}

// Whether `n` (its operands already seen) is generated: made from fills,
// iotas and scalars alone. `generated(name)` and `rank(name)` answer for
// the operands.
template <typename Generated, typename Rank>
bool IsGeneratedNode(const v1::Node& n, const Generated& generated, const Rank& rank) {
  if (n.type().dims_size() == 0) return false;
  if (n.op() == v1::CONSTANT) {
    return n.constant().has_fill() || (n.constant().has_iota() && n.type().dtype() != v1::PRED);
  }
  if (n.op() == v1::BROADCAST_IN_DIM) return rank(n.operands(0)) == 0;
  if (!IsElementwise(n.op())) return false;
  bool any = false;
  for (const std::string& o : n.operands()) {
    if (generated(o)) {
      any = true;
    } else if (rank(o) != 0) {
      return false;
    }
  }
  return any;
}

// Whether `n` is a layout op over a generated value, to be rewritten.
template <typename Generated, typename Rank>
bool IsPushed(const v1::Node& n, const Generated& generated, const Rank& rank) {
  return IsLayout(n.op()) && n.type().dims_size() > 0 && generated(n.operands(0)) &&
         !(n.op() == v1::BROADCAST_IN_DIM && rank(n.operands(0)) == 0);
}

// Whether any node of `g` is a layout op over a generated value: a scan
// that copies no node, so a graph with nothing to push costs a lookup per
// operand.
bool AnythingToPush(const v1::Graph& g) {
  absl::flat_hash_map<absl::string_view, int> rank;  // views of g's names
  absl::flat_hash_set<absl::string_view> generated;
  rank.reserve(g.nodes_size());
  auto is_generated = [&](const std::string& name) { return generated.contains(name); };
  auto rank_of = [&](const std::string& name) {
    auto it = rank.find(name);
    return it == rank.end() ? -1 : it->second;
  };
  for (const v1::Node& n : g.nodes()) {
    if (IsPushed(n, is_generated, rank_of)) return true;
    if (IsGeneratedNode(n, is_generated, rank_of)) generated.insert(n.name());
    rank[n.name()] = n.type().dims_size();
  }
  return false;
}

class Pusher {
 public:
  explicit Pusher(const v1::Graph& g) {
    for (const v1::Node& n : g.nodes()) names_.insert(n.name());
  }

  bool IsGenerated(const v1::Node& n) const {
    return IsGeneratedNode(
        n, [&](const std::string& o) { return generated_.contains(o); },
        [&](const std::string& o) { return Rank(o); });
  }

  // Adds `n`, rewriting it when it is a layout op over a generated value.
  // Returns whether it rewrote it.
  bool Add(const v1::Node& n) {
    if (IsPushed(
            n, [&](const std::string& o) { return generated_.contains(o); },
            [&](const std::string& o) { return Rank(o); })) {
      v1::Node pushed = Push(n.operands(0), n);
      pushed.set_name(n.name());
      Emit(std::move(pushed), /*generated=*/true);
      return true;
    }
    const bool gen = IsGenerated(n);
    Emit(n, gen);
    return false;
  }

  google::protobuf::RepeatedPtrField<v1::Node> Take() { return std::move(out_); }

 private:
  int Rank(const std::string& name) const { return def_.at(name).type().dims_size(); }

  void Emit(v1::Node n, bool generated) {
    if (generated) generated_.insert(n.name());
    def_[n.name()] = n;
    *out_.Add() = std::move(n);
  }
  std::string EmitFresh(v1::Node n, const std::string& base) {
    std::string name;
    do {
      name = StrCat(base, ".gen", ++fresh_);
    } while (names_.contains(name));
    names_.insert(name);
    n.set_name(name);
    Emit(std::move(n), true);
    return name;
  }

  // The generated value `name` with the layout op `layout` applied, as a
  // node not yet emitted (its operands are).
  v1::Node Push(const std::string& name, const v1::Node& layout) {
    const v1::Node n = def_.at(name);  // a copy: emitting rehashes def_
    v1::TensorType t = layout.type();
    t.set_dtype(n.type().dtype());
    if (n.op() == v1::CONSTANT && n.constant().has_iota()) return PushIota(n, layout, t);
    v1::Node r = n;
    *r.mutable_type() = t;
    if (n.op() == v1::CONSTANT) return r;  // a fill
    r.clear_operands();
    if (n.op() == v1::BROADCAST_IN_DIM) {  // of a scalar
      r.add_operands(n.operands(0));
      r.mutable_broadcast_in_dim()->clear_dims();
      for (int64_t d : t.dims()) r.mutable_broadcast_in_dim()->add_dims(d);
      return r;
    }
    for (const std::string& o : n.operands()) {  // elementwise
      r.add_operands(Rank(o) == 0 ? o : Pushed(o, layout));
    }
    return r;
  }
  std::string Pushed(const std::string& name, const v1::Node& layout) {
    const std::string key = StrCat(name, "|", layout.name());
    if (auto it = memo_.find(key); it != memo_.end()) return it->second;
    std::string out = EmitFresh(Push(name, layout), layout.name());
    memo_[key] = out;
    return out;
  }

  v1::Node Constant(const v1::TensorType& t) {
    v1::Node c;
    c.set_op(v1::CONSTANT);
    *c.mutable_type() = t;
    return c;
  }
  std::string Fill(v1::TensorType t, v1::DType dt, int64_t v, const std::string& base) {
    t.set_dtype(dt);
    v1::Node c = Constant(t);
    c.mutable_constant()->mutable_fill()->set_i(v);
    return EmitFresh(std::move(c), base);
  }
  std::string Iota(v1::TensorType t, v1::DType dt, int64_t d, const std::string& base) {
    t.set_dtype(dt);
    v1::Node c = Constant(t);
    c.mutable_constant()->mutable_iota()->set_dimension(d);
    return EmitFresh(std::move(c), base);
  }
  std::string Binary(v1::Op op, const std::string& a, const std::string& b, v1::TensorType t,
                     v1::DType dt, const std::string& base) {
    t.set_dtype(dt);
    v1::Node c;
    c.set_op(op);
    c.add_operands(a);
    c.add_operands(b);
    *c.mutable_type() = t;
    return EmitFresh(std::move(c), base);
  }

  // An iota along d of `iota`'s shape, through `layout`, as a node of type t.
  v1::Node PushIota(const v1::Node& iota, const v1::Node& layout, const v1::TensorType& t) {
    const int64_t d = iota.constant().iota().dimension();
    const v1::TensorType& s = iota.type();
    const std::string& base = layout.name();
    auto iota_along = [&](int64_t dim) {
      v1::Node c = Constant(t);
      c.mutable_constant()->mutable_iota()->set_dimension(dim);
      return c;
    };
    if (s.dims(d) == 1) {  // every element is index 0
      v1::Node c = Constant(t);
      c.mutable_constant()->mutable_fill()->set_i(0);
      return c;
    }
    switch (layout.op()) {
      case v1::TRANSPOSE: {
        const auto& perm = layout.transpose().permutation();
        for (int j = 0; j < perm.size(); ++j) {
          if (perm[j] == d) return iota_along(j);
        }
        break;
      }
      case v1::BROADCAST_IN_DIM:
        return iota_along(layout.broadcast_in_dim().broadcast_dimensions(d));
      default: break;
    }
    // Index arithmetic in an integer wide enough for the positions, then
    // one convert to the iota's dtype.
    int64_t total = 1;
    for (int64_t x : s.dims()) total *= x;
    const v1::DType w = total < (int64_t{1} << 31) ? v1::S32 : v1::S64;
    std::string v;
    if (layout.op() == v1::SLICE) {
      const v1::SliceAttrs& a = layout.slice();
      const int64_t start = a.start(d), stride = a.strides_size() > d ? a.strides(d) : 1;
      v = Iota(t, w, d, base);
      if (stride != 1) v = Binary(v1::MUL, v, Fill(t, w, stride, base), t, w, base);
      if (start != 0) v = Binary(v1::ADD, v, Fill(t, w, start, base), t, w, base);
    } else {  // RESHAPE: the operand's index along d from the flat position
      int64_t stride_d = 1;
      for (int k = d + 1; k < s.dims_size(); ++k) stride_d *= s.dims(k);
      int64_t rstride = 1;
      for (int m = t.dims_size() - 1; m >= 0; --m) {
        if (t.dims(m) != 1) {
          std::string term = Iota(t, w, m, base);
          if (rstride != 1) term = Binary(v1::MUL, term, Fill(t, w, rstride, base), t, w, base);
          v = v.empty() ? term : Binary(v1::ADD, v, term, t, w, base);
        }
        rstride *= t.dims(m);
      }
      if (v.empty()) v = Fill(t, w, 0, base);
      if (stride_d != 1) v = Binary(v1::DIV, v, Fill(t, w, stride_d, base), t, w, base);
      if (d != 0) v = Binary(v1::REM, v, Fill(t, w, s.dims(d), base), t, w, base);
    }
    v1::Node c;
    c.set_op(v1::CONVERT);
    c.add_operands(v);
    c.mutable_convert()->set_dtype(iota.type().dtype());
    *c.mutable_type() = t;
    if (iota.type().dtype() == w) {  // already the iota's dtype: the last step is the value
      v1::Node last = def_.at(v);
      return last;
    }
    return c;
  }

  absl::flat_hash_set<std::string> names_;
  absl::flat_hash_map<std::string, v1::Node> def_;
  absl::flat_hash_set<std::string> generated_;
  absl::flat_hash_map<std::string, std::string> memo_;
  google::protobuf::RepeatedPtrField<v1::Node> out_;
  int fresh_ = 0;
};

}  // namespace

bool PushLayoutsIntoGenerated(v1::Graph& g) {
  if (!AnythingToPush(g)) return false;
  Pusher p(g);
  bool changed = false;
  for (const v1::Node& n : g.nodes()) changed |= p.Add(n);
  if (changed) *g.mutable_nodes() = p.Take();
  return changed;
}

}  // namespace tessel::scheduler
