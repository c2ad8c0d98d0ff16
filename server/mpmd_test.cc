// SplitMpmd: what an MPMD graph may hold at its top level, and how its
// values are wired between the parts.
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "server/mpmd.h"

namespace tessel::server {
namespace {

v1::Graph Parse(const std::string& text) {
  v1::Graph g;
  EXPECT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &g)) << text;
  return g;
}

// Two parameters; region a reads p0, region b reads a's result and p1.
constexpr char kTwoParts[] = R"pb(
  name: "two"
  nodes { name: "p0" op: PARAMETER type { dtype: F32 dims: 4 } parameter { index: 0 } }
  nodes { name: "p1" op: PARAMETER type { dtype: F32 dims: 4 } parameter { index: 1 } }
  nodes {
    name: "a" op: MESH_REGION operands: "p0"
    results { dtype: F32 dims: 4 }
    mesh_region {
      body { name: "first" nodes { name: "x" op: PARAMETER type { dtype: F32 dims: 4 } parameter { index: 0 } }
             nodes { name: "y" op: NEG operands: "x" } outputs: "y" }
      mesh { axis_names: "d" axis_sizes: 1 devices: 0 }
      in_shardings {} out_shardings {}
    }
  }
  nodes { name: "a0" op: TUPLE_ELEMENT operands: "a" tuple_element { index: 0 } }
  nodes {
    name: "b" op: MESH_REGION operands: "a0" operands: "p1"
    results { dtype: F32 dims: 4 }
    mesh_region {
      body { nodes { name: "x" op: PARAMETER type { dtype: F32 dims: 4 } parameter { index: 0 } }
             nodes { name: "z" op: PARAMETER type { dtype: F32 dims: 4 } parameter { index: 1 } }
             nodes { name: "y" op: ADD operands: "x" operands: "z" } outputs: "y" }
      mesh { axis_names: "d" axis_sizes: 1 devices: 1 }
      in_shardings {} in_shardings {} out_shardings {}
    }
  }
  nodes { name: "b0" op: TUPLE_ELEMENT operands: "b" tuple_element { index: 0 } }
  outputs: "b0"
)pb";

TEST(SplitMpmd, WiresEachPartToWhatItReads) {
  const v1::Graph g = Parse(kTwoParts);
  ASSERT_TRUE(IsMpmd(g));
  auto s = SplitMpmd(g);
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_EQ(s->parts.size(), 2u);
  EXPECT_EQ(s->parts[0].name, "first");
  EXPECT_EQ(s->parts[1].name, "b");  // an unnamed body takes its node's name
  EXPECT_EQ(s->parts[0].inputs, (std::vector<MpmdRef>{{-1, 0}}));
  EXPECT_EQ(s->parts[1].inputs, (std::vector<MpmdRef>{{0, 0}, {-1, 1}}));
  EXPECT_EQ(s->outputs, (std::vector<MpmdRef>{{1, 0}}));
  EXPECT_EQ(s->parameter_names, (std::vector<std::string>{"p0", "p1"}));
  EXPECT_EQ(s->parts[1].mesh.devices(0), 1);
}

TEST(SplitMpmd, RefusesWhatCannotBeSplitNamingIt) {
  auto expect = [](std::string text, const std::string& from, const std::string& to,
                   const std::string& message) {
    text.replace(text.find(from), from.size(), to);
    auto s = SplitMpmd(Parse(text));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << to;
    EXPECT_NE(s.status().message().find(message), std::string::npos) << s.status();
  };
  const std::string two = kTwoParts;
  expect(two, R"(outputs: "b0")", R"(nodes { name: "n" op: NEG operands: "b0" } outputs: "n")",
         "node 'n' (NEG) stands outside every mesh region");
  expect(two, R"(outputs: "b0")", R"(outputs: "b0" outputs: "b0")",
         "output 'b0' is returned twice");
  expect(two, R"(outputs: "b0")", R"(outputs: "p0")", "output 'p0' is a parameter");
  expect(two, R"(operands: "a0" operands: "p1")", R"(operands: "a0")",
         "takes 1 operands; its body has 2");
  expect(two, R"(operands: "a0" operands: "p1")", R"(operands: "a" operands: "p1")",
         "reads 'a', which is not");
  expect(two, R"(tuple_element { index: 0 } }
  nodes {
    name: "b")",
         R"(tuple_element { index: 3 } }
  nodes {
    name: "b")",
         "reads result 3 of mesh region 'a', which has 1");
}

}  // namespace
}  // namespace tessel::server
