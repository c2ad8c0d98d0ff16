#include "tessel/sharding.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/src/convert_internal.h"
#include "core/sharding.h"

namespace tessel {

int64_t Mesh::size() const {
  int64_t n = 1;
  for (const Axis& a : axes) n *= a.size;
  return n;
}

int64_t Mesh::axis_size(const std::string& name) const {
  for (const Axis& a : axes) {
    if (a.name == name) return a.size;
  }
  return 0;
}

int64_t Mesh::axes_size(const std::vector<std::string>& names) const {
  int64_t n = 1;
  for (const std::string& a : names) n *= axis_size(a);
  return n;
}

std::string Mesh::ToString() const { return MeshString(ToProto(*this)); }

bool Mesh::operator==(const Mesh& o) const { return SameMesh(ToProto(*this), ToProto(o)); }

absl::StatusOr<Mesh> Mesh::Parse(const std::string& text) {
  Mesh m;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
    std::string name(absl::StripAsciiWhitespace(kv.first));
    int64_t size = 0;
    if (name.empty() || !absl::SimpleAtoi(kv.second, &size) || size < 1) {
      return absl::InvalidArgumentError(absl::StrCat("mesh '", text,
                                                     "': expected NAME=SIZE items such as ",
                                                     "data=2,model=2; got '", item, "'"));
    }
    m.axes.push_back({name, size});
  }
  if (m.axes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh '", text, "': expected NAME=SIZE items such as data=2,model=2"));
  }
  return m;
}

Sharding Sharding::Unspecified() {
  Sharding s;
  s.unspecified = true;
  return s;
}

Sharding Sharding::Split(const std::vector<std::string>& axis_per_dimension) {
  Sharding s;
  for (const std::string& a : axis_per_dimension) {
    s.dims.push_back(a.empty() ? std::vector<std::string>{} : std::vector<std::string>{a});
  }
  return s;
}

Sharding Sharding::Unreduced(std::vector<std::string> axes, ReduceKind kind) const {
  Sharding s = *this;
  s.partial = std::move(axes);
  s.partial_kind = kind;
  return s;
}

std::string Sharding::ToString() const {
  if (unspecified) return "unspecified";
  return ShardingString(ToProto(*this));
}

bool Sharding::operator==(const Sharding& o) const {
  const int rank = std::max(dims.size(), o.dims.size());
  return unspecified == o.unspecified &&
         SameSharding(NormalizeSharding(ToProto(*this), rank), NormalizeSharding(ToProto(o), rank));
}

std::vector<int64_t> Sharding::BlockDims(const Mesh& mesh, std::vector<int64_t> d) const {
  for (size_t i = 0; i < dims.size() && i < d.size(); ++i) {
    const int64_t n = mesh.axes_size(dims[i]);
    if (n > 0) d[i] /= n;
  }
  return d;
}

namespace {

// A small reader for the P(...) text.
class SpecReader {
 public:
  explicit SpecReader(absl::string_view s) : s_(s) {}

  bool Eat(char c) {
    Skip();
    if (!s_.empty() && s_.front() == c) {
      s_.remove_prefix(1);
      return true;
    }
    return false;
  }
  // An axis name, quoted or not; empty when none is there.
  std::string Name() {
    Skip();
    const bool quoted = !s_.empty() && (s_.front() == '\'' || s_.front() == '"');
    const char q = quoted ? s_.front() : 0;
    if (quoted) s_.remove_prefix(1);
    size_t n = 0;
    while (n < s_.size() &&
           (quoted ? s_[n] != q : (absl::ascii_isalnum(s_[n]) || s_[n] == '_' || s_[n] == '-')))
      ++n;
    std::string out(s_.substr(0, n));
    s_.remove_prefix(n);
    if (quoted && !s_.empty()) s_.remove_prefix(1);
    return out;
  }
  bool AtEnd() {
    Skip();
    return s_.empty();
  }
  absl::string_view rest() const { return s_; }

 private:
  void Skip() {
    while (!s_.empty() && absl::ascii_isspace(s_.front())) s_.remove_prefix(1);
  }
  absl::string_view s_;
};

// One dimension's entry: None, a name, or a parenthesized list of names.
absl::StatusOr<std::vector<std::string>> ReadAxes(SpecReader& r) {
  std::vector<std::string> axes;
  if (r.Eat('(')) {
    while (!r.Eat(')')) {
      std::string a = r.Name();
      if (a.empty())
        return absl::InvalidArgumentError(
            absl::StrCat("expected an axis name at '", r.rest(), "'"));
      axes.push_back(a);
      if (r.Eat(',')) continue;
      if (r.Eat(')')) break;
      return absl::InvalidArgumentError(absl::StrCat("expected ',' or ')' at '", r.rest(), "'"));
    }
    return axes;
  }
  std::string a = r.Name();
  if (a.empty())
    return absl::InvalidArgumentError(
        absl::StrCat("expected None, an axis or (axes) at '", r.rest(), "'"));
  if (a != "None") axes.push_back(a);
  return axes;
}

}  // namespace

absl::StatusOr<Sharding> Sharding::Parse(const std::string& text) {
  auto bad = [&](const absl::Status& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("sharding '", text, "': ", why.message(),
                     " (expected e.g. P('data', None) or P(None, unreduced=(model,)))"));
  };
  SpecReader r(text);
  if (r.Name() != "P" || !r.Eat('(')) return bad(absl::InvalidArgumentError("must start with P("));
  Sharding s;
  while (!r.Eat(')')) {
    SpecReader probe = r;
    if (probe.Name() == "unreduced" && probe.Eat('=')) {
      r = probe;
      auto axes = ReadAxes(r);
      if (!axes.ok()) return bad(axes.status());
      s.partial = *axes;
    } else {
      auto axes = ReadAxes(r);
      if (!axes.ok()) return bad(axes.status());
      if (!s.partial.empty())
        return bad(absl::InvalidArgumentError("a dimension after unreduced="));
      s.dims.push_back(*axes);
    }
    if (r.Eat(',')) continue;
    if (!r.Eat(')'))
      return bad(
          absl::InvalidArgumentError(absl::StrCat("expected ',' or ')' at '", r.rest(), "'")));
    break;
  }
  // The printed form's suffix: " partial(sum: a, b)".
  if (SpecReader probe = r; probe.Name() == "partial" && probe.Eat('(')) {
    r = probe;
    const std::string kind = r.Name();
    if (kind == "sum")
      s.partial_kind = ReduceKind::kSum;
    else if (kind == "max")
      s.partial_kind = ReduceKind::kMax;
    else if (kind == "min")
      s.partial_kind = ReduceKind::kMin;
    else if (kind == "prod")
      s.partial_kind = ReduceKind::kProd;
    else
      return bad(absl::InvalidArgumentError(absl::StrCat("unknown partial kind '", kind, "'")));
    if (!r.Eat(':')) return bad(absl::InvalidArgumentError("expected ':' after the partial kind"));
    while (!r.Eat(')')) {
      std::string a = r.Name();
      if (a.empty())
        return bad(
            absl::InvalidArgumentError(absl::StrCat("expected an axis name at '", r.rest(), "'")));
      s.partial.push_back(a);
      r.Eat(',');
    }
  }
  if (!r.AtEnd())
    return bad(absl::InvalidArgumentError(absl::StrCat("unexpected '", r.rest(), "'")));
  while (!s.dims.empty() && s.dims.back().empty()) s.dims.pop_back();
  return s;
}

}  // namespace tessel
