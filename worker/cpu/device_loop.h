// DeviceLoop: a WHILE or SCAN whose condition and body hold only fusions
// and reshapes, over small values, run as a tight loop on the CPU device.
//
// The generic driver (SlotProgram::RunControlFlow) goes through the backend
// once per instruction per iteration: buffers are allocated and reference
// counted, every call returns a status, and the predicate is copied to the
// host. For a loop of a few elementwise ops on a handful of elements that
// bookkeeping is nearly all of the cost. A DeviceLoop allocates its buffers
// once per run, two sets of the body's (an iteration writes one set while it
// reads its carries from the other, so no value is overwritten while it is
// still read), resolves every fusion's kernels at load, and reads the
// predicate byte in place. Its fusions are bound to those buffers once per run, in
// three variants (the first iteration reads the operands; odd iterations
// read the first set and write the second; later even ones the reverse), so
// an iteration is nothing but the kernels.
//
// Results are the same as the generic driver's: the same fused kernels run
// on the same values in the same order. A carry whose result was given a
// donated buffer ends in it (one copy after the last iteration).
//
// Built once per loaded program; Run may be called from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "worker/cpu/fused_loop.h"
#include "worker/device.h"
#include "worker/slot_program.h"

namespace tessel::cpu {

class DeviceLoop {
 public:
  // The largest total of the body's and condition's values (one set) that
  // runs here; larger loops keep the generic driver, which updates carries
  // in place instead of double-buffering them.
  static constexpr int64_t kMaxValueBytes = int64_t{1} << 20;

  // The loop for control-flow instruction `instr` of `program`, or nullopt
  // when it does not qualify. `fusions[j]` is instruction j's built fusion
  // (nullptr when j is not a fusion).
  static std::optional<DeviceLoop> Build(const worker::SlotProgram& program, int instr,
                                         const std::vector<const FusedLoop*>& fusions);

  // Runs the loop: reads its operands from `values` and stores its results
  // there, as SlotProgram's execute callback does.
  absl::Status Run(std::vector<worker::BufferPtr>& values,
                   const std::vector<worker::BufferPtr>& preset, worker::Device& device) const;

 private:
  // One function (condition or body) prepared for the loop.
  struct Call {
    const FusedLoop* fusion;
    std::vector<int> args, results;  // root slots
  };
  struct Function {
    int num_slots = 0;
    std::vector<int> root;          // per slot: the slot whose buffer it is (reshapes followed)
    std::vector<int64_t> bytes;     // per root slot written by a fusion: its size, else -1
    std::vector<int> param_slots;   // root slots
    std::vector<int> output_slots;  // root slots
    std::vector<Call> calls;
  };
  static std::optional<Function> Prepare(const worker::SlotProgram& program, int f,
                                         const std::vector<const FusedLoop*>& fusions);
  // `fn`'s fusions bound to the buffers `addr` (indexed by slot) points at.
  static absl::StatusOr<std::vector<BoundFusion>> Bind(const Function& fn,
                                                       const std::vector<void*>& addr);

  const worker::SlotProgram::Instr* instr_ = nullptr;
  bool scan_ = false, reverse_ = false;
  int64_t length_ = 0;  // scan
  int carries_ = 0;
  std::optional<Function> cond_;  // while
  Function body_;
  std::vector<int64_t> x_slice_bytes_;  // scan: per xs operand, one slice's bytes
  std::vector<int64_t> y_bytes_;        // scan: per ys output, one iteration's bytes
  std::vector<int> y_from_x_;           // scan: per ys output, the xs it passes through, or -1
  // scan: per xs operand, the (body fusion, input) pairs that read it.
  std::vector<std::vector<std::pair<int, int>>> x_readers_;
};

}  // namespace tessel::cpu
