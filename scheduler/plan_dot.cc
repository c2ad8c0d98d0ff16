#include "scheduler/plan_dot.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/dtype.h"
#include "core/sharding.h"
#include "scheduler/validator.h"

namespace tessel::scheduler {

namespace {

using absl::StrCat;

// A DOT string literal's contents.
std::string Esc(absl::string_view s) {
  return absl::StrReplaceAll(s, {{"\\", "\\\\"}, {"\"", "\\\""}, {"\n", "\\n"}});
}

// An op that moves data between devices (axis_index only reads its position).
bool Communicates(v1::Op op) { return IsCollective(op) && op != v1::AXIS_INDEX; }

std::string Bytes(int64_t b) {
  if (b >= (1 << 20)) return StrCat(b >> 20, " MiB");
  if (b >= (1 << 10)) return StrCat(b >> 10, " KiB");
  return StrCat(b, " B");
}

// One program (a function's too) as a cluster of its own: `prefix` keeps
// its node ids apart from the others'.
void Draw(const v1::Program& p, const CompiledProgram* c, const std::string& prefix,
          const std::string& indent, std::string& out) {
  absl::flat_hash_map<std::string, std::string> producer;  // value -> DOT node id
  absl::flat_hash_map<std::string, const PlannedCollective*> planned;
  absl::flat_hash_map<int, int> donated_to;  // parameter -> output (-1: not reused)
  if (c != nullptr) {
    for (const PlannedCollective& pc : c->collectives) planned[pc.value] = &pc;
    for (const AliasDecision& a : c->declared_aliases) donated_to[a.parameter] = a.output;
  }
  for (int i = 0; i < p.parameters_size(); ++i) {
    const v1::Node& n = p.parameters(i);
    const std::string id = StrCat(prefix, "p", i);
    producer[n.name()] = id;
    std::string label = StrCat("parameter ", i, "\\n%", Esc(n.name()), ": ", TypeString(n.type()));
    std::string style = "shape=invhouse, style=filled, fillcolor=\"#e8f0fe\"";
    if (auto d = donated_to.find(i); d != donated_to.end()) {
      absl::StrAppend(&label, d->second >= 0 ? StrCat("\\ndonated: becomes output ", d->second)
                                             : std::string("\\ndonated: not reused"));
      style = "shape=invhouse, style=\"filled,bold\", fillcolor=\"#fde2e1\", color=\"#c5221f\"";
    }
    absl::StrAppend(&out, indent, id, " [label=\"", label, "\", ", style, "];\n");
  }
  auto edges = [&](const std::string& to,
                   const google::protobuf::RepeatedPtrField<std::string>& in) {
    for (const std::string& v : in) {
      if (auto it = producer.find(v); it != producer.end()) {
        absl::StrAppend(&out, indent, it->second, " -> ", to, ";\n");
      }
    }
  };
  for (int i = 0; i < p.instructions_size(); ++i) {
    const v1::Instruction& ins = p.instructions(i);
    const std::string id = StrCat(prefix, "i", i);
    if (ins.has_fusion()) {
      const v1::Fusion& f = ins.fusion();
      std::vector<std::string> ops;
      for (const v1::Node& n : f.nodes()) ops.push_back(OpName(n.op()));
      if (ops.size() > 8) {
        const size_t more = ops.size() - 8;
        ops.resize(8);
        ops.push_back(StrCat("... ", more, " more"));
      }
      absl::StrAppend(&out, indent, id, " [label=\"fusion (", f.nodes_size(), " ops)\\n",
                      Esc(absl::StrJoin(ops, " ")), "\", shape=box, style=\"rounded,filled\", ",
                      "fillcolor=\"#f1f3f4\"];\n");
      edges(id, f.inputs());
      for (const std::string& o : f.outputs()) producer[o] = id;
      continue;
    }
    const v1::Node& n = ins.node();
    std::string label = StrCat(OpName(n.op()), "\\n%", Esc(n.name()));
    if (n.has_type()) absl::StrAppend(&label, ": ", TypeString(n.type()));
    std::string style = "shape=ellipse";
    if (Communicates(n.op())) {
      const int64_t bytes = n.has_type() ? ByteSizeUnchecked(n.type()) : 0;
      absl::StrAppend(&label, "\\nover ", Esc(absl::StrJoin(n.collective().axes(), ",")));
      auto pc = planned.find(n.name());
      absl::StrAppend(&label, ", ",
                      Bytes(pc != planned.end() ? pc->second->bytes_per_device : bytes),
                      pc != planned.end() ? " received per device" : "");
      std::string reason = pc != planned.end() ? pc->second->reason : n.collective().reason();
      if (reason.size() > 90) reason = reason.substr(0, 87) + "...";
      if (!reason.empty()) absl::StrAppend(&label, "\\n", Esc(reason));
      style = "shape=box, style=filled, fillcolor=\"#fce8b2\", color=\"#e37400\"";
    } else if (ins.results_size() > 0) {
      style = "shape=box3d";  // control flow: runs functions below
    }
    absl::StrAppend(&out, indent, id, " [label=\"", label, "\", ", style, "];\n");
    edges(id, n.operands());
    producer[n.name()] = id;
    for (const std::string& r : ins.results()) producer[r] = id;
  }
  for (int i = 0; i < p.outputs_size(); ++i) {
    const std::string id = StrCat(prefix, "o", i);
    absl::StrAppend(&out, indent, id, " [label=\"output ", i,
                    i < p.output_types_size() ? StrCat(": ", TypeString(p.output_types(i))) : "",
                    "\", shape=house, style=filled, fillcolor=\"#e6f4ea\"];\n");
    if (auto it = producer.find(p.outputs(i)); it != producer.end()) {
      absl::StrAppend(&out, indent, it->second, " -> ", id, ";\n");
    }
  }
}

}  // namespace

std::string PlanDot(const CompiledProgram& c) {
  const v1::Program& p = c.program;
  std::string out = StrCat("digraph \"", Esc(p.executable_id()), "\" {\n",
                           "  rankdir=TB;\n  node [fontname=\"Helvetica\", fontsize=10];\n");
  std::string title = StrCat("per-device program ", p.executable_id().substr(0, 12));
  if (c.partitioned()) {
    absl::StrAppend(&title, " on mesh ", MeshString(c.mesh), ": ", c.collectives.size(),
                    " collectives");
  }
  absl::StrAppend(&out, "  label=\"", Esc(title), "\";\n  labelloc=t;\n");
  Draw(p, &c, "", "  ", out);
  for (int f = 0; f < p.functions_size(); ++f) {
    absl::StrAppend(&out, "  subgraph cluster_f", f, " {\n    label=\"function ",
                    Esc(p.functions(f).executable_id()), "\";\n    style=dashed;\n");
    Draw(p.functions(f), nullptr, StrCat("f", f, "_"), "    ", out);
    absl::StrAppend(&out, "  }\n");
  }
  absl::StrAppend(&out, "}\n");
  return out;
}

}  // namespace tessel::scheduler
