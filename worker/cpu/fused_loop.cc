#include "worker/cpu/fused_loop.h"

#include <algorithm>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "worker/cpu/elementwise.h"
#include "worker/cpu/parallel.h"

namespace tessel::cpu {
namespace {

// memcpy with non-temporal stores where the target is 16-byte aligned: the
// target's lines are written without being read into the cache first.
// Callers fence (StreamFence) before the bytes are read by another thread.
void StreamCopy(void* dst, const void* src, int64_t n) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t head = std::min<int64_t>(n, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
#if defined(__AVX512F__)
  for (; n >= 64 && reinterpret_cast<uintptr_t>(d) % 64 == 0; d += 64, s += 64, n -= 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
  }
#elif defined(__AVX__)
  for (; n >= 32 && reinterpret_cast<uintptr_t>(d) % 32 == 0; d += 32, s += 32, n -= 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  }
#endif
  for (; n >= 16; d += 16, s += 16, n -= 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(d),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  }
  std::memcpy(d, s, n);
#else
  std::memcpy(dst, src, n);
#endif
}

void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

}  // namespace

void MaterializeLiteral(const v1::Node& node, void* out) {
  const v1::Literal& lit = node.constant().literal();
  const int64_t n = NumElementsUnchecked(node.type());
  if (!lit.data().empty()) {
    std::memcpy(out, lit.data().data(), lit.data().size());
  } else if (lit.f_size() > 0) {
    ConvertKernel(v1::F64, node.type().dtype(), lit.f().data(), out, n);
  } else if (lit.i_size() > 0) {
    ConvertKernel(v1::S64, node.type().dtype(), lit.i().data(), out, n);
  }
}

int64_t FusionElements(const v1::Fusion& fusion) {
  int64_t elements = 1;
  for (const v1::Node& n : fusion.nodes()) {
    const int64_t e = NumElementsUnchecked(n.type());
    if (e != 1) elements = elements == 1 ? e : std::max(elements, e);
  }
  return elements;
}

absl::StatusOr<FusedLoop> FusedLoop::Build(const v1::Fusion& fusion,
                                           const std::vector<v1::TensorType>& input_types) {
  FusedLoop f;
  f.fusion_ = fusion;
  absl::flat_hash_map<std::string, int> slot_of;
  f.elements_ = FusionElements(f.fusion_);
  // A transcendental costs about what eight cheap ops do (a polynomial and
  // its range reduction): enough of them split a smaller loop over threads.
  for (const v1::Node& n : f.fusion_.nodes()) {
    switch (n.op()) {
      case v1::EXP:
      case v1::EXPM1:
      case v1::LOG:
      case v1::LOG1P:
      case v1::TANH:
      case v1::LOGISTIC:
      case v1::ERF:
      case v1::SIN:
      case v1::COS:
      case v1::TAN:
      case v1::POW:
      case v1::ATAN2:
      case v1::ATAN:
      case v1::ASIN:
      case v1::ACOS:
      case v1::SINH:
      case v1::COSH:
      case v1::ASINH:
      case v1::ACOSH:
      case v1::ATANH:
      case v1::CBRT: f.cost_ += 8; break;
      default: break;
    }
  }
  for (int i = 0; i < f.fusion_.inputs_size(); ++i) {
    const v1::TensorType& t = input_types[i];
    int slot = f.slots_.size();
    f.slots_.push_back({SlotKind::kInput, t.dtype(), DTypeSize(t.dtype()), i});
    if (NumElementsUnchecked(t) != f.elements_) {
      // A one-element value (select predicate, clamp bound, broadcast source).
      f.slots_[slot].kind = SlotKind::kConst;
      f.slots_[slot].index = f.const_blocks_.size();
      f.const_blocks_.emplace_back(kBlock * DTypeSize(t.dtype()));
      f.splat_inputs_.push_back(slot);
    }
    slot_of[f.fusion_.inputs(i)] = slot;
  }
  absl::flat_hash_map<std::string, int> output_index;
  for (int i = 0; i < f.fusion_.outputs_size(); ++i) output_index[f.fusion_.outputs(i)] = i;
  f.output_types_.resize(f.fusion_.outputs_size());

  // The dtype of a value the fusion has seen (an input or an earlier node).
  auto input_dtype = [&](const std::string& name) {
    auto it = slot_of.find(name);
    return it == slot_of.end() ? v1::DTYPE_INVALID : f.slots_[it->second].dtype;
  };
  for (const v1::Node& n : f.fusion_.nodes()) {
    const v1::DType dt = n.type().dtype();
    const int esize = DTypeSize(dt);
    int slot = f.slots_.size();
    auto out_it = output_index.find(n.name());
    const bool is_scalar_const =
        n.op() == v1::CONSTANT && !n.constant().has_iota() && NumElementsUnchecked(n.type()) == 1;
    if (is_scalar_const) {
      // Evaluate once, splat into a constant block.
      std::vector<char> one(esize);
      if (n.constant().has_fill()) {
        FillKernel(dt, n.constant().fill(), one.data(), 1);
      } else {
        MaterializeLiteral(n, one.data());
      }
      std::vector<char> block(kBlock * esize);
      SplatKernel(esize, one.data(), block.data(), kBlock);
      f.slots_.push_back({SlotKind::kConst, dt, esize, int(f.const_blocks_.size())});
      f.const_blocks_.push_back(std::move(block));
      if (out_it != output_index.end()) {
        f.scalar_outputs_.emplace_back(slot, out_it->second);
        f.output_types_[out_it->second] = n.type();
      }
      slot_of[n.name()] = slot;
      continue;
    }
    if (n.op() == v1::BROADCAST_IN_DIM && out_it == output_index.end() && n.operands_size() == 1) {
      // A broadcast of a splatted one-element value reads as that value's
      // block: no copy per block.
      auto src = slot_of.find(n.operands(0));
      if (src != slot_of.end() && f.slots_[src->second].kind == SlotKind::kConst &&
          f.slots_[src->second].dtype == dt) {
        slot_of[n.name()] = src->second;
        continue;
      }
    }
    if (n.op() != v1::CONSTANT && n.op() != v1::BROADCAST_IN_DIM && !IsElementwise(n.op())) {
      return absl::InternalError(absl::StrCat("fusion holds non-elementwise node '", n.name(),
                                              "' (", OpName(n.op()), ")"));
    }
    if (n.op() == v1::CONSTANT && n.constant().has_literal()) {
      return absl::InternalError(
          absl::StrCat("fusion holds a non-scalar literal '", n.name(), "'"));
    }
    if (out_it != output_index.end()) {
      f.slots_.push_back({SlotKind::kOutput, dt, esize, out_it->second});
      f.output_types_[out_it->second] = n.type();
    } else {
      f.slots_.push_back({SlotKind::kTemp, dt, esize, f.num_temps_++});
    }
    Step step{&n, slot, {}};
    if (n.op() == v1::COMPARE) {
      step.binary = CompareKernelFor(n.compare().direction(), input_dtype(n.operands(0)));
    } else if (IsElementwise(n.op()) && n.op() != v1::SELECT && n.op() != v1::CLAMP &&
               n.op() != v1::CONVERT) {
      if (n.operands_size() == 1) step.unary = UnaryKernelFor(n.op(), dt);
      if (n.operands_size() == 2) step.binary = BinaryKernelFor(n.op(), dt);
    }
    for (const std::string& o : n.operands()) {
      auto it = slot_of.find(o);
      if (it == slot_of.end()) {
        return absl::InternalError(
            absl::StrCat("fusion node '", n.name(), "' reads '", o,
                         "', which is neither an input nor an earlier node"));
      }
      step.args.push_back(it->second);
    }
    f.steps_.push_back(std::move(step));
    slot_of[n.name()] = slot;
  }
  for (int i = 0; i < f.fusion_.outputs_size(); ++i) {
    if (!slot_of.contains(f.fusion_.outputs(i))) {
      return absl::InternalError(
          absl::StrCat("fusion output '", f.fusion_.outputs(i), "' is not a fusion node"));
    }
  }
  f.temp_offset_.assign(f.num_temps_, 0);
  for (const Slot& s : f.slots_) {
    if (s.kind == SlotKind::kTemp) {
      f.temp_offset_[s.index] = f.temp_bytes_;
      f.temp_bytes_ += (std::min(kBlock, f.elements_) * s.esize + 63) / 64 * 64;
    }
  }
  f.stage_offset_.assign(f.slots_.size(), -1);
  f.stage_bytes_ = f.temp_bytes_;
  for (size_t i = 0; i < f.slots_.size(); ++i) {
    if (f.slots_[i].kind != SlotKind::kOutput) continue;
    f.output_slots_.push_back(i);
    f.stage_offset_[i] = f.stage_bytes_;
    f.stage_bytes_ += (std::min(kBlock, f.elements_) * f.slots_[i].esize + 63) / 64 * 64;
    f.stream_ = f.stream_ || f.elements_ * f.slots_[i].esize >= kStreamBytes;
  }
  return f;
}

void FusedLoop::Run(absl::Span<const void* const> inputs, absl::Span<void* const> outputs,
                    int threads) const {
  // Per-call scratch shared by every thread: the splats of one-element inputs.
  // A block never holds more than the loop's elements (a small loop, a
  // small block: a one-element loop body in a device-side loop splats one).
  const int64_t block = std::min(kBlock, std::max<int64_t>(elements_, 1));
  absl::InlinedVector<std::vector<char>, 4> splats(const_blocks_.size());
  // Input slots come first, so an input's slot number is its index.
  for (int slot : splat_inputs_) {
    const Slot& s = slots_[slot];
    splats[s.index].resize(block * s.esize);
    SplatKernel(s.esize, inputs[slot], splats[s.index].data(), block);
  }
  for (const auto& [slot, out_index] : scalar_outputs_) {
    std::memcpy(outputs[out_index], const_blocks_[slots_[slot].index].data(), slots_[slot].esize);
  }
  const int64_t blocks = (elements_ + kBlock - 1) / kBlock;
  const int n = ThreadsFor(threads);
  if (n <= 1) return RunBlocks(inputs, outputs, splats, 0, blocks);
  // Four pieces a thread: the caller goes on claiming them while a helper
  // is still waking up.
  const int pieces = int(std::min<int64_t>(blocks, 4 * n));
  ParallelFor(pieces, n, [&](int t) {
    RunBlocks(inputs, outputs, splats, blocks * t / pieces, blocks * (t + 1) / pieces);
  });
}

int FusedLoop::ThreadsFor(int threads) const {
  const int64_t blocks = (elements_ + kBlock - 1) / kBlock;
  return elements_ * cost_ >= kParallelElements
             ? int(std::min<int64_t>(std::max(threads, 1), blocks))
             : 1;
}

void FusedLoop::RunRanges(RangeFn fn, absl::Span<const void* const> inputs,
                          absl::Span<void* const> outputs, int threads) const {
  const int n = ThreadsFor(threads);
  const int64_t blocks = (elements_ + kBlock - 1) / kBlock;
  if (n <= 1) return fn(inputs.data(), outputs.data(), 0, elements_);
  const int pieces = int(std::min<int64_t>(blocks, 4 * n));
  ParallelFor(pieces, n, [&](int t) {
    const int64_t begin = std::min(elements_, blocks * t / pieces * kBlock);
    const int64_t end = std::min(elements_, blocks * (t + 1) / pieces * kBlock);
    fn(inputs.data(), outputs.data(), begin, end);
  });
}

void FusedLoop::RunBlocks(absl::Span<const void* const> inputs, absl::Span<void* const> outputs,
                          absl::Span<const std::vector<char>> splats, int64_t begin,
                          int64_t end) const {
  // Per-thread scratch: temp blocks (and, streaming, the outputs' staging
  // blocks), written before read (no need to clear). Small loops keep them
  // on the stack.
  const int64_t scratch = stream_ ? stage_bytes_ : temp_bytes_;
  alignas(64) char small[1024];
  std::unique_ptr<char[]> big(scratch > int64_t(sizeof(small)) ? new char[scratch + 64] : nullptr);
  char* temps =
      big ? reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(big.get()) + 63) / 64 * 64)
          : small;
  absl::InlinedVector<void*, 16> ptr(slots_.size());
  for (int64_t start = begin * kBlock; start < std::min(end * kBlock, elements_); start += kBlock) {
    const int64_t len = std::min(kBlock, elements_ - start);
    for (size_t i = 0; i < slots_.size(); ++i) {
      const Slot& s = slots_[i];
      switch (s.kind) {
        case SlotKind::kInput:
          ptr[i] = const_cast<char*>(static_cast<const char*>(inputs[s.index])) + start * s.esize;
          break;
        case SlotKind::kOutput:
          ptr[i] = stream_ ? temps + stage_offset_[i]
                           : static_cast<char*>(outputs[s.index]) + start * s.esize;
          break;
        case SlotKind::kTemp: ptr[i] = temps + temp_offset_[s.index]; break;
        case SlotKind::kConst:
          ptr[i] = splats[s.index].empty() ? const_cast<char*>(const_blocks_[s.index].data())
                                           : const_cast<char*>(splats[s.index].data());
          break;
      }
    }
    RunSteps(ptr.data(), start, len);
    if (stream_) {
      for (int slot : output_slots_) {
        const Slot& s = slots_[slot];
        StreamCopy(static_cast<char*>(outputs[s.index]) + start * s.esize, ptr[slot],
                   len * s.esize);
      }
    }
  }
  if (stream_) StreamFence();
}

void FusedLoop::RunSteps(void* const* ptr, int64_t start, int64_t len) const {
  for (const Step& st : steps_) RunStep(st, ptr, start, len);
}

void FusedLoop::RunStep(const Step& st, void* const* ptr, int64_t start, int64_t len) const {
  {
    void* out = ptr[st.out];
    if (st.binary != nullptr) {
      st.binary(ptr[st.args[0]], ptr[st.args[1]], out, len);
      return;
    }
    if (st.unary != nullptr) {
      st.unary(ptr[st.args[0]], out, len);
      return;
    }
    const v1::Node& n = *st.node;
    const v1::DType dt = n.type().dtype();
    auto arg = [&](int k) -> const void* { return ptr[st.args[k]]; };
    switch (n.op()) {
      case v1::CONSTANT:
        if (n.constant().has_fill()) {
          FillKernel(dt, n.constant().fill(), out, len);
        } else {
          IotaKernel(dt, n.type().dims(), n.constant().iota().dimension(), start, out, len);
        }
        break;
      case v1::BROADCAST_IN_DIM: std::memcpy(out, arg(0), len * DTypeSize(dt)); break;
      case v1::COMPARE:
        CompareKernel(n.compare().direction(), slots_[st.args[0]].dtype, arg(0), arg(1), out, len);
        break;
      case v1::SELECT: SelectKernel(dt, arg(0), arg(1), arg(2), out, len); break;
      case v1::CLAMP: ClampKernel(dt, arg(0), arg(1), arg(2), out, len); break;
      case v1::CONVERT:
        if (n.convert().bitcast()) {
          std::memcpy(out, arg(0), len * DTypeSize(dt));  // the same bits, as wide (validated)
        } else {
          ConvertKernel(slots_[st.args[0]].dtype, dt, arg(0), out, len);
        }
        break;
      default:
        if (st.args.size() == 1) {
          UnaryKernel(n.op(), dt, arg(0), out, len);
        } else {
          BinaryKernel(n.op(), dt, arg(0), arg(1), out, len);
        }
    }
  }
}

absl::StatusOr<BoundFusion> FusedLoop::Bind(absl::Span<const void* const> inputs,
                                            absl::Span<void* const> outputs) const {
  if (elements_ > kBlock) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a fusion of ", elements_, " elements runs blockwise; only ", kBlock, " or fewer bind"));
  }
  BoundFusion b;
  b.loop_ = this;
  b.len_ = elements_;
  const int64_t block = std::max<int64_t>(elements_, 1);
  int64_t splat_bytes = 0;
  for (int slot : splat_inputs_) splat_bytes += (block * slots_[slot].esize + 63) / 64 * 64;
  b.scratch_.reset(new char[temp_bytes_ + splat_bytes + 64]);
  char* base =
      reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(b.scratch_.get()) + 63) / 64 * 64);
  b.ptr_.resize(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& sl = slots_[i];
    switch (sl.kind) {
      case SlotKind::kInput: b.ptr_[i] = const_cast<void*>(inputs[sl.index]); break;
      case SlotKind::kOutput: b.ptr_[i] = outputs[sl.index]; break;
      case SlotKind::kTemp: b.ptr_[i] = base + temp_offset_[sl.index]; break;
      case SlotKind::kConst: b.ptr_[i] = const_cast<char*>(const_blocks_[sl.index].data()); break;
    }
  }
  char* splat = base + temp_bytes_;
  for (int slot : splat_inputs_) {
    b.splats_.push_back({slot, inputs[slot], slots_[slot].esize});
    b.ptr_[slot] = splat;
    splat += (block * slots_[slot].esize + 63) / 64 * 64;
  }
  for (const auto& [slot, out_index] : scalar_outputs_) {
    b.scalar_outputs_.push_back(
        {outputs[out_index], const_blocks_[slots_[slot].index].data(), slots_[slot].esize});
  }
  // Constants (fills and iotas) land in buffers only they write: once here.
  for (size_t i = 0; i < steps_.size(); ++i) {
    const Step& st = steps_[i];
    if (st.node->op() == v1::CONSTANT) {
      RunStep(st, b.ptr_.data(), 0, elements_);
    } else {
      b.calls_.push_back({st.unary, st.binary, nullptr, nullptr, nullptr, &st});
    }
  }
  b.Resolve();
  return b;
}

void BoundFusion::Resolve() {
  for (Call& c : calls_) {
    c.out = ptr_[c.step->out];
    if (c.unary != nullptr || c.binary != nullptr) c.a = ptr_[c.step->args[0]];
    if (c.binary != nullptr) c.b = ptr_[c.step->args[1]];
  }
}

void BoundFusion::SetInput(int i, const void* p) {
  for (Splat& s : splats_) {
    if (s.slot == i) {
      s.src = p;
      return;
    }
  }
  ptr_[i] = const_cast<void*>(p);  // input slots come first: slot i is input i
  Resolve();
}

void BoundFusion::Run() const {
  for (const Splat& s : splats_)
    SplatKernel(s.esize, s.src, ptr_[s.slot], std::max<int64_t>(len_, 1));
  for (const ScalarOutput& o : scalar_outputs_) std::memcpy(o.dst, o.src, o.esize);
  for (const Call& c : calls_) {
    if (c.binary != nullptr) {
      c.binary(c.a, c.b, c.out, len_);
    } else if (c.unary != nullptr) {
      c.unary(c.a, c.out, len_);
    } else {
      loop_->RunStep(*c.step, ptr_.data(), 0, len_);
    }
  }
}
}  // namespace tessel::cpu
