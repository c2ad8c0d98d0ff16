#include "worker/cpu/device_loop.h"

#include <cstring>
#include <numeric>

#include "absl/container/inlined_vector.h"
#include "core/dtype.h"
#include "core/status.h"

namespace tessel::cpu {

using worker::BufferPtr;
using worker::SlotProgram;

std::optional<DeviceLoop::Function> DeviceLoop::Prepare(
    const SlotProgram& program, int f, const std::vector<const FusedLoop*>& fusions) {
  const SlotProgram::Function& sf = program.functions()[f];
  Function fn;
  fn.num_slots = sf.num_slots;
  fn.root.resize(sf.num_slots);
  std::iota(fn.root.begin(), fn.root.end(), 0);
  fn.bytes.assign(sf.num_slots, -1);
  for (int j = sf.begin; j < sf.end; ++j) {
    const SlotProgram::Instr& in = program.instrs()[j];
    if (!in.calls.empty()) return std::nullopt;  // nested control flow
    if (in.fusion != nullptr) {
      if (fusions[j] == nullptr || fusions[j]->elements() > FusedLoop::kBlock) return std::nullopt;
      Call c{fusions[j], {}, {}};
      for (int a : in.args) c.args.push_back(fn.root[a]);
      for (size_t k = 0; k < in.results.size(); ++k) {
        c.results.push_back(in.results[k]);
        fn.bytes[in.results[k]] = ByteSizeUnchecked(in.result_types[k]);
      }
      fn.calls.push_back(std::move(c));
    } else if (in.node->op() == v1::RESHAPE) {
      fn.root[in.results[0]] = fn.root[in.args[0]];
    } else {
      return std::nullopt;  // a collective, a literal, a layout op: the generic driver runs it
    }
  }
  fn.param_slots = sf.param_slots;
  for (int s : sf.output_slots) fn.output_slots.push_back(fn.root[s]);
  return fn;
}

std::optional<DeviceLoop> DeviceLoop::Build(const SlotProgram& program, int instr,
                                            const std::vector<const FusedLoop*>& fusions) {
  const SlotProgram::Instr& in = program.instrs()[instr];
  if (in.node == nullptr || (in.node->op() != v1::WHILE && in.node->op() != v1::SCAN))
    return std::nullopt;
  const v1::Node& n = *in.node;
  DeviceLoop loop;
  loop.instr_ = &in;
  loop.scan_ = n.op() == v1::SCAN;
  int64_t bytes = 0;
  auto count = [&](const Function& fn) {
    for (int64_t b : fn.bytes) bytes += std::max<int64_t>(b, 0);
  };
  if (loop.scan_) {
    loop.carries_ = n.control().num_carry();
    loop.length_ = n.control().length();
    loop.reverse_ = n.control().reverse();
    std::optional<Function> body = Prepare(program, in.calls[0], fusions);
    if (!body) return std::nullopt;
    loop.body_ = std::move(*body);
    for (size_t x = loop.carries_; x < in.args.size(); ++x) {
      const v1::TensorType& t = in.arg_types[x];
      loop.x_slice_bytes_.push_back(t.dims(0) == 0 ? 0 : ByteSizeUnchecked(t) / t.dims(0));
    }
    const auto& out_types = program.functions()[in.calls[0]].output_types;
    for (size_t y = loop.carries_; y < out_types.size(); ++y) {
      loop.y_bytes_.push_back(ByteSizeUnchecked(out_types[y]));
      int from = -1;
      for (size_t x = loop.carries_; x < loop.body_.param_slots.size(); ++x) {
        if (loop.body_.output_slots[y] == loop.body_.param_slots[x]) from = int(x) - loop.carries_;
      }
      loop.y_from_x_.push_back(from);
    }
    loop.x_readers_.resize(loop.x_slice_bytes_.size());
    for (size_t c = 0; c < loop.body_.calls.size(); ++c) {
      const std::vector<int>& args = loop.body_.calls[c].args;
      for (size_t a = 0; a < args.size(); ++a) {
        for (size_t x = 0; x < loop.x_slice_bytes_.size(); ++x) {
          if (args[a] == loop.body_.param_slots[loop.carries_ + x])
            loop.x_readers_[x].emplace_back(int(c), int(a));
        }
      }
    }
  } else {
    loop.carries_ = int(in.args.size());
    loop.cond_ = Prepare(program, in.calls[0], fusions);
    std::optional<Function> body = Prepare(program, in.calls[1], fusions);
    if (!loop.cond_ || !body) return std::nullopt;
    loop.body_ = std::move(*body);
    const auto& pred = program.functions()[in.calls[0]].output_types;
    if (pred.size() != 1 || pred[0].dtype() != v1::PRED || NumElementsUnchecked(pred[0]) != 1)
      return std::nullopt;
    count(*loop.cond_);
  }
  count(loop.body_);
  if (bytes > kMaxValueBytes) return std::nullopt;
  // Each carry is written fresh by a fusion, or passed through unchanged.
  // A carry that takes another carry's value would make an iteration read
  // a buffer the same iteration writes: the generic driver runs those.
  for (int k = 0; k < loop.carries_; ++k) {
    const int root = loop.body_.output_slots[k];
    if (root != loop.body_.param_slots[k] && loop.body_.bytes[root] < 0) return std::nullopt;
  }
  return loop;
}

absl::StatusOr<std::vector<BoundFusion>> DeviceLoop::Bind(const Function& fn,
                                                          const std::vector<void*>& addr) {
  std::vector<BoundFusion> bound;
  for (const Call& c : fn.calls) {
    absl::InlinedVector<const void*, 8> ins;
    absl::InlinedVector<void*, 4> outs;
    for (int a : c.args) ins.push_back(addr[a]);
    for (int r : c.results) outs.push_back(addr[r]);
    TESSEL_ASSIGN_OR_RETURN(BoundFusion b, c.fusion->Bind(ins, outs));
    bound.push_back(std::move(b));
  }
  return bound;
}

absl::Status DeviceLoop::Run(std::vector<BufferPtr>& values, const std::vector<BufferPtr>& preset,
                             worker::Device& device) const {
  const SlotProgram::Instr& in = *instr_;
  // The values every fusion writes: two sets for the body, one for the
  // condition, allocated once for the whole loop.
  auto allocate = [&](const Function& fn, std::vector<BufferPtr>& owned) -> absl::Status {
    owned.assign(fn.num_slots, nullptr);
    for (int s = 0; s < fn.num_slots; ++s) {
      if (fn.bytes[s] < 0) continue;
      TESSEL_ASSIGN_OR_RETURN(owned[s], device.Allocate(fn.bytes[s]));
    }
    return absl::OkStatus();
  };
  std::vector<BufferPtr> body_owned[2], cond_owned;
  for (int q = 0; q < 2; ++q) TESSEL_RETURN_IF_ERROR(allocate(body_, body_owned[q]));
  if (cond_) TESSEL_RETURN_IF_ERROR(allocate(*cond_, cond_owned));

  // The carries an iteration reads: the operands (set -1), or those the
  // previous iteration wrote into set `q` (a carry passed through stays
  // its operand).
  auto carry_buffer = [&](int k, int q) -> const BufferPtr& {
    const int root = body_.output_slots[k];
    if (q < 0 || root == body_.param_slots[k]) return values[in.args[k]];
    return body_owned[q][root];
  };
  // Addresses of `fn`'s slots in variant v: v = 0 reads the operands and
  // writes set 0, v = 1 reads set 0 and writes set 1, v = 2 reads set 1
  // and writes set 0.
  constexpr int kReads[3] = {-1, 0, 1}, kWrites[3] = {0, 1, 0};
  auto addresses = [&](const Function& fn, const std::vector<BufferPtr>& owned, int v) {
    std::vector<void*> addr(fn.num_slots, nullptr);
    for (int s = 0; s < fn.num_slots; ++s) {
      if (owned[s]) addr[s] = owned[s]->opaque();
    }
    for (int k = 0; k < carries_; ++k)
      addr[fn.param_slots[k]] = carry_buffer(k, kReads[v])->opaque();
    for (size_t x = 0; x < x_slice_bytes_.size(); ++x) {
      addr[fn.param_slots[carries_ + x]] = values[in.args[carries_ + x]]->opaque();
    }
    return addr;
  };
  std::vector<BoundFusion> body[3], cond[3];
  std::vector<void*> body_addr[3];
  const uint8_t* pred[3] = {nullptr, nullptr, nullptr};
  for (int v = 0; v < 3; ++v) {
    body_addr[v] = addresses(body_, body_owned[kWrites[v]], v);
    TESSEL_ASSIGN_OR_RETURN(body[v], Bind(body_, body_addr[v]));
    if (cond_) {
      std::vector<void*> addr = addresses(*cond_, cond_owned, v);
      TESSEL_ASSIGN_OR_RETURN(cond[v], Bind(*cond_, addr));
      pred[v] = static_cast<const uint8_t*>(addr[cond_->output_slots[0]]);
    }
  }

  std::vector<BufferPtr> stacked;  // scan: the ys
  for (size_t y = 0; y < y_bytes_.size(); ++y) {
    const int slot = in.results[carries_ + y];
    TESSEL_ASSIGN_OR_RETURN(
        BufferPtr b, SlotProgram::ResultBuffer(device, preset, slot,
                                               ByteSizeUnchecked(in.result_types[carries_ + y])));
    stacked.push_back(std::move(b));
  }
  std::vector<const char*> slice(x_slice_bytes_.size());
  int64_t it = 0;
  for (;; ++it) {
    const int v = it == 0 ? 0 : (it & 1) ? 1 : 2;
    if (scan_) {
      if (it == length_) break;
    } else {
      for (const BoundFusion& f : cond[v]) f.Run();
      if (*pred[v] == 0) break;
    }
    const int64_t step = reverse_ ? length_ - 1 - it : it;
    for (size_t x = 0; x < x_slice_bytes_.size(); ++x) {
      slice[x] = static_cast<const char*>(values[in.args[carries_ + x]]->opaque()) +
                 step * x_slice_bytes_[x];
      for (const auto& [c, a] : x_readers_[x]) body[v][c].SetInput(a, slice[x]);
    }
    for (const BoundFusion& f : body[v]) f.Run();
    for (size_t y = 0; y < y_bytes_.size(); ++y) {
      const void* src =
          y_from_x_[y] >= 0 ? slice[y_from_x_[y]] : body_addr[v][body_.output_slots[carries_ + y]];
      std::memcpy(static_cast<char*>(stacked[y]->opaque()) + step * y_bytes_[y], src, y_bytes_[y]);
    }
  }
  // `it` body iterations ran; the last wrote set (it - 1) % 2.
  const int last = it == 0 ? -1 : int((it - 1) & 1);
  std::vector<BufferPtr> results;
  for (int k = 0; k < carries_; ++k) {
    BufferPtr r = carry_buffer(k, last);
    // A carry whose operand was donated to its result ends in that buffer,
    // as the generic driver's in-place update leaves it.
    const BufferPtr& donated = preset[in.results[k]];
    if (donated && donated == values[in.args[k]] && donated != r) {
      std::memcpy(donated->opaque(), r->opaque(), ByteSizeUnchecked(in.result_types[k]));
      r = donated;
    }
    results.push_back(std::move(r));
  }
  for (int k = 0; k < carries_; ++k) values[in.results[k]] = std::move(results[k]);
  for (size_t y = 0; y < stacked.size(); ++y)
    values[in.results[carries_ + y]] = std::move(stacked[y]);
  return absl::OkStatus();
}

}  // namespace tessel::cpu
