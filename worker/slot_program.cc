#include "worker/slot_program.h"

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/shape_inference.h"
#include "core/status.h"

namespace tessel::worker {

absl::StatusOr<SlotProgram> SlotProgram::Build(const v1::Program& program) {
  SlotProgram sp;
  sp.program_ = std::make_unique<v1::Program>(program);
  const v1::Program& p = *sp.program_;
  absl::flat_hash_map<std::string, int> slot_of;
  absl::flat_hash_map<std::string, v1::TensorType> type_of;
  auto define = [&](const std::string& name, const v1::TensorType& t) {
    slot_of[name] = sp.num_slots_++;
    type_of[name] = t;
    return slot_of[name];
  };
  auto lookup = [&](const std::string& name) -> absl::StatusOr<int> {
    auto it = slot_of.find(name);
    if (it == slot_of.end()) {
      return absl::InvalidArgumentError(absl::StrCat("program ", p.executable_id(), " reads undefined value '", name, "'"));
    }
    return it->second;
  };
  for (const v1::Node& prm : p.parameters()) sp.param_slots_.push_back(define(prm.name(), prm.type()));
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
        sp.lone_nodes_.push_back(std::move(single));
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
      in.results.push_back(define(in.node->name(), in.node->type()));
      in.result_types.push_back(in.node->type());
    }
    for (const std::string& r : ins.release()) {
      TESSEL_ASSIGN_OR_RETURN(int slot, lookup(r));
      in.release.push_back(slot);
    }
    sp.instrs_.push_back(std::move(in));
  }
  // A reshape's value is its operand's buffer.
  absl::flat_hash_map<std::string, std::string> reshaped_from;
  for (const v1::Instruction& ins : p.instructions()) {
    if (ins.has_node() && ins.node().op() == v1::RESHAPE) reshaped_from[ins.node().name()] = ins.node().operands(0);
  }
  for (const std::string& o : p.outputs()) {
    TESSEL_ASSIGN_OR_RETURN(int slot, lookup(o));
    sp.output_slots_.push_back(slot);
    std::string root = o;
    for (auto it = reshaped_from.find(root); it != reshaped_from.end(); it = reshaped_from.find(root)) root = it->second;
    sp.output_buffer_slots_.push_back(slot_of.at(root));
  }
  return sp;
}

absl::StatusOr<BufferPtr> SlotProgram::ResultBuffer(Device& device, const std::vector<BufferPtr>& preset, int slot,
                                                    int64_t bytes) {
  if (preset[slot] && preset[slot]->size() >= bytes) return preset[slot];
  return device.Allocate(bytes);
}

absl::StatusOr<std::vector<BufferPtr>> SlotProgram::Run(absl::Span<const BufferPtr> args,
                                                        absl::Span<const BufferPtr> into,
                                                        const ExecuteFn& execute) const {
  if (args.size() != param_slots_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("program ", program_->executable_id(), ": expected ",
                                                   param_slots_.size(), " arguments, got ", args.size()));
  }
  std::vector<BufferPtr> values(num_slots_);
  for (size_t i = 0; i < args.size(); ++i) values[param_slots_[i]] = args[i];
  std::vector<BufferPtr> preset(num_slots_);
  for (size_t i = 0; i < into.size() && i < output_buffer_slots_.size(); ++i) {
    if (into[i]) preset[output_buffer_slots_[i]] = into[i];
  }
  for (size_t i = 0; i < instrs_.size(); ++i) {
    TESSEL_RETURN_IF_ERROR(execute(int(i), values, preset));
    for (int r : instrs_[i].release) values[r].reset();
  }
  std::vector<BufferPtr> outs;
  for (int s : output_slots_) outs.push_back(values[s]);
  return outs;
}

}  // namespace tessel::worker
