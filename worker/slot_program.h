// SlotProgram: a Program numbered for execution, shared by every backend.
// Each value gets a slot; each instruction names its operand and result
// slots, their types, and the slots whose last reader it is. A lone
// elementwise node becomes a one-node fusion, so backends see two kinds of
// instruction: fusions and single non-elementwise nodes.
//
// Run drives one execution: it binds arguments, honours the `into` buffers
// of donated outputs, calls the backend once per instruction in order, and
// releases values after their last reader. Immutable once built; Run may be
// called from any thread.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/v1/program.pb.h"
#include "worker/device.h"

namespace tessel::worker {

class SlotProgram {
 public:
  struct Instr {
    const v1::Node* node = nullptr;      // a single node, or
    const v1::Fusion* fusion = nullptr;  // a fusion
    std::vector<int> args;               // operand slots (fusion: its inputs)
    std::vector<int> results;            // result slots (fusion: its outputs)
    std::vector<v1::TensorType> arg_types, result_types;
    std::vector<int> release;
  };

  static absl::StatusOr<SlotProgram> Build(const v1::Program& program);

  const v1::Program& program() const { return *program_; }
  const std::vector<Instr>& instrs() const { return instrs_; }
  int num_slots() const { return num_slots_; }

  // Runs instruction `i`: reads `values` at its args and stores its results
  // there. `preset[slot]`, where set, is the buffer a result must be written
  // into (a donated argument's), if it is large enough.
  using ExecuteFn = std::function<absl::Status(int i, std::vector<BufferPtr>& values,
                                               const std::vector<BufferPtr>& preset)>;
  absl::StatusOr<std::vector<BufferPtr>> Run(absl::Span<const BufferPtr> args, absl::Span<const BufferPtr> into,
                                             const ExecuteFn& execute) const;

  // The buffer for result slot `slot` of `bytes`: the preset one if it fits, else a new one.
  static absl::StatusOr<BufferPtr> ResultBuffer(Device& device, const std::vector<BufferPtr>& preset, int slot,
                                                int64_t bytes);

 private:
  std::unique_ptr<v1::Program> program_;                 // owns the nodes instructions point into
  std::vector<std::unique_ptr<v1::Fusion>> lone_nodes_;  // one-node fusions of lone elementwise nodes
  int num_slots_ = 0;
  std::vector<int> param_slots_;
  std::vector<int> output_slots_;
  std::vector<int> output_buffer_slots_;  // the slot whose buffer each output is (reshapes followed)
  std::vector<Instr> instrs_;
};

}  // namespace tessel::worker
