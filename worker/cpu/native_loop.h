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

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tessel/v1/program.pb.h"
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

// NativeFusion: a top-level fusion over many elements compiled to one loop
// (its nodes' values in registers, vectorized for this machine's ISA) by
// the same generator and compiler, as XLA's CPU backend compiles its
// loop fusions. The compile runs in the background, one at a time: the
// interpreted FusedLoop runs the fusion until fn() is set, so a program's
// first steps never wait for a compiler. The generated arithmetic is the
// interpreter's, so both give the same bits (native_fusion tests).
class NativeFusion {
 public:
  // Elements [begin, end) of the fusion: `in` follow its inputs, `out` its
  // outputs (as FusedLoop::Run's). One-element constant outputs are
  // written by the call whose begin is 0. Disjoint ranges may run at once.
  using Fn = void (*)(const void* const* in, void* const* out, int64_t begin, int64_t end);

  // The C source of the fusion's loop, or nullopt with `why` set when it
  // does not qualify (a dtype or op the generator does not handle).
  static std::optional<std::string> Source(const v1::Fusion& fusion,
                                           const std::vector<v1::TensorType>& input_types,
                                           std::string* why);
  // Queues the compile; nullptr with `why` set when the fusion does not
  // qualify or TESSEL_NATIVE_LOOPS=0. A failed compile leaves fn() null.
  static std::shared_ptr<NativeFusion> Start(const v1::Fusion& fusion,
                                             const std::vector<v1::TensorType>& input_types,
                                             std::string* why);

  // The compiled loop once ready; nullptr before.
  Fn fn() const { return fn_.load(std::memory_order_acquire); }
  // Waits up to `timeout` for fn() (for tests).
  bool AwaitReady(absl::Duration timeout) const;

 private:
  NativeFusion() = default;
  std::shared_ptr<NativeLoop::Library> library_;  // set before fn_
  std::atomic<Fn> fn_{nullptr};
};

}  // namespace tessel::cpu
