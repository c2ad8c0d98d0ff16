#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "scheduler/compiler.h"
#include "scheduler/test_graphs.h"

namespace tessel::scheduler {
namespace {

using ::testing::HasSubstr;

// state' = state * 2 + 1, plus a sum nobody donates into.
constexpr char kStep[] = R"pb(
  name: "step"
  nodes { name: "state" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 16 } }
  nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: 16 } }
  nodes { name: "one" op: CONSTANT constant { fill { f: 1 } } type { dtype: F32 dims: 16 } }
  nodes { name: "a" op: MUL operands: ["state", "two"] }
  nodes { name: "next" op: ADD operands: ["a", "one"] }
  nodes { name: "total" op: REDUCE operands: "next" reduce { kind: SUM dims: 0 } }
  outputs: "next"
  outputs: "total"
)pb";

TEST(Donation, ElementwiseUpdateReusesTheStateInPlace) {
  auto c = Compile(Parse(kStep), {.donated_parameters = {0}, .strict_donation = true});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->declared_aliases.size(), 1u);
  EXPECT_EQ(c->declared_aliases[0].output, 0);
  EXPECT_THAT(c->plan_text, HasSubstr("donate %state -> output 0 'next' (in place)"));
  // Declared donations are part of the executable's identity.
  auto plain = Compile(Parse(kStep));
  ASSERT_TRUE(plain.ok());
  EXPECT_NE(plain->fingerprint, c->fingerprint);
  EXPECT_TRUE(plain->declared_aliases.empty());
}

TEST(Donation, AParameterReturnedUnchangedIsNeverWrittenInPlace) {
  // (x + 1, x) and (x.reshape(3, 1), x * 10) with x donated: the first
  // output must not be written into the bytes the other returns.
  constexpr char kReturned[] = R"pb(
    name: "returned"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 3 } }
    nodes { name: "one" op: CONSTANT constant { fill { f: 1 } } type { dtype: F32 dims: 3 } }
    nodes { name: "y" op: ADD operands: ["x", "one"] }
    outputs: "y"
    outputs: "x"
  )pb";
  auto c = Compile(Parse(kReturned), {.donated_parameters = {0}});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->declared_aliases.size(), 1u);
  EXPECT_EQ(c->declared_aliases[0].output, 1);  // the pass-through keeps its buffer
  constexpr char kView[] = R"pb(
    name: "view"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 3 } }
    nodes { name: "ten" op: CONSTANT constant { fill { f: 10 } } type { dtype: F32 dims: 3 } }
    nodes { name: "v" op: RESHAPE operands: "x" reshape { dims: [3, 1] } }
    nodes { name: "y" op: MUL operands: ["x", "ten"] }
    outputs: "v"
    outputs: "y"
  )pb";
  auto v = Compile(Parse(kView), {.donated_parameters = {0}});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->declared_aliases[0].output, -1);
  EXPECT_THAT(v->declared_aliases[0].reason,
              HasSubstr("output 0 'v' returns 'x' (a view of it) unchanged"));
}

TEST(Donation, ReuseDoesNotDependOnTheOrderOfOutputs) {
  // (w * 2, sum(w)) reuses w as (sum(w), w * 2) does: the sum reads w first.
  for (const bool sum_first : {false, true}) {
    const std::string nodes = R"pb(
      name: "order"
      nodes { name: "w" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 8 } }
      nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: 8 } }
    )pb";
    const std::string mul = R"pb(nodes { name: "m" op: MUL operands: ["w", "two"] })pb";
    const std::string sum =
        R"pb(nodes { name: "s" op: REDUCE operands: "w" reduce { kind: SUM dims: 0 } })pb";
    const std::string outs =
        sum_first ? R"pb(outputs: ["s", "m"])pb" : R"pb(outputs: ["m", "s"])pb";
    auto c = Compile(Parse(nodes + (sum_first ? sum + mul : mul + sum) + outs),
                     {.donated_parameters = {0}});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->declared_aliases[0].output, sum_first ? 1 : 0)
        << c->declared_aliases[0].reason << "\n"
        << c->plan_text;
  }
}

TEST(Donation, ReadAfterTheOutputIsWrittenBlocksReuse) {
  // b = tanh(x*2) is written before c = max(b, x) reads x in the same fusion.
  constexpr char kLateRead[] = R"pb(
    name: "late"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 8 } }
    nodes { name: "two" op: CONSTANT constant { fill { f: 2 } } type { dtype: F32 dims: 8 } }
    nodes { name: "a" op: MUL operands: ["x", "two"] }
    nodes { name: "b" op: TANH operands: "a" }
    nodes { name: "c" op: MAX operands: ["b", "x"] }
    nodes { name: "s" op: REDUCE operands: "c" reduce { kind: SUM dims: 0 } }
    outputs: "b"
    outputs: "s"
  )pb";
  auto c = Compile(Parse(kLateRead), {.donated_parameters = {0}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->declared_aliases[0].output, -1);
  EXPECT_THAT(c->declared_aliases[0].reason, HasSubstr("reads 'x' after writing it"));
  auto strict = Compile(Parse(kLateRead), {.donated_parameters = {0}, .strict_donation = true});
  ASSERT_FALSE(strict.ok());
  EXPECT_EQ(strict.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(strict.status().message(), HasSubstr("parameter 0 'x' (f32[8])"));
}

TEST(Donation, AScalarConstantAFusionReturnsIsNotWrittenIntoWhatItReads) {
  // (0 / x, zeros_like(x)) for a u8 scalar x: the zero is written before the
  // division reads x, so it may not take x's buffer (it did, and 0 / 0 gave NaN).
  constexpr char kZeros[] = R"pb(
    name: "zeros_like"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: U8 } }
    nodes { name: "z" op: CONSTANT constant { fill { f: 0 } } type { dtype: F64 } }
    nodes { name: "xf" op: CONVERT operands: "x" convert { dtype: F64 } }
    nodes { name: "q" op: DIV operands: ["z", "xf"] }
    nodes { name: "zero" op: CONSTANT constant { fill { f: 0 } } type { dtype: U8 } }
    outputs: "q"
    outputs: "zero"
  )pb";
  auto c = Compile(Parse(kZeros), {.donated_parameters = {0}});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->program.instructions_size(), 1);
  ASSERT_TRUE(c->program.instructions(0).has_fusion());
  EXPECT_EQ(c->declared_aliases[0].output, -1);
  EXPECT_THAT(c->declared_aliases[0].reason, HasSubstr("output 1 'zero' is a constant that"));
  EXPECT_THAT(c->declared_aliases[0].reason, HasSubstr("writes before it reads 'x'"));
}

TEST(Donation, DotReadingTheParameterAndLaterReadsBlockReuse) {
  constexpr char kDot[] = R"pb(
    name: "dot"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: [4, 4] } }
    nodes { name: "w" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: [4, 4] } }
    nodes { name: "y" op: DOT_GENERAL operands: ["x", "w"]
            dot_general { lhs_contracting: 1 rhs_contracting: 0 } }
    nodes { name: "z" op: ADD operands: ["w", "w"] }
    nodes { name: "t" op: TRANSPOSE operands: "w" transpose { permutation: [1, 0] } }
    outputs: "y"
    outputs: "z"
    outputs: "t"
  )pb";
  auto c = Compile(Parse(kDot), {.donated_parameters = {0, 1}});
  ASSERT_TRUE(c.ok()) << c.status();
  // x: y reads it through the dot (not elementwise); z and t are fine.
  EXPECT_EQ(c->declared_aliases[0].output, 1);
  // w: the dot and the transpose read it before the fusion writes z, so z
  // could take its buffer, but x took z first; y and t are written while w
  // is still read.
  EXPECT_EQ(c->declared_aliases[1].output, -1);
  EXPECT_THAT(c->declared_aliases[1].reason, HasSubstr("already takes another donated buffer"));
  EXPECT_THAT(
      c->declared_aliases[1].reason,
      HasSubstr(
          "output 2 't' is written by instruction 1 (transpose 't') while 'w' is still read by "
          "instruction 2 (fusion -> z)"));
  EXPECT_THAT(c->alias_candidates.why_not[0], HasSubstr("other than elementwise"));
  // Donating w alone, it becomes z.
  auto w_only = Compile(Parse(kDot), {.donated_parameters = {1}});
  ASSERT_TRUE(w_only.ok()) << w_only.status();
  EXPECT_EQ(w_only->declared_aliases[0].output, 1) << w_only->declared_aliases[0].reason;
}

TEST(Donation, OneBufferPerOutput) {
  constexpr char kSum[] = R"pb(
    name: "sum"
    nodes { name: "a" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 4 } }
    nodes { name: "b" op: PARAMETER parameter { index: 1 } type { dtype: F32 dims: 4 } }
    nodes { name: "c" op: ADD operands: ["a", "b"] }
    outputs: "c"
  )pb";
  auto c = Compile(Parse(kSum), {.donated_parameters = {1, 0}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->declared_aliases[0].parameter, 1);
  EXPECT_EQ(c->declared_aliases[0].output, 0);
  EXPECT_EQ(c->declared_aliases[1].output, -1);
  EXPECT_THAT(c->declared_aliases[1].reason,
              HasSubstr("'a' could become already takes another donated buffer"));
}

TEST(Donation, PassThroughAndMismatchedTypes) {
  constexpr char kPass[] = R"pb(
    name: "pass"
    nodes { name: "x" op: PARAMETER parameter { index: 0 } type { dtype: F32 dims: 4 } }
    nodes { name: "i" op: PARAMETER parameter { index: 1 } type { dtype: S32 dims: 3 } }
    nodes { name: "r" op: RESHAPE operands: "x" reshape { dims: [2, 2] } }
    nodes { name: "back" op: RESHAPE operands: "r" reshape { dims: 4 } }
    outputs: "back"
  )pb";
  auto c = Compile(Parse(kPass), {.donated_parameters = {0, 1}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->declared_aliases[0].output, 0);
  EXPECT_EQ(c->declared_aliases[1].output, -1);
  EXPECT_THAT(c->declared_aliases[1].reason,
              HasSubstr("no output has its type s32[3] (outputs: f32[4])"));
  auto bad = Compile(Parse(kPass), {.donated_parameters = {2}});
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(bad.status().message(), HasSubstr("donated parameter 2 does not exist"));
}

}  // namespace
}  // namespace tessel::scheduler
