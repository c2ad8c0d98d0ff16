// Visitors over a plan's instructions: the values an instruction reads and
// the values it writes (a fusion's outputs; a control-flow node's results; a
// node's own value).
#pragma once

#include <string>

#include "tessel/v1/program.pb.h"

namespace tessel::scheduler {

template <typename F>
void ForEachRead(const v1::Instruction& ins, F&& f) {
  if (ins.has_node()) {
    for (const std::string& o : ins.node().operands()) f(o);
  } else {
    for (const std::string& o : ins.fusion().inputs()) f(o);
  }
}

template <typename F>
void ForEachWrite(const v1::Instruction& ins, F&& f) {
  if (ins.results_size() > 0) {
    for (const std::string& r : ins.results()) f(r);
  } else if (ins.has_node()) {
    f(ins.node().name());
  } else {
    for (const std::string& o : ins.fusion().outputs()) f(o);
  }
}

}  // namespace tessel::scheduler
