// Every row of the scalar table (worker/scalar_expr.h), for every dtype of
// its class, compiled with the system C compiler as the native loops are and
// run over edge values, against the interpreted CPU kernels
// (cpu/elementwise.cc), bit for bit (any NaN matches any NaN).
#include "worker/scalar_expr.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/dtype.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/native_loop.h"

namespace tessel::worker {
namespace {

struct Type {
  v1::DType dt;
  const char* c;       // storage and compute type
  const char* u;       // unsigned type of its width (integers)
  const char* suffix;  // of the prelude's helpers
};

constexpr Type kTypes[] = {
    {v1::F32, "float", "", "f32"},
    {v1::F64, "double", "", "f64"},
    {v1::S8, "int8_t", "uint8_t", "s8"},
    {v1::S16, "int16_t", "uint16_t", "s16"},
    {v1::S32, "int32_t", "uint32_t", "s32"},
    {v1::S64, "int64_t", "uint64_t", "s64"},
    {v1::U8, "uint8_t", "uint8_t", "u8"},
    {v1::U16, "uint16_t", "uint16_t", "u16"},
    {v1::U32, "uint32_t", "uint32_t", "u32"},
    {v1::U64, "uint64_t", "uint64_t", "u64"},
    {v1::PRED, "int", "", "pred"},
};

const Type& TypeOf(v1::DType dt) {
  for (const Type& t : kTypes) {
    if (t.dt == dt) return t;
  }
  std::abort();
}

const ScalarDialect kDialect{
    .compute_type = [](v1::DType dt) { return std::string(TypeOf(dt).c); },
    .unsigned_type = [](v1::DType dt) { return std::string(TypeOf(dt).u); },
    .math = [](v1::DType dt, absl::string_view name) { return MathFunction(dt, name); },
    .helper = [](v1::DType dt,
                 absl::string_view name) { return absl::StrCat(name, "_", TypeOf(dt).suffix); },
};

// Edge values of `dt`, as storage bytes: zeros, ones, signs, the extremes,
// and for floats infinities, NaN, a denormal and halves.
std::vector<std::vector<uint8_t>> Samples(v1::DType dt) {
  std::vector<std::vector<uint8_t>> out;
  auto add = [&](auto v) {
    std::vector<uint8_t> b(sizeof(v));
    std::memcpy(b.data(), &v, sizeof(v));
    out.push_back(std::move(b));
  };
  auto ints = [&](auto zero) {
    using T = decltype(zero);
    using L = std::numeric_limits<T>;
    for (T v : {T(0), T(1), T(2), T(3), T(7), T(L::max()), T(L::max() - 1), T(L::min()),
                T(L::min() + 1), T(-1), T(-2), T(-7)}) {
      add(v);
    }
  };
  auto floats = [&](auto zero) {
    using T = decltype(zero);
    using L = std::numeric_limits<T>;
    for (T v : {T(0), T(-0.0), T(1), T(-1), T(0.5), T(-2.5), T(3.75), T(100), T(1e30), T(-1e-30),
                L::infinity(), -L::infinity(), L::quiet_NaN(), L::denorm_min(), T(2.5)}) {
      add(v);
    }
  };
  switch (dt) {
    case v1::F32: floats(0.0f); break;
    case v1::F64: floats(0.0); break;
    case v1::S8: ints(int8_t{0}); break;
    case v1::S16: ints(int16_t{0}); break;
    case v1::S32: ints(int32_t{0}); break;
    case v1::S64: ints(int64_t{0}); break;
    case v1::U8: ints(uint8_t{0}); break;
    case v1::U16: ints(uint16_t{0}); break;
    case v1::U32: ints(uint32_t{0}); break;
    case v1::U64: ints(uint64_t{0}); break;
    default: out = {{0}, {1}};
  }
  return out;
}

bool SameValue(v1::DType dt, const uint8_t* a, const uint8_t* b) {
  if (dt == v1::F32) {
    float x, y;
    std::memcpy(&x, a, 4);
    std::memcpy(&y, b, 4);
    if (std::isnan(x) && std::isnan(y)) return true;
  } else if (dt == v1::F64) {
    double x, y;
    std::memcpy(&x, a, 8);
    std::memcpy(&y, b, 8);
    if (std::isnan(x) && std::isnan(y)) return true;
  }
  return std::memcmp(a, b, DTypeSize(dt)) == 0;
}

TEST(ScalarExpr, EveryRowMatchesTheInterpretedKernelsOnEveryDType) {
  // One C function per (row, dtype): out[i] = the row's expression over
  // in0[i], in1[i], in2[i].
  struct Case {
    const ScalarRule* rule;
    v1::DType dt;
    std::string fn;
  };
  std::vector<Case> cases;
  std::string src = cpu::NativeLoop::Prelude();  // the helpers the native loops use
  for (const ScalarRule& r : ScalarRules()) {
    for (const Type& t : kTypes) {
      if (ClassOf(t.dt) != r.cls) continue;
      const bool pred = t.dt == v1::PRED;
      const char* storage = pred ? "uint8_t" : t.c;
      std::vector<std::string> args;
      for (int k = 0; k < r.arity; ++k) args.push_back(absl::StrCat("x", k));
      auto expr = ScalarExpr(r.op, t.dt, args, kDialect);
      ASSERT_TRUE(expr.ok()) << expr.status();
      const std::string fn = absl::StrCat("f", cases.size());
      absl::StrAppend(&src, "void ", fn, "(const ", storage, "* a, const ", storage, "* b, const ",
                      storage, "* c, ", storage,
                      "* out, long n) {\n  for (long i = 0; i < n; ++i) {\n");
      const char* in[] = {"a", "b", "c"};
      for (int k = 0; k < r.arity; ++k) {
        // A pred is stored as a byte and computed as an int 0 or 1.
        const std::string load =
            pred ? absl::StrCat("(", in[k], "[i] != 0)") : absl::StrCat(in[k], "[i]");
        absl::StrAppend(&src, "    const ", t.c, " x", k, " = ", load, ";\n");
      }
      const std::string value = pred ? absl::StrCat("((", *expr, ") != 0)") : *expr;
      absl::StrAppend(&src, "    out[i] = (", storage, ")", value, ";\n  }\n}\n");
      cases.push_back(Case{&r, t.dt, fn});
    }
  }
  ASSERT_GT(cases.size(), 100u);
  // Compiled as the native loops compile theirs.
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("scalar-expr-", getpid());
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "rows.c") << src;
  const char* env_cc = std::getenv("CC");
  const std::string cmd =
      absl::StrCat(env_cc != nullptr && *env_cc ? env_cc : "cc",
                   " -O2 -std=c11 -ffp-contract=off -fPIC -shared -o ", (dir / "rows.so").string(),
                   " ", (dir / "rows.c").string(), " -lm 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  void* lib = dlopen((dir / "rows.so").c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(lib, nullptr) << dlerror();
  using Fn = void (*)(const void*, const void*, const void*, void*, long);
  int checked = 0;
  for (const Case& k : cases) {
    auto fn = reinterpret_cast<Fn>(dlsym(lib, k.fn.c_str()));
    ASSERT_NE(fn, nullptr) << k.fn;
    const std::vector<std::vector<uint8_t>> samples = Samples(k.dt);
    const int size = DTypeSize(k.dt);
    // Every combination of samples for the row's operands.
    std::vector<uint8_t> a, b, c;
    const size_t m = samples.size();
    const size_t count = k.rule->arity == 1 ? m : k.rule->arity == 2 ? m * m : m * m * m;
    for (size_t i = 0; i < count; ++i) {
      for (auto [v, j] :
           {std::pair{&a, i % m}, std::pair{&b, i / m % m}, std::pair{&c, i / m / m % m}}) {
        v->insert(v->end(), samples[j].begin(), samples[j].end());
      }
    }
    std::vector<uint8_t> got(count * size), want(count * size);
    fn(a.data(), b.data(), c.data(), got.data(), long(count));
    switch (k.rule->arity) {
      case 1: cpu::UnaryKernel(k.rule->op, k.dt, a.data(), want.data(), count); break;
      case 2: cpu::BinaryKernel(k.rule->op, k.dt, a.data(), b.data(), want.data(), count); break;
      default: cpu::ClampKernel(k.dt, a.data(), b.data(), c.data(), want.data(), count);
    }
    for (size_t i = 0; i < count; ++i) {
      ASSERT_TRUE(SameValue(k.dt, &got[i * size], &want[i * size]))
          << OpName(k.rule->op) << " on " << DTypeName(k.dt) << ", element " << i << " ("
          << k.rule->pattern << ")";
      ++checked;
    }
  }
  dlclose(lib);
  std::filesystem::remove_all(dir);
  EXPECT_GT(checked, 10000);
}

// Nothing outside the table is made up: an op a class has no row for is
// UNIMPLEMENTED, naming both.
TEST(ScalarExpr, AnOpWithoutARowIsUnimplementedNamingIt) {
  auto e = ScalarExpr(v1::TANH, v1::S32, {std::string("x")}, kDialect);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(e.status().message().find("tanh on s32"), std::string::npos) << e.status();
}

}  // namespace
}  // namespace tessel::worker
