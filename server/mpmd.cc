#include "server/mpmd.h"

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace tessel::server {

bool IsMpmd(const v1::Graph& g) {
  for (const v1::Node& n : g.nodes()) {
    if (n.op() == v1::MESH_REGION) return true;
  }
  return false;
}

absl::StatusOr<MpmdSplit> SplitMpmd(const v1::Graph& g) {
  const std::string what = absl::StrCat("MPMD graph '", g.name(), "'");
  MpmdSplit out;
  // name -> what it is: a parameter, a region (multi-result), or one of its results.
  absl::flat_hash_map<std::string, MpmdRef> value_of;
  absl::flat_hash_map<std::string, int> region_of;
  for (const v1::Node& n : g.nodes()) {
    switch (n.op()) {
      case v1::PARAMETER: {
        const int i = n.parameter().index();
        if (i < 0 || i > 100000) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": parameter '", n.name(), "' has index ", i));
        }
        if (int(out.parameter_types.size()) <= i) {
          out.parameter_types.resize(i + 1);
          out.parameter_names.resize(i + 1);
        }
        out.parameter_types[i] = n.type();
        out.parameter_names[i] = n.name();
        value_of[n.name()] = MpmdRef{-1, i};
        break;
      }
      case v1::MESH_REGION: {
        const v1::MeshRegionAttrs& a = n.mesh_region();
        MpmdPart p;
        p.name = a.body().name().empty() ? n.name() : a.body().name();
        p.graph = a.body();
        p.graph.set_name(p.name);
        *p.graph.mutable_functions() = g.functions();
        p.mesh = a.mesh();
        p.in_shardings.assign(a.in_shardings().begin(), a.in_shardings().end());
        p.out_shardings.assign(a.out_shardings().begin(), a.out_shardings().end());
        int params = 0;
        for (const v1::Node& b : a.body().nodes()) params += b.op() == v1::PARAMETER;
        if (params != n.operands_size() || int(p.in_shardings.size()) != n.operands_size()) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": mesh region '", n.name(), "' takes ", n.operands_size(),
                           " operands; its body has ", params, " parameters and ",
                           p.in_shardings.size(), " in_shardings"));
        }
        if (int(p.out_shardings.size()) != a.body().outputs_size() ||
            n.results_size() != a.body().outputs_size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              what, ": mesh region '", n.name(), "' has ", a.body().outputs_size(), " outputs, ",
              p.out_shardings.size(), " out_shardings and ", n.results_size(), " result types"));
        }
        for (const std::string& o : n.operands()) {
          auto it = value_of.find(o);
          if (it == value_of.end()) {
            return absl::InvalidArgumentError(
                absl::StrCat(what, ": mesh region '", n.name(), "' reads '", o,
                             "', which is not a parameter or a region's "
                             "result defined before it (read a result with tuple_element)"));
          }
          p.inputs.push_back(it->second);
          p.input_names.push_back(o);
        }
        region_of[n.name()] = int(out.parts.size());
        out.parts.push_back(std::move(p));
        break;
      }
      case v1::TUPLE_ELEMENT: {
        auto it = n.operands_size() == 1 ? region_of.find(n.operands(0)) : region_of.end();
        if (it == region_of.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat(what, ": tuple_element '", n.name(), "' does not read a mesh region"));
        }
        const int k = n.tuple_element().index();
        if (k < 0 || k >= int(out.parts[it->second].out_shardings.size())) {
          return absl::InvalidArgumentError(absl::StrCat(
              what, ": tuple_element '", n.name(), "' reads result ", k, " of mesh region '",
              n.operands(0), "', which has ", out.parts[it->second].out_shardings.size()));
        }
        value_of[n.name()] = MpmdRef{it->second, k};
        break;
      }
      default:
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": node '", n.name(), "' (", v1::Op_Name(n.op()),
                         ") stands outside every mesh region; in an MPMD program every computation "
                         "runs in a region"));
    }
  }
  absl::flat_hash_set<std::string> seen;
  for (const std::string& o : g.outputs()) {
    auto it = value_of.find(o);
    if (it == value_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": output '", o, "' is not a region's result"));
    }
    if (it->second.part < 0) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": output '", o,
                                                     "' is a parameter; return a region's "
                                                     "result"));
    }
    if (!seen.insert(o).second) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": output '", o, "' is returned twice"));
    }
    out.outputs.push_back(it->second);
  }
  return out;
}

}  // namespace tessel::server
