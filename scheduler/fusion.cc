#include "scheduler/fusion.h"

#include <functional>

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

// Cheap enough to make again in a later fusion rather than write out and
// read back: one arithmetic or select instruction per element (no
// transcendental, no division).
bool Recomputable(const v1::Node& n) {
  switch (n.op()) {
    case v1::ADD:
    case v1::SUB:
    case v1::MUL:
    case v1::NEG:
    case v1::ABS:
    case v1::MAX:
    case v1::MIN:
    case v1::SELECT:
    case v1::COMPARE:
    case v1::BROADCAST_IN_DIM: return true;
    case v1::CONVERT: return !n.convert().bitcast();
    default: return false;
  }
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
  const int n_nodes = graph.nodes_size();
  // Who reads each node, to find a fusion's outputs.
  std::vector<std::vector<int>> readers(n_nodes);
  for (int i = 0; i < n_nodes; ++i) {
    for (const std::string& o : graph.nodes(i).operands()) readers[g.index_of.at(o)].push_back(i);
  }
  absl::flat_hash_set<int> is_output(g.outputs.begin(), g.outputs.end());

  // First the runs (a fusion each) and the nodes between them, in order;
  // then what each run writes out, knowing who reads it.
  struct Item {
    std::vector<int> run;  // a fusion's nodes, or empty
    int node = -1;         // else one node on its own
  };
  std::vector<Item> items;
  std::vector<int> run;  // node positions of the open fusion
  auto close_run = [&] {
    if (run.empty()) return;
    // A lone scalar constant is not worth a fusion; emit it as a node.
    bool all_scalar_consts = true;
    for (int p : run) all_scalar_consts &= IsScalarConstant(graph.nodes(p));
    if (all_scalar_consts) {
      for (int p : run) items.push_back(Item{{}, p});
    } else {
      items.push_back(Item{run, -1});
    }
    run.clear();
  };

  const google::protobuf::RepeatedField<int64_t>* run_dims = nullptr;
  for (int p = 0; p < n_nodes; ++p) {
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
      items.push_back(Item{{}, p});
      continue;
    }
    run.push_back(p);
  }
  close_run();

  // What a fusion need not write out, because a later fusion that reads it
  // can make it again for no more than reading it would cost:
  // - generators (fills, iotas) and scalar constants, always;
  // - a cheap elementwise node (Recomputable) whose making, within its own
  //   fusion, reads at most one array (an input, or a value written out
  //   anyway): x * x or 1 - t where x or t is written out.
  // A node read by anything but a fusion is written out (a generator once,
  // just before its first such reader).
  std::vector<int> run_of(n_nodes, -1);
  for (int i = 0; i < int(items.size()); ++i) {
    for (int p : items[i].run) run_of[p] = i;
  }
  auto made_anywhere = [&](int q) {
    return IsGenerator(graph.nodes(q)) || IsScalarConstant(graph.nodes(q));
  };
  std::vector<char> written_out(n_nodes, 0), remade(n_nodes, 0);
  std::vector<int> cone(n_nodes, 0);   // nodes a remade node makes again
  std::vector<int> leaf(n_nodes, -1);  // the one array it reads (-1: none)
  for (int i = 0; i < int(items.size()); ++i) {
    for (int p : items[i].run) {
      const v1::Node& n = graph.nodes(p);
      bool by_node = is_output.contains(p), by_fusion = false;
      for (int r : readers[p]) {
        if (run_of[r] == -1) by_node = true;
        if (run_of[r] >= 0 && run_of[r] != i) by_fusion = true;
      }
      if (made_anywhere(p)) {
        written_out[p] = is_output.contains(p);
        continue;
      }
      bool ok = Recomputable(n);
      int size = 1, reads = -1;
      for (const std::string& o : n.operands()) {
        if (!ok) break;
        const int q = g.index_of.at(o);
        int array = -1;
        if (run_of[q] == -1) {
          array = q;  // a parameter, or what an instruction of its own wrote
        } else if (made_anywhere(q)) {
          continue;
        } else if (written_out[q]) {
          array = q;
        } else if (remade[q]) {
          array = leaf[q];
          size += cone[q];
        } else {
          ok = false;  // made only in this fusion, and not cheaply
        }
        if (array >= 0) {
          if (reads >= 0 && reads != array) ok = false;
          reads = array;
        }
      }
      remade[p] = ok && size <= 8;
      cone[p] = size;
      leaf[p] = reads;
      written_out[p] = by_node || (by_fusion && !remade[p]);
    }
  }

  std::vector<v1::Instruction> out;
  absl::flat_hash_set<int> written;  // generators written on their own
  for (int i = 0; i < int(items.size()); ++i) {
    const Item& item = items[i];
    if (item.node >= 0) {
      const v1::Node& n = graph.nodes(item.node);
      for (const std::string& o : n.operands()) {
        const int q = g.index_of.at(o);
        if (run_of[q] >= 0 && !written_out[q] && written.insert(q).second) {
          *out.emplace_back().mutable_node() = graph.nodes(q);  // a generator
        }
      }
      *out.emplace_back().mutable_node() = n;
      continue;
    }
    v1::Fusion f;
    absl::flat_hash_set<int> defined(item.run.begin(), item.run.end());
    absl::flat_hash_set<std::string> inputs;
    auto read = [&](int q) {
      if (!defined.contains(q) && inputs.insert(graph.nodes(q).name()).second)
        f.add_inputs(graph.nodes(q).name());
    };
    // An earlier fusion's value it did not write out: made here again, first.
    std::function<void(int)> remake = [&](int q) {
      if (defined.contains(q)) return;
      if (written_out[q] || written.contains(q) || run_of[q] < 0) return read(q);
      for (const std::string& o : graph.nodes(q).operands()) remake(g.index_of.at(o));
      defined.insert(q);
      *f.add_nodes() = graph.nodes(q);
    };
    for (int p : item.run) {
      for (const std::string& o : graph.nodes(p).operands()) remake(g.index_of.at(o));
    }
    for (int p : item.run) {
      const v1::Node& n = graph.nodes(p);
      *f.add_nodes() = n;
      for (const std::string& o : n.operands()) read(g.index_of.at(o));
      if (written_out[p]) f.add_outputs(n.name());
    }
    // Nothing read outside (all of it made again where read): no fusion.
    if (f.outputs_size() > 0) *out.emplace_back().mutable_fusion() = std::move(f);
  }
  return out;
}

}  // namespace tessel::scheduler
