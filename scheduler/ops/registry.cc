#include <cstdio>
#include <cstdlib>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_join.h"
#include "core/shape_inference.h"
#include "scheduler/ops/op_rules.h"

namespace tessel::scheduler::ops {

Axes DimAxes(const v1::Sharding& s, int d) {
  return {s.dims(d).axes().begin(), s.dims(d).axes().end()};
}

void SetDimAxes(v1::Sharding& s, int d, const Axes& a) {
  s.mutable_dims(d)->clear_axes();
  for (const std::string& x : a) s.mutable_dims(d)->add_axes(x);
}

v1::Sharding Complete(v1::Sharding s) {
  s.clear_partial();
  return s;
}

Axes PartialAxes(const v1::Sharding& s) { return {s.partial().begin(), s.partial().end()}; }

std::string AxesText(const Axes& a) { return absl::StrJoin(a, ", "); }

void KeepPartial(const v1::Sharding& from, v1::Sharding& result) {
  *result.mutable_partial() = from.partial();
  result.set_partial_kind(from.partial_kind());
}

absl::Status NoCotangent(ReverseMode&, const v1::Node&, const std::string&) {
  return absl::OkStatus();
}
absl::StatusOr<std::string> NoTangent(ForwardMode&, const v1::Node&) { return std::string(); }
absl::StatusOr<std::string> SameOfTangent(ForwardMode& m, const v1::Node& n) {
  return m.Same(n, {m.Tangent(n, 0)});
}

absl::StatusOr<std::string> BilinearTangent(ForwardMode& m, const v1::Node& n) {
  const std::string ta = m.Tangent(n, 0), tb = m.Tangent(n, 1);
  const std::string l = ta.empty() ? "" : m.Same(n, {ta, m.Operand(n, 1)});
  const std::string r = tb.empty() ? "" : m.Same(n, {m.Operand(n, 0), tb});
  if (l.empty()) return r;
  if (r.empty()) return l;
  return m.e().Binary(v1::ADD, l, r);
}

namespace {

absl::flat_hash_map<int, OpRules> Build() {
  Rows rows;
  ElementwiseRows(rows);
  LayoutRows(rows);
  ReduceRows(rows);
  DotRows(rows);
  ConvolutionRows(rows);
  LinalgRows(rows);
  IndexingRows(rows);
  CollectiveRows(rows);
  absl::flat_hash_map<int, OpRules> table;
  for (auto& [op, r] : rows) {
    if (!table.emplace(int(op), r).second) {
      // Two families claim one op: a programming error, caught by the first test that looks an op
      // up.
      std::fprintf(stderr, "tessel: op %s has two rows in scheduler/ops\n",
                   std::string(OpName(op)).c_str());
      std::abort();
    }
  }
  return table;
}

}  // namespace

const OpRules* Find(v1::Op op) {
  static const absl::flat_hash_map<int, OpRules>* const table = new auto(Build());
  auto it = table->find(int(op));
  return it == table->end() ? nullptr : &it->second;
}

}  // namespace tessel::scheduler::ops
