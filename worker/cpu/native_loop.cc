#include "worker/cpu/native_loop.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"
#include "spdlog/spdlog.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/fused_loop.h"
#include "worker/scalar_expr.h"
#include "worker/step_queue.h"
#include "worker/vector_math_source.h"

extern char** environ;

namespace tessel::cpu {

using worker::BufferPtr;
using worker::SlotProgram;

// Helpers every generated file carries: exact literals, NaN-propagating
// max/min, integer power as XLA defines it; for every width, so that
// scalar_expr_test.cc runs the scalar table's every row on them.
constexpr char kPrelude[] = R"(#include <math.h>
#include <stdint.h>
#include <string.h>
static inline float lit_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline double lit_f64(uint64_t u) { double f; memcpy(&f, &u, 8); return f; }
#define MAXMIN(S, T) \
  static inline T max##S(T a, T b) { return (a != a || a > b) ? a : b; } \
  static inline T min##S(T a, T b) { return (a != a || a < b) ? a : b; }
MAXMIN(_f32, float) MAXMIN(_f64, double) MAXMIN(_s8, int8_t) MAXMIN(_s16, int16_t) MAXMIN(_s32, int32_t)
MAXMIN(_s64, int64_t) MAXMIN(_u8, uint8_t) MAXMIN(_u16, uint16_t) MAXMIN(_u32, uint32_t) MAXMIN(_u64, uint64_t)
#define IPOW(S, T, U, SIGNED) \
  static inline T ipow##S(T base, T exp) { \
    if (SIGNED && exp < 0) return base == 1 ? (T)1 : base == (T)-1 ? ((exp & 1) ? (T)-1 : (T)1) : (T)0; \
    U result = 1, b = (U)base, e = (U)exp; \
    while (e) { if (e & 1) result = (U)(1u * result * b); b = (U)(1u * b * b); e >>= 1; } \
    return (T)result; \
  }
IPOW(_s8, int8_t, uint8_t, 1) IPOW(_s16, int16_t, uint16_t, 1) IPOW(_s32, int32_t, uint32_t, 1)
IPOW(_s64, int64_t, uint64_t, 1) IPOW(_u8, uint8_t, uint8_t, 0) IPOW(_u16, uint16_t, uint16_t, 0)
IPOW(_u32, uint32_t, uint32_t, 0) IPOW(_u64, uint64_t, uint64_t, 0)
)";

const char* NativeLoop::Prelude() {
  static const std::string* const prelude = new std::string(absl::StrCat(
      kPrelude,
      "static inline uint32_t tm_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }\n"
      "static inline float tm_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }\n"
      "#define TM static inline\n",
      worker::kVectorMathFma, worker::kVectorMathSource, "#undef TM_FMA\n#undef TM\n"));
  return prelude->c_str();
}

namespace {

// The C types of the dtypes the generated code handles: storage and compute
// are the same except for pred (one byte, computed as an int 0 or 1).
const char* CType(v1::DType dt) {
  switch (dt) {
    case v1::F32: return "float";
    case v1::F64: return "double";
    case v1::S32: return "int32_t";
    case v1::S64: return "int64_t";
    case v1::U8: return "uint8_t";
    case v1::PRED: return "uint8_t";
    default: return nullptr;
  }
}
const char* UType(v1::DType dt) {
  switch (dt) {
    case v1::S32: return "uint32_t";
    case v1::S64: return "uint64_t";
    case v1::U8: return "uint8_t";
    default: return nullptr;
  }
}
const char* Suffix(v1::DType dt) {
  return dt == v1::F32   ? "_f32"
         : dt == v1::F64 ? "_f64"
         : dt == v1::S32 ? "_s32"
         : dt == v1::S64 ? "_s64"
                         : "_u8";
}
bool IsFloat(v1::DType dt) { return dt == v1::F32 || dt == v1::F64; }
bool IsInt(v1::DType dt) { return dt == v1::S32 || dt == v1::S64 || dt == v1::U8; }

// One element of dtype `dt` at `p` as an exact C literal.
std::string Literal(v1::DType dt, const void* p) {
  switch (dt) {
    case v1::F32: {
      uint32_t u;
      std::memcpy(&u, p, 4);
      return absl::StrFormat("lit_f32(0x%08xu)", u);
    }
    case v1::F64: {
      uint64_t u;
      std::memcpy(&u, p, 8);
      return absl::StrFormat("lit_f64(0x%016xull)", u);
    }
    case v1::S32: {
      uint32_t u;
      std::memcpy(&u, p, 4);
      return absl::StrFormat("(int32_t)0x%08xu", u);
    }
    case v1::S64: {
      uint64_t u;
      std::memcpy(&u, p, 8);
      return absl::StrFormat("(int64_t)0x%016xull", u);
    }
    default: {
      uint8_t u;
      std::memcpy(&u, p, 1);
      return absl::StrFormat("(uint8_t)%u", unsigned(u));
    }
  }
}

// `x` (a compute value of dtype `from`) converted as ConvertValue does.
std::string Convert(v1::DType from, v1::DType to, const std::string& x) {
  const char* t = CType(to);
  if (to == v1::PRED) return absl::StrCat("(", x, " != 0)");
  if (IsFloat(from) && IsInt(to)) {
    const char* lo = to == v1::S32 ? "INT32_MIN" : to == v1::S64 ? "INT64_MIN" : "0";
    const char* hi = to == v1::S32 ? "INT32_MAX" : to == v1::S64 ? "INT64_MAX" : "UINT8_MAX";
    const char* f = CType(from);
    return absl::StrCat("(", x, " != ", x, " ? (", t, ")0 : ", x, " <= (", f, ")", lo, " ? (", t,
                        ")", lo, " : ", x, " >= (", f, ")", hi, " ? (", t, ")", hi, " : (", t, ")",
                        x, ")");
  }
  return absl::StrCat("((", t, ")", x, ")");
}

// How the generated C spells the scalar table's types and helpers
// (worker/scalar_expr.h): the prelude's max_f32, ipow_s32, ...
const worker::ScalarDialect kDialect{
    .compute_type = [](v1::DType dt) { return std::string(CType(dt) ? CType(dt) : ""); },
    .unsigned_type = [](v1::DType dt) { return std::string(UType(dt) ? UType(dt) : ""); },
    .math = [](v1::DType dt, absl::string_view name) { return worker::MathFunction(dt, name); },
    .helper = [](v1::DType dt, absl::string_view name) { return absl::StrCat(name, Suffix(dt)); },
};

// The expression of elementwise node `n` over its operands' values, or ""
// when the generated code does not handle it.
std::string Expr(const v1::Node& n, const std::vector<std::string>& a,
                 const std::vector<v1::DType>& in_dt) {
  const v1::DType dt = n.type().dtype();
  if (n.op() == v1::COMPARE) {
    const char* op = nullptr;
    switch (n.compare().direction()) {
      case v1::EQ: op = "=="; break;
      case v1::NE: op = "!="; break;
      case v1::LT: op = "<"; break;
      case v1::LE: op = "<="; break;
      case v1::GT: op = ">"; break;
      case v1::GE: op = ">="; break;
      default: return "";
    }
    return absl::StrCat("(", a[0], " ", op, " ", a[1], ")");
  }
  if (n.op() == v1::SELECT) return absl::StrCat("(", a[0], " ? ", a[1], " : ", a[2], ")");
  // A bitcast reads storage bits, which a compute value (f16 and bf16 held
  // as float) does not show: the interpreted loop runs it.
  if (n.op() == v1::CONVERT) return n.convert().bitcast() ? "" : Convert(in_dt[0], dt, a[0]);
  if (n.op() == v1::BROADCAST_IN_DIM) return a[0];
  auto e = worker::ScalarExpr(n.op(), dt, a, kDialect);
  return e.ok() ? *e : "";
}

// Emits fusion `fu`'s element loop over [begin, end): input k is read from
// the array `inputs[k]` (of arg_types[k]), output k written to the array
// `outputs[k]`. `once` gets what is written once (one-element constant
// outputs, even by a loop of no elements), `loop` the loop. Returns "" or
// why the fusion does not qualify.
std::string EmitFusion(const v1::Fusion& fu, const std::vector<v1::TensorType>& arg_types,
                       const std::vector<std::string>& inputs,
                       const std::vector<std::string>& outputs, int64_t elements,
                       const std::string& begin, const std::string& end, std::string& once,
                       std::string& loop) {
  absl::flat_hash_map<std::string, std::string>
      value;  // fusion-local name -> C expression of this element
  absl::flat_hash_map<std::string, v1::DType> vdt;
  std::string body;
  for (int k = 0; k < fu.inputs_size(); ++k) {
    const v1::TensorType& t = arg_types[k];
    if (CType(t.dtype()) == nullptr) return absl::StrCat("dtype ", DTypeName(t.dtype()));
    const std::string v = absl::StrCat("x", k);
    const std::string idx = NumElementsUnchecked(t) == elements ? "i" : "0";
    std::string load = absl::StrCat(inputs[k], "[", idx, "]");
    if (t.dtype() == v1::PRED) load = absl::StrCat("(", load, " != 0)");
    absl::StrAppend(&body, "      const ", t.dtype() == v1::PRED ? "int" : CType(t.dtype()), " ", v,
                    " = ", load, ";\n");
    value[fu.inputs(k)] = v;
    vdt[fu.inputs(k)] = t.dtype();
  }
  absl::flat_hash_map<std::string, int> output_index;
  for (int k = 0; k < fu.outputs_size(); ++k) output_index[fu.outputs(k)] = k;
  int counter = 0;
  for (const v1::Node& n : fu.nodes()) {
    const v1::DType dt = n.type().dtype();
    if (CType(dt) == nullptr) return absl::StrCat("dtype ", DTypeName(dt));
    std::string expr;
    bool constant = false;
    if (n.op() == v1::CONSTANT) {
      const int64_t ne = NumElementsUnchecked(n.type());
      if (n.constant().has_iota()) {
        const auto& dims = n.type().dims();
        const int64_t d = n.constant().iota().dimension();
        int64_t inner = 1;
        for (int k = d + 1; k < dims.size(); ++k) inner *= dims[k];
        if (dims[d] <= 0 || inner <= 0) return "an empty iota";
        expr = Convert(v1::S64, dt,
                       absl::StrCat("(((int64_t)", ne == elements ? "i" : "0", " / ", inner, ") % ",
                                    dims[d], ")"));
      } else {
        if (n.constant().has_literal() && ne != 1) return "a literal array";
        char one[8] = {};
        if (n.constant().has_fill()) {
          FillKernel(dt, n.constant().fill(), one, 1);
        } else {
          MaterializeLiteral(n, one);
        }
        expr = Literal(dt, one);
        if (dt == v1::PRED) expr = absl::StrCat("(", expr, " != 0)");
        constant = ne == 1;
      }
    } else {
      std::vector<std::string> a;
      std::vector<v1::DType> adt;
      for (const std::string& o : n.operands()) {
        auto it = value.find(o);
        if (it == value.end())
          return absl::StrCat("fusion node '", n.name(), "' reads '", o, "' before it is defined");
        a.push_back(it->second);
        adt.push_back(vdt[o]);
      }
      if (n.op() != v1::BROADCAST_IN_DIM && !IsElementwise(n.op()))
        return absl::StrCat("op ", OpName(n.op()));
      expr = Expr(n, a, adt);
      if (expr.empty()) return absl::StrCat("op ", OpName(n.op()), " on ", DTypeName(dt));
    }
    const std::string v = absl::StrCat("v", counter++);
    const char* ct = dt == v1::PRED ? "int" : CType(dt);
    absl::StrAppend(&body, "      const ", ct, " ", v, " = ", expr, ";\n");
    value[n.name()] = v;
    vdt[n.name()] = dt;
    auto oi = output_index.find(n.name());
    if (oi != output_index.end()) {
      const std::string& arr = outputs[oi->second];
      const int64_t ne = NumElementsUnchecked(n.type());
      const std::string store = dt == v1::PRED ? absl::StrCat("(uint8_t)", v) : v;
      if (constant) {
        absl::StrAppend(&once, "    { const ", ct, " ", v, " = ", expr, "; ", arr, "[0] = ", store,
                        "; }\n");
      } else if (ne == elements) {
        absl::StrAppend(&body, "      ", arr, "[i] = ", store, ";\n");
      } else {
        absl::StrAppend(&body, "      if (i == 0) ", arr, "[0] = ", store, ";\n");
      }
    }
  }
  absl::StrAppend(&loop, "    for (int64_t i = ", begin, "; i < ", end, "; ++i) {\n", body,
                  "    }\n");
  return "";
}

// The type of fusion `fu`'s output k, the node that makes it; nullptr for
// an input passed through, which the generated loops do not write.
const v1::TensorType* FusionOutputType(const v1::Fusion& fu, int k) {
  for (const v1::Node& n : fu.nodes()) {
    if (n.name() == fu.outputs(k)) return &n.type();
  }
  return nullptr;
}

// Emits one function's instructions (fusions and reshapes) into `out`.
// `name[slot]` starts with the parameters' arrays; each fusion result
// becomes a local array s<slot>. Returns "" or why the function does not
// qualify.
std::string EmitFunction(const SlotProgram& program, int f, const std::string& prefix,
                         std::vector<std::string>& name, std::vector<v1::DType>& dtype,
                         int64_t& local_bytes, std::string& out) {
  const SlotProgram::Function& sf = program.functions()[f];
  for (int j = sf.begin; j < sf.end; ++j) {
    const SlotProgram::Instr& in = program.instrs()[j];
    if (!in.calls.empty()) return "nested control flow";
    if (in.fusion == nullptr) {
      if (in.node->op() != v1::RESHAPE) return absl::StrCat("op ", OpName(in.node->op()));
      name[in.results[0]] = name[in.args[0]];
      dtype[in.results[0]] = dtype[in.args[0]];
      continue;
    }
    const v1::Fusion& fu = *in.fusion;
    const int64_t elements = FusionElements(fu);
    if (elements > FusedLoop::kBlock) return "a value over one block";
    std::vector<std::string> inputs, outputs;
    for (int k = 0; k < fu.inputs_size(); ++k) inputs.push_back(name[in.args[k]]);
    std::string decls;
    for (int k = 0; k < fu.outputs_size(); ++k) {
      const v1::TensorType* t = FusionOutputType(fu, k);
      if (t == nullptr) return "an input passed through as an output";
      if (CType(t->dtype()) == nullptr) return absl::StrCat("dtype ", DTypeName(t->dtype()));
      const int slot = in.results[k];
      const std::string arr = absl::StrCat(prefix, "s", slot);
      name[slot] = arr;
      dtype[slot] = t->dtype();
      const int64_t ne = NumElementsUnchecked(*t);
      local_bytes += ne * DTypeSize(t->dtype());
      absl::StrAppend(&decls, "    ", CType(t->dtype()), " ", arr, "[", std::max<int64_t>(ne, 1),
                      "];\n");
      outputs.push_back(arr);
    }
    std::string once, loop;
    std::string err = EmitFusion(fu, in.arg_types, inputs, outputs, elements, "0",
                                 absl::StrCat(elements), once, loop);
    if (!err.empty()) return err;
    absl::StrAppend(&out, decls, once, loop);
  }
  return "";
}

}  // namespace

std::optional<std::string> NativeLoop::Source(const SlotProgram& program, int instr,
                                              std::string* why) {
  const SlotProgram::Instr& in = program.instrs()[instr];
  if (in.node == nullptr || (in.node->op() != v1::WHILE && in.node->op() != v1::SCAN)) {
    *why = "not a loop";
    return std::nullopt;
  }
  const v1::Node& n = *in.node;
  const bool scan = n.op() == v1::SCAN;
  const int carries = scan ? n.control().num_carry() : int(in.args.size());
  const int body = scan ? in.calls[0] : in.calls[1];
  const SlotProgram::Function& bf = program.functions()[body];
  int64_t local_bytes = 0;
  std::string src = Prelude();
  absl::StrAppend(&src, "void tessel_loop(const void* const* in, void* const* out) {\n");
  std::vector<int64_t> carry_bytes;
  for (int k = 0; k < carries; ++k) {
    const v1::TensorType& t = in.arg_types[k];
    if (CType(t.dtype()) == nullptr) {
      *why = absl::StrCat("carry ", k, " is ", DTypeName(t.dtype()));
      return std::nullopt;
    }
    carry_bytes.push_back(ByteSizeUnchecked(t));
    local_bytes += 2 * carry_bytes.back();
    absl::StrAppend(&src, "  ", CType(t.dtype()), " c", k, "[",
                    std::max<int64_t>(NumElementsUnchecked(t), 1), "];\n  memcpy(c", k, ", in[", k,
                    "], ", carry_bytes.back(), ");\n");
  }
  const int64_t length = scan ? n.control().length() : 0;
  if (scan) {
    absl::StrAppend(&src, "  for (int64_t it = 0; it < ", length,
                    "; ++it) {\n    const int64_t step = ",
                    n.control().reverse() ? absl::StrCat(length - 1, " - it") : "it", ";\n");
  } else {
    absl::StrAppend(&src, "  for (;;) {\n");
  }
  // Each function's values live in its own block; parameters are the carries.
  auto params = [&](const SlotProgram::Function& fn, std::vector<std::string>& name,
                    std::vector<v1::DType>& dtype) {
    name.assign(fn.num_slots, "");
    dtype.assign(fn.num_slots, v1::DTYPE_INVALID);
    for (int k = 0; k < carries; ++k) {
      name[fn.param_slots[k]] = absl::StrCat("c", k);
      dtype[fn.param_slots[k]] = in.arg_types[k].dtype();
    }
  };
  std::vector<std::string> name;
  std::vector<v1::DType> dtype;
  if (!scan) {
    const SlotProgram::Function& cf = program.functions()[in.calls[0]];
    params(cf, name, dtype);
    std::string code;
    std::string err = EmitFunction(program, in.calls[0], "p", name, dtype, local_bytes, code);
    if (!err.empty()) {
      *why = absl::StrCat("condition: ", err);
      return std::nullopt;
    }
    absl::StrAppend(&src, "    {\n", code, "    if (!", name[cf.output_slots[0]],
                    "[0]) break;\n    }\n");
  }
  params(bf, name, dtype);
  std::string code;
  for (size_t x = carries; x < in.args.size(); ++x) {
    const v1::TensorType& t = in.arg_types[x];
    if (CType(t.dtype()) == nullptr) {
      *why = absl::StrCat("scanned operand ", x, " is ", DTypeName(t.dtype()));
      return std::nullopt;
    }
    const int64_t slice = t.dims(0) == 0 ? 0 : ByteSizeUnchecked(t) / t.dims(0);
    const std::string xn = absl::StrCat("xs", x);
    absl::StrAppend(&code, "    const ", CType(t.dtype()), "* ", xn, " = (const ", CType(t.dtype()),
                    "*)((const char*)in[", x, "] + step * ", slice, ");\n");
    name[bf.param_slots[x]] = xn;
    dtype[bf.param_slots[x]] = t.dtype();
  }
  std::string err = EmitFunction(program, body, "b", name, dtype, local_bytes, code);
  if (!err.empty()) {
    *why = absl::StrCat("body: ", err);
    return std::nullopt;
  }
  // New carries are taken whole before any is written: a body may swap them.
  std::string take, put;
  for (int k = 0; k < carries; ++k) {
    const std::string& o = name[bf.output_slots[k]];
    if (o == absl::StrCat("c", k)) continue;
    const v1::TensorType& t = in.arg_types[k];
    absl::StrAppend(&take, "    ", CType(t.dtype()), " n", k, "[",
                    std::max<int64_t>(NumElementsUnchecked(t), 1), "];\n    memcpy(n", k, ", ", o,
                    ", ", carry_bytes[k], ");\n");
    absl::StrAppend(&put, "    memcpy(c", k, ", n", k, ", ", carry_bytes[k], ");\n");
  }
  for (size_t y = carries; y < bf.output_slots.size(); ++y) {
    const int64_t bytes = ByteSizeUnchecked(bf.output_types[y]);
    absl::StrAppend(&take, "    memcpy((char*)out[", y, "] + step * ", bytes, ", ",
                    name[bf.output_slots[y]], ", ", bytes, ");\n");
  }
  if (local_bytes > kMaxLocalBytes) {
    *why = absl::StrCat(local_bytes, " bytes of values, over ", kMaxLocalBytes);
    return std::nullopt;
  }
  absl::StrAppend(&src, "    {\n", code, take, put, "    }\n  }\n");
  for (int k = 0; k < carries; ++k)
    absl::StrAppend(&src, "  memcpy(out[", k, "], c", k, ", ", carry_bytes[k], ");\n");
  absl::StrAppend(&src, "}\n");
  return src;
}

struct NativeLoop::Library {
  void* handle = nullptr;
  void* fn = nullptr;  // the generated function
  ~Library() {
    if (handle != nullptr) dlclose(handle);
  }
};

namespace {

// The process's compiled loops, shared by identical sources, and the
// private directory they are built in. Thread-safe.
class LoopCompiler {
 public:
  static LoopCompiler& Get() {
    static auto* compiler = new LoopCompiler();
    return *compiler;
  }
  // Compiles `source` into a shared object and loads it (or returns the
  // library an identical source already loaded); `symbol` names its
  // function, `flags` go to the compiler beside the loops' own.
  absl::StatusOr<std::shared_ptr<NativeLoop::Library>> Compile(
      const std::string& source, const char* symbol, const std::vector<std::string>& flags = {})
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;  // held across a compile: identical loads wait for one build
  absl::flat_hash_map<size_t, std::weak_ptr<NativeLoop::Library>> cache_ ABSL_GUARDED_BY(mu_);
  std::string dir_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<std::shared_ptr<NativeLoop::Library>> LoopCompiler::Compile(
    const std::string& source, const char* symbol, const std::vector<std::string>& flags) {
  const size_t key =
      std::hash<std::string>()(absl::StrCat(source, "\n", absl::StrJoin(flags, " ")));
  absl::MutexLock lock(&mu_);
  if (auto it = cache_.find(key); it != cache_.end()) {
    if (auto lib = it->second.lock()) return lib;
  }
  if (dir_.empty()) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "tessel-loops-XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) {
      return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
    }
    dir_ = tmpl;
  }
  const std::string base = absl::StrFormat("%s/loop-%016x", dir_, key);
  const std::string c_file = base + ".c", so_file = base + ".so", log_file = base + ".log";
  {
    std::ofstream f(c_file);
    f << source;
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", c_file));
  }
  const char* env_cc = std::getenv("CC");
  std::string cc = env_cc != nullptr && *env_cc != '\0' ? env_cc : "cc";
  std::vector<std::string> args = {
      cc, "-O2", "-std=c11", "-ffp-contract=off", "-fPIC", "-shared", "-o", so_file, c_file, "-lm"};
#ifdef TESSEL_FMA
  args.insert(args.begin() + 1, "-mfma");  // TM_FMA's fmaf as one instruction, as in the kernels
#endif
  args.insert(args.end(), flags.begin(), flags.end());  // after -O2: the last -O counts
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                   0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, cc.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0)
    return absl::UnavailableError(
        absl::StrCat("cannot run the C compiler '", cc, "': ", std::strerror(rc)));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::remove(c_file.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::ifstream f(log_file);
    std::stringstream log;
    log << f.rdbuf();
    std::remove(log_file.c_str());
    return absl::InternalError(
        absl::StrCat("'", cc, "' failed on a generated loop: ", log.str().substr(0, 2000)));
  }
  std::remove(log_file.c_str());
  auto lib = std::make_shared<NativeLoop::Library>();
  lib->handle = dlopen(so_file.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::remove(so_file.c_str());  // mapped: the file is no longer needed
  if (lib->handle == nullptr)
    return absl::InternalError(absl::StrCat("dlopen of a generated loop: ", dlerror()));
  lib->fn = dlsym(lib->handle, symbol);
  if (lib->fn == nullptr)
    return absl::InternalError(absl::StrCat("a generated loop has no ", symbol));
  for (auto it = cache_.begin(); it != cache_.end();) {  // forget unloaded libraries
    if (it->second.expired()) {
      cache_.erase(it++);
    } else {
      ++it;
    }
  }
  cache_[key] = lib;
  return lib;
}

}  // namespace

std::optional<NativeLoop> NativeLoop::Build(const SlotProgram& program, int instr,
                                            std::string* why) {
  const char* off = std::getenv("TESSEL_NATIVE_LOOPS");
  if (off != nullptr && std::string(off) == "0") {
    *why = "TESSEL_NATIVE_LOOPS=0";
    return std::nullopt;
  }
  std::optional<std::string> source = Source(program, instr, why);
  if (!source) return std::nullopt;
  absl::StatusOr<std::shared_ptr<Library>> lib =
      LoopCompiler::Get().Compile(*source, "tessel_loop");
  if (!lib.ok()) {
    *why = std::string(lib.status().message());
    return std::nullopt;
  }
  NativeLoop loop;
  loop.library_ = *std::move(lib);
  loop.fn_ = reinterpret_cast<Fn>(loop.library_->fn);
  loop.instr_ = &program.instrs()[instr];
  const v1::Node& n = *loop.instr_->node;
  loop.carries_ = n.op() == v1::SCAN ? n.control().num_carry() : int(loop.instr_->args.size());
  return loop;
}

absl::Status NativeLoop::Run(std::vector<BufferPtr>& values, const std::vector<BufferPtr>& preset,
                             worker::Device& device) const {
  const SlotProgram::Instr& in = *instr_;
  std::vector<const void*> ins;
  for (int a : in.args) ins.push_back(values[a]->opaque());
  std::vector<BufferPtr> results;
  std::vector<void*> outs;
  for (size_t k = 0; k < in.results.size(); ++k) {
    const int64_t bytes = ByteSizeUnchecked(in.result_types[k]);
    BufferPtr r;
    // The carries are copied in before the loop and out after it: a carry's
    // donated operand can take its result. Stacked outputs take any
    // donated buffer the plan gave them.
    if (int(k) < carries_) {
      const BufferPtr& donated = preset[in.results[k]];
      if (donated && donated == values[in.args[k]] && donated->size() >= bytes) r = donated;
    } else {
      TESSEL_ASSIGN_OR_RETURN(r, SlotProgram::ResultBuffer(device, preset, in.results[k], bytes));
    }
    if (!r) {
      TESSEL_ASSIGN_OR_RETURN(r, device.Allocate(bytes));
    }
    outs.push_back(r->opaque());
    results.push_back(std::move(r));
  }
  fn_(ins.data(), outs.data());
  for (size_t k = 0; k < results.size(); ++k) values[in.results[k]] = std::move(results[k]);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- fusions

std::optional<std::string> NativeFusion::Source(const v1::Fusion& fusion,
                                                const std::vector<v1::TensorType>& input_types,
                                                std::string* why) {
  const int64_t elements = FusionElements(fusion);
  std::string src = NativeLoop::Prelude();
  absl::StrAppend(&src,
                  "void tessel_fusion(const void* const* in, void* const* out, int64_t begin, "
                  "int64_t end) {\n");
  std::vector<std::string> inputs, outputs;
  for (int k = 0; k < fusion.inputs_size(); ++k) {
    const char* t = CType(input_types[k].dtype());
    if (t == nullptr) {
      *why = absl::StrCat("input ", k, " is ", DTypeName(input_types[k].dtype()));
      return std::nullopt;
    }
    absl::StrAppend(&src, "  const ", t, "* in", k, " = (const ", t, "*)in[", k, "];\n");
    inputs.push_back(absl::StrCat("in", k));
  }
  for (int k = 0; k < fusion.outputs_size(); ++k) {
    const v1::TensorType* t = FusionOutputType(fusion, k);
    if (t == nullptr || CType(t->dtype()) == nullptr) {
      *why = t == nullptr ? "an input passed through as an output"
                          : absl::StrCat("output ", k, " is ", DTypeName(t->dtype()));
      return std::nullopt;
    }
    const char* ct = CType(t->dtype());
    absl::StrAppend(&src, "  ", ct, "* out", k, " = (", ct, "*)out[", k, "];\n");
    outputs.push_back(absl::StrCat("out", k));
  }
  std::string once, loop;
  std::string err =
      EmitFusion(fusion, input_types, inputs, outputs, elements, "begin", "end", once, loop);
  if (!err.empty()) {
    *why = err;
    return std::nullopt;
  }
  absl::StrAppend(&src, "  if (begin == 0) {\n", once, "  }\n", loop, "}\n");
  return src;
}

namespace {

// Compiles fusions one at a time, off the step threads.
worker::CompletionQueue& FusionCompiles() {
  static auto* q = new worker::CompletionQueue("tessel-jit");
  return *q;
}

}  // namespace

std::shared_ptr<NativeFusion> NativeFusion::Start(const v1::Fusion& fusion,
                                                  const std::vector<v1::TensorType>& input_types,
                                                  std::string* why) {
  const char* off = std::getenv("TESSEL_NATIVE_LOOPS");
  if (off != nullptr && std::string(off) == "0") {
    *why = "TESSEL_NATIVE_LOOPS=0";
    return nullptr;
  }
  std::optional<std::string> source = Source(fusion, input_types, why);
  if (!source) return nullptr;
  auto native = std::shared_ptr<NativeFusion>(new NativeFusion());
  FusionCompiles().Push([native, source = *std::move(source)] {
    // For this machine's own ISA, as XLA compiles its loops: the bits are
    // the interpreter's whatever the vector width (no contraction; TM_FMA
    // rounds once either way).
    auto lib = LoopCompiler::Get().Compile(source, "tessel_fusion", {"-O3", "-march=native"});
    if (!lib.ok()) {
      if (auto log = spdlog::get("worker")) {
        log->warn("a fusion stays interpreted: {}", std::string(lib.status().message()));
      }
      return;
    }
    native->library_ = *std::move(lib);
    native->fn_.store(reinterpret_cast<Fn>(native->library_->fn), std::memory_order_release);
  });
  return native;
}

bool NativeFusion::AwaitReady(absl::Duration timeout) const {
  const absl::Time deadline = absl::Now() + timeout;
  while (fn() == nullptr) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(1));
  }
  return true;
}

}  // namespace tessel::cpu
