// Generated CUDA kernels, checked without a GPU: every module is compiled
// by NVRTC for sm_90 (the code a GPU would load), and the same source is
// compiled by the host compiler and run, each kernel's grid-stride loop on
// one thread, against the CPU backend's kernels on the same inputs.
#include "worker/cuda/kernel_source.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "worker/cpu/convolution.h"
#include "worker/cpu/dot.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/fused_loop.h"
#include "worker/cpu/gather.h"
#include "worker/cpu/layout.h"
#include "worker/cpu/reduce.h"
#include "worker/cpu/sort.h"
#ifdef TESSEL_HAVE_CUDA
#include "worker/cuda/kernel_compiler.h"
#endif

namespace tessel::cuda {
namespace {

namespace fs = std::filesystem;

// A module compiled by the host compiler and loaded into this process.
class HostModule {
 public:
  explicit HostModule(const ModuleSource& module) {
    dir_ = fs::temp_directory_path() / absl::StrCat("tessel-kernels-", getpid(), "-", counter_++);
    fs::create_directories(dir_);
    const fs::path src = dir_ / "kernels.cc", so = dir_ / "kernels.so";
    std::ofstream(src) << module.source();
    const char* cxx = std::getenv("CXX");
    const std::string cmd = absl::StrCat(
        cxx != nullptr ? cxx : "c++", " -std=c++17 -O1 -ffp-contract=off -fPIC -shared -w -o ",
        so.string(), " ", src.string(), " 2>", (dir_ / "log").string());
    if (std::system(cmd.c_str()) != 0) {
      std::ifstream log(dir_ / "log");
      error_ = absl::StrCat("host compile failed: ",
                            std::string(std::istreambuf_iterator<char>(log), {}));
      return;
    }
    handle_ = dlopen(so.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle_ == nullptr) error_ = dlerror();
  }
  ~HostModule() {
    if (handle_ != nullptr) dlclose(handle_);
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  const std::string& error() const { return error_; }

  void Launch(const KernelLaunch& l, const KernelParams& params) const {
    using Fn = void (*)(KernelParams);
    auto fn = reinterpret_cast<Fn>(dlsym(handle_, l.kernel.c_str()));
    ASSERT_NE(fn, nullptr) << l.kernel;
    if (l.elements > 0) fn(params);
  }

 private:
  static inline int counter_ = 0;
  fs::path dir_;
  void* handle_ = nullptr;
  std::string error_;
};

// Compiles the module for a GPU (NVRTC) and for the host; fails the test if either fails.
std::unique_ptr<HostModule> Build(const ModuleSource& module) {
#ifdef TESSEL_HAVE_CUDA
  static KernelCompiler* nvrtc = new KernelCompiler({});
  auto cubin = nvrtc->Compile(module.source());
  EXPECT_TRUE(cubin.ok()) << cubin.status();
  if (cubin.ok()) {
    EXPECT_GT((*cubin)->size(), 0u);
  }
#endif
  auto host = std::make_unique<HostModule>(module);
  EXPECT_EQ(host->error(), "") << module.source();
  return host;
}

// Random elements of `dt`, with the special values of floats mixed in.
std::vector<char> RandomBytes(v1::DType dt, int64_t n, int seed, double lo = -4, double hi = 4) {
  std::mt19937_64 rng(seed);
  std::vector<char> out(n * DTypeSize(dt));
  if (IsFloat(dt)) {
    std::uniform_real_distribution<double> u(lo, hi);
    const double specials[] = {0.0,      -0.0,      1.0, -1.0,  0.5,     2.5, -2.5,
                               INFINITY, -INFINITY, NAN, 1e-30, 65504.0, 1e6};
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i)
      v[i] = (i % 7 == 3) ? specials[(i / 7) % std::size(specials)] : u(rng);
    cpu::ConvertKernel(v1::F64, dt, v.data(), out.data(), n);
  } else if (dt == v1::PRED) {
    for (char& c : out) c = char(rng() & 1);
  } else {
    for (char& c : out) c = char(rng());
    // small values too, so that pow and division see ordinary cases
    const int64_t es = DTypeSize(dt);
    for (int64_t i = 0; i < n; i += 2) {
      const int64_t v = int64_t(rng() % 9) - (IsSigned(dt) ? 4 : 0);
      cpu::ConvertKernel(v1::S64, dt, &v, out.data() + i * es, 1);
    }
  }
  return out;
}

bool SameElements(v1::DType dt, const std::vector<char>& a, const std::vector<char>& b,
                  std::string* where) {
  const int es = DTypeSize(dt);
  for (size_t i = 0; i * es < a.size(); ++i) {
    if (std::memcmp(a.data() + i * es, b.data() + i * es, es) == 0) continue;
    if (IsFloat(dt)) {  // NaNs agree whatever their payload
      double x, y;
      v1::DType f64 = v1::F64;
      cpu::ConvertKernel(dt, f64, a.data() + i * es, &x, 1);
      cpu::ConvertKernel(dt, f64, b.data() + i * es, &y, 1);
      if (std::isnan(x) && std::isnan(y)) continue;
      *where = absl::StrCat("element ", i, ": cuda kernel ", x, ", cpu ", y);
    } else {
      *where = absl::StrCat("element ", i, " differs");
    }
    return false;
  }
  return true;
}

v1::Node MakeNode(const std::string& name, v1::Op op, v1::TensorType type,
                  std::vector<std::string> operands) {
  v1::Node n;
  n.set_name(name);
  n.set_op(op);
  *n.mutable_type() = std::move(type);
  for (auto& o : operands) n.add_operands(o);
  return n;
}

// Fusions run through generated kernels, all in one module (one host and
// one NVRTC compile), and through the CPU backend's FusedLoop.
class FusionBatch {
 public:
  void Add(const v1::Fusion& fusion, const std::vector<v1::TensorType>& in_types,
           const std::string& what) {
    auto launch = module_.AddFusion(fusion, in_types);
    ASSERT_TRUE(launch.ok()) << what << ": " << launch.status();
    auto loop = cpu::FusedLoop::Build(fusion, in_types);
    ASSERT_TRUE(loop.ok()) << what << ": " << loop.status();
    Case c{what, *launch, {}, {}, {}, loop->output_types()};
    for (size_t i = 0; i < in_types.size(); ++i) {
      c.ins.push_back(RandomBytes(in_types[i].dtype(), NumElementsUnchecked(in_types[i]),
                                  cases_.size() * 8 + i));
    }
    std::vector<const void*> in_ptrs;
    for (auto& b : c.ins) in_ptrs.push_back(b.data());
    std::vector<void*> want_ptrs;
    for (const v1::TensorType& t : c.out_types) {
      c.want.emplace_back(ByteSizeUnchecked(t));
      c.got.emplace_back(ByteSizeUnchecked(t));
      want_ptrs.push_back(c.want.back().data());
    }
    loop->Run(in_ptrs, want_ptrs);
    cases_.push_back(std::move(c));
  }

  // Runs every kernel; returns the number of cases checked.
  int Check() {
    auto host = Build(module_);
    if (host->error() != "") return 0;
    for (Case& c : cases_) {
      KernelParams params;
      for (size_t i = 0; i < c.ins.size(); ++i) params.p[i] = c.ins[i].data();
      for (size_t j = 0; j < c.got.size(); ++j) params.p[c.ins.size() + j] = c.got[j].data();
      host->Launch(c.launch, params);
      for (size_t j = 0; j < c.got.size(); ++j) {
        std::string where;
        EXPECT_TRUE(SameElements(c.out_types[j].dtype(), c.got[j], c.want[j], &where))
            << c.what << " (kernel " << c.launch.kernel << "), output " << j << ": " << where;
      }
    }
    return int(cases_.size());
  }

 private:
  struct Case {
    std::string what;
    KernelLaunch launch;
    std::vector<std::vector<char>> ins, want, got;
    std::vector<v1::TensorType> out_types;
  };
  ModuleSource module_;
  std::vector<Case> cases_;
};

v1::Fusion OneNode(const v1::Node& n, int inputs) {
  v1::Fusion f;
  *f.add_nodes() = n;
  for (int i = 0; i < inputs; ++i) f.add_inputs(n.operands(i));
  f.add_outputs(n.name());
  return f;
}

TEST(KernelSource, EveryElementwiseOpMatchesTheCpuBackendBitForBit) {
  const int64_t n = 1000;
  FusionBatch batch;
  for (v1::DType dt : kAllDTypes) {
    const v1::TensorType t = MakeType(dt, {n});
    std::vector<v1::Op> unary, binary;
    if (IsFloat(dt)) {
      unary = {v1::NEG,   v1::ABS,   v1::EXP,   v1::LOG,   v1::LOG1P, v1::TANH, v1::LOGISTIC,
               v1::SQRT,  v1::RSQRT, v1::FLOOR, v1::CEIL,  v1::ROUND, v1::SIGN, v1::SIN,
               v1::COS,   v1::TAN,   v1::ASIN,  v1::ACOS,  v1::ATAN,  v1::SINH, v1::COSH,
               v1::ASINH, v1::ACOSH, v1::ATANH, v1::EXPM1, v1::ERF,   v1::CBRT};
      binary = {v1::ADD, v1::SUB, v1::MUL, v1::DIV, v1::REM, v1::POW, v1::MAX, v1::MIN, v1::ATAN2};
    } else if (dt == v1::PRED) {
      unary = {v1::NOT};
      binary = {v1::AND, v1::OR, v1::XOR};
    } else {
      unary = {v1::NEG, v1::ABS, v1::SIGN, v1::NOT};
      binary = {v1::ADD, v1::SUB, v1::MUL, v1::DIV, v1::REM, v1::POW,
                v1::MAX, v1::MIN, v1::AND, v1::OR,  v1::XOR};
    }
    for (v1::Op op : unary) {
      batch.Add(OneNode(MakeNode("y", op, t, {"a"}), 1), {t},
                absl::StrCat(OpName(op), " ", DTypeName(dt)));
    }
    for (v1::Op op : binary) {
      batch.Add(OneNode(MakeNode("y", op, t, {"a", "b"}), 2), {t, t},
                absl::StrCat(OpName(op), " ", DTypeName(dt)));
    }
    for (int d = v1::EQ; d <= v1::GE; ++d) {
      v1::Node c = MakeNode("y", v1::COMPARE, MakeType(v1::PRED, {n}), {"a", "b"});
      c.mutable_compare()->set_direction(v1::CompareDirection(d));
      batch.Add(OneNode(c, 2), {t, t}, absl::StrCat("compare ", d, " ", DTypeName(dt)));
    }
    batch.Add(OneNode(MakeNode("y", v1::SELECT, t, {"p", "a", "b"}), 3),
              {MakeType(v1::PRED, {n}), t, t}, absl::StrCat("select ", DTypeName(dt)));
    if (dt != v1::PRED) {
      batch.Add(OneNode(MakeNode("y", v1::CLAMP, t, {"lo", "a", "hi"}), 3),
                {MakeType(dt, {}), t, MakeType(dt, {})}, absl::StrCat("clamp ", DTypeName(dt)));
    }
    for (v1::DType to : kAllDTypes) {
      v1::Node c = MakeNode("y", v1::CONVERT, MakeType(to, {n}), {"a"});
      c.mutable_convert()->set_dtype(to);
      batch.Add(OneNode(c, 1), {t}, absl::StrCat("convert ", DTypeName(dt), "->", DTypeName(to)));
      if (DTypeSize(to) == DTypeSize(dt) && to != v1::PRED && dt != v1::PRED) {
        // the same bits read as another dtype of the width
        c.mutable_convert()->set_bitcast(true);
        batch.Add(OneNode(c, 1), {t}, absl::StrCat("bitcast ", DTypeName(dt), "->", DTypeName(to)));
      }
    }
  }
  EXPECT_GT(batch.Check(), 500);
}

TEST(KernelSource, FusedChainWithSplatsConstantsAndIotaMatchesTheCpuBackend) {
  FusionBatch batch;
  for (v1::DType dt : {v1::F32, v1::BF16, v1::F16, v1::S32}) {
    const int64_t n = 3000;
    const v1::TensorType t = MakeType(dt, {3, n / 3});
    v1::Fusion f;
    f.add_inputs("x");
    f.add_inputs("s");  // one element, splatted
    v1::Node two = MakeNode("two", v1::CONSTANT, MakeType(dt, {}), {});
    two.mutable_constant()->mutable_fill()->set_f(2.0);
    *f.add_nodes() = two;
    v1::Node two_b = MakeNode("two_b", v1::BROADCAST_IN_DIM, t, {"two"});
    two_b.mutable_broadcast_in_dim()->mutable_dims()->CopyFrom(t.dims());
    *f.add_nodes() = two_b;
    v1::Node iota = MakeNode("iota", v1::CONSTANT, t, {});
    iota.mutable_constant()->mutable_iota()->set_dimension(1);
    *f.add_nodes() = iota;
    *f.add_nodes() = MakeNode("m", v1::MUL, t, {"x", "two_b"});
    *f.add_nodes() = MakeNode("p", v1::ADD, t, {"m", "iota"});
    v1::Node s_b = MakeNode("s_b", v1::BROADCAST_IN_DIM, t, {"s"});
    s_b.mutable_broadcast_in_dim()->mutable_dims()->CopyFrom(t.dims());
    *f.add_nodes() = s_b;
    *f.add_nodes() = MakeNode("q", IsFloat(dt) ? v1::DIV : v1::SUB, t, {"p", "s_b"});
    *f.add_nodes() = MakeNode("r", IsFloat(dt) ? v1::TANH : v1::NEG, t, {"q"});
    v1::Node cmp = MakeNode("c", v1::COMPARE, MakeType(v1::PRED, {3, n / 3}), {"r", "x"});
    cmp.mutable_compare()->set_direction(v1::GT);
    *f.add_nodes() = cmp;
    f.add_outputs("r");
    f.add_outputs("c");
    f.add_outputs("two");  // a one-element output
    batch.Add(f, {t, MakeType(dt, {})}, absl::StrCat("chain ", DTypeName(dt)));
  }
  EXPECT_EQ(batch.Check(), 4);
}

// Size-0 fusions: a scalar constant in them does not make them one element,
// and a one-element output (a scalar constant read elsewhere) is still
// written.
TEST(KernelSource, EmptyFusionsMatchTheCpuBackend) {
  FusionBatch batch;
  for (int64_t n : {0, 5}) {
    const v1::TensorType t = MakeType(v1::F32, {n});
    v1::Fusion f;
    f.add_inputs("x");  // bool, converted
    f.add_inputs("s");  // one element, splatted
    v1::Node zero = MakeNode("zero", v1::CONSTANT, MakeType(v1::F32, {}), {});
    zero.mutable_constant()->mutable_fill()->set_f(0.5);
    *f.add_nodes() = zero;
    v1::Node zero_b = MakeNode("zero_b", v1::BROADCAST_IN_DIM, t, {"zero"});
    zero_b.mutable_broadcast_in_dim()->add_dims(n);
    *f.add_nodes() = zero_b;
    *f.add_nodes() = MakeNode("xf", v1::CONVERT, t, {"x"});
    *f.add_nodes() = MakeNode("sum", v1::ADD, t, {"zero_b", "xf"});
    v1::Node s_b = MakeNode("s_b", v1::BROADCAST_IN_DIM, t, {"s"});
    s_b.mutable_broadcast_in_dim()->add_dims(n);
    *f.add_nodes() = s_b;
    *f.add_nodes() = MakeNode("y", v1::MUL, t, {"sum", "s_b"});
    f.add_outputs("y");
    f.add_outputs("zero");
    batch.Add(f, {MakeType(v1::PRED, {n}), MakeType(v1::F32, {})}, absl::StrCat("size ", n));
  }
  EXPECT_EQ(batch.Check(), 2);
}

// Runs a single-kernel op on random operands and compares with `cpu_reference`.
template <typename Ref>
void CheckKernel(ModuleSource& module, const KernelLaunch& launch,
                 const std::vector<v1::TensorType>& in_types, const v1::TensorType& out_type,
                 Ref cpu_reference, int64_t scalar = 0) {
  std::vector<std::vector<char>> ins;
  KernelParams params;
  for (size_t i = 0; i < in_types.size(); ++i) {
    ins.push_back(RandomBytes(in_types[i].dtype(), NumElementsUnchecked(in_types[i]), 100 + i));
    params.p[i] = ins[i].data();
  }
  std::vector<char> got(ByteSizeUnchecked(out_type), 0x5a), want(ByteSizeUnchecked(out_type), 0x5a);
  params.p[in_types.size()] = got.data();
  params.s[0] = scalar;
  auto host = Build(module);
  ASSERT_EQ(host->error(), "");
  host->Launch(launch, params);
  std::vector<const void*> in_ptrs;
  for (auto& b : ins) in_ptrs.push_back(b.data());
  cpu_reference(in_ptrs, want.data());
  std::string where;
  EXPECT_TRUE(SameElements(out_type.dtype(), got, want, &where)) << where << "\n"
                                                                 << module.source();
}

// Single-kernel ops gathered into one module, built once (a host build per
// op would dominate the test's time), each checked against its reference.
class KernelBatch {
 public:
  using Ref = std::function<void(const std::vector<const void*>&, void*)>;
  ModuleSource& module() { return module_; }
  void Add(const KernelLaunch& launch, const std::vector<v1::TensorType>& in_types,
           const v1::TensorType& out_type, Ref reference, const std::string& what) {
    Case c{what,
           launch,
           out_type,
           {},
           std::vector<char>(ByteSizeUnchecked(out_type), 0x5a),
           std::vector<char>(ByteSizeUnchecked(out_type), 0x5a)};
    std::vector<const void*> in_ptrs;
    for (size_t i = 0; i < in_types.size(); ++i) {
      c.ins.push_back(RandomBytes(in_types[i].dtype(), NumElementsUnchecked(in_types[i]), 100 + i));
      in_ptrs.push_back(c.ins.back().data());
    }
    reference(in_ptrs, c.want.data());
    cases_.push_back(std::move(c));
  }
  int Check() {
    auto host = Build(module_);
    EXPECT_EQ(host->error(), "");
    if (host->error() != "") return 0;
    for (Case& c : cases_) {
      KernelParams params;
      for (size_t i = 0; i < c.ins.size(); ++i) params.p[i] = c.ins[i].data();
      params.p[c.ins.size()] = c.got.data();
      host->Launch(c.launch, params);
      std::string where;
      EXPECT_TRUE(SameElements(c.out_type.dtype(), c.got, c.want, &where))
          << c.what << ": " << where;
    }
    return int(cases_.size());
  }

 private:
  struct Case {
    std::string what;
    KernelLaunch launch;
    v1::TensorType out_type;
    std::vector<std::vector<char>> ins;
    std::vector<char> want, got;
  };
  ModuleSource module_;
  std::vector<Case> cases_;
};

TEST(KernelSource, LayoutOpsMatchTheCpuBackend) {
  const v1::TensorType in = MakeType(v1::BF16, {4, 5, 6});
  {
    v1::Node n = MakeNode("t", v1::TRANSPOSE, MakeType(v1::BF16, {6, 4, 5}), {"a"});
    for (int64_t p : {2, 0, 1}) n.mutable_transpose()->add_permutation(p);
    ModuleSource m;
    auto l = m.AddLayout(n, {in});
    ASSERT_TRUE(l.ok()) << l.status();
    CheckKernel(m, *l, {in}, n.type(), [&](auto ins, void* out) {
      cpu::Transpose(in, ins[0], n.transpose(), n.type(), out);
    });
  }
  {
    v1::Node n = MakeNode("s", v1::SLICE, MakeType(v1::BF16, {2, 2, 5}), {"a"});
    v1::SliceAttrs* s = n.mutable_slice();
    for (int64_t v : {1, 0, 1}) s->add_start(v);
    for (int64_t v : {4, 5, 6}) s->add_limit(v);
    for (int64_t v : {2, 3, 1}) s->add_strides(v);
    ModuleSource m;
    auto l = m.AddLayout(n, {in});
    ASSERT_TRUE(l.ok()) << l.status();
    CheckKernel(m, *l, {in}, n.type(),
                [&](auto ins, void* out) { cpu::Slice(in, ins[0], n.slice(), n.type(), out); });
  }
  {
    v1::Node n = MakeNode("r", v1::REVERSE, in, {"a"});
    for (int64_t d : {0, 2}) n.mutable_reverse()->add_dimensions(d);
    ModuleSource m;
    auto l = m.AddLayout(n, {in});
    ASSERT_TRUE(l.ok()) << l.status();
    CheckKernel(m, *l, {in}, n.type(),
                [&](auto ins, void* out) { cpu::Reverse(in, ins[0], n.reverse(), out); });
  }
  {
    const v1::TensorType row = MakeType(v1::F32, {1, 6});
    v1::Node n = MakeNode("b", v1::BROADCAST_IN_DIM, MakeType(v1::F32, {3, 5, 6}), {"a"});
    for (int64_t v : {3, 5, 6}) n.mutable_broadcast_in_dim()->add_dims(v);
    for (int64_t v : {0, 2}) n.mutable_broadcast_in_dim()->add_broadcast_dimensions(v);
    ModuleSource m;
    auto l = m.AddLayout(n, {row});
    ASSERT_TRUE(l.ok()) << l.status();
    CheckKernel(m, *l, {row}, n.type(), [&](auto ins, void* out) {
      cpu::BroadcastInDim(row, ins[0], n.broadcast_in_dim(), n.type(), out);
    });
  }
  {
    const std::vector<v1::TensorType> parts = {MakeType(v1::S64, {2, 3}), MakeType(v1::S64, {2, 1}),
                                               MakeType(v1::S64, {2, 4})};
    v1::Node n = MakeNode("c", v1::CONCATENATE, MakeType(v1::S64, {2, 8}), {"a", "b", "c"});
    n.mutable_concatenate()->set_dimension(1);
    ModuleSource m;
    auto l = m.AddLayout(n, parts);
    ASSERT_TRUE(l.ok()) << l.status();
    std::vector<const v1::TensorType*> ptypes;
    for (auto& p : parts) ptypes.push_back(&p);
    CheckKernel(m, *l, parts, n.type(),
                [&](auto ins, void* out) { cpu::Concatenate(ptypes, ins, 1, n.type(), out); });
  }
  {
    // Negative low padding crops; interior padding spreads.
    const v1::TensorType small = MakeType(v1::U8, {3, 4});
    v1::Node n = MakeNode("p", v1::PAD, MakeType(v1::U8, {4, 10}), {"a", "v"});
    v1::PadAttrs* p = n.mutable_pad();
    for (int64_t v : {1, -1}) p->add_low(v);
    for (int64_t v : {0, 2}) p->add_high(v);
    for (int64_t v : {0, 2}) p->add_interior(v);
    ModuleSource m;
    auto l = m.AddLayout(n, {small, MakeType(v1::U8, {})});
    ASSERT_TRUE(l.ok()) << l.status();
    CheckKernel(m, *l, {small, MakeType(v1::U8, {})}, n.type(), [&](auto ins, void* out) {
      cpu::Pad(small, ins[0], ins[1], n.pad(), n.type(), out);
    });
  }
}

// Runs every pass of a reduction plan on the host.
std::vector<char> RunReduce(const ModuleSource& module, const ReducePlan& plan,
                            const std::vector<char>& in, int64_t out_bytes) {
  auto host = Build(module);
  std::vector<char> out(out_bytes);
  std::vector<std::vector<char>> partials;
  for (int64_t e : plan.partial_elements) partials.emplace_back(e * plan.accumulator_bytes);
  for (size_t k = 0; k < plan.passes.size(); ++k) {
    KernelParams p;
    p.p[0] = k == 0 ? const_cast<char*>(in.data()) : partials[k - 1].data();
    p.p[1] = k + 1 == plan.passes.size() ? out.data() : partials[k].data();
    host->Launch(plan.passes[k], p);
  }
  return out;
}

TEST(KernelSource, ReductionsMatchTheCpuBackend) {
  struct Case {
    v1::DType dt;
    std::vector<int64_t> dims, reduce;
    v1::ReduceKind kind;
    int passes_at_least;
  };
  const std::vector<Case> cases = {
      {v1::S32, {3, 70000}, {1}, v1::SUM, 2},          // rows, chunked: integer sums wrap exactly
      {v1::S64, {5000, 7}, {0}, v1::PROD, 2},          // columns
      {v1::U8, {4, 6, 5}, {0, 2}, v1::REDUCE_MAX, 1},  // scattered dimensions
      {v1::S32, {6, 4, 5}, {1}, v1::REDUCE_MIN, 1},
      {v1::F32, {1 << 20}, {0}, v1::REDUCE_MAX, 3},  // everything to one value, NaN included
      {v1::BF16, {8, 300}, {1}, v1::REDUCE_MIN, 1},
      {v1::F64, {7, 0}, {1}, v1::SUM, 1},  // empty: the identity
  };
  for (const Case& c : cases) {
    v1::TensorType in;
    in.set_dtype(c.dt);
    for (int64_t d : c.dims) in.add_dims(d);
    v1::TensorType out;
    out.set_dtype(c.dt);
    for (size_t d = 0; d < c.dims.size(); ++d) {
      if (std::find(c.reduce.begin(), c.reduce.end(), int64_t(d)) == c.reduce.end())
        out.add_dims(c.dims[d]);
    }
    v1::Node n = MakeNode("r", v1::REDUCE, out, {"a"});
    n.mutable_reduce()->set_kind(c.kind);
    for (int64_t d : c.reduce) n.mutable_reduce()->add_dims(d);
    SCOPED_TRACE(absl::StrCat(TypeString(in), " reduce ", c.kind));
    ModuleSource m;
    auto plan = m.AddReduce(n, in);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_GE(int(plan->passes.size()), c.passes_at_least);
    std::vector<char> data = RandomBytes(c.dt, NumElementsUnchecked(in), 5);
    std::vector<char> want(ByteSizeUnchecked(out));
    cpu::Reduce(in, data.data(), n.reduce(), out, want.data());
    std::vector<char> got = RunReduce(m, *plan, data, ByteSizeUnchecked(out));
    std::string where;
    EXPECT_TRUE(SameElements(c.dt, got, want, &where)) << where;
  }
}

TEST(KernelSource, FloatSumsAccumulateInChunks) {
  // 2^22 values of 1.92f sum to 8053063.5. A sequential float sum rounds
  // every addend to the sum's ulp and ends at 8278207 (2.8% off); the
  // chunked passes stay within 1e-5.
  const int64_t n = int64_t{1} << 22;
  const v1::TensorType in = MakeType(v1::F32, {n});
  v1::Node r = MakeNode("r", v1::REDUCE, MakeType(v1::F32, {}), {"a"});
  r.mutable_reduce()->set_kind(v1::SUM);
  r.mutable_reduce()->add_dims(0);
  ModuleSource m;
  auto plan = m.AddReduce(r, in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<char> data(n * 4);
  for (int64_t i = 0; i < n; ++i) {
    const float v = 1.92f;
    std::memcpy(data.data() + i * 4, &v, 4);
  }
  std::vector<char> got = RunReduce(m, *plan, data, 4);
  float sum;
  std::memcpy(&sum, got.data(), 4);
  EXPECT_NEAR(sum, double(1.92f) * n, double(1.92f) * n * 1e-5);
}

TEST(KernelSource, FloatSumsArePairwiseWhateverTheNumberOfOutputs) {
  // Every output's rounding error, against a double-precision sum of the
  // same floats, stays within twice the CPU backend's (pairwise, as numpy's)
  // plus two ulps: rows, columns, one long row, and more outputs than the
  // GPU has threads to split them over.
  struct Case {
    std::vector<int64_t> dims;
    int64_t reduce;
  };
  for (const Case& c : std::vector<Case>{
           {{1 << 20}, 0}, {{300, 5000}, 1}, {{5000, 300}, 0}, {{66000, 64}, 1}, {{3, 100}, 1}}) {
    v1::TensorType in, out;
    in.set_dtype(v1::F32);
    out.set_dtype(v1::F32);
    for (size_t d = 0; d < c.dims.size(); ++d) {
      in.add_dims(c.dims[d]);
      if (int64_t(d) != c.reduce) out.add_dims(c.dims[d]);
    }
    v1::Node r = MakeNode("r", v1::REDUCE, out, {"a"});
    r.mutable_reduce()->set_kind(v1::SUM);
    r.mutable_reduce()->add_dims(c.reduce);
    SCOPED_TRACE(TypeString(in));
    ModuleSource m;
    auto plan = m.AddReduce(r, in);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const int64_t n = NumElementsUnchecked(in), outs = NumElementsUnchecked(out);
    std::vector<float> x(n);
    std::mt19937 rng(11);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (float& v : x) v = u(rng);
    std::vector<char> data(n * 4);
    std::memcpy(data.data(), x.data(), n * 4);
    std::vector<char> got = RunReduce(m, *plan, data, outs * 4);
    std::vector<float> cpu(outs);
    cpu::Reduce(in, x.data(), r.reduce(), out, cpu.data());
    const int64_t extent = c.dims[c.reduce], stride = c.reduce == 0 ? outs : 1,
                  step = c.reduce == 0 ? 1 : extent;
    for (int64_t o = 0; o < outs; ++o) {
      double ref = 0;
      for (int64_t e = 0; e < extent; ++e) ref += x[o * step + e * stride];
      float g;
      std::memcpy(&g, got.data() + o * 4, 4);
      const double ulp = std::nextafter(float(ref), INFINITY) - float(ref);
      ASSERT_LE(std::fabs(g - ref), 2 * std::fabs(cpu[o] - ref) + 2 * ulp)
          << "output " << o << ": " << g << " vs " << ref << " (cpu " << cpu[o] << ")";
    }
  }
}

TEST(KernelSource, ArgReductionsMatchTheCpuBackend) {
  for (v1::DType dt : {v1::F32, v1::BF16, v1::S64, v1::U8}) {
    for (v1::Op op : {v1::ARGMAX, v1::ARGMIN}) {
      const v1::TensorType in = MakeType(dt, {3, 50, 4});
      v1::Node n = MakeNode("r", op, MakeType(v1::S32, {3, 4}), {"a"});
      n.mutable_arg_reduce()->set_dimension(1);
      ModuleSource m;
      auto l = m.AddArgReduce(n, in);
      ASSERT_TRUE(l.ok()) << l.status();
      SCOPED_TRACE(absl::StrCat(OpName(op), " ", DTypeName(dt)));
      CheckKernel(m, *l, {in}, n.type(), [&](auto ins, void* out) {
        cpu::ArgReduce(op == v1::ARGMAX, in, ins[0], n.arg_reduce(), n.type(), out);
      });
    }
  }
}

TEST(KernelSource, SortMatchesTheCpuBackend) {
  // Keys with NaNs, infinities and ties (small s32 values, pred); the moved
  // operand of another dtype, so a wrong order or an unstable tie shows.
  for (v1::DType dt :
       {v1::F32, v1::F64, v1::BF16, v1::F16, v1::S32, v1::S64, v1::U8, v1::PRED, v1::S8, v1::U64}) {
    for (bool descending : {false, true}) {
      for (int64_t dim : {0, 1}) {
        const v1::TensorType keys = MakeType(dt, {9, 14});
        const v1::TensorType moved = MakeType(v1::S32, {9, 14});
        v1::Node n = MakeNode("s", v1::SORT, moved, {"k", "v"});
        n.mutable_sort()->set_dimension(dim);
        n.mutable_sort()->set_descending(descending);
        n.mutable_sort()->set_result_operand(1);
        ModuleSource m;
        auto l = m.AddSort(n, keys, moved);
        ASSERT_TRUE(l.ok()) << l.status();
        SCOPED_TRACE(
            absl::StrCat("sort ", DTypeName(dt), descending ? " descending" : "", " along ", dim));
        CheckKernel(m, *l, {keys, moved}, moved, [&](auto ins, void* out) {
          cpu::Sort(keys, ins[0], moved, ins[1], n.sort(), out);
        });
      }
    }
  }
}

TEST(KernelSource, GatherAndScatterMatchTheCpuBackend) {
  // Indices: half small ([-4, 4] signed, [0, 8] unsigned: in range,
  // negative, repeated), half random bits (far out of range; a u64 past
  // int64 must clamp high, not wrap negative); u8 over an extent of 200.
  struct Case {
    v1::DType index;
    int64_t extent;
  };
  KernelBatch batch;
  int expected = 0;
  for (const Case c : {Case{v1::S32, 5}, Case{v1::U8, 200}, Case{v1::U64, 5}, Case{v1::S16, 5}}) {
    for (v1::DType dt : {v1::F32, v1::F64, v1::BF16, v1::F16, v1::S32, v1::S64, v1::U8, v1::PRED}) {
      for (int64_t axis : {0, 1}) {
        const v1::TensorType x =
            axis == 0 ? MakeType(dt, {c.extent, 3, 2}) : MakeType(dt, {3, c.extent, 2});
        const v1::TensorType idx = MakeType(c.index, {6, 7});
        const v1::TensorType picked =
            axis == 0 ? MakeType(dt, {6, 7, 3, 2}) : MakeType(dt, {3, 6, 7, 2});
        const std::string what =
            absl::StrCat(DTypeName(dt), " along ", axis, " by ", DTypeName(c.index));
        {
          v1::Node n = MakeNode("g", v1::GATHER, picked, {"x", "i"});
          n.mutable_gather()->set_axis(axis);
          auto l = batch.module().AddGather(n, x, idx);
          ASSERT_TRUE(l.ok()) << l.status();
          batch.Add(
              *l, {x, idx}, picked,
              [=](auto ins, void* out) { cpu::Gather(x, ins[0], idx, ins[1], n.gather(), out); },
              "gather " + what);
          ++expected;
        }
        for (v1::ReduceKind k :
             {v1::REDUCE_INVALID, v1::SUM, v1::PROD, v1::REDUCE_MAX, v1::REDUCE_MIN}) {
          if (dt == v1::PRED && (k == v1::SUM || k == v1::PROD)) continue;
          v1::Node n = MakeNode("s", v1::SCATTER, x, {"x", "i", "u"});
          n.mutable_scatter()->set_axis(axis);
          n.mutable_scatter()->set_combine(k);
          auto l = batch.module().AddScatter(n, x, idx);
          ASSERT_TRUE(l.ok()) << l.status();
          const v1::ScatterAttrs attrs = n.scatter();
          batch.Add(
              *l, {x, idx, picked}, x,
              [=](auto ins, void* out) {
                cpu::Scatter(x, ins[0], idx, ins[1], ins[2], attrs, out);
              },
              absl::StrCat("scatter ", v1::ReduceKind_Name(k), " ", what));
          ++expected;
        }
      }
    }
  }
  EXPECT_EQ(batch.Check(), expected);
}

TEST(KernelSource, ConvolutionsMatchTheCpuDirectLoop) {
  // NHWC/HWIO with strides, SAME-like padding, a negative pad, input and
  // kernel dilation; NCHW with feature groups; batch groups; 1-D and 3-D.
  struct Case {
    std::vector<int64_t> lhs, rhs;
    std::vector<int64_t> lhs_spec, rhs_spec, out_spec;  // (batch|out, feature|in, spatial...)
    std::vector<int64_t> strides, lo, hi, lhs_dil, rhs_dil;
    int64_t groups = 1, batch_groups = 1;
  };
  const std::vector<Case> cases = {
      {{2, 7, 6, 3},
       {3, 2, 3, 4},
       {0, 3, 1, 2},
       {3, 2, 0, 1},
       {0, 3, 1, 2},
       {2, 1},
       {1, -1},
       {1, 2},
       {1, 2},
       {2, 1}},
      {{2, 4, 5, 5},
       {6, 2, 2, 3},
       {0, 1, 2, 3},
       {0, 1, 2, 3},
       {0, 1, 2, 3},
       {1, 1},
       {0, 1},
       {0, 1},
       {1, 1},
       {1, 1},
       2},
      {{4, 3, 5, 5},
       {6, 3, 2, 2},
       {0, 1, 2, 3},
       {0, 1, 2, 3},
       {1, 0, 3, 2},
       {1, 2},
       {0, 0},
       {1, 0},
       {1, 1},
       {1, 1},
       1,
       2},
      {{3, 10, 2}, {3, 2, 4}, {0, 2, 1}, {2, 1, 0}, {0, 2, 1}, {2}, {1}, {1}, {1}, {1}},
      {{1, 5, 4, 6, 2},
       {2, 2, 3, 2, 3},
       {0, 4, 1, 2, 3},
       {4, 3, 0, 1, 2},
       {0, 4, 1, 2, 3},
       {1, 2, 1},
       {0, 1, 0},
       {0, 0, 1},
       {1, 1, 2},
       {1, 1, 1}},
  };
  KernelBatch batch;
  int expected = 0;
  for (const Case& c : cases) {
    for (v1::DType dt : {v1::F32, v1::F64, v1::BF16, v1::F16, v1::S32, v1::U8, v1::S64}) {
      v1::TensorType lt, rt;
      lt.set_dtype(dt);
      rt.set_dtype(dt);
      for (int64_t d : c.lhs) lt.add_dims(d);
      for (int64_t d : c.rhs) rt.add_dims(d);
      v1::Node n = MakeNode("c", v1::CONVOLUTION, {}, {"x", "k"});
      v1::ConvolutionAttrs& a = *n.mutable_convolution();
      a.set_input_batch_dimension(c.lhs_spec[0]);
      a.set_input_feature_dimension(c.lhs_spec[1]);
      a.set_kernel_output_feature_dimension(c.rhs_spec[0]);
      a.set_kernel_input_feature_dimension(c.rhs_spec[1]);
      a.set_output_batch_dimension(c.out_spec[0]);
      a.set_output_feature_dimension(c.out_spec[1]);
      for (size_t i = 2; i < c.lhs_spec.size(); ++i) {
        a.add_input_spatial_dimensions(c.lhs_spec[i]);
        a.add_kernel_spatial_dimensions(c.rhs_spec[i]);
        a.add_output_spatial_dimensions(c.out_spec[i]);
      }
      for (size_t i = 0; i < c.strides.size(); ++i) {
        a.add_window_strides(c.strides[i]);
        a.add_padding_low(c.lo[i]);
        a.add_padding_high(c.hi[i]);
        a.add_lhs_dilation(c.lhs_dil[i]);
        a.add_rhs_dilation(c.rhs_dil[i]);
      }
      a.set_feature_group_count(c.groups);
      a.set_batch_group_count(c.batch_groups);
      auto t = InferType(n, {&lt, &rt});
      ASSERT_TRUE(t.ok()) << t.status();
      *n.mutable_type() = *t;
      auto l = batch.module().AddConvolution(n, lt, rt);
      ASSERT_TRUE(l.ok()) << l.status();
      const v1::ConvolutionAttrs attrs = a;
      const v1::TensorType ot = *t;
      batch.Add(
          *l, {lt, rt}, ot,
          [=](auto ins, void* out) {
            cpu::ConvolutionDirect(lt, ins[0], rt, ins[1], attrs, ot, out);
          },
          absl::StrCat("convolution ", expected / 7, " ", DTypeName(dt)));
      ++expected;
    }
  }
  EXPECT_EQ(batch.Check(), expected);
}

TEST(KernelSource, ShardSliceAndSwapMajorMoveTheRightBlocks) {
  const v1::TensorType in = MakeType(v1::S32, {3, 8, 2});
  v1::Node n = MakeNode("s", v1::SHARD_SLICE, MakeType(v1::S32, {3, 2, 2}), {"a"});
  n.mutable_collective()->set_dimension(1);
  for (int64_t block = 0; block < 4; ++block) {
    ModuleSource m;
    auto l = m.AddShardSlice(n, in, 4);
    ASSERT_TRUE(l.ok()) << l.status();
    CheckKernel(
        m, *l, {in}, n.type(),
        [&](auto ins, void* out) {
          auto* src = static_cast<const int32_t*>(ins[0]);
          auto* dst = static_cast<int32_t*>(out);
          for (int o = 0; o < 3; ++o)
            for (int j = 0; j < 2; ++j)
              for (int k = 0; k < 2; ++k)
                dst[(o * 2 + j) * 2 + k] = src[(o * 8 + block * 2 + j) * 2 + k];
        },
        block);
  }
  for (bool to_rank_major : {true, false}) {
    const int64_t outer = 3, k = 4, piece = 5;
    ModuleSource m;
    KernelLaunch l = m.AddSwapMajor(v1::F32, outer, k, piece, to_rank_major);
    const v1::TensorType t = MakeType(v1::F32, {outer * k * piece});
    CheckKernel(m, l, {t}, t, [&](auto ins, void* out) {
      auto* src = static_cast<const float*>(ins[0]);
      auto* dst = static_cast<float*>(out);
      for (int64_t o = 0; o < outer; ++o)
        for (int64_t r = 0; r < k; ++r)
          for (int64_t j = 0; j < piece; ++j) {
            const int64_t a = (o * k + r) * piece + j, b = (r * outer + o) * piece + j;
            if (to_rank_major)
              dst[b] = src[a];
            else
              dst[a] = src[b];
          }
    });
  }
}

TEST(KernelSource, IntegerGemmWrapsLikeTheCpuBackend) {
  for (v1::DType dt : {v1::S32, v1::S64, v1::U8, v1::S8, v1::U16, v1::U32, v1::U64}) {
    const int64_t b = 2, m = 5, k = 7, n = 3;
    const v1::TensorType lt = MakeType(dt, {b, m, k}), rt = MakeType(dt, {b, k, n}),
                         ot = MakeType(dt, {b, m, n});
    v1::DotGeneralAttrs a;
    a.add_lhs_batch(0);
    a.add_rhs_batch(0);
    a.add_lhs_contracting(2);
    a.add_rhs_contracting(1);
    ModuleSource m_src;
    KernelLaunch l = m_src.AddGemm(dt, b, m, n, k);
    SCOPED_TRACE(DTypeName(dt));
    CheckKernel(m_src, l, {lt, rt}, ot,
                [&](auto ins, void* out) { cpu::DotGeneral(lt, ins[0], rt, ins[1], a, ot, out); });
  }
}

TEST(KernelSource, IdenticalKernelsAreEmittedOnce) {
  ModuleSource m;
  const v1::TensorType t = MakeType(v1::F32, {16});
  auto a = m.AddFusion(OneNode(MakeNode("y", v1::EXP, t, {"a"}), 1), {t});
  auto b = m.AddFusion(OneNode(MakeNode("z", v1::EXP, t, {"b"}), 1), {t});
  auto c = m.AddFusion(OneNode(MakeNode("z", v1::LOG, t, {"b"}), 1), {t});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->kernel, b->kernel);
  EXPECT_NE(a->kernel, c->kernel);
  EXPECT_EQ(m.num_kernels(), 2);
}

#ifdef TESSEL_HAVE_CUDA
TEST(KernelCompiler, CachesByContentInMemoryAndOnDisk) {
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("tessel-kcache-", getpid());
  fs::remove_all(dir);
  ModuleSource m;
  const v1::TensorType t = MakeType(v1::F32, {16});
  ASSERT_TRUE(m.AddFusion(OneNode(MakeNode("y", v1::TANH, t, {"a"}), 1), {t}).ok());
  {
    KernelCompiler c({.arch = "sm_90", .cache_dir = dir.string()});
    auto first = c.Compile(m.source());
    ASSERT_TRUE(first.ok()) << first.status();
    auto again = c.Compile(m.source());
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(first->get(), again->get());
    EXPECT_EQ(c.stats().compiled, 1);
    EXPECT_EQ(c.stats().memory_hits, 1);
  }
  {
    // A new process (here: a new compiler) finds the code on disk.
    KernelCompiler c({.arch = "sm_90", .cache_dir = dir.string()});
    auto code = c.Compile(m.source());
    ASSERT_TRUE(code.ok());
    EXPECT_EQ(c.stats().compiled, 0);
    EXPECT_EQ(c.stats().disk_hits, 1);
    // Another architecture is another entry.
    KernelCompiler ptx({.arch = "compute_80", .cache_dir = dir.string()});
    auto text = ptx.Compile(m.source());
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_NE((*text)->find(".entry k0"), std::string::npos);
    EXPECT_EQ(ptx.stats().compiled, 1);
  }
  // An entry whose stored source differs is not used.
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string data;
    {
      std::ifstream f(e.path(), std::ios::binary);
      data.assign(std::istreambuf_iterator<char>(f), {});
    }
    const size_t at = data.find("tanhf");
    ASSERT_NE(at, std::string::npos);
    data[at] = 'T';
    std::ofstream(e.path(), std::ios::binary | std::ios::trunc) << data;
  }
  KernelCompiler c({.arch = "sm_90", .cache_dir = dir.string()});
  ASSERT_TRUE(c.Compile(m.source()).ok());
  EXPECT_EQ(c.stats().compiled, 1);
  EXPECT_EQ(c.stats().disk_hits, 0);
  fs::remove_all(dir);
}

TEST(KernelCompiler, BadSourceIsAnErrorCarryingNvrtcsLog) {
  KernelCompiler c({});
  auto r = c.Compile("extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("undefined_name"), std::string::npos) << r.status();
  EXPECT_NE(r.status().message().find("sm_90"), std::string::npos) << r.status();
}
#endif

}  // namespace
}  // namespace tessel::cuda
