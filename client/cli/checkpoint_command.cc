// `tessel checkpoint ls|inspect PATH`: a checkpoint directory read where it
// lies (the shared volume, from any host that mounts it), no cluster needed.
#include "client/cli/checkpoint_command.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "core/zarr.h"

namespace tessel::cli {

namespace fs = std::filesystem;
using google::protobuf::Struct;
using google::protobuf::Value;

namespace {

absl::StatusOr<Struct> ReadJson(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat(path.string(), " does not exist or is unreadable"));
  std::ostringstream text;
  text << in.rdbuf();
  Struct s;
  if (!google::protobuf::util::JsonStringToMessage(text.str(), &s).ok()) {
    return absl::DataLossError(absl::StrCat(path.string(), " is not valid JSON"));
  }
  return s;
}

const Value* Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

std::string Step(const Struct& manifest) {
  const Value* meta = Field(manifest, "metadata");
  const Value* step = meta != nullptr ? Field(meta->struct_value(), "step") : nullptr;
  if (step == nullptr || step->has_null_value()) return "-";
  return absl::StrCat(int64_t(step->number_value()));
}

// The array's bytes, from its dtype and shape.
int64_t Bytes(const Struct& array) {
  const Value* dtype = Field(array, "dtype");
  auto t = FromZarrDType(dtype != nullptr ? dtype->string_value() : "");
  if (!t.ok()) return 0;
  int64_t n = DTypeSize(*t);
  for (int64_t d : JsonInts(array, "shape")) n *= d;
  return n;
}

std::string Size(int64_t bytes) {
  if (bytes >= (int64_t{1} << 30)) return absl::StrFormat("%.2f GiB", bytes / double(1 << 30));
  if (bytes >= (1 << 20)) return absl::StrFormat("%.2f MiB", bytes / double(1 << 20));
  if (bytes >= (1 << 10)) return absl::StrFormat("%.1f KiB", bytes / double(1 << 10));
  return absl::StrCat(bytes, " B");
}

// Each chunk of `array` under `dir`: whether it is there, whole, and (with
// `verify`) whether its CRC32C holds. Returns the problems found.
std::vector<std::string> CheckChunks(const fs::path& dir, const Struct& array, bool verify,
                                     int64_t* chunks) {
  std::vector<std::string> problems;
  const std::vector<int64_t> shape = JsonInts(array, "shape"),
                             chunk = JsonInts(array, "chunk_shape");
  const Value* dtype = Field(array, "dtype");
  auto t = FromZarrDType(dtype != nullptr ? dtype->string_value() : "");
  if (!t.ok() || shape.size() != chunk.size()) return {"its dtype or chunk shape is unreadable"};
  int64_t chunk_bytes = DTypeSize(*t);
  std::vector<int64_t> grid, index(shape.size(), 0);
  for (size_t d = 0; d < shape.size(); ++d) {
    if (chunk[d] <= 0) return {"its chunk shape is not positive"};
    grid.push_back((shape[d] + chunk[d] - 1) / chunk[d]);
    chunk_bytes *= chunk[d];
    if (grid.back() == 0) return {};
  }
  *chunks = 0;
  std::vector<char> data;
  while (true) {
    ++*chunks;
    const fs::path file = dir / ChunkKey(index);
    std::error_code ec;
    const auto size = fs::file_size(file, ec);
    if (ec) {
      problems.push_back(absl::StrCat(file.string(), " is missing"));
    } else if (int64_t(size) != chunk_bytes + 4) {
      problems.push_back(absl::StrCat(file.string(), " holds ", size, " bytes; expected ",
                                      chunk_bytes + 4, ": it is torn"));
    } else if (verify) {
      data.resize(size);
      std::ifstream in(file, std::ios::binary);
      in.read(data.data(), size);
      if (!in || Crc32c(data.data(), chunk_bytes) != StoredCrc32c(data.data() + chunk_bytes)) {
        problems.push_back(absl::StrCat(file.string(), " is corrupt: its CRC32C does not match"));
      }
    }
    int d = int(shape.size()) - 1;
    for (; d >= 0; --d) {
      if (++index[d] < grid[d]) break;
      index[d] = 0;
    }
    if (d < 0) break;
  }
  return problems;
}

int List(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    std::cerr << "tessel checkpoint ls: " << dir.string() << " is not a directory\n";
    return 1;
  }
  std::vector<fs::path> entries;
  if (fs::exists(dir / kManifest)) {
    entries.push_back(dir);
  } else {
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (e.is_directory() && fs::exists(e.path() / kManifest)) entries.push_back(e.path());
    }
  }
  std::sort(entries.begin(), entries.end());
  std::cout << absl::StrFormat("%-32s %-10s %8s %8s %12s\n", "CHECKPOINT", "STATE", "STEP",
                               "ARRAYS", "BYTES");
  for (const fs::path& p : entries) {
    auto manifest = ReadJson(p / kManifest);
    if (!manifest.ok()) {
      std::cout << absl::StrFormat("%-32s %-10s\n", p.filename().string(), "unreadable");
      continue;
    }
    int64_t arrays = 0, bytes = 0;
    if (const Value* a = Field(*manifest, "arrays")) {
      for (const auto& [name, v] : a->struct_value().fields()) {
        ++arrays;
        bytes += Bytes(v.struct_value());
      }
    }
    const bool committed = fs::exists(p / kCommitMarker);
    std::cout << absl::StrFormat("%-32s %-10s %8s %8d %12s\n", p.filename().string(),
                                 committed ? "committed" : "incomplete", Step(*manifest), arrays,
                                 Size(bytes));
  }
  return 0;
}

int Inspect(const fs::path& path, bool verify) {
  auto manifest = ReadJson(path / kManifest);
  if (!manifest.ok()) {
    std::cerr << "tessel checkpoint inspect: " << manifest.status().message() << "\n";
    return 1;
  }
  const bool committed = fs::exists(path / kCommitMarker);
  std::cout << "checkpoint " << path.string() << ": "
            << (committed ? "committed" : "incomplete (no commit marker)") << ", step "
            << Step(*manifest) << "\n";
  int problems = committed ? 0 : 1;
  std::cout << absl::StrFormat("%-36s %-9s %-18s %-14s %8s %12s  %s\n", "ARRAY", "DTYPE", "SHAPE",
                               "CHUNK", "CHUNKS", "BYTES", "PLACEMENT");
  if (const Value* a = Field(*manifest, "arrays")) {
    std::vector<std::string> names;
    for (const auto& [name, v] : a->struct_value().fields()) names.push_back(name);
    std::sort(names.begin(), names.end());
    for (const std::string& name : names) {
      const Struct& array = a->struct_value().fields().at(name).struct_value();
      int64_t chunks = 0;
      std::vector<std::string> bad = CheckChunks(path / name, array, verify, &chunks);
      std::string placement;
      if (const Value* p = Field(array, "placement")) {
        google::protobuf::util::MessageToJsonString(p->struct_value(), &placement);
      }
      const Value* dtype = Field(array, "dtype");
      std::cout << absl::StrFormat(
          "%-36s %-9s %-18s %-14s %8d %12s  %s\n", name, dtype ? dtype->string_value() : "?",
          absl::StrCat("[", absl::StrJoin(JsonInts(array, "shape"), ","), "]"),
          absl::StrCat("[", absl::StrJoin(JsonInts(array, "chunk_shape"), ","), "]"), chunks,
          Size(Bytes(array)), placement);
      for (const std::string& b : bad) std::cout << "  ! " << b << "\n";
      problems += bad.size();
    }
  }
  if (verify) {
    std::cout << (problems == 0 ? "every chunk is present and its CRC32C holds\n"
                                : absl::StrCat(problems, " problem(s) found\n"));
  }
  return problems == 0 ? 0 : 1;
}

}  // namespace

int CheckpointCommand(const std::vector<std::string>& operands, bool verify) {
  if (operands.size() != 2 || (operands[0] != "ls" && operands[0] != "inspect")) {
    std::cerr << "tessel checkpoint: expected 'ls DIRECTORY' or 'inspect PATH'\n";
    return 2;
  }
  return operands[0] == "ls" ? List(operands[1]) : Inspect(operands[1], verify);
}

}  // namespace tessel::cli
