// JSON text as the daemons and the SDK write it by hand (trace events, the
// dashboard's data, checkpoint manifests): string literals per RFC 8259.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace tessel {

// `s` as a JSON string, quotes included, appended to `out`.
void AppendJsonString(std::string& out, absl::string_view s);
// `s` as a JSON string, quotes included.
std::string JsonString(absl::string_view s);

}  // namespace tessel
