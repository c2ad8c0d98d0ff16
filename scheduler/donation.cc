#include "scheduler/donation.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "scheduler/program_walk.h"

namespace tessel::scheduler {
namespace {

struct Writer {
  int instruction = -1;  // -1: a parameter
  int fusion_node = 0;   // index of the writing node inside a fusion
  bool literal = false;  // a literal constant: shared across runs, never written
};

std::string Describe(const v1::Program& p, int k) {
  const v1::Instruction& ins = p.instructions(k);
  if (ins.has_node())
    return absl::StrCat("instruction ", k, " (", OpName(ins.node().op()), " '", ins.node().name(),
                        "')");
  return absl::StrCat("instruction ", k, " (fusion -> ",
                      absl::StrJoin(ins.fusion().outputs(), ", "), ")");
}

// Empty when result `j` of the loop `n` may be written into the buffer of
// parameter `prm` (its carry j), else why not.
template <typename RootOf, typename Shares>
std::string LoopCarryInPlace(const v1::Program& p, const v1::Node& n, int j, const std::string& prm,
                             const RootOf& root_of, const Shares& shares) {
  const int carries = n.op() == v1::WHILE  ? n.operands_size()
                      : n.op() == v1::SCAN ? n.control().num_carry()
                                           : 0;
  if (j >= carries) return absl::StrCat("result ", j, " is not a loop carry");
  if (root_of(n.operands(j)) != prm)
    return absl::StrCat("its carry ", j, " starts from another value");
  for (int i = 0; i < n.operands_size(); ++i) {
    if (i != j && shares(n.operands(i)))
      return absl::StrCat("operand ", i, " reads '", prm, "' too");
  }
  for (const v1::Program& f : p.functions()) {
    if (f.executable_id() != n.control().body()) continue;
    if (j < f.parameter_aliases_size() && f.parameter_aliases(j) == j) return "";
    return absl::StrCat("its body '", f.executable_id(), "' cannot write carry ", j, " in place");
  }
  return absl::StrCat("its body '", n.control().body(), "' is not compiled");
}

}  // namespace

namespace {

// Where each value of a program lives and who writes it: reshapes share
// their operand's buffer; each instruction reads some buffers (a fusion's
// last reading node for each).
struct Buffers {
  absl::flat_hash_map<std::string, std::string> root;
  absl::flat_hash_map<std::string, Writer> writer;
  std::vector<absl::flat_hash_map<std::string, int>> reads;  // by instruction
  // A loop's carry result may be its operand's buffer (a loop that runs no
  // iteration, or writes the carry in place): the root it may share.
  absl::flat_hash_map<std::string, std::string> carried;
  // By instruction: for each root read through such results, each result
  // and its last reading node.
  std::vector<absl::flat_hash_map<std::string, absl::flat_hash_map<std::string, int>>>
      carried_reads;

  void Read(int k, const std::string& r, int node) {
    reads[k][r] = node;
    if (auto it = carried.find(r); it != carried.end()) carried_reads[k][it->second][r] = node;
  }
  // Whether value `v` is, or may share, the buffer `prm`.
  bool Shares(const std::string& v, const std::string& prm) const {
    const std::string r = RootOf(v);
    if (r == prm) return true;
    auto it = carried.find(r);
    return it != carried.end() && it->second == prm;
  }

  std::string RootOf(const std::string& v) const {
    auto it = root.find(v);
    return it == root.end() ? v : it->second;
  }
};

Buffers TraceBuffers(const v1::Program& p) {
  Buffers b;
  for (const v1::Node& prm : p.parameters()) {
    b.root[prm.name()] = prm.name();
    b.writer[prm.name()] = Writer{};
  }
  b.reads.resize(p.instructions_size());
  b.carried_reads.resize(p.instructions_size());
  for (int k = 0; k < p.instructions_size(); ++k) {
    const v1::Instruction& ins = p.instructions(k);
    if (ins.has_node()) {
      const v1::Node& n = ins.node();
      for (const std::string& o : n.operands()) b.Read(k, b.RootOf(o), 0);
      if (ins.results_size() > 0) {  // control flow
        const int carries = n.op() == v1::WHILE  ? n.operands_size()
                            : n.op() == v1::SCAN ? n.control().num_carry()
                                                 : 0;
        for (int j = 0; j < ins.results_size(); ++j) {
          b.root[ins.results(j)] = ins.results(j);
          b.writer[ins.results(j)] = Writer{k, j, false};
          if (j < carries) {
            const std::string from = b.RootOf(n.operands(j));
            auto it = b.carried.find(from);
            b.carried[ins.results(j)] = it == b.carried.end() ? from : it->second;
          }
        }
        continue;
      }
      b.root[n.name()] = n.op() == v1::RESHAPE ? b.RootOf(n.operands(0)) : n.name();
      b.writer[n.name()] = Writer{k, 0, n.op() == v1::CONSTANT && n.constant().has_literal()};
    } else {
      const v1::Fusion& f = ins.fusion();
      absl::flat_hash_map<std::string, std::string> input_root;
      for (const std::string& i : f.inputs()) input_root[i] = b.RootOf(i);
      for (int j = 0; j < f.nodes_size(); ++j) {
        const v1::Node& n = f.nodes(j);
        for (const std::string& o : n.operands()) {
          auto it = input_root.find(o);
          if (it != input_root.end()) b.Read(k, it->second, j);  // nodes in order: the last wins
        }
        b.root[n.name()] = n.name();
        b.writer[n.name()] = Writer{k, j, false};
      }
    }
  }
  return b;
}

// Empty when the instruction that writes buffer `buf` (output `out_desc`)
// may write it into parameter `prm`'s buffer, else why not.
std::string WhyNotWrittenInto(const v1::Program& p, const Buffers& b, const std::string& buf,
                              const std::string& prm, const std::string& out_desc) {
  const Writer& w = b.writer.at(buf);
  if (w.instruction < 0) return absl::StrCat(out_desc, " is parameter '", buf, "' passed through");
  if (w.literal) return absl::StrCat(out_desc, " is a literal constant");
  // A read through a loop's carry result that may share prm's buffer is a
  // read of prm, unless that result is the buffer written (the loop's own):
  // the last such read of instruction k, and the result read ({-1, ""}: none).
  auto through = [&](int k) {
    std::pair<int, std::string> last = {-1, ""};
    auto it = b.carried_reads[k].find(prm);
    if (it == b.carried_reads[k].end()) return last;
    for (const auto& [result, node] : it->second) {
      if (result != buf && node > last.first) last = {node, result};
    }
    return last;
  };
  for (int k = w.instruction + 1; k < p.instructions_size(); ++k) {
    if (b.reads[k].contains(prm)) {
      return absl::StrCat(out_desc, " is written by ", Describe(p, w.instruction), " while '", prm,
                          "' is still read by ", Describe(p, k));
    }
    if (const auto [node, result] = through(k); node >= 0) {
      return absl::StrCat(out_desc, " is written by ", Describe(p, w.instruction), " while '",
                          result, "', a loop's carry that may be '", prm, "''s buffer, is read by ",
                          Describe(p, k));
    }
  }
  int read_at = through(w.instruction).first;
  if (auto r = b.reads[w.instruction].find(prm); r != b.reads[w.instruction].end()) {
    read_at = std::max(read_at, r->second);
  }
  if (read_at < 0) return "";
  const v1::Instruction& ins = p.instructions(w.instruction);
  if (ins.results_size() > 0) {
    // A loop updates carry j in place when its body writes parameter j
    // into result j and nothing else of the loop reads the buffer.
    const std::string why_loop = LoopCarryInPlace(
        p, ins.node(), w.fusion_node, prm, [&](const std::string& v) { return b.RootOf(v); },
        [&](const std::string& v) { return b.Shares(v, prm); });
    if (why_loop.empty()) return "";
    return absl::StrCat(out_desc, " is computed by ", Describe(p, w.instruction), ": ", why_loop);
  }
  // An all_reduce reads each element before it writes it, so it runs in
  // place (the worker skips its copy in -> out then).
  const bool elementwise =
      ins.has_fusion() || IsElementwise(ins.node().op()) || ins.node().op() == v1::ALL_REDUCE;
  // A scalar constant a fusion returns is written once, before the
  // fusion's loop reads anything (on every backend): into a buffer the
  // loop reads, it would overwrite what the loop has yet to read.
  if (ins.has_fusion()) {
    const v1::Node& wn = ins.fusion().nodes(w.fusion_node);
    if (wn.op() == v1::CONSTANT && !wn.constant().has_iota() && wn.type().dims_size() == 0) {
      return absl::StrCat(out_desc, " is a constant that ", Describe(p, w.instruction),
                          " writes before it reads '", prm, "'");
    }
  }
  if (!elementwise || read_at > w.fusion_node) {
    return absl::StrCat(out_desc, " is computed by ", Describe(p, w.instruction), ", which reads '",
                        prm, "' ", elementwise ? "after writing it" : "other than elementwise");
  }
  return "";
}

}  // namespace

AliasCandidates FindAliasCandidates(const v1::Program& p) {
  const Buffers b = TraceBuffers(p);
  AliasCandidates c;
  c.outputs.resize(p.parameters_size());
  c.why_not.resize(p.parameters_size());
  for (const std::string& o : p.outputs()) c.buffer_of_output.push_back(b.RootOf(o));
  for (int pi = 0; pi < p.parameters_size(); ++pi) {
    const v1::Node& prm = p.parameters(pi);
    std::vector<std::string> why;
    // An output that is the parameter itself, or a view of it, returns its
    // bytes: no other output may be written into them.
    int returned_as = -1;
    for (int oi = 0; oi < p.outputs_size() && returned_as < 0; ++oi) {
      if (c.buffer_of_output[oi] == prm.name()) returned_as = oi;
    }
    int same_type = 0;
    for (int oi = 0; oi < p.outputs_size(); ++oi) {
      if (!SameType(p.output_types(oi), prm.type())) continue;
      ++same_type;
      const std::string& buf = c.buffer_of_output[oi];
      const std::string out_desc = absl::StrCat("output ", oi, " '", p.outputs(oi), "'");
      std::string why_not;
      if (buf == prm.name()) {
        // the parameter itself, passed through
      } else if (returned_as >= 0) {
        why_not = absl::StrCat(out_desc, " cannot be written into '", prm.name(), "': output ",
                               returned_as, " '", p.outputs(returned_as), "' returns '", prm.name(),
                               "'", p.outputs(returned_as) == prm.name() ? "" : " (a view of it)",
                               " unchanged");
      } else {
        why_not = WhyNotWrittenInto(p, b, buf, prm.name(), out_desc);
      }
      if (why_not.empty()) {
        c.outputs[pi].push_back(oi);
      } else {
        why.push_back(std::move(why_not));
      }
    }
    if (same_type == 0) {
      std::vector<std::string> types;
      for (const auto& t : p.output_types()) types.push_back(TypeString(t));
      c.why_not[pi] = absl::StrCat("no output has its type ", TypeString(prm.type()),
                                   " (outputs: ", absl::StrJoin(types, ", "), ")");
    } else if (!why.empty()) {
      c.why_not[pi] = absl::StrJoin(why, "; ");
    }
  }
  return c;
}

std::vector<AliasDecision> AssignAliases(const v1::Program& p, const AliasCandidates& c,
                                         const std::vector<int>& donated) {
  std::vector<AliasDecision> out;
  absl::flat_hash_set<std::string> taken;
  for (int pi : donated) {
    AliasDecision d;
    d.parameter = pi;
    if (pi < 0 || pi >= int(c.outputs.size())) {
      d.reason = absl::StrCat("parameter ", pi, " does not exist");
      out.push_back(d);
      continue;
    }
    bool blocked_by_taken = false;
    for (int oi : c.outputs[pi]) {
      if (taken.insert(c.buffer_of_output[oi]).second) {
        d.output = oi;
        break;
      }
      blocked_by_taken = true;
    }
    if (d.output < 0) {
      const std::string& name = p.parameters(pi).name();
      if (blocked_by_taken) {
        d.reason = absl::StrCat("every output that '", name,
                                "' could become already takes another donated buffer");
        if (!c.why_not[pi].empty()) absl::StrAppend(&d.reason, "; ", c.why_not[pi]);
      } else {
        d.reason = c.why_not[pi].empty() ? "no output can take its buffer" : c.why_not[pi];
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace tessel::scheduler
