// Random identifiers: session ids, handles the coordinator makes, queue
// epochs and the coordinator's incarnation.
#pragma once

#include <cstdint>
#include <random>

namespace tessel::server {

inline uint64_t RandomU64() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  return rng();
}

inline uint64_t RandomNonzero() {
  uint64_t v = 0;
  while (v == 0) v = RandomU64();
  return v;
}

}  // namespace tessel::server
