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
#include <string>
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
    // Control flow (a WHILE, CONDITIONAL or SCAN node): the functions it
    // runs, as indices into functions(): (cond, body), (body) or branches.
    std::vector<int> calls;
    // Set by a backend that runs this control-flow instruction itself:
    // Run then hands it to ExecuteFn like any other instruction.
    bool run_by_backend = false;
  };

  // The program (function 0) and the functions its control flow runs; each
  // has its own slots, and its instructions are instrs()[begin, end).
  struct Function {
    std::string name;
    int begin = 0, end = 0;
    int num_slots = 0;
    std::vector<int> param_slots, output_slots;
    std::vector<int>
        output_buffer_slots;  // the slot whose buffer each output is (reshapes followed)
    std::vector<v1::TensorType> param_types, output_types;
    std::vector<int> parameter_aliases;  // per parameter: the output it may be written into, or -1
  };

  static absl::StatusOr<SlotProgram> Build(const v1::Program& program);

  const v1::Program& program() const { return *program_; }
  // Every instruction of the program and of its functions: a backend
  // prepares each once, by this index.
  const std::vector<Instr>& instrs() const { return instrs_; }
  const std::vector<Function>& functions() const { return functions_; }
  // Marks control-flow instruction `i` as run by the backend's ExecuteFn
  // (a loop it compiles whole); called while preparing, before any Run.
  void SetRunByBackend(int i) { instrs_[i].run_by_backend = true; }

  // Runs instruction `i`: reads `values` at its args and stores its results
  // there. `preset[slot]`, where set, is the buffer a result must be written
  // into (a donated argument's), if it is large enough.
  // `scope` is 0 in the program; inside a function it names the call and
  // the iteration, so a collective there has an identity per iteration.
  using ExecuteFn = std::function<absl::Status(
      int i, std::vector<BufferPtr>& values, const std::vector<BufferPtr>& preset, uint64_t scope)>;
  // Runs the program on `device`, control flow included: loops and
  // branches run here, reading their predicates and indices with
  // Device::CopyToHost and moving scan slices with Device::CopyWithin.
  absl::StatusOr<std::vector<BufferPtr>> Run(absl::Span<const BufferPtr> args,
                                             absl::Span<const BufferPtr> into, Device& device,
                                             const ExecuteFn& execute) const;

  // The buffer for result slot `slot` of `bytes`: the preset one if it fits, else a new one.
  static absl::StatusOr<BufferPtr> ResultBuffer(Device& device,
                                                const std::vector<BufferPtr>& preset, int slot,
                                                int64_t bytes);

 private:
  // A function's values while it runs; kept across a loop's iterations so
  // that an iteration allocates no bookkeeping.
  struct Frame {
    std::vector<BufferPtr> values, preset;
  };
  absl::Status AddFunction(const v1::Program& p, const std::vector<std::string>& names);
  // Runs function `f` on `args` (moved from when `consume`); its outputs
  // go to `outs`. `frame` is left empty.
  absl::Status RunFunction(int f, absl::Span<BufferPtr> args, bool consume,
                           absl::Span<const BufferPtr> into, Device& device,
                           const ExecuteFn& execute, uint64_t scope, Frame& frame,
                           std::vector<BufferPtr>& outs) const;
  absl::Status RunControlFlow(int i, std::vector<BufferPtr>& values,
                              const std::vector<BufferPtr>& preset, Device& device,
                              const ExecuteFn& execute, uint64_t scope) const;

  std::unique_ptr<v1::Program> program_;  // owns the nodes instructions point into
  std::vector<std::unique_ptr<v1::Fusion>>
      lone_nodes_;  // one-node fusions of lone elementwise nodes
  std::vector<Function> functions_;
  std::vector<Instr> instrs_;
};

}  // namespace tessel::worker
