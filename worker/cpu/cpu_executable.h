// CpuExecutable: a Program prepared for a CpuDevice: values numbered into
// slots (SlotProgram), fusions built into FusedLoops, literal constants
// materialized once, loops of fusions built into DeviceLoops. Run allocates results from the device
// and releases intermediates after their last reader, as the plan says. One Run at a time per
// instance.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "core/trace.h"
#include "worker/cpu/device_loop.h"
#include "worker/cpu/fused_loop.h"
#include "worker/cpu/native_loop.h"
#include "worker/device.h"
#include "worker/slot_program.h"

namespace tessel::cpu {

class CpuExecutable final : public worker::Executable {
 public:
  static absl::StatusOr<std::unique_ptr<worker::Executable>> Load(const v1::Program& program,
                                                                  worker::Device* device);
  // Fusions of at least this many elements are also compiled (NativeFusion).
  static constexpr int64_t kCompiledFusionElements = int64_t{1} << 15;
  absl::StatusOr<std::vector<worker::BufferPtr>> Run(absl::Span<const worker::BufferPtr> args,
                                                     absl::Span<const worker::BufferPtr> into,
                                                     const worker::StepContext& ctx) override;

 private:
  explicit CpuExecutable(worker::SlotProgram slots) : slots_(std::move(slots)) {}
  // Per instruction of slots_: its built fusion, or its materialized literal.
  struct Prepared {
    std::optional<FusedLoop> fusion;
    // The fusion compiled (native_loop.h), once its background compile is done.
    std::shared_ptr<NativeFusion> compiled;
    worker::BufferPtr literal;
    // A loop of fusions, run whole: compiled (native_loop.h), else bound (device_loop.h).
    std::optional<NativeLoop> native;
    std::optional<DeviceLoop> loop;
  };
  absl::Status Execute(int i, std::vector<worker::BufferPtr>& values,
                       const std::vector<worker::BufferPtr>& preset,
                       const worker::StepContext& ctx);

  worker::SlotProgram slots_;
  worker::Device* device_ = nullptr;
  std::vector<Prepared> prepared_;
  std::vector<trace::Name>
      kernel_names_;  // per instruction, interned when first traced (0: not yet)
};

}  // namespace tessel::cpu
