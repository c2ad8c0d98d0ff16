// The daemons' logs: spdlog to stdout, as text (the default) or as JSON
// lines for log collectors (--log_format=json): one object per line with
// "time" (UTC, RFC 3339 with microseconds), "level", "logger", "thread" and
// "message", the message escaped as JSON requires.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "spdlog/formatter.h"
#include "spdlog/logger.h"

namespace tessel {

// A formatter writing each record as one JSON object per line.
std::unique_ptr<spdlog::formatter> NewJsonFormatter();

// The daemon's logger `name` on stdout, at `level` (trace, debug, info,
// warn, error) in `format` (text or json). INVALID_ARGUMENT naming the flag
// for a level or format it does not know.
absl::StatusOr<std::shared_ptr<spdlog::logger>> MakeDaemonLogger(const std::string& name,
                                                                 const std::string& level,
                                                                 const std::string& format);

}  // namespace tessel
