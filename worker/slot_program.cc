#include "worker/slot_program.h"

#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"

namespace tessel::worker {
namespace {

bool IsControlFlowOp(v1::Op op) {
  return op == v1::WHILE || op == v1::CONDITIONAL || op == v1::SCAN;
}

std::vector<std::string> Calls(const v1::Node& n) {
  const v1::ControlFlowAttrs& c = n.control();
  switch (n.op()) {
    case v1::WHILE: return {c.cond(), c.body()};
    case v1::SCAN: return {c.body()};
    default: return {c.branches().begin(), c.branches().end()};
  }
}

// The scope of one run of function call `part` of instruction `i` in
// iteration `iteration`, inside `parent`.
uint64_t ScopeOf(uint64_t parent, int i, int part, int64_t iteration) {
  uint64_t h = parent ^ 0x9e3779b97f4a7c15ull;
  for (uint64_t v : {uint64_t(i), uint64_t(part), uint64_t(iteration)}) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0x100000001b3ull;
  }
  return h == 0 ? 1 : h;
}

}  // namespace

absl::StatusOr<SlotProgram> SlotProgram::Build(const v1::Program& program) {
  SlotProgram sp;
  sp.program_ = std::make_unique<v1::Program>(program);
  std::vector<std::string> names = {""};
  for (const v1::Program& f : sp.program_->functions()) names.push_back(f.executable_id());
  TESSEL_RETURN_IF_ERROR(sp.AddFunction(*sp.program_, names));
  for (const v1::Program& f : sp.program_->functions())
    TESSEL_RETURN_IF_ERROR(sp.AddFunction(f, names));
  return sp;
}

absl::Status SlotProgram::AddFunction(const v1::Program& p, const std::vector<std::string>& names) {
  Function fn;
  fn.name = p.executable_id();
  fn.begin = int(instrs_.size());
  absl::flat_hash_map<std::string, int> slot_of;
  absl::flat_hash_map<std::string, v1::TensorType> type_of;
  auto define = [&](const std::string& name, const v1::TensorType& t) {
    slot_of[name] = fn.num_slots++;
    type_of[name] = t;
    return slot_of[name];
  };
  auto lookup = [&](const std::string& name) -> absl::StatusOr<int> {
    auto it = slot_of.find(name);
    if (it == slot_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("program ", p.executable_id(), " reads undefined value '", name, "'"));
    }
    return it->second;
  };
  for (const v1::Node& prm : p.parameters()) {
    fn.param_slots.push_back(define(prm.name(), prm.type()));
    fn.param_types.push_back(prm.type());
  }
  for (const v1::Instruction& ins : p.instructions()) {
    Instr in;
    if (ins.has_fusion() || IsElementwise(ins.node().op())) {
      if (ins.has_fusion()) {
        in.fusion = &ins.fusion();
      } else {
        auto single = std::make_unique<v1::Fusion>();
        *single->add_nodes() = ins.node();
        for (const std::string& o : ins.node().operands()) {
          bool seen = false;
          for (const std::string& i : single->inputs()) seen |= i == o;
          if (!seen) single->add_inputs(o);
        }
        single->add_outputs(ins.node().name());
        in.fusion = single.get();
        lone_nodes_.push_back(std::move(single));
      }
      for (const std::string& i : in.fusion->inputs()) {
        TESSEL_ASSIGN_OR_RETURN(int slot, lookup(i));
        in.args.push_back(slot);
        in.arg_types.push_back(type_of[i]);
      }
      absl::flat_hash_map<std::string, const v1::TensorType*> node_type;
      for (const v1::Node& n : in.fusion->nodes()) node_type[n.name()] = &n.type();
      for (const std::string& o : in.fusion->outputs()) {
        auto it = node_type.find(o);
        if (it == node_type.end()) {
          return absl::InternalError(absl::StrCat("fusion output '", o, "' is not a fusion node"));
        }
        in.results.push_back(define(o, *it->second));
        in.result_types.push_back(*it->second);
      }
    } else {
      in.node = &ins.node();
      for (const std::string& o : in.node->operands()) {
        TESSEL_ASSIGN_OR_RETURN(int slot, lookup(o));
        in.args.push_back(slot);
        in.arg_types.push_back(type_of[o]);
      }
      if (IsControlFlowOp(in.node->op())) {
        if (ins.results_size() != in.node->results_size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "program ", p.executable_id(), ": ", OpName(in.node->op()), " '", in.node->name(),
              "' names ", ins.results_size(), " results of its ", in.node->results_size()));
        }
        for (int k = 0; k < ins.results_size(); ++k) {
          in.results.push_back(define(ins.results(k), in.node->results(k)));
          in.result_types.push_back(in.node->results(k));
        }
        for (const std::string& f : Calls(*in.node)) {
          int found = -1;
          for (size_t k = 1; k < names.size(); ++k) {
            if (names[k] == f) found = int(k);
          }
          if (found < 0) {
            return absl::InvalidArgumentError(absl::StrCat(
                "program ", p.executable_id(), ": ", OpName(in.node->op()), " '", in.node->name(),
                "' runs function '", f, "', which the program does not define"));
          }
          in.calls.push_back(found);
        }
      } else {
        in.results.push_back(define(in.node->name(), in.node->type()));
        in.result_types.push_back(in.node->type());
      }
    }
    for (const std::string& r : ins.release()) {
      TESSEL_ASSIGN_OR_RETURN(int slot, lookup(r));
      in.release.push_back(slot);
    }
    instrs_.push_back(std::move(in));
  }
  fn.end = int(instrs_.size());
  // A reshape's value is its operand's buffer.
  absl::flat_hash_map<std::string, std::string> reshaped_from;
  for (const v1::Instruction& ins : p.instructions()) {
    if (ins.has_node() && ins.node().op() == v1::RESHAPE)
      reshaped_from[ins.node().name()] = ins.node().operands(0);
  }
  for (const std::string& o : p.outputs()) {
    TESSEL_ASSIGN_OR_RETURN(int slot, lookup(o));
    fn.output_slots.push_back(slot);
    fn.output_types.push_back(type_of[o]);
    std::string root = o;
    for (auto it = reshaped_from.find(root); it != reshaped_from.end();
         it = reshaped_from.find(root))
      root = it->second;
    fn.output_buffer_slots.push_back(slot_of.at(root));
  }
  fn.parameter_aliases.assign(p.parameters_size(), -1);
  for (int i = 0; i < p.parameter_aliases_size() && i < p.parameters_size(); ++i) {
    const int o = p.parameter_aliases(i);
    if (o >= 0 && o < p.outputs_size()) fn.parameter_aliases[i] = o;
  }
  functions_.push_back(std::move(fn));
  return absl::OkStatus();
}

absl::StatusOr<BufferPtr> SlotProgram::ResultBuffer(Device& device,
                                                    const std::vector<BufferPtr>& preset, int slot,
                                                    int64_t bytes) {
  if (preset[slot] && preset[slot]->size() >= bytes) return preset[slot];
  return device.Allocate(bytes);
}

absl::StatusOr<std::vector<BufferPtr>> SlotProgram::Run(absl::Span<const BufferPtr> args,
                                                        absl::Span<const BufferPtr> into,
                                                        Device& device,
                                                        const ExecuteFn& execute) const {
  Frame frame;
  std::vector<BufferPtr> outs, copy(args.begin(), args.end());
  TESSEL_RETURN_IF_ERROR(
      RunFunction(0, absl::MakeSpan(copy), true, into, device, execute, 0, frame, outs));
  return outs;
}

absl::Status SlotProgram::RunFunction(int f, absl::Span<BufferPtr> args, bool consume,
                                      absl::Span<const BufferPtr> into, Device& device,
                                      const ExecuteFn& execute, uint64_t scope, Frame& frame,
                                      std::vector<BufferPtr>& outs) const {
  const Function& fn = functions_[f];
  if (args.size() != fn.param_slots.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("program ", f == 0 ? program_->executable_id() : fn.name, ": expected ",
                     fn.param_slots.size(), " arguments, got ", args.size()));
  }
  std::vector<BufferPtr>& values = frame.values;
  std::vector<BufferPtr>& preset = frame.preset;
  values.assign(fn.num_slots, nullptr);
  preset.assign(fn.num_slots, nullptr);
  auto clear = [&] {
    std::fill(values.begin(), values.end(), nullptr);
    std::fill(preset.begin(), preset.end(), nullptr);
  };
  for (size_t i = 0; i < args.size(); ++i) {
    values[fn.param_slots[i]] = consume ? std::move(args[i]) : args[i];
  }
  for (size_t i = 0; i < into.size() && i < fn.output_buffer_slots.size(); ++i) {
    if (into[i]) preset[fn.output_buffer_slots[i]] = into[i];
  }
  for (int i = fn.begin; i < fn.end; ++i) {
    absl::Status s = instrs_[i].calls.empty() || instrs_[i].run_by_backend
                         ? execute(i, values, preset, scope)
                         : RunControlFlow(i, values, preset, device, execute, scope);
    if (!s.ok()) {
      clear();
      return s;
    }
    for (int r : instrs_[i].release) values[r].reset();
  }
  outs.clear();
  for (int s : fn.output_slots) outs.push_back(values[s]);
  clear();
  return absl::OkStatus();
}

absl::Status SlotProgram::RunControlFlow(int i, std::vector<BufferPtr>& values,
                                         const std::vector<BufferPtr>& preset, Device& device,
                                         const ExecuteFn& execute, uint64_t scope) const {
  const Instr& in = instrs_[i];
  const v1::Node& n = *in.node;
  const std::string what = absl::StrCat(OpName(n.op()), " '", n.name(), "'");
  std::vector<BufferPtr> operands;
  for (int a : in.args) operands.push_back(values[a]);
  auto read_scalar = [&](const BufferPtr& b, v1::DType dt) -> absl::StatusOr<int64_t> {
    if (dt == v1::PRED) {
      uint8_t v = 0;
      TESSEL_RETURN_IF_ERROR(device.CopyToHost(*b, 0, &v, 1));
      return v != 0;
    }
    int32_t v = 0;
    TESSEL_RETURN_IF_ERROR(device.CopyToHost(*b, 0, &v, sizeof(v)));
    return v;
  };
  auto finish = [&](std::vector<BufferPtr> results) {
    for (size_t k = 0; k < in.results.size(); ++k) values[in.results[k]] = std::move(results[k]);
  };

  Frame frame;
  std::vector<BufferPtr> outs;
  if (n.op() == v1::CONDITIONAL) {
    TESSEL_ASSIGN_OR_RETURN(int64_t index, read_scalar(operands[0], in.arg_types[0].dtype()));
    // Out of range runs the last branch, as XLA does.
    const int nb = int(in.calls.size());
    const int b = index < 0 || index >= nb ? nb - 1 : int(index);
    std::vector<BufferPtr> args(operands.begin() + 1, operands.end());
    absl::Status s = RunFunction(in.calls[b], absl::MakeSpan(args), true, {}, device, execute,
                                 ScopeOf(scope, i, 2 + b, 0), frame, outs);
    if (!s.ok()) return Annotate(s, absl::StrCat(what, " branch ", b, ": "));
    finish(std::move(outs));
    return absl::OkStatus();
  }

  const bool scan = n.op() == v1::SCAN;
  const int body = scan ? in.calls[0] : in.calls[1];
  const Function& bf = functions_[body];
  const int carries = scan ? n.control().num_carry() : int(operands.size());
  std::vector<BufferPtr> carry(operands.begin(), operands.begin() + carries);
  // A carry updates in place when nothing else holds its buffer (after the
  // first iteration, the loop's own), or when it is the donated buffer the
  // plan gave this result.
  std::vector<bool> own(carries, false);
  for (int k = 0; k < carries; ++k)
    own[k] = preset[in.results[k]] && preset[in.results[k]] == carry[k];
  operands.clear();                // the xs stay in `values`
  std::vector<BufferPtr> stacked;  // scan: the ys
  int64_t length = 0;
  if (scan) {
    length = n.control().length();
    for (size_t k = carries; k < in.results.size(); ++k) {
      TESSEL_ASSIGN_OR_RETURN(BufferPtr b, ResultBuffer(device, preset, in.results[k],
                                                        ByteSizeUnchecked(in.result_types[k])));
      stacked.push_back(std::move(b));
    }
  }
  std::vector<BufferPtr> into(bf.output_slots.size()), args, pred;
  for (int64_t it = 0;; ++it) {
    if (scan) {
      if (it == length) break;
    } else {
      // The last predicate's buffer, read and held only here, takes the next.
      absl::Status s = RunFunction(in.calls[0], absl::MakeSpan(carry), false, pred, device, execute,
                                   ScopeOf(scope, i, 0, it), frame, pred);
      if (!s.ok()) return Annotate(s, absl::StrCat(what, " condition, iteration ", it, ": "));
      TESSEL_ASSIGN_OR_RETURN(int64_t holds, read_scalar(pred[0], v1::PRED));
      if (!holds) break;
    }
    args.swap(carry);
    const int64_t step = scan && n.control().reverse() ? length - 1 - it : it;
    for (size_t x = carries; x < in.args.size(); ++x) {
      const v1::TensorType& t = in.arg_types[x];
      const int64_t slice = t.dims(0) == 0 ? 0 : ByteSizeUnchecked(t) / t.dims(0);
      TESSEL_ASSIGN_OR_RETURN(BufferPtr b, device.Allocate(slice));
      TESSEL_RETURN_IF_ERROR(device.CopyWithin(*values[in.args[x]], step * slice, *b, 0, slice));
      args.push_back(std::move(b));
    }
    std::fill(into.begin(), into.end(), nullptr);
    for (int k = 0; k < carries; ++k) {
      const int o = bf.parameter_aliases[k];
      if (o < 0) continue;
      // Held only by `args`: nobody else sees the overwrite.
      if (own[k] || args[k].use_count() == 1) into[o] = args[k];
    }
    absl::Status s = RunFunction(body, absl::MakeSpan(args), true, into, device, execute,
                                 ScopeOf(scope, i, 1, it), frame, outs);
    if (!s.ok()) return Annotate(s, absl::StrCat(what, " body, iteration ", it, ": "));
    args.clear();
    for (int k = 0; k < carries; ++k)
      own[k] = own[k] && bf.parameter_aliases[k] == k && outs[k] == into[k];
    for (size_t y = carries; y < outs.size(); ++y) {
      const int64_t bytes = ByteSizeUnchecked(bf.output_types[y]);
      TESSEL_RETURN_IF_ERROR(
          device.CopyWithin(*outs[y], 0, *stacked[y - carries], step * bytes, bytes));
    }
    outs.resize(carries);
    carry.swap(outs);
  }
  carry.insert(carry.end(), stacked.begin(), stacked.end());
  finish(std::move(carry));
  return absl::OkStatus();
}

}  // namespace tessel::worker
