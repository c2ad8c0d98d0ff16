#include "scheduler/fusion.h"

#include "absl/container/flat_hash_set.h"
#include "core/dtype.h"
#include "core/shape_inference.h"

namespace tessel::scheduler {
namespace {

bool SameDims(const google::protobuf::RepeatedField<int64_t>& a,
              const google::protobuf::RepeatedField<int64_t>& b) {
  if (a.size() != b.size()) return false;
  for (int i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

bool IsScalarConstant(const v1::Node& n) {
  return n.op() == v1::CONSTANT && n.type().dims_size() == 0 && !n.constant().has_iota();
}

// A fill or an unsplit iota over more than one element: generated where it
// is read, it costs nothing to make again, so a fusion never writes it out
// whole for another to read (a fusion that reads it makes its own).
bool IsGenerator(const v1::Node& n) {
  return n.op() == v1::CONSTANT && n.type().dims_size() > 0 &&
         (n.constant().has_fill() ||
          (n.constant().has_iota() && n.constant().iota().sharded_axes_size() == 0));
}

}  // namespace

bool FusibleInto(const v1::Node& n, const TypedGraph& g,
                 const google::protobuf::RepeatedField<int64_t>& dims) {
  if (IsScalarConstant(n)) return true;
  if (!SameDims(n.type().dims(), dims)) return false;
  if (IsElementwise(n.op())) return true;
  // A split iota starts at each device's block offset: it runs on its own.
  if (n.op() == v1::CONSTANT) {
    return n.constant().has_fill() ||
           (n.constant().has_iota() && n.constant().iota().sharded_axes_size() == 0);
  }
  if (n.op() == v1::BROADCAST_IN_DIM) {
    const v1::Node& src = g.graph.nodes(g.index_of.at(n.operands(0)));
    return NumElementsUnchecked(src.type()) == 1;
  }
  return false;
}

std::vector<v1::Instruction> PlanFusions(const TypedGraph& g) {
  const v1::Graph& graph = g.graph;
  // Who reads each node, to find a fusion's outputs.
  std::vector<std::vector<int>> readers(graph.nodes_size());
  for (int i = 0; i < graph.nodes_size(); ++i) {
    for (const std::string& o : graph.nodes(i).operands()) readers[g.index_of.at(o)].push_back(i);
  }
  absl::flat_hash_set<int> is_output(g.outputs.begin(), g.outputs.end());

  std::vector<v1::Instruction> out;
  std::vector<int> run;  // node positions of the open fusion
  // Generators a fusion made and did not write out: a later fusion makes
  // its own copy; any other reader gets one written once, before it.
  absl::flat_hash_set<int> regenerated, written;
  auto write_generators = [&](const v1::Node& n) {
    for (const std::string& o : n.operands()) {
      const int q = g.index_of.at(o);
      if (regenerated.contains(q) && written.insert(q).second) {
        *out.emplace_back().mutable_node() = graph.nodes(q);
      }
    }
  };
  auto close_run = [&] {
    if (run.empty()) return;
    // A lone scalar constant is not worth a fusion; emit it as a node.
    bool all_scalar_consts = true;
    for (int p : run) all_scalar_consts &= IsScalarConstant(graph.nodes(p));
    if (all_scalar_consts) {
      for (int p : run) *out.emplace_back().mutable_node() = graph.nodes(p);
      run.clear();
      return;
    }
    v1::Fusion f;
    absl::flat_hash_set<int> in_run(run.begin(), run.end());
    // An earlier fusion's generator this one reads: made here again, first.
    for (int p : run) {
      for (const std::string& o : graph.nodes(p).operands()) {
        const int q = g.index_of.at(o);
        if (regenerated.contains(q) && !written.contains(q) && in_run.insert(q).second) {
          *f.add_nodes() = graph.nodes(q);
        }
      }
    }
    absl::flat_hash_set<std::string> inputs;
    for (int p : run) {
      const v1::Node& n = graph.nodes(p);
      *f.add_nodes() = n;
      for (const std::string& o : n.operands()) {
        if (!in_run.contains(g.index_of.at(o)) && inputs.insert(o).second) f.add_inputs(o);
      }
      bool read_outside = false;
      for (int r : readers[p]) read_outside |= !in_run.contains(r);
      if (!is_output.contains(p) && read_outside && IsGenerator(n)) {
        regenerated.insert(p);
      } else if (is_output.contains(p) || read_outside) {
        f.add_outputs(n.name());
      }
    }
    run.clear();
    // Nothing read outside (only generators, made again where read): no fusion.
    if (f.outputs_size() > 0) *out.emplace_back().mutable_fusion() = std::move(f);
  };

  const google::protobuf::RepeatedField<int64_t>* run_dims = nullptr;
  for (int p = 0; p < graph.nodes_size(); ++p) {
    const v1::Node& n = graph.nodes(p);
    if (n.op() == v1::PARAMETER) continue;
    if (run_dims == nullptr || !FusibleInto(n, g, *run_dims)) {
      // Start a new run if this node can anchor one (a non-scalar shape), or
      // join as a scalar constant ahead of the next anchor.
      bool anchors = FusibleInto(n, g, n.type().dims()) && !IsScalarConstant(n);
      if (anchors) {
        // Keep leading scalar constants with the new run.
        std::vector<int> carried;
        bool only_scalars = !run.empty();
        for (int q : run) only_scalars &= IsScalarConstant(graph.nodes(q));
        if (only_scalars) carried.swap(run);
        close_run();
        run = std::move(carried);
        run.push_back(p);
        run_dims = &n.type().dims();
        continue;
      }
      if (IsScalarConstant(n)) {
        if (run_dims != nullptr) close_run();
        run_dims = nullptr;
        run.push_back(p);
        continue;
      }
      close_run();
      run_dims = nullptr;
      write_generators(n);
      *out.emplace_back().mutable_node() = n;
      continue;
    }
    run.push_back(p);
  }
  close_run();
  return out;
}

}  // namespace tessel::scheduler
