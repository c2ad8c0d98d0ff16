// .npy reader and writer (https://numpy.org/neps/nep-0001-npy-format.html).
#include <fstream>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "tessel/types.h"

namespace tessel {
namespace {

struct Descr {
  const char* npy;
  DType dtype;
};
constexpr Descr kDescrs[] = {
    {"<f4", DType::kF32}, {"<f8", DType::kF64}, {"<f2", DType::kF16}, {"<V2", DType::kBF16},
    {"<i4", DType::kS32}, {"<i8", DType::kS64}, {"|u1", DType::kU8},  {"|b1", DType::kPred},
    {"|i1", DType::kS8},  {"<i2", DType::kS16}, {"<u2", DType::kU16}, {"<u4", DType::kU32},
    {"<u8", DType::kU64},
};

}  // namespace

absl::StatusOr<HostArray> ReadNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  char magic[8];
  if (!in.read(magic, 8) || std::string(magic, 6) != "\x93NUMPY") {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a .npy file (bad magic)"));
  }
  uint32_t header_len = 0;
  if (magic[6] == 1) {
    uint16_t l;
    in.read(reinterpret_cast<char*>(&l), 2);
    header_len = l;
  } else {
    in.read(reinterpret_cast<char*>(&header_len), 4);
  }
  std::string header(header_len, '\0');
  if (!in.read(header.data(), header_len)) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': truncated header"));
  }
  std::smatch m;
  if (!std::regex_search(header, m, std::regex("'descr':\\s*'([^']*)'"))) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': header has no descr"));
  }
  std::string descr = m[1];
  if (descr == "<b1") descr = "|b1";
  if (descr == "<u1") descr = "|u1";
  if (descr == "<i1") descr = "|i1";
  if (descr == "|V2") descr = "<V2";  // bf16 (ml_dtypes' bfloat16 saves as <V2)
  const Descr* found = nullptr;
  for (const Descr& d : kDescrs) {
    if (descr == d.npy) found = &d;
  }
  if (found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "': dtype '", descr,
                     "' not supported: expected one of <f4 <f8 <f2 <V2(bf16) |i1 <i2 <i4 <i8 |u1 "
                     "<u2 <u4 <u8 |b1"));
  }
  if (std::regex_search(header, m, std::regex("'fortran_order':\\s*True"))) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "': Fortran order is not supported; save with C order"));
  }
  if (!std::regex_search(header, m, std::regex("'shape':\\s*\\(([^)]*)\\)"))) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': header has no shape"));
  }
  ArrayType type{found->dtype, {}};
  for (absl::string_view part : absl::StrSplit(std::string(m[1]), ',', absl::SkipWhitespace())) {
    int64_t d;
    std::string p(part);
    p.erase(std::remove(p.begin(), p.end(), ' '), p.end());
    if (p.empty()) continue;
    if (!absl::SimpleAtoi(p, &d) || d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("'", path, "': bad dimension '", p, "'"));
    }
    type.dims.push_back(d);
  }
  HostArray a(type);
  if (!in.read(reinterpret_cast<char*>(a.mutable_data()), a.size_bytes())) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': expected ", a.size_bytes(),
                                                   " bytes of data for ", type.ToString(),
                                                   ", file is shorter"));
  }
  return a;
}

absl::Status WriteNpy(const std::string& path, const HostArray& array) {
  const Descr* found = nullptr;
  for (const Descr& d : kDescrs) {
    if (d.dtype == array.type().dtype) found = &d;
  }
  std::string shape = absl::StrJoin(array.type().dims, ", ");
  if (array.type().dims.size() == 1) shape += ",";
  std::string header = absl::StrCat("{'descr': '", found->npy,
                                    "', 'fortran_order': False, 'shape': (", shape, "), }");
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header.push_back('\n');
  std::ofstream out(path, std::ios::binary);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  out.write("\x93NUMPY\x01\x00", 8);
  uint16_t len = header.size();
  out.write(reinterpret_cast<const char*>(&len), 2);
  out.write(header.data(), header.size());
  out.write(reinterpret_cast<const char*>(array.data()), array.size_bytes());
  if (!out) return absl::DataLossError(absl::StrCat("writing '", path, "' failed"));
  return absl::OkStatus();
}

}  // namespace tessel
