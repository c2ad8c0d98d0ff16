#include "scheduler/compiler.h"

#include "core/security.h"

#include <google/protobuf/io/coded_stream.h>

#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <algorithm>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "core/status.h"
#include "scheduler/autodiff.h"
#include "scheduler/bodies.h"
#include "scheduler/combine_collectives.h"
#include "scheduler/fusion.h"
#include "scheduler/generated.h"
#include "scheduler/program_walk.h"
#include "scheduler/validator.h"

namespace tessel::scheduler {
namespace {

// Fills Instruction.release with the values each instruction reads last, and
// returns the peak bytes live at once (parameters included).
int64_t PlanBuffers(const TypedGraph& g, v1::Program& p) {
  absl::flat_hash_map<std::string, int> last_read;
  for (int i = 0; i < p.instructions_size(); ++i) {
    ForEachRead(p.instructions(i), [&](const std::string& v) { last_read[v] = i; });
  }
  absl::flat_hash_set<std::string> keep(p.outputs().begin(), p.outputs().end());
  for (const v1::Node& prm : p.parameters()) keep.insert(prm.name());
  absl::flat_hash_map<std::string, const v1::TensorType*> result_type;  // control flow's results
  for (const v1::Instruction& ins : p.instructions()) {
    for (int k = 0; k < ins.results_size(); ++k)
      result_type[ins.results(k)] = &ins.node().results(k);
  }
  auto bytes_of = [&](const std::string& v) {
    if (auto it = result_type.find(v); it != result_type.end())
      return ByteSizeUnchecked(*it->second);
    return ByteSizeUnchecked(g.graph.nodes(g.index_of.at(v)).type());
  };
  int64_t live = 0;
  for (const v1::Node& prm : p.parameters()) live += ByteSizeUnchecked(prm.type());
  int64_t peak = live;
  for (int i = 0; i < p.instructions_size(); ++i) {
    v1::Instruction& ins = *p.mutable_instructions(i);
    ForEachWrite(ins, [&](const std::string& v) { live += bytes_of(v); });
    peak = std::max(peak, live);
    std::vector<std::string> released;
    ForEachRead(ins, [&](const std::string& v) {
      if (last_read[v] == i && !keep.contains(v)) released.push_back(v);
    });
    std::sort(released.begin(), released.end());
    released.erase(std::unique(released.begin(), released.end()), released.end());
    for (const std::string& v : released) {
      live -= bytes_of(v);
      ins.add_release(v);
    }
    // Values written but never read (and not outputs) die at once.
    ForEachWrite(ins, [&](const std::string& v) {
      if (!last_read.contains(v) && !keep.contains(v)) {
        live -= bytes_of(v);
        ins.add_release(v);
      }
    });
  }
  return peak;
}

uint64_t Fnv1a(absl::string_view s, uint64_t h) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string NodeText(const v1::Node& n) {
  std::string attrs;
  switch (n.attrs_case()) {
    case v1::Node::kParameter: attrs = absl::StrCat(n.parameter().index()); break;
    case v1::Node::kConstant:
      if (n.constant().has_fill()) {
        attrs = n.constant().fill().value_case() == v1::Fill::kF
                    ? absl::StrCat("fill=", n.constant().fill().f())
                    : absl::StrCat("fill=", n.constant().fill().i());
      } else if (n.constant().has_iota()) {
        attrs = absl::StrCat("iota dim=", n.constant().iota().dimension());
        if (n.constant().iota().sharded_axes_size() > 0) {
          absl::StrAppend(&attrs, " split over ",
                          absl::StrJoin(n.constant().iota().sharded_axes(), ","));
        }
      } else {
        attrs = "literal";
      }
      break;
    case v1::Node::kCompare: attrs = v1::CompareDirection_Name(n.compare().direction()); break;
    case v1::Node::kReduce:
      attrs = absl::StrCat(v1::ReduceKind_Name(n.reduce().kind()),
                           " dims=", DimsString(n.reduce().dims()));
      break;
    case v1::Node::kDotGeneral: {
      const auto& d = n.dot_general();
      attrs = absl::StrCat("batch=", DimsString(d.lhs_batch()), DimsString(d.rhs_batch()),
                           " contracting=", DimsString(d.lhs_contracting()),
                           DimsString(d.rhs_contracting()));
      break;
    }
    case v1::Node::kCollective: {
      const v1::CollectiveAttrs& c = n.collective();
      attrs = absl::StrCat("axes=", absl::StrJoin(c.axes(), ","));
      if (n.op() == v1::ALL_REDUCE || n.op() == v1::REDUCE_SCATTER) {
        absl::StrAppend(&attrs, " ", v1::ReduceKind_Name(c.kind()));
      }
      if (n.op() == v1::ALL_GATHER || n.op() == v1::REDUCE_SCATTER || n.op() == v1::ALL_TO_ALL ||
          n.op() == v1::SHARD_SLICE) {
        absl::StrAppend(&attrs, " dim=", c.dimension());
      }
      if (n.op() == v1::ALL_TO_ALL) absl::StrAppend(&attrs, " concat=", c.concat_dimension());
      if (n.op() == v1::COLLECTIVE_PERMUTE)
        absl::StrAppend(&attrs, " pairs=", absl::StrJoin(c.source_target_pairs(), ","));
      break;
    }
    case v1::Node::kControl: {
      const v1::ControlFlowAttrs& c = n.control();
      if (n.op() == v1::WHILE) attrs = absl::StrCat("cond=", c.cond(), " body=", c.body());
      if (n.op() == v1::SCAN) {
        attrs = absl::StrCat("body=", c.body(), " length=", c.length(), " carries=", c.num_carry(),
                             c.reverse() ? " reverse" : "");
      }
      if (n.op() == v1::CONDITIONAL)
        attrs = absl::StrCat("branches=", absl::StrJoin(c.branches(), ","));
      break;
    }
    case v1::Node::kTupleElement: attrs = absl::StrCat("index=", n.tuple_element().index()); break;
    case v1::Node::kTranspose:
      attrs = absl::StrCat("perm=", DimsString(n.transpose().permutation()));
      break;
    case v1::Node::kBroadcastInDim:
      attrs = absl::StrCat("dims=", DimsString(n.broadcast_in_dim().broadcast_dimensions()));
      break;
    default: break;
  }
  std::vector<std::string> ops;
  for (const std::string& o : n.operands()) ops.push_back(absl::StrCat("%", o));
  std::string type = TypeString(n.type());
  if (n.results_size() > 0) {
    std::vector<std::string> ts;
    for (const v1::TensorType& t : n.results()) ts.push_back(TypeString(t));
    type = absl::StrCat("(", absl::StrJoin(ts, ", "), ")");
  }
  return absl::StrCat("%", n.name(), " = ", OpName(n.op()), "(", absl::StrJoin(ops, ", "), ")",
                      attrs.empty() ? "" : absl::StrCat(" {", attrs, "}"), " : ", type);
}

// The vjp whose backward pass value `v` belongs to ("g" for "g/bwd.3"), or "".
std::string BackwardOf(const std::string& v) {
  const size_t at = v.find("/bwd");
  return at == std::string::npos ? "" : v.substr(0, at);
}

void PrintInstructions(const v1::Program& p, const std::string& indent, std::string& s) {
  for (const v1::Node& prm : p.parameters()) absl::StrAppend(&s, indent, NodeText(prm), "\n");
  absl::flat_hash_set<std::string> backward_begun;
  for (const v1::Instruction& ins : p.instructions()) {
    // Where a gradient's backward pass begins (the autodiff expansion names
    // its values vjp/bwd...).
    ForEachWrite(ins, [&](const std::string& v) {
      const std::string vjp = BackwardOf(v);
      if (!vjp.empty() && backward_begun.insert(vjp).second) {
        absl::StrAppend(&s, indent, "-- backward pass of vjp '", vjp, "' --\n");
      }
    });
    if (ins.has_node()) {
      std::string text = NodeText(ins.node());
      if (ins.results_size() > 0) {
        std::vector<std::string> rs;
        for (const std::string& r : ins.results()) rs.push_back(absl::StrCat("%", r));
        text =
            absl::StrCat("(", absl::StrJoin(rs, ", "), ") = ", text.substr(text.find(" = ") + 3));
      }
      absl::StrAppend(&s, indent, text, "\n");
    } else {
      const v1::Fusion& f = ins.fusion();
      absl::StrAppend(&s, indent, "fusion(", absl::StrJoin(f.inputs(), ", "), ") -> (",
                      absl::StrJoin(f.outputs(), ", "), ") {\n");
      for (const v1::Node& n : f.nodes()) absl::StrAppend(&s, indent, "  ", NodeText(n), "\n");
      absl::StrAppend(&s, indent, "}\n");
    }
    if (ins.release_size() > 0) {
      absl::StrAppend(&s, indent, "  release ", absl::StrJoin(ins.release(), ", "), "\n");
    }
  }
  absl::StrAppend(&s, indent, "outputs ", absl::StrJoin(p.outputs(), ", "), "\n");
  for (int i = 0; i < p.parameter_aliases_size(); ++i) {
    if (p.parameter_aliases(i) < 0) continue;
    absl::StrAppend(&s, indent, "carry %", p.parameters(i).name(), " -> output ",
                    p.parameter_aliases(i), " '", p.outputs(p.parameter_aliases(i)),
                    "' (in place)\n");
  }
}

}  // namespace

namespace {

std::string DeterministicBytes(const v1::Graph& graph) {
  std::string bytes;
  google::protobuf::io::StringOutputStream sos(&bytes);
  google::protobuf::io::CodedOutputStream cos(&sos);
  cos.SetSerializationDeterministic(true);
  graph.SerializeToCodedStream(&cos);
  return bytes;
}

}  // namespace

std::string Fingerprint(const v1::Graph& graph) {
  const std::string bytes = DeterministicBytes(graph);
  uint64_t a = Fnv1a(bytes, 0xcbf29ce484222325ull);
  uint64_t b = Fnv1a(bytes, 0x84222325cbf29ce4ull ^ bytes.size());
  return absl::StrFormat("%016x%016x", a, b);
}

std::string PrintProgram(const v1::Program& p) {
  std::string s = absl::StrCat("program ", p.executable_id(), "\n");
  PrintInstructions(p, "  ", s);
  for (const v1::Program& f : p.functions()) {
    absl::StrAppend(&s, "  function ", f.executable_id(), " {\n");
    PrintInstructions(f, "    ", s);
    absl::StrAppend(&s, "  }\n");
  }
  return s;
}

std::string ExecutableKey(const v1::Graph& graph, const CompileOptions& options) {
  std::vector<int> sorted = options.donated_parameters;
  std::sort(sorted.begin(), sorted.end());
  // Everything but the graph, then the graph's bytes: the parts cannot run
  // into each other (the graph goes last, whole).
  std::string key = absl::StrCat("owner ", options.owner.size(), ":", options.owner, " donate ",
                                 absl::StrJoin(sorted, ","));
  if (options.mesh.axis_names_size() > 0) {
    absl::StrAppend(&key, " mesh ", MeshString(options.mesh), " in");
    for (const v1::Sharding& s : options.parameter_shardings)
      absl::StrAppend(&key, " ", s.unspecified() ? "auto" : ShardingString(s));
    absl::StrAppend(&key, " out");
    for (const v1::Sharding& s : options.output_shardings) {
      absl::StrAppend(&key, " ", s.unspecified() ? "auto" : ShardingString(s));
    }
  }
  absl::StrAppend(&key, "\n", DeterministicBytes(graph));
  return Sha256Hex(key).substr(0, 32);
}

// Drops the nodes no output depends on (parameters stay: they are the
// signature), in manual region bodies too, so nothing is computed, and no
// collective planned, for a value nobody reads. Returns whether it dropped any.
static bool DropDeadNodes(v1::Graph& g) {
  absl::flat_hash_set<std::string> needed(g.outputs().begin(), g.outputs().end());
  std::vector<bool> keep(g.nodes_size());
  bool dropped = false;
  for (int i = g.nodes_size() - 1; i >= 0; --i) {
    v1::Node& n = *g.mutable_nodes(i);
    keep[i] = n.op() == v1::PARAMETER || needed.contains(n.name());
    if (!keep[i]) {
      dropped = true;
      continue;
    }
    for (const std::string& o : n.operands()) needed.insert(o);
    if (n.has_manual_region()) dropped |= DropDeadNodes(*n.mutable_manual_region()->mutable_body());
  }
  for (v1::Graph& f : *g.mutable_functions()) dropped |= DropDeadNodes(f);
  if (!dropped) return false;
  google::protobuf::RepeatedPtrField<v1::Node> live;
  for (int i = 0; i < g.nodes_size(); ++i) {
    if (keep[i]) *live.Add() = std::move(*g.mutable_nodes(i));
  }
  g.mutable_nodes()->Swap(&live);
  return true;
}

// Makes each result of a control-flow node read through one tuple_element
// node (the first), so that every result has one name in the plan.
// A node equal to an earlier one (op, operands after renaming, attributes
// and type) is that node. Reverse mode recomputes a manual region's forward
// values in its backward region; where both run, each is computed once.
// Collectives keep their own instructions (each is a rendezvous), and so do
// nodes of several results.
static bool EliminateCommonSubexpressions(v1::Graph& g) {
  absl::flat_hash_map<std::string, std::string> rename, first;
  google::protobuf::RepeatedPtrField<v1::Node> kept;
  bool changed = false;
  for (v1::Node& n : *g.mutable_nodes()) {
    for (std::string& o : *n.mutable_operands()) {
      if (auto it = rename.find(o); it != rename.end()) o = it->second;
    }
    if (n.op() != v1::PARAMETER && !IsCollective(n.op()) && !IsMultiResult(n) &&
        n.op() != v1::TUPLE_ELEMENT) {
      v1::Node key = n;
      key.clear_name();
      auto [it, fresh] = first.emplace(key.SerializeAsString(), n.name());
      if (!fresh) {
        rename[n.name()] = it->second;
        changed = true;
        continue;
      }
    }
    *kept.Add() = std::move(n);
  }
  *g.mutable_nodes() = std::move(kept);
  if (!changed) return false;
  for (std::string& o : *g.mutable_outputs()) {
    if (auto it = rename.find(o); it != rename.end()) o = it->second;
  }
  return true;
}

static void DedupeTupleElements(v1::Graph& g) {
  absl::flat_hash_map<std::string, std::string> first, rename;  // "node#k" -> name; dup -> first
  google::protobuf::RepeatedPtrField<v1::Node> kept;
  for (v1::Node& n : *g.mutable_nodes()) {
    for (std::string& o : *n.mutable_operands()) {
      if (auto it = rename.find(o); it != rename.end()) o = it->second;
    }
    if (n.op() == v1::TUPLE_ELEMENT) {
      auto [it, fresh] =
          first.emplace(absl::StrCat(n.operands(0), "#", n.tuple_element().index()), n.name());
      if (!fresh) {
        rename[n.name()] = it->second;
        continue;
      }
    }
    *kept.Add() = std::move(n);
  }
  g.mutable_nodes()->Swap(&kept);
  for (std::string& o : *g.mutable_outputs()) {
    if (auto it = rename.find(o); it != rename.end()) o = it->second;
  }
}

// The plan of one validated graph (the program, or a function): its
// parameters, instructions (fusions planned, each control-flow node with its
// tuple_element readers as one instruction of several results), outputs and
// release lists. Returns the estimated peak bytes.
static int64_t BuildPlan(const TypedGraph& g, v1::Program& p);

// Reads a transposed operand of a dot_general in place: dot(transpose(a),
// b) becomes dot(a, b) with a's dimension numbers, when that keeps the
// product's layout (the operand's free dimensions stay in order; batch and
// contracting dimensions are listed, so any order serves). The transpose
// then runs only where something else reads it; both backends read a
// contracting dimension wherever it lies (BLAS and cuBLASLt transpose
// flags). Returns whether it rewrote any dot.
static bool FoldTransposesIntoDots(v1::Graph& g) {
  absl::flat_hash_map<std::string, int> index_of;
  for (int i = 0; i < g.nodes_size(); ++i) index_of[g.nodes(i).name()] = i;
  bool folded = false;
  for (v1::Node& n : *g.mutable_nodes()) {
    if (n.op() != v1::DOT_GENERAL) continue;
    for (int side = 0; side < 2; ++side) {
      auto it = index_of.find(n.operands(side));
      if (it == index_of.end()) continue;
      const v1::Node& t = g.nodes(it->second);
      if (t.op() != v1::TRANSPOSE) continue;
      const auto& perm = t.transpose().permutation();
      v1::DotGeneralAttrs* d = n.mutable_dot_general();
      auto* batch = side == 0 ? d->mutable_lhs_batch() : d->mutable_rhs_batch();
      auto* contracting = side == 0 ? d->mutable_lhs_contracting() : d->mutable_rhs_contracting();
      std::vector<bool> listed(perm.size(), false);
      for (int64_t k : *batch) listed[k] = true;
      for (int64_t k : *contracting) listed[k] = true;
      int64_t last = -1;
      bool in_order = true;
      for (int k = 0; k < perm.size(); ++k) {
        if (listed[k]) continue;
        in_order &= perm[k] > last;
        last = perm[k];
      }
      if (!in_order) continue;
      for (int64_t& k : *batch) k = perm[k];
      for (int64_t& k : *contracting) k = perm[k];
      n.set_operands(side, t.operands(0));
      folded = true;
    }
  }
  return folded;
}

// Moves each instruction that reads a parameter as early as its other
// operands allow, keeping the order otherwise. A parameter's last reader
// then tends to come before the elementwise update that could be written
// into its donated buffer, whatever order the outputs were listed in:
// `(w * 2, sum(w))` reuses `w` as `(sum(w), w * 2)` does.
static void HoistParameterReaders(v1::Program& p) {
  // Each instruction gets a slot: one that reads no parameter stays at (its
  // index, 0); one that reads a parameter goes just after its latest
  // producer: (that producer's base, its depth + 1), and among those at one
  // place, fusions (the in-place writers) last. Sorting by slot keeps every
  // producer before its readers.
  struct Slot {
    int base, depth;
    bool fusion;
    int index;
    bool operator<(const Slot& o) const {
      return std::tie(base, depth, fusion, index) < std::tie(o.base, o.depth, o.fusion, o.index);
    }
  };
  absl::flat_hash_set<std::string> params;
  for (const v1::Node& prm : p.parameters()) params.insert(prm.name());
  absl::flat_hash_map<std::string, int> producer;
  std::vector<Slot> slots;
  for (int i = 0; i < p.instructions_size(); ++i) {
    const v1::Instruction& ins = p.instructions(i);
    bool reads_param = false;
    Slot after{-1, 0, ins.has_fusion(), i};
    ForEachRead(ins, [&](const std::string& v) {
      if (params.contains(v)) {
        reads_param = true;
      } else if (auto it = producer.find(v); it != producer.end()) {
        const Slot& s = slots[it->second];
        if (s.base > after.base || (s.base == after.base && s.depth >= after.depth))
          after.base = s.base, after.depth = s.depth + 1;
      }
    });
    slots.push_back(reads_param ? after : Slot{i, 0, false, i});
    ForEachWrite(ins, [&](const std::string& v) { producer[v] = i; });
  }
  std::vector<Slot> order = slots;
  std::sort(order.begin(), order.end());
  bool moved = false;
  for (int i = 0; i < int(order.size()); ++i) moved |= order[i].index != i;
  if (!moved) return;
  google::protobuf::RepeatedPtrField<v1::Instruction> sorted;
  for (const Slot& s : order) *sorted.Add() = std::move(*p.mutable_instructions(s.index));
  p.mutable_instructions()->Swap(&sorted);
}

static int64_t BuildPlan(const TypedGraph& g, v1::Program& p) {
  for (int pos : g.parameters) *p.add_parameters() = g.graph.nodes(pos);
  for (int pos : g.outputs) {
    p.add_outputs(g.graph.nodes(pos).name());
    *p.add_output_types() = g.graph.nodes(pos).type();
  }
  std::vector<v1::Instruction> planned = PlanFusions(g);
  // Control flow: its tuple_element readers become its result names.
  absl::flat_hash_map<std::string, std::vector<std::string>> results;
  for (const v1::Instruction& ins : planned) {
    if (!ins.has_node() || ins.node().op() != v1::TUPLE_ELEMENT) continue;
    const v1::Node& n = ins.node();
    const v1::Node& cf = g.graph.nodes(g.index_of.at(n.operands(0)));
    std::vector<std::string>& names = results[cf.name()];
    if (names.empty()) {
      for (int k = 0; k < cf.results_size(); ++k) names.push_back(absl::StrCat(cf.name(), "#", k));
    }
    names[n.tuple_element().index()] = n.name();
  }
  for (v1::Instruction& ins : planned) {
    if (ins.has_node() && ins.node().op() == v1::TUPLE_ELEMENT) continue;
    if (ins.has_node() && IsControlFlow(ins.node().op())) {
      std::vector<std::string>& names = results[ins.node().name()];
      for (int k = int(names.size()); k < ins.node().results_size(); ++k) {
        names.push_back(absl::StrCat(ins.node().name(), "#", k));
      }
      for (const std::string& r : names) ins.add_results(r);
    }
    *p.add_instructions() = std::move(ins);
  }
  HoistParameterReaders(p);
  return PlanBuffers(g, p);
}

// Each parameter of a function, the output it may be written into: its own
// position where it can (a loop carry updated in place), else the first
// free candidate.
static void PlanParameterAliases(v1::Program& f) {
  const AliasCandidates c = FindAliasCandidates(f);
  std::vector<int> alias(f.parameters_size(), -1);
  absl::flat_hash_set<std::string> taken;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < f.parameters_size(); ++i) {
      if (alias[i] >= 0) continue;
      for (int o : c.outputs[i]) {
        if ((pass == 0 && o != i) || c.buffer_of_output[o] == f.parameters(i).name()) continue;
        if (taken.insert(c.buffer_of_output[o]).second) {
          alias[i] = o;
          break;
        }
      }
    }
  }
  for (int a : alias) f.add_parameter_aliases(a);
}

// Lowers and plans every function of `lowered` into p.functions.
static absl::Status CompileFunctions(const v1::Graph& lowered, const ValidateOptions& base,
                                     v1::Program& p, int64_t& peak) {
  FunctionTable table(lowered);
  for (const v1::Graph& fn : lowered.functions()) {
    ValidateOptions o = base;
    o.functions = &table;
    auto typed = ValidateGraph(fn, o);
    if (!typed.ok())
      return Annotate(typed.status(),
                      absl::StrCat("internal: function '", fn.name(), "' does not check: "));
    v1::Program& f = *p.add_functions();
    f.set_executable_id(fn.name());
    peak += BuildPlan(*typed, f);
    PlanParameterAliases(f);
  }
  return absl::OkStatus();
}

// Lowers each function of `client` (custom kernels inlined, constraints
// dropped) into out.functions, dead nodes dropped and tuple reads deduped.
// Collectives in functions (called from shard_map) are listed in the plan.
static absl::Status LowerFunctions(const TypedGraph& client, CompiledProgram& c, v1::Graph& out) {
  FunctionTable table(client.graph);
  for (const v1::Graph& fn : client.graph.functions()) {
    auto typed = ValidateGraph(
        fn, {.manual_mesh = c.partitioned() ? &c.mesh : nullptr, .functions = &table});
    if (!typed.ok()) return Annotate(typed.status(), absl::StrCat("function '", fn.name(), "': "));
    TESSEL_ASSIGN_OR_RETURN(v1::Graph lowered, LowerUnpartitioned(*typed));
    lowered.set_name(fn.name());
    absl::flat_hash_map<std::string, const v1::TensorType*> type_of;
    for (v1::Node& n : *lowered.mutable_nodes()) {
      type_of[n.name()] = &n.type();
      if (!IsCollective(n.op()) || n.op() == v1::AXIS_INDEX) continue;
      v1::CollectiveAttrs& col = *n.mutable_collective();
      if ((n.op() == v1::ALL_REDUCE || n.op() == v1::REDUCE_SCATTER) &&
          col.kind() == v1::REDUCE_INVALID) {
        col.set_kind(v1::SUM);
      }
      col.set_reason(absl::StrCat("explicit in function '", fn.name(), "', each time it runs"));
      c.collectives.push_back(PlanCollective(c.mesh, n.name(), n.op(),
                                             {col.axes().begin(), col.axes().end()},
                                             *type_of.at(n.operands(0)), n.type(), col.reason()));
    }
    if (FoldTransposesIntoDots(lowered)) DropDeadNodes(lowered);
    DedupeTupleElements(lowered);
    *out.add_functions() = std::move(lowered);
  }
  return absl::OkStatus();
}

namespace {

// `graph` checked again after a rewrite; an error is the rewrite's (`what`).
absl::Status Recheck(TypedGraph& client, v1::Graph graph, absl::string_view what) {
  auto typed = ValidateGraph(std::move(graph));
  if (!typed.ok())
    return Annotate(typed.status(),
                    absl::StrCat("internal: the graph ", what, " does not check: "));
  client = std::move(*typed);
  return absl::OkStatus();
}

// The client's graph with its bodies lowered, its gradients expanded, its
// dead nodes dropped and layout ops pushed into generated constants,
// checked after each.
absl::Status Simplify(TypedGraph& client, const CompileOptions& options) {
  if (HasBodies(client.graph)) {
    TESSEL_ASSIGN_OR_RETURN(v1::Graph lowered, LowerBodies(client, options.mesh));
    TESSEL_RETURN_IF_ERROR(Recheck(client, std::move(lowered), "with its bodies lowered"));
  }
  if (HasAutodiff(client.graph)) {
    TESSEL_ASSIGN_OR_RETURN(v1::Graph expanded, ExpandAutodiff(client, options.mesh));
    TESSEL_RETURN_IF_ERROR(Recheck(client, std::move(expanded), "with its gradients expanded"));
  }
  if (DropDeadNodes(client.graph)) {
    TESSEL_RETURN_IF_ERROR(Recheck(client, std::move(client.graph), "without its dead nodes"));
  }
  // Constants cut or moved by layout ops stay generated: no device makes
  // the whole of one to keep a block of it.
  if (PushLayoutsIntoGenerated(client.graph)) {
    DropDeadNodes(client.graph);
    TESSEL_RETURN_IF_ERROR(
        Recheck(client, std::move(client.graph), "with layouts pushed into its constants"));
  }
  return absl::OkStatus();
}

// The per-device graph: partitioned over the mesh, or lowered whole; then
// cleaned up, its functions lowered, and checked as a partitioned graph.
absl::StatusOr<TypedGraph> Lower(const TypedGraph& client, const CompileOptions& options,
                                 CompiledProgram& c) {
  v1::Graph lowered;
  if (options.mesh.axis_names_size() > 0) {
    TESSEL_ASSIGN_OR_RETURN(
        PartitionedGraph pg,
        Partition(client, {options.mesh, options.parameter_shardings, options.output_shardings}));
    lowered = std::move(pg.local);
    c.mesh = options.mesh;
    c.parameter_shardings = std::move(pg.parameter_shardings);
    c.output_shardings = std::move(pg.output_shardings);
    c.collectives = std::move(pg.collectives);
    for (std::string& d : pg.diagnostics) c.diagnostics.push_back(std::move(d));
  } else {
    TESSEL_ASSIGN_OR_RETURN(lowered, LowerUnpartitioned(client));
  }
  EliminateCommonSubexpressions(lowered);
  if (FoldTransposesIntoDots(lowered)) DropDeadNodes(lowered);
  DedupeTupleElements(lowered);
  if (c.partitioned()) CombineAllReduces(lowered, c.collectives, c.mesh);
  if (client.graph.functions_size() > 0) {
    TESSEL_RETURN_IF_ERROR(LowerFunctions(client, c, lowered));
  }
  for (int pos : client.parameters)
    c.global_parameter_types.push_back(client.graph.nodes(pos).type());
  for (int pos : client.outputs) c.global_output_types.push_back(client.graph.nodes(pos).type());
  auto validated =
      ValidateGraph(std::move(lowered),
                    {.manual_mesh = c.partitioned() ? &c.mesh : nullptr, .partitioned = true});
  if (!validated.ok())
    return Annotate(validated.status(), "internal: the partitioned graph does not check: ");
  return std::move(*validated);
}

absl::Status CheckDonatedParameters(const std::vector<int>& donated, size_t parameters) {
  absl::flat_hash_set<int> seen;
  for (int d : donated) {
    if (d < 0 || d >= int(parameters)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "donated parameter ", d, " does not exist: the graph has ", parameters, " parameters"));
    }
    if (!seen.insert(d).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", d, " is declared donated twice"));
    }
  }
  return absl::OkStatus();
}

// The diagnostics every program gets: large literals shipped with it, and
// its size.
void NoteProgram(const v1::Graph& graph, CompiledProgram& c) {
  const v1::Program& p = c.program;
  int fusions = 0;
  for (const v1::Instruction& ins : p.instructions()) {
    fusions += ins.has_fusion();
    if (ins.has_node() && ins.node().op() == v1::CONSTANT && ins.node().constant().has_literal()) {
      int64_t bytes = ByteSizeUnchecked(ins.node().type());
      if (bytes > kLargeLiteralBytes) {
        c.diagnostics.push_back(
            absl::StrCat("warning: literal constant '", ins.node().name(), "' (",
                         TypeString(ins.node().type()), ", ", bytes,
                         " bytes) is shipped with the program to every device it runs on; "
                         "pass it as a parameter to place it once"));
      }
    }
  }
  c.diagnostics.push_back(absl::StrCat(
      "note: ", graph.nodes_size(), " nodes -> ", p.instructions_size(), " instructions (", fusions,
      " fusions); estimated peak ", c.estimated_peak_bytes, " bytes per device"));
}

// The plan's text: the mesh, each parameter's and output's sharding and
// blocks, and every collective with its reason (partitioned programs),
// then the program.
void WritePlanText(CompiledProgram& c) {
  const v1::Program& p = c.program;
  c.plan_text.clear();
  if (c.partitioned()) {
    absl::StrAppend(&c.plan_text, "mesh ", MeshString(c.mesh),
                    ": every device runs the program below on its blocks\n");
    for (size_t i = 0; i < c.parameter_shardings.size(); ++i) {
      absl::StrAppend(&c.plan_text, "  parameter ", i, " '", p.parameters(i).name(), "' ",
                      TypeString(c.global_parameter_types[i]), " ",
                      ShardingString(c.parameter_shardings[i]), " -> blocks of ",
                      TypeString(p.parameters(i).type()), "\n");
    }
    for (size_t i = 0; i < c.output_shardings.size(); ++i) {
      absl::StrAppend(&c.plan_text, "  output ", i, " ", TypeString(c.global_output_types[i]), " ",
                      ShardingString(c.output_shardings[i]), " -> blocks of ",
                      TypeString(p.output_types(i)), "\n");
    }
    int64_t total = 0;
    for (const PlannedCollective& pc : c.collectives) total += pc.bytes_per_device;
    absl::StrAppend(&c.plan_text, "collectives: ", c.collectives.size(), ", ", total,
                    " bytes received per device\n");
    for (const PlannedCollective& pc : c.collectives) {
      absl::StrAppend(&c.plan_text, "  %", pc.value, " = ", OpName(pc.op), " over ",
                      absl::StrJoin(pc.axes, ","), ", ", pc.bytes_per_device,
                      " bytes per device: ", pc.reason, "\n");
    }
    c.diagnostics.push_back(absl::StrCat("note: partitioned over ", MeshString(c.mesh), " with ",
                                         c.collectives.size(), " collectives (", total,
                                         " bytes received per device)"));
  }
  absl::StrAppend(&c.plan_text, PrintProgram(p));
}

// Which donated buffer each output can take, said in the plan and, for a
// donation no output takes, in a warning.
void PlanDonations(const CompileOptions& options, CompiledProgram& c) {
  const v1::Program& p = c.program;
  c.alias_candidates = FindAliasCandidates(p);
  c.donated_parameters = options.donated_parameters;
  c.declared_aliases = AssignAliases(p, c.alias_candidates, options.donated_parameters);
  for (const AliasDecision& d : c.declared_aliases) {
    const std::string& name = p.parameters(d.parameter).name();
    if (d.output >= 0) {
      absl::StrAppend(&c.plan_text, "  donate %", name, " -> output ", d.output, " '",
                      p.outputs(d.output), "' (in place)\n");
      continue;
    }
    absl::StrAppend(&c.plan_text, "  donate %", name, ": not reused: ", d.reason, "\n");
    c.diagnostics.push_back(absl::StrCat("warning: donated parameter ", d.parameter, " '", name,
                                         "' cannot give its buffer to any output: ", d.reason));
  }
}

}  // namespace

absl::StatusOr<CompiledProgram> Compile(const v1::Graph& graph, const CompileOptions& given) {
  TESSEL_ASSIGN_OR_RETURN(TypedGraph client, ValidateGraph(graph));
  CompileOptions options = given;
  if (options.mesh.axis_names_size() > 0) {
    TESSEL_ASSIGN_OR_RETURN(options.mesh, NormalizeMesh(options.mesh));
  }
  TESSEL_RETURN_IF_ERROR(Simplify(client, options));
  CompiledProgram c;
  TESSEL_ASSIGN_OR_RETURN(TypedGraph g, Lower(client, options, c));
  TESSEL_RETURN_IF_ERROR(CheckDonatedParameters(options.donated_parameters, g.parameters.size()));
  c.fingerprint = ExecutableKey(graph, options);
  v1::Program& p = c.program;
  p.set_executable_id(c.fingerprint);
  if (c.partitioned()) *p.mutable_mesh() = c.mesh;
  for (int pos : g.parameters) c.parameter_types.push_back(g.graph.nodes(pos).type());
  for (int pos : g.outputs) c.output_types.push_back(g.graph.nodes(pos).type());
  c.estimated_peak_bytes = BuildPlan(g, p);
  // A function's values live while it runs: counted on top (an upper bound).
  TESSEL_RETURN_IF_ERROR(CompileFunctions(
      g.graph, {.manual_mesh = c.partitioned() ? &c.mesh : nullptr, .partitioned = true}, p,
      c.estimated_peak_bytes));
  NoteProgram(graph, c);
  WritePlanText(c);
  PlanDonations(options, c);
  if (options.strict_donation) TESSEL_RETURN_IF_ERROR(CheckStrictDonation(c));
  return c;
}

absl::Status CheckStrictDonation(const CompiledProgram& c) {
  for (const AliasDecision& d : c.declared_aliases) {
    if (d.output >= 0) continue;
    const v1::Node& prm = c.program.parameters(d.parameter);
    return absl::InvalidArgumentError(
        absl::StrCat("strict donation: parameter ", d.parameter, " '", prm.name(), "' (",
                     TypeString(prm.type()), ") cannot give its buffer to any output: ", d.reason));
  }
  return absl::OkStatus();
}

}  // namespace tessel::scheduler
