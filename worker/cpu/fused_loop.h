// FusedLoop: a fusion of elementwise nodes compiled for blockwise
// evaluation. Each block of kBlock elements is carried through every node of
// the chain while it is in cache, so the fusion reads its inputs and writes
// its outputs once: one pass over memory, not one per op.
//
// Built once per loaded program; Run is const and may be called from any
// thread (scratch lives on the caller's stack frame).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "tessel/v1/program.pb.h"
#include "worker/cpu/elementwise.h"

namespace tessel::cpu {

// The number of elements a fusion loops over: that of its nodes of other
// than one element (one-element values are splatted), 1 when it has none.
// Not the largest: a size-0 run with a scalar in it has no elements, and a
// loop over the scalar's one would index an empty shape. Every backend's
// fused kernels use this rule.
int64_t FusionElements(const v1::Fusion& fusion);

class BoundFusion;

class FusedLoop {
 public:
  static constexpr int64_t kBlock = 2048;

  // `input_types` are the types of fusion.inputs(), in order.
  static absl::StatusOr<FusedLoop> Build(const v1::Fusion& fusion,
                                         const std::vector<v1::TensorType>& input_types);

  // `inputs` follow fusion.inputs(); `outputs` follow fusion.outputs() and
  // must hold the output types' bytes.
  // Loops of at least kParallelElements (each transcendental op counting
  // its elements nine times over) split their blocks over up to
  // `threads` threads (each block is independent, so in-place outputs stay
  // safe: an element is read and written by the same thread).
  void Run(absl::Span<const void* const> inputs, absl::Span<void* const> outputs,
           int threads = 1) const;
  static constexpr int64_t kParallelElements = int64_t{1} << 20;

  // The same loop as a compiled function of element ranges (NativeFusion's):
  // split over threads as Run splits its blocks.
  using RangeFn = void (*)(const void* const* in, void* const* out, int64_t begin, int64_t end);
  void RunRanges(RangeFn fn, absl::Span<const void* const> inputs, absl::Span<void* const> outputs,
                 int threads) const;
  // Whether Run streams its outputs (kStreamBytes): a compiled loop would not.
  bool streams() const { return stream_; }
  // The threads a run over `threads` uses: 1 below kParallelElements.
  int ThreadsFor(int threads) const;
  // Outputs of at least this many bytes are written with non-temporal
  // stores: each block is made in a thread's scratch, then streamed out,
  // so an output too big to stay in cache costs its write and no read.
  static constexpr int64_t kStreamBytes = int64_t{32} << 20;

  const std::vector<v1::TensorType>& output_types() const { return output_types_; }
  int64_t elements() const { return elements_; }

  // The fusion bound to fixed buffers, for a caller that runs it many
  // times on the same addresses (a device-side loop). Only fusions of at
  // most kBlock elements (one block) bind. The BoundFusion refers to this
  // FusedLoop, which must outlive it.
  absl::StatusOr<BoundFusion> Bind(absl::Span<const void* const> inputs,
                                   absl::Span<void* const> outputs) const;

 private:
  friend class BoundFusion;
  enum class SlotKind { kInput, kOutput, kTemp, kConst };
  struct Step;
  // Runs every step (or one) on the block at `start` of `len` elements,
  // with `ptr[slot]` pointing at each slot's block.
  void RunSteps(void* const* ptr, int64_t start, int64_t len) const;
  void RunStep(const Step& st, void* const* ptr, int64_t start, int64_t len) const;
  void RunBlocks(absl::Span<const void* const> inputs, absl::Span<void* const> outputs,
                 absl::Span<const std::vector<char>> splats, int64_t begin, int64_t end) const;
  struct Slot {
    SlotKind kind;
    v1::DType dtype;
    int esize;
    int index;  // input / output / temp index, or offset into const_blocks_
  };
  struct Step {
    const v1::Node* node;
    int out;                // slot
    std::vector<int> args;  // slots
    // The kernel, resolved at build for unary, binary and compare nodes;
    // the others switch on the node per block.
    UnaryFn unary = nullptr;
    BinaryFn binary = nullptr;
  };

  v1::Fusion fusion_;  // owns the nodes the steps point into
  int64_t elements_ = 0;
  int64_t cost_ = 1;  // per element: 1, and 8 per transcendental op
  std::vector<Slot> slots_;
  std::vector<Step> steps_;
  std::vector<v1::TensorType> output_types_;
  std::vector<int> splat_inputs_;  // input slots holding one element, splatted per Run
  std::vector<std::pair<int, int>> scalar_outputs_;  // (const slot, output index)
  std::vector<std::vector<char>> const_blocks_;      // splatted scalar constants
  int num_temps_ = 0;
  std::vector<int64_t> temp_offset_;  // per temp: its offset in a thread's scratch, 64-byte aligned
  int64_t temp_bytes_ = 0;
  std::vector<int> output_slots_;  // slots of the outputs the steps write
  std::vector<int64_t>
      stage_offset_;  // per output slot: its staging block, after the temps, when streamed
  int64_t stage_bytes_ = 0;
  bool stream_ = false;  // an output of kStreamBytes or more: every output is streamed
};

// A FusedLoop bound to fixed buffers: its block's pointers resolved and its
// constants written once, so a run is the splat of one-element inputs and
// the kernels. Owns its temporaries; one Run at a time.
class BoundFusion {
 public:
  void Run() const;
  // Re-points input `i` (a loop reading the next slice).
  void SetInput(int i, const void* p);

 private:
  friend class FusedLoop;
  struct Splat {
    int slot;
    const void* src;
    int esize;
  };
  struct ScalarOutput {
    void* dst;
    const void* src;
    int esize;
  };
  // A step with its kernel's operands resolved; others go through RunStep.
  struct Call {
    UnaryFn unary;
    BinaryFn binary;
    const void *a, *b;
    void* out;
    const FusedLoop::Step* step;
  };
  void Resolve();  // the calls' addresses from ptr_
  const FusedLoop* loop_ = nullptr;
  int64_t len_ = 0;
  std::vector<void*> ptr_;
  std::unique_ptr<char[]> scratch_;  // temps, then splat blocks
  std::vector<Splat> splats_;
  std::vector<ScalarOutput> scalar_outputs_;
  std::vector<Call> calls_;
};

// Writes a literal constant's elements (data, f or i) into `out`.
void MaterializeLiteral(const v1::Node& node, void* out);

}  // namespace tessel::cpu
