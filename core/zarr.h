// The zarr v3 format of Tessel's checkpoints (docs/checkpoints.md): names,
// metadata and paths, shared by the workers that write and read them, the
// coordinator that plans them and the CLI that lists them. Pure.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "google/protobuf/struct.pb.h"
#include "tessel/v1/ir.pb.h"

namespace tessel {

// Zarr v3's name of a dtype ("float32", "bool", "bfloat16", ...).
absl::string_view ZarrDType(v1::DType t);
// A chunk's file under its array's directory: "c/0/1"; "c" for a 0-d array.
std::string ChunkKey(absl::Span<const int64_t> chunk_index);
// CRC32C (Castagnoli), as zarr's crc32c codec computes it (ISA-L); `crc`
// continues an earlier call's result over the bytes that follow.
uint32_t Crc32c(const void* data, int64_t n, uint32_t crc = 0);
// The CRC32C a chunk file stores after its bytes (4 bytes, little-endian).
uint32_t StoredCrc32c(const void* trailer);
// A parsed JSON object's (zarr.json, tessel.json) field `key`: a list of
// integers, a string; empty when absent.
std::vector<int64_t> JsonInts(const google::protobuf::Struct& s, const std::string& key);
std::string JsonText(const google::protobuf::Struct& s, const std::string& key);
// The zarr.json of an array of `global`'s type in chunks of `chunk_shape`.
std::string ZarrArrayJson(const v1::TensorType& global, absl::Span<const int64_t> chunk_shape);
// INVALID_ARGUMENT naming `path` unless it is absolute, has no "." or ".."
// component, and lies under `root`.
absl::Status CheckCheckpointPath(absl::string_view root, absl::string_view path);

// INVALID_ARGUMENT unless `name` can name an array's directory in a
// checkpoint: letters, digits, '_', '-' and '.', not first, and none of the
// names below.
absl::Status CheckArrayName(absl::string_view name);

// The names a checkpoint's directory holds besides its arrays.
inline constexpr char kCommitMarker[] = "tessel.commit";
inline constexpr char kManifest[] = "tessel.json";
inline constexpr char kProbe[] = ".tessel-probe";

// The dtype of zarr's name; INVALID_ARGUMENT for a name Tessel has no dtype of.
absl::StatusOr<v1::DType> FromZarrDType(absl::string_view name);

}  // namespace tessel
