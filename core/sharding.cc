#include "core/sharding.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/status.h"

namespace tessel {

using absl::StrCat;

absl::StatusOr<v1::Mesh> NormalizeMesh(const v1::Mesh& mesh, int num_devices) {
  if (mesh.axis_names_size() == 0) return absl::InvalidArgumentError("mesh: no axes");
  if (mesh.axis_names_size() != mesh.axis_sizes_size()) {
    return absl::InvalidArgumentError(StrCat("mesh: ", mesh.axis_names_size(), " axis names but ",
                                             mesh.axis_sizes_size(), " axis sizes"));
  }
  absl::flat_hash_set<std::string> names;
  int64_t n = 1;
  for (int i = 0; i < mesh.axis_names_size(); ++i) {
    const std::string& a = mesh.axis_names(i);
    if (a.empty())
      return absl::InvalidArgumentError(StrCat("mesh: axis ", i, " has an empty name"));
    if (!names.insert(a).second)
      return absl::InvalidArgumentError(StrCat("mesh: axis '", a, "' is named twice"));
    if (mesh.axis_sizes(i) < 1 || mesh.axis_sizes(i) > 65536) {
      return absl::InvalidArgumentError(
          StrCat("mesh: axis '", a, "' has size ", mesh.axis_sizes(i), "; expected 1..65536"));
    }
    n *= mesh.axis_sizes(i);
    if (n > 65536) return absl::InvalidArgumentError(StrCat("mesh: more than 65536 devices"));
  }
  v1::Mesh out = mesh;
  if (out.devices_size() == 0) {
    for (int i = 0; i < n; ++i) out.add_devices(i);
  }
  if (out.devices_size() != n) {
    return absl::InvalidArgumentError(StrCat("mesh ", MeshString(out), ": the axes hold ", n,
                                             " devices but ", out.devices_size(), " are listed"));
  }
  absl::flat_hash_set<int> seen;
  for (int d : out.devices()) {
    if (d < 0 || (num_devices >= 0 && d >= num_devices)) {
      return absl::InvalidArgumentError(StrCat("mesh ", MeshString(out), ": device ", d,
                                               " does not exist; the cluster has ", num_devices,
                                               " devices"));
    }
    if (!seen.insert(d).second) {
      return absl::InvalidArgumentError(
          StrCat("mesh ", MeshString(out), ": device ", d, " is listed twice"));
    }
  }
  if (num_devices >= 0 && n > num_devices) {
    return absl::InvalidArgumentError(
        StrCat("mesh ", MeshString(out), " needs ", n, " devices; the cluster has ", num_devices));
  }
  return out;
}

int64_t MeshSize(const v1::Mesh& mesh) {
  int64_t n = 1;
  for (int64_t s : mesh.axis_sizes()) n *= s;
  return n;
}

bool SameMesh(const v1::Mesh& a, const v1::Mesh& b) {
  auto eq = [](const auto& x, const auto& y) {
    return std::equal(x.begin(), x.end(), y.begin(), y.end());
  };
  return eq(a.axis_names(), b.axis_names()) && eq(a.axis_sizes(), b.axis_sizes()) &&
         eq(a.devices(), b.devices());
}

int AxisIndex(const v1::Mesh& mesh, absl::string_view axis) {
  for (int i = 0; i < mesh.axis_names_size(); ++i) {
    if (mesh.axis_names(i) == axis) return i;
  }
  return -1;
}

std::string MeshString(const v1::Mesh& mesh) {
  std::vector<std::string> axes;
  for (int i = 0; i < mesh.axis_names_size(); ++i) {
    axes.push_back(
        StrCat(mesh.axis_names(i), ": ", i < mesh.axis_sizes_size() ? mesh.axis_sizes(i) : 0));
  }
  std::string s = StrCat("{", absl::StrJoin(axes, ", "), "}");
  if (mesh.devices_size() > 0)
    absl::StrAppend(&s, " over devices ", absl::StrJoin(mesh.devices(), ","));
  return s;
}

v1::Sharding Replicated(int rank) {
  v1::Sharding s;
  for (int i = 0; i < rank; ++i) s.add_dims();
  s.set_partial_kind(v1::SUM);
  return s;
}

v1::Sharding NormalizeSharding(const v1::Sharding& s, int rank) {
  v1::Sharding out = s;
  out.set_unspecified(false);
  while (out.dims_size() < rank) out.add_dims();
  if (out.partial_kind() == v1::REDUCE_INVALID) out.set_partial_kind(v1::SUM);
  return out;
}

bool SameSharding(const v1::Sharding& a, const v1::Sharding& b) {
  if (a.dims_size() != b.dims_size() || a.partial_size() != b.partial_size()) return false;
  for (int i = 0; i < a.dims_size(); ++i) {
    if (a.dims(i).axes_size() != b.dims(i).axes_size()) return false;
    for (int j = 0; j < a.dims(i).axes_size(); ++j) {
      if (a.dims(i).axes(j) != b.dims(i).axes(j)) return false;
    }
  }
  std::vector<std::string> pa(a.partial().begin(), a.partial().end()),
      pb(b.partial().begin(), b.partial().end());
  std::sort(pa.begin(), pa.end());
  std::sort(pb.begin(), pb.end());
  if (pa != pb) return false;
  return a.partial_size() == 0 || a.partial_kind() == b.partial_kind();
}

bool IsPartial(const v1::Sharding& s) { return s.partial_size() > 0; }

bool IsReplicated(const v1::Sharding& s) {
  for (const auto& d : s.dims()) {
    if (d.axes_size() > 0) return false;
  }
  return !IsPartial(s);
}

int64_t AxesSize(const v1::Mesh& mesh,
                 const google::protobuf::RepeatedPtrField<std::string>& axes) {
  return AxesSize(mesh, std::vector<std::string>(axes.begin(), axes.end()));
}

int64_t AxesSize(const v1::Mesh& mesh, const std::vector<std::string>& axes) {
  int64_t n = 1;
  for (const std::string& a : axes) {
    int i = AxisIndex(mesh, a);
    if (i >= 0) n *= mesh.axis_sizes(i);
  }
  return n;
}

absl::Status ValidateSharding(const v1::Sharding& s, const v1::Mesh& mesh,
                              const v1::TensorType& type, absl::string_view what) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(StrCat(what, " (", TypeString(type), "): sharding ",
                                             ShardingString(s), " on mesh ", MeshString(mesh), ": ",
                                             why));
  };
  if (s.dims_size() > type.dims_size()) {
    return bad(
        StrCat("names ", s.dims_size(), " dimensions but the value has rank ", type.dims_size()));
  }
  absl::flat_hash_set<std::string> used;
  auto use = [&](const std::string& a) -> absl::Status {
    if (AxisIndex(mesh, a) < 0) {
      return bad(StrCat("unknown mesh axis '", a, "'; the mesh has ",
                        absl::StrJoin(mesh.axis_names(), ", ")));
    }
    if (!used.insert(a).second) return bad(StrCat("mesh axis '", a, "' is used twice"));
    return absl::OkStatus();
  };
  for (int d = 0; d < s.dims_size(); ++d) {
    for (const std::string& a : s.dims(d).axes()) {
      if (absl::Status st = use(a); !st.ok()) return st;
    }
    const int64_t n = AxesSize(mesh, s.dims(d).axes());
    if (type.dims(d) % n != 0) {
      return bad(StrCat("dimension ", d, " of size ", type.dims(d), " does not split evenly over ",
                        absl::StrJoin(s.dims(d).axes(), "x"), " (", n,
                        " devices); uneven blocks are not supported"));
    }
  }
  for (const std::string& a : s.partial()) {
    if (absl::Status st = use(a); !st.ok()) return st;
  }
  return absl::OkStatus();
}

std::string ShardingString(const v1::Sharding& s) {
  std::vector<std::string> dims;
  for (const auto& d : s.dims()) {
    if (d.axes_size() == 0) {
      dims.push_back("None");
    } else if (d.axes_size() == 1) {
      dims.push_back(StrCat("'", d.axes(0), "'"));
    } else {
      std::vector<std::string> q;
      for (const std::string& a : d.axes()) q.push_back(StrCat("'", a, "'"));
      dims.push_back(StrCat("(", absl::StrJoin(q, ", "), ")"));
    }
  }
  std::string out = StrCat("P(", absl::StrJoin(dims, ", "), dims.size() == 1 ? "," : "", ")");
  if (dims.size() == 1 && s.dims(0).axes_size() == 0) out = "P(None,)";
  if (s.partial_size() > 0) {
    const char* kind = s.partial_kind() == v1::REDUCE_MAX   ? "max"
                       : s.partial_kind() == v1::REDUCE_MIN ? "min"
                       : s.partial_kind() == v1::PROD       ? "prod"
                                                            : "sum";
    absl::StrAppend(&out, " partial(", kind, ": ", absl::StrJoin(s.partial(), ", "), ")");
  }
  return out;
}

v1::TensorType LocalType(const v1::TensorType& global, const v1::Sharding& s,
                         const v1::Mesh& mesh) {
  v1::TensorType t = global;
  for (int d = 0; d < s.dims_size() && d < t.dims_size(); ++d)
    t.set_dims(d, t.dims(d) / AxesSize(mesh, s.dims(d).axes()));
  return t;
}

std::vector<int64_t> MeshCoords(const v1::Mesh& mesh, int pos) {
  std::vector<int64_t> c(mesh.axis_sizes_size());
  for (int i = mesh.axis_sizes_size() - 1; i >= 0; --i) {
    c[i] = pos % mesh.axis_sizes(i);
    pos /= mesh.axis_sizes(i);
  }
  return c;
}

int64_t IndexAlong(const v1::Mesh& mesh, int pos, const std::vector<std::string>& axes) {
  const std::vector<int64_t> c = MeshCoords(mesh, pos);
  int64_t idx = 0;
  for (const std::string& a : axes) {
    const int i = AxisIndex(mesh, a);
    if (i < 0) continue;
    idx = idx * mesh.axis_sizes(i) + c[i];
  }
  return idx;
}

std::vector<int64_t> BlockIndex(const v1::Sharding& s, const v1::Mesh& mesh, int pos) {
  std::vector<int64_t> b;
  for (const auto& d : s.dims())
    b.push_back(IndexAlong(mesh, pos, {d.axes().begin(), d.axes().end()}));
  return b;
}

std::vector<int> GroupPositions(const v1::Mesh& mesh, int pos,
                                const std::vector<std::string>& axes) {
  const std::vector<int64_t> base = MeshCoords(mesh, pos);
  std::vector<int> in_group(mesh.axis_sizes_size(), 0);
  for (const std::string& a : axes) {
    if (int i = AxisIndex(mesh, a); i >= 0) in_group[i] = 1;
  }
  std::vector<std::pair<int64_t, int>> members;  // (index along axes, position)
  const int64_t n = MeshSize(mesh);
  for (int p = 0; p < n; ++p) {
    const std::vector<int64_t> c = MeshCoords(mesh, p);
    bool same = true;
    for (size_t i = 0; i < c.size(); ++i) same &= in_group[i] || c[i] == base[i];
    if (same) members.emplace_back(IndexAlong(mesh, p, axes), p);
  }
  std::sort(members.begin(), members.end());
  std::vector<int> out;
  for (const auto& [idx, p] : members) out.push_back(p);
  return out;
}

// ---------------------------------------------------------------- collectives

namespace {
absl::Status CheckAxes(const v1::Node& n, const v1::Mesh& mesh) {
  const auto& axes = n.collective().axes();
  if (axes.empty()) return absl::InvalidArgumentError("names no mesh axis");
  absl::flat_hash_set<std::string> seen;
  for (const std::string& a : axes) {
    if (AxisIndex(mesh, a) < 0) {
      return absl::InvalidArgumentError(
          StrCat("unknown mesh axis '", a, "'; the mesh is ", MeshString(mesh)));
    }
    if (!seen.insert(a).second)
      return absl::InvalidArgumentError(StrCat("mesh axis '", a, "' is named twice"));
  }
  return absl::OkStatus();
}

absl::Status CheckDim(const v1::TensorType& t, int64_t d, absl::string_view what) {
  if (d < 0 || d >= t.dims_size()) {
    return absl::InvalidArgumentError(StrCat(what, " ", d, " out of range for ", TypeString(t)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::TensorType> InferCollectiveType(const v1::Node& n,
                                                   absl::Span<const v1::TensorType* const> ops,
                                                   const v1::Mesh& mesh) {
  const int want = n.op() == v1::AXIS_INDEX ? 0 : 1;
  if (int(ops.size()) != want) {
    return absl::InvalidArgumentError(StrCat("expected ", want, " operands, got ", ops.size()));
  }
  if (n.attrs_case() != v1::Node::kCollective)
    return absl::InvalidArgumentError("missing attributes 'collective'");
  TESSEL_RETURN_IF_ERROR(CheckAxes(n, mesh));
  const v1::CollectiveAttrs& c = n.collective();
  const int64_t size = AxesSize(mesh, c.axes());
  if (n.op() == v1::AXIS_INDEX) return MakeType(v1::S32, {});
  v1::TensorType t = *ops[0];
  switch (n.op()) {
    case v1::ALL_REDUCE:
    case v1::COLLECTIVE_PERMUTE: break;
    case v1::ALL_GATHER:
      TESSEL_RETURN_IF_ERROR(CheckDim(t, c.dimension(), "dimension"));
      t.set_dims(c.dimension(), t.dims(c.dimension()) * size);
      break;
    case v1::REDUCE_SCATTER:
    case v1::ALL_TO_ALL:
    case v1::SHARD_SLICE:
      TESSEL_RETURN_IF_ERROR(CheckDim(t, c.dimension(), "dimension"));
      if (t.dims(c.dimension()) % size != 0) {
        return absl::InvalidArgumentError(StrCat("dimension ", c.dimension(), " of ", TypeString(t),
                                                 " does not split evenly over ", size, " devices"));
      }
      t.set_dims(c.dimension(), t.dims(c.dimension()) / size);
      if (n.op() == v1::ALL_TO_ALL) {
        TESSEL_RETURN_IF_ERROR(CheckDim(t, c.concat_dimension(), "concat_dimension"));
        t.set_dims(c.concat_dimension(), t.dims(c.concat_dimension()) * size);
      }
      break;
    default: return absl::InvalidArgumentError("not a collective");
  }
  if (n.op() == v1::COLLECTIVE_PERMUTE) {
    if (c.source_target_pairs_size() % 2 != 0) {
      return absl::InvalidArgumentError(
          "source_target_pairs: expected (source, target) pairs, got an odd count");
    }
    absl::flat_hash_set<int64_t> sources, targets;
    for (int i = 0; i < c.source_target_pairs_size(); i += 2) {
      const int64_t src = c.source_target_pairs(i), dst = c.source_target_pairs(i + 1);
      if (src < 0 || src >= size || dst < 0 || dst >= size) {
        return absl::InvalidArgumentError(
            StrCat("pair (", src, ", ", dst, ") out of range: the group has ", size, " devices"));
      }
      if (!sources.insert(src).second || !targets.insert(dst).second) {
        return absl::InvalidArgumentError(
            StrCat("pair (", src, ", ", dst, "): each device sends and receives at most once"));
      }
    }
  }
  return t;
}

}  // namespace tessel
