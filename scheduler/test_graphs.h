// Helpers for the scheduler's tests: graphs written as text protos.
#pragma once

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include <string>

#include "scheduler/compiler.h"
#include "tessel/v1/ir.pb.h"

namespace tessel::scheduler {

// `text` (a Graph in protobuf text format) parsed; a parse error fails the test.
inline v1::Graph Parse(const std::string& text) {
  v1::Graph g;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &g));
  return g;
}

// "ok" when the graph in `text` compiles, else the message it fails with.
inline std::string ErrorOf(const std::string& text) {
  auto c = Compile(Parse(text));
  return c.ok() ? "ok" : std::string(c.status().message());
}

}  // namespace tessel::scheduler
