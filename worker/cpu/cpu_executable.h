// CpuExecutable: a Program prepared for a CpuDevice: values numbered into
// slots, fusions built into FusedLoops, literal constants materialized once.
// Run allocates results from the device and releases intermediates after
// their last reader, as the plan says. One Run at a time per instance.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "worker/cpu/fused_loop.h"
#include "worker/device.h"

namespace tessel::cpu {

class CpuExecutable final : public worker::Executable {
 public:
  static absl::StatusOr<std::unique_ptr<worker::Executable>> Load(const v1::Program& program,
                                                                  worker::Device* device);
  absl::StatusOr<std::vector<worker::BufferPtr>> Run(absl::Span<const worker::BufferPtr> args,
                                                     absl::Span<const worker::BufferPtr> into,
                                                     const worker::StepContext& ctx) override;

 private:
  struct Instr {
    const v1::Node* node = nullptr;     // a single node, or
    std::optional<FusedLoop> fusion;    // a fusion
    std::vector<int> args;              // operand slots (fusion: its inputs)
    std::vector<int> results;           // result slots (fusion: its outputs)
    std::vector<const v1::TensorType*> arg_types;
    std::vector<int> release;
    worker::BufferPtr literal;          // materialized literal constant
  };
  // `preset[slot]`, where set, is the buffer that slot's value is written into.
  absl::Status Execute(const Instr& in, std::vector<worker::BufferPtr>& values,
                       const std::vector<worker::BufferPtr>& preset, const worker::StepContext& ctx);

  v1::Program program_;  // owns the nodes instructions point into
  worker::Device* device_ = nullptr;
  int num_slots_ = 0;
  std::vector<int> param_slots_;
  std::vector<int> output_slots_;
  std::vector<int> output_buffer_slots_;  // the slot whose buffer each output is (reshapes followed)
  std::vector<Instr> instrs_;
};

}  // namespace tessel::cpu
