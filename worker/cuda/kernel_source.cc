#include "worker/cuda/kernel_source.h"
#include "worker/cuda/kernel_dtypes.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/fused_loop.h"
#include "worker/scalar_expr.h"
#include "worker/vector_math_source.h"

namespace tessel::cuda {
namespace {

using absl::StrCat;

// Valid CUDA C++ (NVRTC defines __CUDACC__) and valid host C++.
constexpr char kPrelude[] = R"(// Tessel generated kernels
typedef long long i64;
typedef unsigned long long u64;
typedef int i32;
typedef unsigned u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
typedef short i16;
#ifdef __CUDACC__
#define TD static __device__ __forceinline__
#define TESSEL_KERNEL extern "C" __global__ void
TD u32 f2u(float f) { return __float_as_uint(f); }
TD float u2f(u32 u) { return __uint_as_float(u); }
TD double u2d(u64 u) { return __longlong_as_double((i64)u); }
TD u64 d2u(double d) { return (u64)__double_as_longlong(d); }
TD i64 tid() { return (i64)blockIdx.x * blockDim.x + threadIdx.x; }
TD i64 nthreads() { return (i64)blockDim.x * gridDim.x; }
#else
#include <math.h>
#include <string.h>
#define TD static inline
#define TESSEL_KERNEL extern "C" void
TD u32 f2u(float f) { u32 u; memcpy(&u, &f, 4); return u; }
TD float u2f(u32 u) { float f; memcpy(&f, &u, 4); return f; }
TD double u2d(u64 u) { double d; memcpy(&d, &u, 8); return d; }
TD u64 d2u(double d) { u64 u; memcpy(&u, &d, 8); return u; }
TD i64 tid() { return 0; }
TD i64 nthreads() { return 1; }
#endif
struct TesselParams { void* p[64]; i64 s[4]; };
#define TESSEL_LOOP(n) for (i64 i = tid(); i < (i64)(n); i += nthreads())
// Fused elementwise loops take TESSEL_UNROLL elements per thread and pass:
// every input element is loaded before any output is stored, so the loads
// of one pass are in flight together (outputs may alias inputs: a donated
// buffer is updated in place).
#define TESSEL_UNROLL 4
#define TESSEL_UNROLLED(n, ...)                                    \
  _Pragma("unroll") for (int u = 0; u < TESSEL_UNROLL; ++u) {        \
    const i64 i = base + u * nthreads();                           \
    if (i < (i64)(n)) { __VA_ARGS__ }                              \
  }

TD float ld_bf16(u16 h) { return u2f((u32)h << 16); }
TD u16 st_bf16(float f) {
  u32 u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}
TD float ld_f16(u16 h) {
  u32 sign = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return u2f(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return u2f(sign);
    float v = (float)m * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return u2f(sign | ((e + 112) << 23) | (m << 13));
}
TD u16 st_f16(float f) {
  u32 u = f2u(f);
  u16 sign = (u16)((u >> 16) & 0x8000u);
  u32 a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (u16)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (u16)(sign | 0x7c00u);
  if (a < 0x38800000u) {
    float v = u2f(a) * 16777216.0f;
    u32 m = (u32)v;
    float frac = v - (float)m;
    if (frac > 0.5f || (frac == 0.5f && (m & 1u))) ++m;
    return (u16)(sign | m);
  }
  u32 r = a + 0xfffu + ((a >> 13) & 1u);
  return (u16)(sign | ((r - 0x38000000u) >> 13));
}
// The storage bits of an f16 or bf16 compute value (one that came from
// storage, so exact), NaN payloads kept, for bitcasts.
TD u16 bits_bf16(float f) { return (u16)(f2u(f) >> 16); }
TD u16 bits_f16(float f) {
  u32 u = f2u(f), a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (u16)(((u >> 16) & 0x8000u) | 0x7c00u | ((a >> 13) & 0x3ffu));
  return st_f16(f);
}
// Round to odd first, so that the later rounding to f16/bf16 is one rounding of the exact value.
TD float odd_f(double d) {
  float f = (float)d;
  if (!(d - d == 0.0) || (double)f == d) return f;
  if (fabs((double)f) > fabs(d)) f = nextafterf(f, 0.0f);
  return u2f(f2u(f) | 1u);
}
TD double odd_m(u64 m, bool neg) {
  if (m < (1ull << 53)) return neg ? -(double)m : (double)m;
  int k = 0;
  while ((m >> k) >= (1ull << 53)) ++k;
  bool sticky = (m & ((1ull << k) - 1)) != 0;
  m = (m >> k) | (u64)sticky;
  double r = ldexp((double)m, k);
  return neg ? -r : r;
}
TD double odd_d(i64 v) { return odd_m(v < 0 ? (u64)0 - (u64)v : (u64)v, v < 0); }
template <typename T> TD T maxp(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> TD T minp(T a, T b) { return (a != a || a < b) ? a : b; }
template <typename T, typename F> TD T sat(F x, T lo, T hi) {
  if (x != x) return (T)0;
  if (x <= (F)lo) return lo;
  if (x >= (F)hi) return hi;
  return (T)x;
}
template <typename C, typename U> TD C ipow(C b, C e) {
  if (e < (C)0) return b == (C)1 ? (C)1 : b == (C)-1 ? ((e & 1) ? (C)-1 : (C)1) : (C)0;
  U r = 1, x = (U)b, k = (U)e;
  while (k) {
    if (k & 1) r = (U)(1u * r * x);  // unsigned: a narrow U is promoted to int otherwise
    x = (U)(1u * x * x);
    k >>= 1;
  }
  return (C)r;
}
)";

// --- elementwise expressions --------------------------------------------------

// How CUDA C spells the scalar table's types and helpers
// (worker/scalar_expr.h): the prelude's maxp, minp and ipow<C, U>.
const worker::ScalarDialect kDialect{
    .compute_type = [](v1::DType dt) { return Compute(dt); },
    .unsigned_type = [](v1::DType dt) { return UnsignedOf(dt); },
    .math = [](v1::DType dt, absl::string_view name) { return Fn(dt, std::string(name)); },
    .helper =
        [](v1::DType dt, absl::string_view name) {
          return name == "ipow" ? StrCat("ipow<", Compute(dt), ", ", UnsignedOf(dt), ">")
                                : StrCat(name, "p");
        },
};

absl::StatusOr<std::string> Elementwise(v1::Op op, v1::DType dt,
                                        absl::Span<const std::string> args) {
  absl::StatusOr<std::string> e = worker::ScalarExpr(op, dt, args, kDialect);
  if (!e.ok()) return Annotate(e.status(), "cuda codegen: ");
  return e;
}

absl::StatusOr<std::string> CompareSymbol(v1::CompareDirection d) {
  switch (d) {
    case v1::EQ: return "==";
    case v1::NE: return "!=";
    case v1::LT: return "<";
    case v1::LE: return "<=";
    case v1::GT: return ">";
    case v1::GE: return ">=";
    default: return absl::InvalidArgumentError("cuda codegen: invalid compare direction");
  }
}

// --- index arithmetic -----------------------------------------------------------

std::vector<int64_t> Strides(const google::protobuf::RepeatedField<int64_t>& dims) {
  std::vector<int64_t> s(dims.size(), 1);
  for (int i = dims.size() - 2; i >= 0; --i) s[i] = s[i + 1] * dims[i + 1];
  return s;
}

// "const i64 <pfx>d = ...;" for every dimension d of `dims`, from linear index `lin`.
std::string Coords(const google::protobuf::RepeatedField<int64_t>& dims, const std::string& lin,
                   const std::string& pfx) {
  std::string out = StrCat("    i64 t_", pfx, " = ", lin, ";\n");
  for (int d = dims.size() - 1; d >= 0; --d) {
    absl::StrAppend(&out, "    const i64 ", pfx, d, " = t_", pfx, " % ", dims[d], "; t_", pfx,
                    " /= ", dims[d], ";\n");
  }
  return out;
}

std::string Kernel(const std::string& decls, const std::string& loop_extent,
                   const std::string& body) {
  return StrCat("{\n", decls, "  TESSEL_LOOP(", loop_extent, ") {\n", body, "  }\n}\n");
}

std::string PtrDecl(const std::string& type, const std::string& name, int index, bool is_const) {
  return absl::StrFormat("  %s%s* %s = (%s%s*)a.p[%d];\n", is_const ? "const " : "", type, name,
                         is_const ? "const " : "", type, index);
}

}  // namespace

const std::string& KernelPrelude() {
  static const std::string* prelude = new std::string(
      StrCat(kPrelude, "#define TM TD\n#define tm_bits f2u\n#define tm_float u2f\n",
             worker::kVectorMathFma, worker::kVectorMathSource, "#undef TM_FMA\n#undef TM\n"));
  return *prelude;
}

std::string KernelName(int index) { return StrCat("k", index); }

KernelLaunch ModuleSource::Add(const std::string& body, int64_t elements) {
  int index = 0;
  while (index < int(bodies_.size()) && bodies_[index] != body) ++index;
  if (index == int(bodies_.size())) bodies_.push_back(body);
  return KernelLaunch{KernelName(index), index, elements};
}

std::string ModuleSource::source() const {
  std::string out = KernelPrelude();
  for (size_t i = 0; i < bodies_.size(); ++i) {
    absl::StrAppend(&out, "\nTESSEL_KERNEL ", KernelName(int(i)), "(TesselParams a) ", bodies_[i]);
  }
  return out;
}

absl::StatusOr<KernelLaunch> ModuleSource::AddFusion(
    const v1::Fusion& fusion, const std::vector<v1::TensorType>& input_types) {
  if (fusion.inputs_size() + fusion.outputs_size() > kMaxKernelPointers) {
    return absl::UnimplementedError(StrCat(
        "cuda codegen: a fusion of ", fusion.inputs_size(), " inputs and ", fusion.outputs_size(),
        " outputs exceeds ", kMaxKernelPointers, " kernel arguments"));
  }
  const int64_t elements = cpu::FusionElements(fusion);
  absl::flat_hash_map<std::string, std::string> var;  // value -> compute-typed variable
  absl::flat_hash_map<std::string, v1::DType> dtype;
  // Values that are the same for every element (one-element inputs, scalar
  // constants, and what is computed from them alone) are computed once,
  // before the loop: a one-element output may be one of them.
  absl::flat_hash_set<std::string> uniform;
  // Per-element inputs are loaded into `staged` (one register array each)
  // by the first pass of an unrolled iteration, and read from it by `body`.
  std::string decls, staged, loads, body;
  for (int i = 0; i < fusion.inputs_size(); ++i) {
    const v1::DType dt = input_types[i].dtype();
    const std::string p = StrCat("in", i), v = StrCat("x", i);
    decls += PtrDecl(Storage(dt), p, i, true);
    if (NumElementsUnchecked(input_types[i]) != elements) {
      absl::StrAppend(&decls, "  const ", Compute(dt), " ", v, " = ", Load(dt, p + "[0]"), ";\n");
      uniform.insert(fusion.inputs(i));
    } else {
      absl::StrAppend(&staged, "    ", Compute(dt), " ", v, "_[TESSEL_UNROLL];\n");
      absl::StrAppend(&loads, " ", v, "_[u] = ", Load(dt, p + "[i]"), ";");
      absl::StrAppend(&body, "    const ", Compute(dt), " ", v, " = ", v, "_[u];\n");
    }
    var[fusion.inputs(i)] = v;
    dtype[fusion.inputs(i)] = dt;
  }
  for (int k = 0; k < fusion.nodes_size(); ++k) {
    const v1::Node& n = fusion.nodes(k);
    const v1::DType dt = n.type().dtype();
    const std::string v = StrCat("v", k);
    std::vector<std::string> args;
    for (const std::string& o : n.operands()) {
      auto it = var.find(o);
      if (it == var.end()) {
        return absl::InternalError(StrCat("fusion node '", n.name(), "' reads '", o,
                                          "', which is neither an input nor an earlier node"));
      }
      args.push_back(it->second);
    }
    std::string expr;
    bool hoist = false;
    switch (n.op()) {
      case v1::CONSTANT: {
        const v1::ConstantAttrs& c = n.constant();
        if (c.has_iota()) {
          int64_t inner = 1;
          for (int d = c.iota().dimension() + 1; d < n.type().dims_size(); ++d)
            inner *= n.type().dims(d);
          expr = Convert(v1::S64, dt,
                         absl::StrFormat("(i / %dll) %% %dll + a.s[0]", inner,
                                         n.type().dims(c.iota().dimension())));
        } else if (c.has_fill() || NumElementsUnchecked(n.type()) == 1) {
          char one[8] = {};
          if (c.has_fill()) {
            cpu::FillKernel(dt, c.fill(), one, 1);
          } else {
            cpu::MaterializeLiteral(n, one);
          }
          expr = Literal(dt, one);
          hoist = true;
        } else {
          return absl::InternalError(StrCat("fusion holds a non-scalar literal '", n.name(), "'"));
        }
        break;
      }
      case v1::BROADCAST_IN_DIM: expr = args[0]; break;
      case v1::COMPARE: {
        auto sym = CompareSymbol(n.compare().direction());
        if (!sym.ok()) return sym.status();
        expr = StrCat(args[0], " ", *sym, " ", args[1]);
        break;
      }
      case v1::SELECT: expr = StrCat(args[0], " ? ", args[1], " : ", args[2]); break;
      case v1::CONVERT:
        expr = n.convert().bitcast() ? Bitcast(dtype[n.operands(0)], dt, args[0])
                                     : Convert(dtype[n.operands(0)], dt, args[0]);
        break;
      default: {
        if (!IsElementwise(n.op())) {
          return absl::InternalError(
              StrCat("fusion holds non-elementwise node '", n.name(), "' (", OpName(n.op()), ")"));
        }
        absl::StatusOr<std::string> e = Elementwise(n.op(), dt, args);
        if (!e.ok()) return e.status();
        expr = n.op() == v1::CLAMP ? *e : Round(dt, *e);
      }
    }
    if (!hoist && !n.constant().has_iota() && n.operands_size() > 0) {
      hoist =
          absl::c_all_of(n.operands(), [&](const std::string& o) { return uniform.contains(o); });
    }
    if (hoist) uniform.insert(n.name());
    absl::StrAppend(hoist ? &decls : &body, hoist ? "  const " : "    const ", Compute(dt), " ", v,
                    " = ", expr, ";\n");
    var[n.name()] = v;
    dtype[n.name()] = dt;
  }
  // Outputs the size of the fusion are written per element; one-element ones once.
  absl::flat_hash_map<std::string, int64_t> node_elements;
  for (const v1::Node& n : fusion.nodes()) node_elements[n.name()] = NumElementsUnchecked(n.type());
  std::string once;
  for (int j = 0; j < fusion.outputs_size(); ++j) {
    const std::string& o = fusion.outputs(j);
    if (!node_elements.contains(o)) {
      return absl::InternalError(StrCat("fusion output '", o, "' is not a fusion node"));
    }
    const v1::DType dt = dtype[o];
    const std::string p = StrCat("out", j);
    decls += PtrDecl(Storage(dt), p, fusion.inputs_size() + j, false);
    if (node_elements[o] == elements) {
      absl::StrAppend(&body, "    ", p, "[i] = ", Store(dt, var[o]), ";\n");
    } else {
      if (!uniform.contains(o)) {
        return absl::InternalError(StrCat("fusion output '", o, "' has ", node_elements[o],
                                          " elements, the fusion ", elements,
                                          ", and it varies by element"));
      }
      absl::StrAppend(&once, "  if (tid() == 0) ", p, "[0] = ", Store(dt, var[o]), ";\n");
    }
  }
  // A size-0 fusion still writes its one-element outputs: one thread runs.
  const std::string n = StrCat(elements);
  const std::string kernel =
      StrCat("{\n", decls, once, "  for (i64 base = tid(); base < (i64)(", n,
             "); base += TESSEL_UNROLL * nthreads()) {\n", staged, "    TESSEL_UNROLLED(", n, ",",
             loads, ")\n    TESSEL_UNROLLED(", n, ",\n", body, "    )\n  }\n}\n");
  return Add(kernel, once.empty() ? elements : std::max<int64_t>(elements, 1));
}

absl::StatusOr<KernelLaunch> ModuleSource::AddLayout(
    const v1::Node& n, const std::vector<v1::TensorType>& operand_types) {
  const v1::TensorType& t = n.type();
  const int64_t elements = NumElementsUnchecked(t);
  const std::string e = Bits(DTypeSize(t.dtype()));
  std::string decls, body = Coords(t.dims(), "i", "c");
  const int nin = n.op() == v1::CONCATENATE ? int(operand_types.size()) : 1;
  for (int k = 0; k < nin; ++k) decls += PtrDecl(e, StrCat("in", k), k, true);
  if (n.op() == v1::PAD) decls += PtrDecl(e, "padv", 1, true);
  decls += PtrDecl(e, "out", n.op() == v1::PAD ? 2 : nin, false);
  const v1::TensorType& in = operand_types[0];
  const std::vector<int64_t> is = Strides(in.dims());
  std::string src = "0";
  switch (n.op()) {
    case v1::BROADCAST_IN_DIM: {
      const auto& bd = n.broadcast_in_dim().broadcast_dimensions();
      for (int k = 0; k < in.dims_size(); ++k) {
        if (in.dims(k) != 1) absl::StrAppend(&src, " + c", bd[k], " * ", is[k]);
      }
      break;
    }
    case v1::TRANSPOSE: {
      const auto& perm = n.transpose().permutation();
      for (int j = 0; j < perm.size(); ++j) absl::StrAppend(&src, " + c", j, " * ", is[perm[j]]);
      break;
    }
    case v1::SLICE: {
      const v1::SliceAttrs& s = n.slice();
      for (int d = 0; d < in.dims_size(); ++d) {
        const int64_t stride = s.strides().empty() ? 1 : s.strides(d);
        absl::StrAppend(&src, " + (", s.start(d), " + c", d, " * ", stride, ") * ", is[d]);
      }
      break;
    }
    case v1::REVERSE: {
      std::vector<bool> reversed(in.dims_size(), false);
      for (int64_t d : n.reverse().dimensions()) reversed[d] = true;
      for (int d = 0; d < in.dims_size(); ++d) {
        if (reversed[d]) {
          absl::StrAppend(&src, " + (", in.dims(d) - 1, " - c", d, ") * ", is[d]);
        } else {
          absl::StrAppend(&src, " + c", d, " * ", is[d]);
        }
      }
      break;
    }
    case v1::PAD: {
      const v1::PadAttrs& p = n.pad();
      std::string cond = "false";
      for (int d = 0; d < in.dims_size(); ++d) {
        const int64_t step = 1 + (p.interior().empty() ? 0 : p.interior(d));
        absl::StrAppend(&body, "    const i64 q", d, " = c", d, " - (", p.low(d), ");\n");
        absl::StrAppend(&cond, " || q", d, " < 0 || q", d, " % ", step, " != 0 || q", d, " / ",
                        step, " >= ", in.dims(d));
        absl::StrAppend(&src, " + q", d, " / ", step, " * ", is[d]);
      }
      absl::StrAppend(&body, "    out[i] = (", cond, ") ? padv[0] : in0[", src, "];\n");
      return Add(Kernel(decls, StrCat(elements), body), elements);
    }
    case v1::CONCATENATE: {
      const int64_t dim = n.concatenate().dimension();
      int64_t offset = 0;
      for (int k = 0; k < nin; ++k) {
        const std::vector<int64_t> ks = Strides(operand_types[k].dims());
        std::string ksrc = "0";
        for (int d = 0; d < t.dims_size(); ++d) {
          absl::StrAppend(&ksrc, " + ",
                          d == dim ? absl::StrFormat("(c%d - %d)", d, offset) : StrCat("c", d),
                          " * ", ks[d]);
        }
        const int64_t end = offset + operand_types[k].dims(dim);
        absl::StrAppend(&body, k == 0 ? "    " : "    else ",
                        k + 1 < nin ? absl::StrFormat("if (c%d < %d) ", dim, end) : "",
                        "out[i] = in", k, "[", ksrc, "];\n");
        offset = end;
      }
      return Add(Kernel(decls, StrCat(elements), body), elements);
    }
    default:
      return absl::UnimplementedError(
          StrCat("cuda codegen: ", OpName(n.op()), " is not a layout op"));
  }
  absl::StrAppend(&body, "    out[i] = in0[", src, "];\n");
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

namespace {

// The identity of reduce `n`'s kind in accumulator type `acc`: 0 and 1,
// and -inf/+inf (floats) or the type's range (integers) for max and min.
absl::StatusOr<std::string> ReduceIdentity(const v1::Node& n, v1::DType dt,
                                           const std::string& acc) {
  const v1::ReduceKind kind = n.reduce().kind();
  switch (kind) {
    case v1::SUM: return StrCat("(", acc, ")0");
    case v1::PROD: return StrCat("(", acc, ")1");
    case v1::REDUCE_MAX:
    case v1::REDUCE_MIN: {
      const bool mx = kind == v1::REDUCE_MAX;
      if (dt == v1::F64) return mx ? "-u2d(0x7ff0000000000000ull)" : "u2d(0x7ff0000000000000ull)";
      if (IsFloat(dt)) return mx ? "-u2f(0x7f800000u)" : "u2f(0x7f800000u)";
      return mx ? IntRange(dt).first : IntRange(dt).second;
    }
    default:
      return absl::InvalidArgumentError(
          StrCat("cuda codegen: reduce '", n.name(), "' has no kind"));
  }
}

// Chunks per output of each pass of a reduce of `outs` outputs over
// `extent` elements each, the last pass's 1. Pairwise (float sums): each
// thread of the first pass sums a run of at most 128 in 8 interleaved
// lanes, and the passes after halve the partials, so the rounding error
// grows as O(log n) ulps whatever the number of outputs. Otherwise: enough
// threads to fill a GPU, at least 32 elements per thread; later passes
// fold up to 256 chunks each.
std::vector<int64_t> ReduceChunks(bool pairwise, int64_t outs, int64_t extent) {
  constexpr int64_t kThreads = int64_t{1} << 18;
  constexpr int64_t kRun = 128;
  std::vector<int64_t> chunks = {1};
  if (pairwise) {
    if (outs > 0 && extent > kRun) chunks[0] = (extent + kRun - 1) / kRun;
    while (chunks.back() > 1) chunks.push_back((chunks.back() + 1) / 2);
  } else {
    if (outs > 0 && outs < kThreads / 4 && extent > 32) {
      chunks[0] = std::max<int64_t>(1, std::min((kThreads + outs - 1) / outs, (extent + 31) / 32));
    }
    while (chunks.back() > 1) chunks.push_back((chunks.back() + 255) / 256);
  }
  if (chunks.size() > 1) chunks.back() = 1;
  return chunks;
}

}  // namespace

absl::StatusOr<ReducePlan> ModuleSource::AddReduce(const v1::Node& n, const v1::TensorType& in) {
  const v1::DType dt = in.dtype();
  const v1::ReduceKind kind = n.reduce().kind();
  if (dt == v1::PRED) return absl::UnimplementedError("cuda codegen: reduce of pred");
  const int rank = in.dims_size();
  std::vector<bool> reduced(rank, false);
  for (int64_t d : n.reduce().dims()) reduced[d] = true;
  int64_t outs = 1, extent = 1;
  google::protobuf::RepeatedField<int64_t> kept_dims, red_dims;
  std::vector<int64_t> kept_strides, red_strides;
  const std::vector<int64_t> is = Strides(in.dims());
  for (int d = 0; d < rank; ++d) {
    if (reduced[d]) {
      extent *= in.dims(d);
      red_dims.Add(in.dims(d));
      red_strides.push_back(is[d]);
    } else {
      outs *= in.dims(d);
      kept_dims.Add(in.dims(d));
      kept_strides.push_back(is[d]);
    }
  }
  // Accumulators: floats in their compute type, integer sums and products in
  // 64-bit unsigned (modular, so truncating at the end equals wrapping).
  const bool int_arith = IsInteger(dt) && (kind == v1::SUM || kind == v1::PROD);
  const std::string acc = int_arith ? "u64" : Compute(dt);
  TESSEL_ASSIGN_OR_RETURN(const std::string ident, ReduceIdentity(n, dt, acc));
  auto combine = [&](const std::string& x) {
    switch (kind) {
      case v1::SUM: return StrCat("acc + (", acc, ")(", x, ")");
      case v1::PROD: return StrCat("acc * (", acc, ")(", x, ")");
      case v1::REDUCE_MAX: return StrCat("maxp(acc, (", acc, ")(", x, "))");
      default: return StrCat("minp(acc, (", acc, ")(", x, "))");
    }
  };
  // Float sums are pairwise, as numpy's and the CPU backend's (ReduceChunks).
  const bool pairwise = kind == v1::SUM && IsFloat(dt);
  const std::vector<int64_t> chunks = ReduceChunks(pairwise, outs, extent);

  ReducePlan plan;
  plan.accumulator_bytes = int_arith ? 8 : (dt == v1::F64 ? 8 : IsFloat(dt) ? 4 : DTypeSize(dt));
  const bool leading = [&] {  // reduced dimensions lead: columns
    int d = 0;
    while (d < rank && reduced[d]) ++d;
    for (int e = d; e < rank; ++e)
      if (reduced[e]) return false;
    return d > 0 && d < rank;
  }();
  const bool trailing = [&] {
    int d = rank;
    while (d > 0 && reduced[d - 1]) --d;
    for (int e = 0; e < d; ++e)
      if (reduced[e]) return false;
    return true;
  }();
  for (size_t pass = 0; pass < chunks.size(); ++pass) {
    const bool first = pass == 0, last = pass + 1 == chunks.size();
    const int64_t c = chunks[pass];
    const int64_t r_extent = first ? extent : chunks[pass - 1];
    std::string decls = PtrDecl(first ? Storage(dt) : acc, "in", 0, true);
    decls += PtrDecl(last ? Storage(dt) : acc, "out", 1, false);
    std::string body;
    std::string src;
    if (first && leading) {
      absl::StrAppend(&body, "    const i64 o = i % ", outs, ", c = i / ", outs, ";\n");
      src = StrCat("r * ", outs, " + o");
    } else {
      absl::StrAppend(&body, "    const i64 o = i / ", c, ", c = i % ", c, ";\n");
      if (!first || trailing) {
        src = StrCat("o * ", r_extent, " + r");
      } else {
        body += Coords(kept_dims, "o", "k");
        std::string base = "0";
        for (size_t k = 0; k < kept_strides.size(); ++k)
          absl::StrAppend(&base, " + k", k, " * ", kept_strides[k]);
        absl::StrAppend(&body, "    const i64 base = ", base, ";\n");
        src = "base";
        for (size_t k = 0; k < red_strides.size(); ++k)
          absl::StrAppend(&src, " + j", k, " * ", red_strides[k]);
      }
    }
    const std::string x = first ? Load(dt, StrCat("in[", src, "]")) : StrCat("in[", src, "]");
    if (pairwise && first) {
      absl::StrAppend(&body, "    ", acc, " lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};\n    i64 lk = 0;\n",
                      "    for (i64 r = c; r < ", r_extent, "; r += ", c, ", ++lk) {\n");
      if (!leading && !trailing) body += Coords(red_dims, "r", "j");
      absl::StrAppend(&body, "      lane[lk & 7] = lane[lk & 7] + (", acc, ")(", x, ");\n    }\n",
                      "    ", acc, " acc = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ",
                      "((lane[4] + lane[5]) + (lane[6] + lane[7]));\n");
    } else {
      absl::StrAppend(&body, "    ", acc, " acc = ", ident, ";\n    for (i64 r = c; r < ", r_extent,
                      "; r += ", c, ") {\n");
      if (first && !leading && !trailing) body += Coords(red_dims, "r", "j");
      absl::StrAppend(&body, "      acc = ", combine(x), ";\n    }\n");
    }
    if (last) {
      absl::StrAppend(&body, "    out[o] = ", Store(dt, StrCat("(", Compute(dt), ")acc")), ";\n");
    } else {
      absl::StrAppend(&body, "    out[o * ", c, " + c] = acc;\n");
      plan.partial_elements.push_back(outs * c);
    }
    plan.passes.push_back(Add(Kernel(decls, StrCat(outs * c), body), outs * c));
  }
  return plan;
}

absl::StatusOr<KernelLaunch> ModuleSource::AddArgReduce(const v1::Node& n,
                                                        const v1::TensorType& in) {
  const v1::DType dt = in.dtype();
  if (dt == v1::PRED) return absl::UnimplementedError("cuda codegen: argmax/argmin of pred");
  const int64_t dim = n.arg_reduce().dimension();
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= in.dims(d);
  for (int d = dim + 1; d < in.dims_size(); ++d) inner *= in.dims(d);
  const int64_t extent = in.dims(dim);
  const std::string c = Compute(dt), idx = Storage(n.type().dtype());
  const std::string cmp = n.op() == v1::ARGMAX ? ">" : "<";
  std::string decls = PtrDecl(Storage(dt), "in", 0, true) + PtrDecl(idx, "out", 1, false);
  std::string take = IsFloat(dt) ? StrCat("best == best && (v != v || v ", cmp, " best)")
                                 : StrCat("v ", cmp, " best");
  std::string body = absl::StrFormat(
      "    const i64 base = i / %d * %d + i %% %d;\n"
      "    %s best = %s;\n    %s idx = 0;\n"
      "    for (i64 e = 1; e < %d; ++e) {\n"
      "      const %s v = %s;\n"
      "      if (%s) { best = v; idx = (%s)e; }\n    }\n"
      "    out[i] = idx;\n",
      inner, extent * inner, inner, c, Load(dt, "in[base]"), idx, extent, c,
      Load(dt, StrCat("in[base + e * ", inner, "]")), take, idx);
  const int64_t elements = extent == 0 ? 0 : outer * inner;
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

absl::StatusOr<KernelLaunch> ModuleSource::AddSort(const v1::Node& n, const v1::TensorType& keys,
                                                   const v1::TensorType& moved) {
  const v1::DType dt = keys.dtype();
  const int64_t dim = n.sort().dimension();
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= keys.dims(d);
  for (int d = dim + 1; d < keys.dims_size(); ++d) inner *= keys.dims(d);
  const int64_t extent = keys.dims(dim);
  const std::string c = Compute(dt), e = Bits(DTypeSize(moved.dtype()));
  // before(a, b): a sorts ahead of b (NaN last ascending, first descending).
  std::string before;
  const bool desc = n.sort().descending();
  if (IsFloat(dt)) {
    before = desc ? "(a > b || (a != a && b == b))" : "(a < b || (a == a && b != b))";
  } else {
    before = desc ? "(a > b)" : "(a < b)";
  }
  auto before_of = [&](const std::string& a, const std::string& b) {
    return absl::StrReplaceAll(before, {{"a", a}, {"b", b}});
  };
  // Each element's place is the count of keys that go ahead of it: those
  // before it, and the equal ones at lower positions (a stable sort).
  std::string decls = PtrDecl(Storage(dt), "keys", 0, true) + PtrDecl(e, "src", 1, true) +
                      PtrDecl(e, "out", 2, false);
  std::string body = absl::StrFormat(
      "    const i64 j = i %% %d, pos = i / %d %% %d, base = i / %d * %d + j;\n"
      "    const %s v = %s;\n"
      "    i64 rank = 0;\n"
      "    for (i64 f = 0; f < %d; ++f) {\n"
      "      const %s w = %s;\n"
      "      if (%s || (f < pos && !%s)) ++rank;\n    }\n"
      "    out[base + rank * %d] = src[base + pos * %d];\n",
      inner, inner, extent, extent * inner, extent * inner, c,
      Load(dt, StrCat("keys[base + pos * ", inner, "]")), extent, c,
      Load(dt, StrCat("keys[base + f * ", inner, "]")), before_of("w", "v"), before_of("v", "w"),
      inner, inner);
  const int64_t elements = outer * extent * inner;
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

namespace {

// [outer, extent, inner] around `axis` of `t` (outer counting the batch
// dims too: `per_batch` of it per batch element), and the number of indices
// per batch element.
struct AroundAxis {
  int64_t outer = 1, per_batch = 1, extent = 0, inner = 1, count = 1;
  AroundAxis(const v1::TensorType& t, const v1::TensorType& indices, int64_t axis,
             int64_t batch_dims = 0) {
    for (int d = 0; d < axis; ++d) outer *= t.dims(d);
    for (int d = int(batch_dims); d < axis; ++d) per_batch *= t.dims(d);
    for (int d = int(axis) + 1; d < t.dims_size(); ++d) inner *= t.dims(d);
    extent = t.dims(int(axis));
    for (int d = int(batch_dims); d < indices.dims_size(); ++d) count *= indices.dims(d);
  }
};

}  // namespace

absl::StatusOr<KernelLaunch> ModuleSource::AddGather(const v1::Node& n,
                                                     const v1::TensorType& operand,
                                                     const v1::TensorType& indices) {
  const AroundAxis a(operand, indices, n.gather().axis(), n.gather().batch_dims());
  const std::string e = Bits(DTypeSize(operand.dtype()));
  std::string decls = PtrDecl(e, "in", 0, true) +
                      PtrDecl(Storage(indices.dtype()), "idx", 1, true) +
                      PtrDecl(e, "out", 2, false);
  // Each batch element (o / per_batch) reads its own indices.
  std::string body = absl::StrFormat(
      "    const i64 e = i %% %d, o = i / %d / %d, j = i / %d %% %d + o / %d * %d;\n"
      "    i64 k = %s;\n"
      "    k = k < 0 ? 0 : k >= %d ? %d : k;\n"
      "    out[i] = in[(o * %d + k) * %d + e];\n",
      a.inner, a.inner, a.count, a.inner, a.count, a.per_batch, a.count,
      // a u64 index past int64 is out of range all the same
      indices.dtype() == v1::U64
          ? "idx[j] > 0x7fffffffffffffffull ? 0x7fffffffffffffffll : (i64)idx[j]"
          : "(i64)idx[j]",
      a.extent, a.extent - 1, a.extent, a.inner);
  const int64_t elements = a.extent == 0 ? 0 : a.outer * a.count * a.inner;
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

absl::StatusOr<KernelLaunch> ModuleSource::AddScatter(const v1::Node& n,
                                                      const v1::TensorType& operand,
                                                      const v1::TensorType& indices) {
  if (n.scatter().batch_dims() > 0) {
    return absl::UnimplementedError(StrCat("scatter '", n.name(), "' with batch_dims ",
                                           n.scatter().batch_dims(),
                                           " has no CUDA kernel yet (the CPU device runs it)"));
  }
  const AroundAxis a(operand, indices, n.scatter().axis());
  const v1::DType dt = operand.dtype();
  const v1::ReduceKind k = n.scatter().combine();
  // Each result element scans the indices for updates of its slice, in
  // order, so repeated indices apply as on the CPU and no two threads write
  // one element.
  std::string decls, fold, init, fin;
  if (k == v1::REDUCE_INVALID) {
    const std::string e = Bits(DTypeSize(dt));
    decls = PtrDecl(e, "in", 0, true) + PtrDecl(Storage(indices.dtype()), "idx", 1, true) +
            PtrDecl(e, "upd", 2, true) + PtrDecl(e, "out", 3, false);
    init = StrCat("    ", e, " v = in[i];\n");
    fold = "v = upd[u];";
    fin = "    out[i] = v;\n";
  } else {
    v1::Op op = k == v1::SUM          ? v1::ADD
                : k == v1::PROD       ? v1::MUL
                : k == v1::REDUCE_MAX ? v1::MAX
                                      : v1::MIN;
    if (dt == v1::PRED) op = k == v1::REDUCE_MAX ? v1::OR : v1::AND;
    absl::StatusOr<std::string> combined = Elementwise(op, dt, {"v", Load(dt, "upd[u]")});
    if (!combined.ok()) return combined.status();
    decls = PtrDecl(Storage(dt), "in", 0, true) +
            PtrDecl(Storage(indices.dtype()), "idx", 1, true) +
            PtrDecl(Storage(dt), "upd", 2, true) + PtrDecl(Storage(dt), "out", 3, false);
    init = StrCat("    ", Compute(dt), " v = ", Load(dt, "in[i]"), ";\n");
    fold = StrCat("v = ", Round(dt, StrCat("(", Compute(dt), ")(", *combined, ")")), ";");
    fin = StrCat("    out[i] = ", Store(dt, "v"), ";\n");
  }
  std::string body = absl::StrFormat(
      "    const i64 e = i %% %d, pos = i / %d %% %d, o = i / %d / %d;\n"
      "%s"
      "    for (i64 j = 0; j < %d; ++j) {\n"
      "      if ((i64)idx[j] != pos) continue;\n"
      "      const i64 u = (o * %d + j) * %d + e;\n"
      "      %s\n    }\n"
      "%s",
      a.inner, a.inner, a.extent, a.inner, a.extent, init, a.count, a.count, a.inner, fold, fin);
  const int64_t elements = a.outer * a.extent * a.inner;
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

absl::StatusOr<KernelLaunch> ModuleSource::AddShardSlice(const v1::Node& n,
                                                         const v1::TensorType& in, int64_t blocks) {
  const int64_t dim = n.collective().dimension();
  int64_t outer = 1, inner = 1;
  for (int d = 0; d < dim; ++d) outer *= in.dims(d);
  for (int d = dim + 1; d < in.dims_size(); ++d) inner *= in.dims(d);
  const int64_t piece = in.dims(dim) / blocks * inner;
  const std::string e = Bits(DTypeSize(in.dtype()));
  std::string decls = PtrDecl(e, "in", 0, true) + PtrDecl(e, "out", 1, false);
  std::string body = absl::StrFormat("    out[i] = in[(i / %d * %d + a.s[0]) * %d + i %% %d];\n",
                                     piece, blocks, piece, piece);
  return Add(Kernel(decls, StrCat(outer * piece), body), outer * piece);
}

KernelLaunch ModuleSource::AddSwapMajor(v1::DType dt, int64_t outer, int64_t k, int64_t piece,
                                        bool to_rank_major) {
  const std::string e = Bits(DTypeSize(dt));
  std::string decls = PtrDecl(e, "in", 0, true) + PtrDecl(e, "out", 1, false);
  // Output element i = (major, minor, j); its source swaps major and minor.
  const int64_t major = to_rank_major ? k : outer, minor = to_rank_major ? outer : k;
  std::string body = absl::StrFormat(
      "    const i64 j = i %% %d, mi = i / %d %% %d, ma = i / %d / %d;\n"
      "    out[i] = in[(mi * %d + ma) * %d + j];\n",
      piece, piece, minor, piece, minor, major, piece);
  const int64_t elements = outer * k * piece;
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

KernelLaunch ModuleSource::AddGemm(v1::DType dt, int64_t batch, int64_t m, int64_t n, int64_t k) {
  const std::string st = Storage(dt), acc = IsFloat(dt) ? Compute(dt) : "u64";
  std::string decls =
      PtrDecl(st, "l", 0, true) + PtrDecl(st, "r", 1, true) + PtrDecl(st, "out", 2, false);
  std::string body = absl::StrFormat(
      "    const i64 b = i / %d, row = i / %d %% %d, col = i %% %d;\n"
      "    %s acc = 0;\n"
      "    for (i64 p = 0; p < %d; ++p) acc += (%s)%s * (%s)%s;\n"
      "    out[i] = %s;\n",
      m * n, n, m, n, acc, k, acc, Load(dt, StrCat("l[(b * ", m, " + row) * ", k, " + p]")), acc,
      Load(dt, StrCat("r[(b * ", k, " + p) * ", n, " + col]")),
      Store(dt, StrCat("(", Compute(dt), ")acc")));
  const int64_t elements = batch * m * n;
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

absl::StatusOr<KernelLaunch> ModuleSource::AddConvolution(const v1::Node& n,
                                                          const v1::TensorType& lt,
                                                          const v1::TensorType& rt) {
  const v1::ConvolutionAttrs a = ConvolutionWithDefaults(n.convolution());
  const v1::TensorType& ot = n.type();
  const v1::DType dt = lt.dtype();
  const std::string st = Storage(dt), acc = IsFloat(dt) ? Compute(dt) : "u64";
  const std::vector<int64_t> ls = Strides(lt.dims()), rs = Strides(rt.dims()),
                             os = Strides(ot.dims());
  const int s = a.input_spatial_dimensions_size();
  auto coord = [&](int64_t d) { return StrCat("i / ", os[d], " % ", ot.dims(d)); };
  const int64_t out_features = ot.dims(a.output_feature_dimension());
  const int64_t in_features = rt.dims(a.kernel_input_feature_dimension());
  int64_t window = 1;
  for (int j = 0; j < s; ++j) window *= rt.dims(a.kernel_spatial_dimensions(j));
  std::string body = absl::StrFormat(
      "    const i64 o = %s;\n"
      "    const i64 n = o / %d * %d + %s;\n"
      "    const i64 c0 = o / %d * %d;\n"
      "    %s acc = 0;\n"
      "    for (i64 w = 0; w < %d; ++w) {\n"
      "      i64 l = n * %d + c0 * %d, r = o * %d, t = w;\n",
      coord(a.output_feature_dimension()), out_features / a.batch_group_count(),
      ot.dims(a.output_batch_dimension()), coord(a.output_batch_dimension()),
      out_features / a.feature_group_count(), in_features, acc, window,
      ls[a.input_batch_dimension()], ls[a.input_feature_dimension()],
      rs[a.kernel_output_feature_dimension()]);
  // The window's position, its last spatial dimension fastest.
  for (int j = s - 1; j >= 0; --j) {
    const int64_t k = rt.dims(a.kernel_spatial_dimensions(j));
    absl::StrAppend(
        &body,
        absl::StrFormat("      { const i64 k = t %% %d; t /= %d;\n"
                        "        const i64 p = (%s) * %d - %d + k * %d;\n"
                        "        if (p < 0 || p %% %d != 0 || p / %d >= %d) continue;\n"
                        "        l += p / %d * %d; r += k * %d; }\n",
                        k, k, coord(a.output_spatial_dimensions(j)), a.window_strides(j),
                        a.padding_low(j), a.rhs_dilation(j), a.lhs_dilation(j), a.lhs_dilation(j),
                        lt.dims(a.input_spatial_dimensions(j)), a.lhs_dilation(j),
                        ls[a.input_spatial_dimensions(j)], rs[a.kernel_spatial_dimensions(j)]));
  }
  absl::StrAppend(
      &body,
      absl::StrFormat("      for (i64 c = 0; c < %d; ++c) acc += (%s)%s * (%s)%s;\n"
                      "    }\n"
                      "    out[i] = %s;\n",
                      in_features, acc,
                      Load(dt, StrCat("x[l + c * ", ls[a.input_feature_dimension()], "]")), acc,
                      Load(dt, StrCat("y[r + c * ", rs[a.kernel_input_feature_dimension()], "]")),
                      Store(dt, StrCat("(", Compute(dt), ")acc"))));
  const std::string decls =
      PtrDecl(st, "x", 0, true) + PtrDecl(st, "y", 1, true) + PtrDecl(st, "out", 2, false);
  const int64_t elements = NumElementsUnchecked(ot);
  return Add(Kernel(decls, StrCat(elements), body), elements);
}

KernelLaunch ModuleSource::AddScalarS32() {
  return Add(Kernel(PtrDecl("i32", "out", 0, false), "1", "    out[i] = (i32)a.s[0];\n"), 1);
}

}  // namespace tessel::cuda
