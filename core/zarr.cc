#include "core/zarr.h"

#include <isa-l/crc.h>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/dtype.h"

namespace tessel {

using absl::StrCat;

absl::string_view ZarrDType(v1::DType t) {
  switch (t) {
    case v1::F32: return "float32";
    case v1::F64: return "float64";
    case v1::F16: return "float16";
    case v1::BF16: return "bfloat16";
    case v1::S8: return "int8";
    case v1::S16: return "int16";
    case v1::S32: return "int32";
    case v1::S64: return "int64";
    case v1::U8: return "uint8";
    case v1::U16: return "uint16";
    case v1::U32: return "uint32";
    case v1::U64: return "uint64";
    case v1::PRED: return "bool";
    default: return "invalid";
  }
}

std::string ChunkKey(absl::Span<const int64_t> chunk_index) {
  if (chunk_index.empty()) return "c";
  return StrCat("c/", absl::StrJoin(chunk_index, "/"));
}

std::string ZarrArrayJson(const v1::TensorType& global, absl::Span<const int64_t> chunk_shape) {
  const bool one_byte = DTypeSize(global.dtype()) == 1;
  const char* fill = global.dtype() == v1::PRED ? "false" : IsFloat(global.dtype()) ? "0.0" : "0";
  return StrCat(
      "{\n  \"zarr_format\": 3,\n  \"node_type\": \"array\",\n  \"shape\": [",
      absl::StrJoin(global.dims(), ", "), "],\n  \"data_type\": \"", ZarrDType(global.dtype()),
      "\",\n  \"chunk_grid\": {\"name\": \"regular\", \"configuration\": {\"chunk_shape\": [",
      absl::StrJoin(chunk_shape, ", "),
      "]}},\n  \"chunk_key_encoding\": {\"name\": \"default\", \"configuration\": "
      "{\"separator\": \"/\"}},\n  \"fill_value\": ",
      fill, ",\n  \"codecs\": [",
      one_byte ? "{\"name\": \"bytes\"}"
               : "{\"name\": \"bytes\", \"configuration\": {\"endian\": \"little\"}}",
      ", {\"name\": \"crc32c\"}],\n  \"attributes\": {}\n}\n");
}

absl::Status CheckCheckpointPath(absl::string_view root, absl::string_view path) {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(
        StrCat("checkpoint path '", path, "' must be absolute (the workers resolve it)"));
  }
  for (absl::string_view part : absl::StrSplit(path.substr(1), '/', absl::SkipEmpty())) {
    if (part == "." || part == "..") {
      return absl::InvalidArgumentError(
          StrCat("checkpoint path '", path, "' has a '", part, "' component"));
    }
  }
  std::string r(root);
  while (r.size() > 1 && r.back() == '/') r.pop_back();
  if (r != "/" &&
      !(absl::StartsWith(path, r) && (path.size() == r.size() || path[r.size()] == '/'))) {
    return absl::PermissionDeniedError(
        StrCat("checkpoint path '", path, "' is outside this worker's checkpoint root ", r));
  }
  return absl::OkStatus();
}

absl::Status CheckArrayName(absl::string_view name) {
  const bool chars_ok = absl::c_all_of(
      name, [](char ch) { return absl::ascii_isalnum(ch) || ch == '_' || ch == '-' || ch == '.'; });
  if (name.empty() || name.size() > 200 || !chars_ok || name.front() == '.' || name == kManifest ||
      name == kCommitMarker || name == "zarr.json") {
    return absl::InvalidArgumentError(
        StrCat("checkpoint array name '", name,
               "': expected 1 to 200 letters, digits, '_', '-' or '.', not starting with '.', "
               "and not a name the checkpoint itself uses"));
  }
  return absl::OkStatus();
}

uint32_t Crc32c(const void* data, int64_t n, uint32_t crc) {
  // ISA-L's iSCSI CRC is CRC32C without the final inversion.
  uint32_t state = ~crc;
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  while (n > 0) {
    const int step = int(std::min<int64_t>(n, int64_t{1} << 30));
    state = crc32_iscsi(p, step, state);
    p += step;
    n -= step;
  }
  return ~state;
}

uint32_t StoredCrc32c(const void* trailer) {
  const auto* le = static_cast<const unsigned char*>(trailer);
  return uint32_t(le[0]) | uint32_t(le[1]) << 8 | uint32_t(le[2]) << 16 | uint32_t(le[3]) << 24;
}

std::vector<int64_t> JsonInts(const google::protobuf::Struct& s, const std::string& key) {
  std::vector<int64_t> out;
  auto it = s.fields().find(key);
  if (it == s.fields().end()) return out;
  for (const auto& v : it->second.list_value().values()) out.push_back(int64_t(v.number_value()));
  return out;
}

std::string JsonText(const google::protobuf::Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? "" : it->second.string_value();
}

absl::StatusOr<v1::DType> FromZarrDType(absl::string_view name) {
  for (v1::DType t : {v1::F32, v1::F64, v1::F16, v1::BF16, v1::S8, v1::S16, v1::S32, v1::S64,
                      v1::U8, v1::U16, v1::U32, v1::U64, v1::PRED}) {
    if (ZarrDType(t) == name) return t;
  }
  return absl::InvalidArgumentError(StrCat("zarr data type '", name, "' has no Tessel dtype"));
}

}  // namespace tessel
