// Tessel's public value types: element types, array types and host arrays.
// Plain data; no RPC or protobuf types. Thread-compatible.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace tessel {

enum class DType {
  kF32 = 1,
  kF64 = 2,
  kF16 = 3,
  kBF16 = 4,
  kS32 = 5,
  kS64 = 6,
  kU8 = 7,
  kPred = 8,
  kS8 = 9,
  kS16 = 10,
  kU16 = 11,
  kU32 = 12,
  kU64 = 13,
};

int DTypeBytes(DType t);
// "f32", "bf16", ...
std::string DTypeString(DType t);
absl::StatusOr<DType> DTypeFromString(const std::string& name);

template <typename T>
constexpr DType DTypeOf();
template <>
constexpr DType DTypeOf<float>() {
  return DType::kF32;
}
template <>
constexpr DType DTypeOf<double>() {
  return DType::kF64;
}
template <>
constexpr DType DTypeOf<int32_t>() {
  return DType::kS32;
}
template <>
constexpr DType DTypeOf<int64_t>() {
  return DType::kS64;
}
template <>
constexpr DType DTypeOf<uint8_t>() {
  return DType::kU8;
}
template <>
constexpr DType DTypeOf<int8_t>() {
  return DType::kS8;
}
template <>
constexpr DType DTypeOf<int16_t>() {
  return DType::kS16;
}
template <>
constexpr DType DTypeOf<uint16_t>() {
  return DType::kU16;
}
template <>
constexpr DType DTypeOf<uint32_t>() {
  return DType::kU32;
}
template <>
constexpr DType DTypeOf<uint64_t>() {
  return DType::kU64;
}
template <>
constexpr DType DTypeOf<bool>() {
  return DType::kPred;
}

struct ArrayType {
  DType dtype = DType::kF32;
  std::vector<int64_t> dims;

  int64_t elements() const;
  int64_t bytes() const;
  std::string ToString() const;  // "f32[2,3]"
  bool operator==(const ArrayType& o) const { return dtype == o.dtype && dims == o.dims; }
};

// An array in host memory: a type and its dense row-major bytes (pred is one
// byte per element; f16/bf16 are their 16-bit patterns).
class HostArray {
 public:
  HostArray() = default;
  explicit HostArray(ArrayType type) : type_(std::move(type)), bytes_(type_.bytes()) {}
  HostArray(ArrayType type, std::vector<uint8_t> bytes)
      : type_(std::move(type)), bytes_(std::move(bytes)) {}

  template <typename T>
  static HostArray From(std::vector<int64_t> dims, const std::vector<T>& values) {
    HostArray a(ArrayType{DTypeOf<T>(), std::move(dims)});
    if constexpr (std::is_same_v<T, bool>) {
      for (size_t i = 0; i < values.size() && i < a.bytes_.size(); ++i) a.bytes_[i] = values[i];
    } else {
      std::memcpy(a.bytes_.data(), values.data(),
                  std::min(a.bytes_.size(), values.size() * sizeof(T)));
    }
    return a;
  }

  const ArrayType& type() const { return type_; }
  const uint8_t* data() const { return bytes_.data(); }
  uint8_t* mutable_data() { return bytes_.data(); }
  int64_t size_bytes() const { return bytes_.size(); }
  std::vector<uint8_t>& bytes() { return bytes_; }

  template <typename T>
  absl::Span<const T> as() const {
    return {reinterpret_cast<const T*>(bytes_.data()), bytes_.size() / sizeof(T)};
  }
  template <typename T>
  absl::Span<T> as_mutable() {
    return {reinterpret_cast<T*>(bytes_.data()), bytes_.size() / sizeof(T)};
  }

 private:
  ArrayType type_;
  std::vector<uint8_t> bytes_;
};

// Reads and writes numpy .npy files (format 1.0/2.0/3.0, little-endian, C
// order). Numpy has no bfloat16: bf16 arrays travel as uint16 ('<u2') bit
// patterns, and '<u2' files are read as bf16.
absl::StatusOr<HostArray> ReadNpy(const std::string& path);
absl::Status WriteNpy(const std::string& path, const HostArray& array);

}  // namespace tessel
