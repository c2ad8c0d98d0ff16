// The worker's collective groups by key (collectives.h has the contract).
#pragma once

#include <string>

namespace tessel::worker {

// A group key "<devices>@<incarnation>.<epoch>", as ResolveGroup makes
// them; other keys (tests') are not epoch keys (`valid` false).
struct EpochKey {
  bool valid = false;
  std::string devices, incarnation;
  int64_t epoch = 0;
};
EpochKey ParseEpochKey(const std::string& key);

}  // namespace tessel::worker
