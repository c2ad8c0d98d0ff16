#include "core/json.h"

#include "absl/strings/str_format.h"

namespace tessel {

void AppendJsonString(std::string& out, absl::string_view s) {
  out.push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          absl::StrAppendFormat(&out, "\\u%04x", c);
        } else {
          out.push_back(char(c));
        }
    }
  }
  out.push_back('"');
}

std::string JsonString(absl::string_view s) {
  std::string out;
  AppendJsonString(out, s);
  return out;
}

}  // namespace tessel
