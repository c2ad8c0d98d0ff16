// NativeLoop: a WHILE or SCAN whose condition and body hold only fusions
// and reshapes over small values, compiled whole to native code with the
// system C compiler (as XLA compiles a loop to one function).
//
// The generated function copies the carries into local arrays, runs the
// condition's and the body's fusions as element loops over them (each
// fusion one loop, its nodes' values scalars in registers), and copies the
// carries out once at the end. Its arithmetic is the interpreter's, op for
// op: the same libm calls, integer wrap-around, XLA's division by zero and
// saturating float-to-int conversion, NaN-propagating max and min, and no
// contraction into fused multiply-adds (-ffp-contract=off), so a loop gives
// the same bits whichever path runs it. A differential test holds the two
// to that.
//
// Loops with other ops (a dot, a collective, nested control flow), other
// dtypes (f16, bf16) or more than kMaxLocalBytes of values stay with
// DeviceLoop and the generic driver. So do all loops where no C compiler
// runs: $CC, else `cc`; TESSEL_NATIVE_LOOPS=0 turns the path off.
// Compiled libraries are shared by identical loops (keyed by their source)
// and unloaded with the last program that uses them.
//
// Built once per loaded program; Run may be called from any thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "worker/device.h"
#include "worker/slot_program.h"

namespace tessel::cpu {

class NativeLoop {
 public:
  // The most bytes of values (carries, the functions' values) the
  // generated code keeps on the worker thread's stack.
  static constexpr int64_t kMaxLocalBytes = 64 << 10;

  // The C source of control-flow instruction `instr`'s loop, or nullopt
  // with `why` set when the loop does not qualify. Deterministic.
  static std::optional<std::string> Source(const worker::SlotProgram& program, int instr,
                                           std::string* why);

  // The loop compiled, or nullopt with `why` set (it does not qualify, the
  // path is off, or the compiler failed).
  static std::optional<NativeLoop> Build(const worker::SlotProgram& program, int instr,
                                         std::string* why);

  // The helpers every generated file starts with (max_f32, ipow_s8, ...).
  static const char* Prelude();

  absl::Status Run(std::vector<worker::BufferPtr>& values,
                   const std::vector<worker::BufferPtr>& preset, worker::Device& device) const;

  struct Library;  // a loaded shared object
  // The generated function: `in` the loop's operands, `out` its results.
  using Fn = void (*)(const void* const* in, void* const* out);

 private:
  std::shared_ptr<Library> library_;
  Fn fn_ = nullptr;
  const worker::SlotProgram::Instr* instr_ = nullptr;
  int carries_ = 0;
};

}  // namespace tessel::cpu
